"""A highly available metadata tier on the test bed: PostgreSQL 15 under Patroni, etcd as its
consensus store, one member of each on every metadata host.

For the failover tests, ``make demo-ha`` and ``make bench-hosts``. Nothing here is a consensus or
failover protocol of our own: etcd (Raft) holds the leader key, Patroni (Zalando; Debian's
``patroni`` package) keeps one PostgreSQL the primary while it holds that key, promotes the most
up-to-date synchronous standby when it expires, and rewinds a returning old primary
(``pg_rewind``) into a standby. With ``synchronous_mode: true`` a COMMIT is acknowledged only once
a synchronous standby has it (PostgreSQL's ``synchronous_commit = on``), and Patroni only promotes
a standby that was synchronous, so an acknowledged metadata write survives the primary's loss
(Patroni's documentation, "Replication modes").

The layout (:class:`PatroniCluster`), on hosts ``H0..Hn-1`` of a :class:`~irdma.ops.testbed.TestBed`:

* ``etcd`` on each host, client port 2379, peer port 2380, one cluster of ``n`` members;
* ``patroni`` on each host (as the ``postgres`` OS user), REST API on port 8008, managing a
  PostgreSQL 15 on port 5432 with its data in a temporary directory; timings for a test bed:
  ``ttl`` 10 s (the leader key's lease: the time before a failover begins), ``loop_wait`` 1 s,
  ``retry_timeout`` 4 s;
* a login role and database for irdma on the primary, replicated to the others.

Clients use a multi-host URL, ``postgresql://irdma@H0:5432,H1:5432,H2:5432/irdma?target_session_attrs=read-write``
(libpq picks the host that accepts writes: the primary), the password in a libpq password file
(:attr:`PatroniCluster.passfile`, given as ``PGPASSFILE``). :class:`irdma.meta.postgres.PostgresMeta`
reconnects to the new primary after a failover and settles the writes in flight.

Faults: :meth:`PatroniCluster.kill_host` (every process of the host SIGKILLed and its link
downed: a host that died), :meth:`PatroniCluster.partition` and :meth:`PatroniCluster.heal` (the
link only: the processes go on, cut off), :meth:`PatroniCluster.restart_member` (a replaced host
comes back and rejoins as a standby).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from .._errors import IrdmaError
from .testbed import PG_BIN, Host, TestBed, _ip, _kill_netns_processes, _unreachable, postgres_cannot_reach

log = logging.getLogger("irdma.patroni")

ETCD_CLIENT_PORT, ETCD_PEER_PORT, REST_PORT, PG_PORT = 2379, 2380, 8008, 5432
#: The leader key's lease (s): how long a dead primary is still the primary.
TTL_S = 10


def available() -> str:
    """Why a :class:`PatroniCluster` cannot run here ("" if it can)."""
    from .testbed import postgres_available

    why = postgres_available()
    if why:
        return why
    for exe, pkg in (("etcd", "etcd-server"), ("patroni", "patroni")):
        if shutil.which(exe) is None:
            return f"{exe} is not installed (apt-get install {pkg}; `make install` does)"
    return ""


class PatroniCluster:
    """Patroni + etcd on ``hosts`` of ``bed`` (see the module docstring); returns once a
    primary and a synchronous standby serve and the irdma role and database exist.

    Args:
        bed: the test bed.
        hosts: the metadata hosts (3 or 5: an etcd majority must survive a host's loss).
        user, database: the login role and database made for irdma.

    Attributes:
        url: the multi-host URL (no password: it is in :attr:`passfile`).
        passfile: a 0600 libpq password file for :attr:`url`.
        password: the login role's password.

    Patroni and the postgres user's commands run in the tier's own directory, whatever the
    caller's working directory (one postgres cannot enter, such as a checkout in a 0700 home,
    kept every member in "bootstrap in progress").

    Raises:
        IrdmaError: Patroni, etcd or PostgreSQL 15 missing; the postgres user cannot reach the
            tier's temporary directory (``$TMPDIR`` below a directory it may not enter: the
            message names it, before anything starts); an etcd or Patroni exited; or the tier did
            not come up within ``start_timeout`` seconds (the message quotes the members' logs);
            what was started is stopped and removed first.
    """

    def __init__(self, bed: TestBed, hosts: Sequence[Host], *, user: str = "irdma", database: str = "irdma",
                 start_timeout: float = 120.0) -> None:
        why = available()
        if why:
            raise IrdmaError(f"the HA metadata tier cannot run here: {why}", "run `make install` as root")
        if len(hosts) < 3:
            raise ValueError("an HA tier needs at least 3 metadata hosts (an etcd majority survives one loss)")
        import pwd

        self.bed, self.hosts, self.user, self.database = bed, list(hosts), user, database
        self.scope = f"irdma-{os.getpid()}-{secrets.token_hex(3)}"
        self.password = secrets.token_hex(16)
        self._super, self._repl = secrets.token_hex(16), secrets.token_hex(16)
        self.dir = tempfile.mkdtemp(prefix="irdma-ha-")
        self._pw = pwd.getpwnam("postgres")
        os.chown(self.dir, self._pw.pw_uid, self._pw.pw_gid)
        os.chmod(self.dir, 0o700)
        self._procs: dict[int, list[subprocess.Popen[Any]]] = {}
        self.down: set[int] = set()  # hosts killed or partitioned
        hosts_list = ",".join(f"{h.address}:{PG_PORT}" for h in self.hosts)
        self.url = f"postgresql://{user}@{hosts_list}/{database}?target_session_attrs=read-write"
        self.passfile = os.path.join(self.dir, "pgpass")
        with open(os.open(self.passfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.writelines(f"{h.address}:{PG_PORT}:*:{user}:{self.password}\n" for h in self.hosts)
        os.chown(self.passfile, self._pw.pw_uid, self._pw.pw_gid)  # readable by the postgres user too
        try:
            why = postgres_cannot_reach(self.dir, PG_BIN)
            if why:
                raise _unreachable(why)
            for i in range(len(self.hosts)):
                self._start(i, new=True)
            self.wait_healthy(start_timeout)
            leader = self.primary()
            # (the server logs no statement of this session, so a failure never writes the password)
            self.psql(leader, f"SET log_min_error_statement = panic; CREATE ROLE {user} LOGIN PASSWORD"
                              f" '{self.password}'", stdin=True)
            self.psql(leader, f"CREATE DATABASE {database} OWNER {user}")
            self.psql(leader, f"GRANT pg_monitor TO {user}")  # `irdma status` reads pg_stat_replication
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ members
    def _member_dir(self, i: int) -> str:
        return os.path.join(self.dir, f"m{i}")

    def _start(self, i: int, new: bool) -> None:
        """Start host ``i``'s etcd and Patroni (``new``: a first start, else a restart with the
        data they left)."""
        h, d = self.hosts[i], self._member_dir(i)
        os.makedirs(os.path.join(d, "sock"), exist_ok=True)
        for sub in ("", "sock"):
            os.chown(os.path.join(d, sub), self._pw.pw_uid, self._pw.pw_gid)
        cluster = ",".join(f"e{j}=http://{x.address}:{ETCD_PEER_PORT}" for j, x in enumerate(self.hosts))
        etcd_data = os.path.join(self.dir, f"etcd{i}")
        etcd = ["etcd", "--name", f"e{i}", "--data-dir", etcd_data,
                "--listen-client-urls", f"http://{h.address}:{ETCD_CLIENT_PORT}",
                "--advertise-client-urls", f"http://{h.address}:{ETCD_CLIENT_PORT}",
                "--listen-peer-urls", f"http://{h.address}:{ETCD_PEER_PORT}",
                "--initial-advertise-peer-urls", f"http://{h.address}:{ETCD_PEER_PORT}",
                "--initial-cluster", cluster, "--initial-cluster-token", self.scope,
                "--initial-cluster-state", "new" if new or not os.path.isdir(etcd_data) else "existing",
                "--heartbeat-interval", "100", "--election-timeout", "1000"]
        config = os.path.join(d, "patroni.yml")
        with open(config, "w") as f:
            json.dump(self._config(i), f, indent=1)  # JSON is YAML
        os.chown(config, self._pw.pw_uid, self._pw.pw_gid)
        logs = [open(os.path.join(self.dir, f"{name}{i}.log"), "a") for name in ("etcd", "patroni")]
        try:
            self._procs[i] = [
                self.bed.popen(h, etcd, stdout=logs[0], stderr=subprocess.STDOUT),
                # in the member's directory: Patroni's children (initdb, multiprocessing's) enter the
                # working directory, and the caller's may be one postgres cannot enter (a 0700 home)
                self.bed.popen(h, ["runuser", "-u", "postgres", "--", "patroni", config], stdout=logs[1],
                               stderr=subprocess.STDOUT, env={**os.environ, "PGPASSFILE": os.path.join(d, "pgpass")},
                               cwd=d),
            ]
        finally:
            for f in logs:
                f.close()

    def _config(self, i: int) -> dict[str, Any]:
        h, d = self.hosts[i], self._member_dir(i)
        hba = ["local all all trust", "host replication replicator 0.0.0.0/0 scram-sha-256",
               "host all all 0.0.0.0/0 scram-sha-256"]
        return {
            "scope": self.scope, "name": f"m{i}",
            "restapi": {"listen": f"{h.address}:{REST_PORT}", "connect_address": f"{h.address}:{REST_PORT}"},
            "etcd3": {"hosts": [f"{x.address}:{ETCD_CLIENT_PORT}" for x in self.hosts]},
            "bootstrap": {
                "dcs": {"ttl": TTL_S, "loop_wait": 1, "retry_timeout": 4, "maximum_lag_on_failover": 16 << 20,
                        "synchronous_mode": True,
                        "postgresql": {"use_pg_rewind": True,
                                       "parameters": {"max_connections": 200, "wal_log_hints": "on",
                                                      "synchronous_commit": "on", "wal_keep_size": "128MB"}}},
                "initdb": [{"encoding": "UTF8"}, {"auth-local": "trust"}],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"{h.address}:{PG_PORT}", "connect_address": f"{h.address}:{PG_PORT}",
                "data_dir": os.path.join(d, "data"), "bin_dir": PG_BIN, "pgpass": os.path.join(d, "pgpass"),
                "authentication": {"superuser": {"username": "postgres", "password": self._super},
                                   "replication": {"username": "replicator", "password": self._repl},
                                   "rewind": {"username": "postgres", "password": self._super}},
                "parameters": {"unix_socket_directories": os.path.join(d, "sock")},
                "pg_hba": hba,
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }

    # ------------------------------------------------------------ state
    def _rest(self, i: int, path: str, timeout: float = 2.0) -> Any:
        """GET ``path`` of host ``i``'s Patroni REST API (from inside the bed); None if it does not answer."""
        h = self.hosts[i]
        res = self.bed.run(h, ["curl", "-s", "-m", f"{timeout:g}", f"http://{h.address}:{REST_PORT}{path}"],
                           timeout=timeout + 5, capture_output=True, text=True)
        if res.returncode != 0 or not res.stdout.strip():
            return None
        with contextlib.suppress(ValueError):
            return json.loads(res.stdout)
        return None

    def members(self) -> list[dict[str, Any]]:
        """Patroni's view of the tier (``GET /cluster`` of the first host that answers): one dict
        per member with ``name``, ``role`` (``leader``, ``sync_standby``, ``replica``), ``state``,
        ``host`` and ``lag`` (bytes); [] if no member answers."""
        for i in range(len(self.hosts)):
            if i in self.down:
                continue
            doc = self._rest(i, "/cluster")
            if doc and doc.get("members"):
                return list(doc["members"])
        return []

    def _status_code(self, i: int, path: str, timeout: float = 2.0) -> int:
        """The HTTP status of host ``i``'s Patroni health endpoint ``path`` (0: no answer)."""
        h = self.hosts[i]
        res = self.bed.run(h, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", f"{timeout:g}",
                               f"http://{h.address}:{REST_PORT}{path}"], timeout=timeout + 5, capture_output=True,
                           text=True)
        return int(res.stdout.strip() or 0) if res.stdout.strip().isdigit() else 0

    def primary(self, exclude: Sequence[int] = ()) -> int:
        """The index of the host whose PostgreSQL is the primary now: its Patroni answers 200 on
        ``GET /primary`` (it holds the leader key and its PostgreSQL runs read-write).

        Raises:
            IrdmaError: no member is the primary (a failover under way)."""
        for i in range(len(self.hosts)):
            if i not in self.down and i not in exclude and self._status_code(i, "/primary") == 200:
                return i
        raise IrdmaError("no PostgreSQL member is the primary now", "wait for Patroni's failover (ttl + loop_wait)")

    def healthy(self) -> bool:
        """Whether exactly one live member is the primary, one is a synchronous standby
        (``GET /sync`` 200) and every live member's PostgreSQL runs (``GET /health`` 200), as
        Patroni's REST API says (its "Health check endpoints")."""
        live = [i for i in range(len(self.hosts)) if i not in self.down]
        if any(self._status_code(i, "/health") != 200 for i in live):
            return False
        return sum(self._status_code(i, "/primary") == 200 for i in live) == 1 and \
            any(self._status_code(i, "/sync") == 200 for i in live)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Wait (up to ``timeout`` s) for :meth:`healthy`.

        Raises:
            IrdmaError: not healthy in time, or (at once) an etcd or Patroni of a member that is
                not down exited (quotes the members and the tail of their logs)."""
        end = time.monotonic() + timeout
        delay = 0.2
        while not self.healthy():
            exited = [f"{name} of host {i} (exit {p.returncode})" for i, procs in self._procs.items()
                      if i not in self.down for name, p in zip(("etcd", "Patroni"), procs, strict=True)
                      if p.poll() is not None]
            if exited:
                raise IrdmaError(f"the HA metadata tier is not healthy: {', '.join(exited)} exited\n{self.logs()}",
                                 "see the Patroni and etcd logs above")
            if time.monotonic() > end:
                raise IrdmaError(f"the HA metadata tier is not healthy after {timeout:.0f} s: members"
                                 f" {self.members()}\n{self.logs()}", "see the Patroni and etcd logs above")
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)

    def wait_primary(self, exclude: Sequence[int] = (), timeout: float = 60.0) -> tuple[int, float]:
        """Wait for a primary on a host not in ``exclude``; returns (its index, seconds waited)."""
        t0 = time.monotonic()
        while True:
            with contextlib.suppress(IrdmaError):
                return self.primary(exclude), time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise IrdmaError(f"no new primary within {timeout:.0f} s: {self.members()}\n{self.logs()}",
                                 "see the Patroni logs")
            time.sleep(0.1)

    def logs(self, tail: int = 1500) -> str:
        out = []
        for name in sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []:
            if name.endswith(".log"):
                with contextlib.suppress(OSError), open(os.path.join(self.dir, name), errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-tail:]}")
        return "\n".join(out)

    def psql(self, i: int, sql: str, database: str = "postgres", stdin: bool = False) -> str:
        """Run ``sql`` as the superuser on host ``i``'s PostgreSQL (unix socket; on standard input
        with ``stdin``, so a secret never shows in ``ps``)."""
        args = [f"{PG_BIN}/psql", "-h", os.path.join(self._member_dir(i), "sock"), "-p", str(PG_PORT), "-U",
                "postgres", "-d", database, "-v", "ON_ERROR_STOP=1", "-qAt"]
        res = self.bed.run(self.hosts[i], ["runuser", "-u", "postgres", "--", *(args if stdin else [*args, "-c", sql])],
                           timeout=60, capture_output=True, text=True, input=sql if stdin else None, cwd=self.dir)
        if res.returncode != 0:
            raise IrdmaError(f"psql on metadata host {i} failed: {res.stderr.strip()[-600:]}")
        return str(res.stdout)

    def psql_primary(self, sql: str, database: str = "postgres", timeout: float = 60.0) -> str:
        """Run ``sql`` (as :meth:`psql`) on the primary, retrying until one answers or ``timeout``
        s pass. Patroni's health endpoints lag PostgreSQL by up to a loop: just after
        :meth:`wait_healthy`, the member that answered ``GET /primary`` may still be restarting
        (psql: "the database system is shutting down").

        Raises:
            IrdmaError: no primary answered within ``timeout`` (the last error quoted)."""
        end = time.monotonic() + timeout
        while True:
            try:
                return self.psql(self.primary(), sql, database=database)
            except IrdmaError as e:
                if time.monotonic() > end:
                    raise IrdmaError(f"no primary answered within {timeout:.0f} s: {e}\n{self.members()}",
                                     "see the Patroni logs") from e
            time.sleep(0.5)

    # ------------------------------------------------------------ faults
    def kill_host(self, i: int) -> None:
        """Host ``i`` dies: its link goes down and every process on it is SIGKILLed."""
        self.down.add(i)
        _ip("-n", self.hosts[i].netns, "link", "set", "eth0", "down")
        for pid in _ip("netns", "pids", self.hosts[i].netns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
        for p in self._procs.pop(i, []):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)

    def partition(self, i: int) -> None:
        """Cut host ``i`` off (its link down); its processes go on."""
        self.down.add(i)
        _ip("-n", self.hosts[i].netns, "link", "set", "eth0", "down")

    def heal(self, i: int) -> None:
        """Bring host ``i``'s link back (after :meth:`partition`)."""
        _ip("-n", self.hosts[i].netns, "link", "set", "eth0", "up")
        self.down.discard(i)

    def restart_member(self, i: int) -> None:
        """Start a killed host's etcd and Patroni again on its data (its link up first): it
        rejoins as a standby (Patroni rewinds an old primary with ``pg_rewind``)."""
        _ip("-n", self.hosts[i].netns, "link", "set", "eth0", "up")
        self.down.discard(i)
        self._start(i, new=False)

    def close(self) -> None:
        """Stop every member and remove the tier's files (twice is fine)."""
        for i in list(self._procs):
            for p in self._procs.pop(i):
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGTERM)
            _kill_netns_processes(self.hosts[i].netns, deadline_s=5.0)
        if os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PatroniCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
