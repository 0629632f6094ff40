"""A multi-host test bed on one machine: hosts are network namespaces on one bridge.

For tests, demos and benchmarks that need several machines (``make demo-hosts``, the
cross-host tests, ``make bench-hosts``). Needs root (``ip netns``, ``tc``, ``nsenter``).

How it is built (iproute2's ``ip-netns(8)``, ``tc-tbf(8)``):

* one namespace ``irdma-bed-PID-br`` holds a Linux bridge ``br0``; nothing is configured in
  the machine's own network namespace;
* host ``i`` is namespace ``irdma-bed-PID-hI`` with one veth ``eth0`` whose peer ``hI`` is a
  port of the bridge, and the address ``SUBNET.(10+i)/24`` on a private subnet that exists only
  inside these namespaces (no default route: nothing leaves them);
* each host's link is shaped in both directions: a ``tbf`` rate limit on ``eth0`` (what the
  host sends) and on the bridge port (what it receives), plus a ``netem`` delay where the
  kernel has ``sch_netem`` (:attr:`TestBed.delay_shaped` says whether it had);
* processes are started on a host with ``nsenter --net=/run/netns/NAME``: they share the
  machine's mount namespace, so a FUSE mount made on a host is visible to the test;
* :meth:`TestBed.close` (and leaving the ``with`` block, also on an exception) stops every
  process started on the bed and every process left in its namespaces (SIGTERM, then SIGKILL
  after a deadline), lazily unmounts the mounts it was told of, and deletes the namespaces,
  which deletes their links. Beds left behind by a killed process are removed by the next
  bed made on the machine (:func:`remove_stale_beds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from .._errors import IrdmaError
from .probe import _free_port as free_port

log = logging.getLogger("irdma.testbed")

#: The default private subnet (/24) of a bed; hosts get .10, .11, ...
DEFAULT_SUBNET = "10.213.0"
_PREFIX = "irdma-bed-"
_NAME_RE = re.compile(rf"^{_PREFIX}(\d+)-(br|h\d+)$")


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of the bed: its index, network namespace and address on the bed's subnet."""

    index: int
    netns: str
    address: str

    @property
    def nsenter(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise IrdmaError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}",
                         "the test bed needs root and iproute2 (`apt-get install iproute2`)")
    return res


def _netns_list() -> list[str]:
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _kill_netns_processes(netns: str, deadline_s: float = 5.0) -> None:
    """SIGTERM every process in ``netns``, then SIGKILL what is left after ``deadline_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        end = time.monotonic() + deadline_s
        while pids and time.monotonic() < end:
            pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
            if pids:
                time.sleep(0.05)
        if not pids:
            return


def remove_stale_beds() -> list[str]:
    """Delete the namespaces of beds whose creating process is gone (killed tests); returns them."""
    gone = []
    for name in _netns_list():
        m = _NAME_RE.match(name)
        if m is None or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        _kill_netns_processes(name, 2.0)
        _ip("netns", "del", name, check=False)
        gone.append(name)
    if gone:
        log.warning("removed %d namespaces of test beds left by dead processes: %s", len(gone), " ".join(gone))
    return gone


class TestBed:
    """``hosts`` network namespaces joined by a bridge, links shaped to ``rate``/``delay_us``.

    Args:
        hosts: how many hosts (1 to 200).
        rate: each host's link rate in each direction, in tc's units (``"1gbit"``,
            ``"500mbit"``), or None for unshaped links.
        delay_us: one-way delay added on each host's link, in microseconds (0: none); needs
            the kernel's ``sch_netem`` (see :attr:`delay_shaped`).
        subnet: the first three octets of the bed's private /24.
        rates: per-host link rates that differ from ``rate`` (host index -> rate or None).

    Raises:
        IrdmaError: not root, or iproute2/tc missing or refusing (the message says which);
            whatever was made is removed first.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: int, *, rate: str | None = "1gbit", delay_us: int = 0,
                 subnet: str = DEFAULT_SUBNET, rates: dict[int, str | None] | None = None) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1..200, not {hosts}")
        if os.geteuid() != 0:
            raise IrdmaError("the multi-host test bed needs root (network namespaces)", "run it as root")
        remove_stale_beds()
        self.rate, self.delay_us, self.subnet = rate, delay_us, subnet
        self.rates = {i: (rates or {}).get(i, rate) for i in range(hosts)}
        self.delay_shaped = delay_us == 0
        tag = f"{_PREFIX}{os.getpid()}"
        self.bridge_ns = f"{tag}-br"
        self.hosts = [Host(i, f"{tag}-h{i}", f"{subnet}.{10 + i}") for i in range(hosts)]
        self._procs: list[tuple[Host, subprocess.Popen[Any]]] = []
        self._mounts: list[str] = []
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            port = f"h{h.index}"
            _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            self._shape(h.netns, "eth0", self.rates[h.index])
            self._shape(self.bridge_ns, port, self.rates[h.index])

    def _shape(self, netns: str, dev: str, rate: str | None) -> None:
        tc = ["nsenter", f"--net=/run/netns/{netns}", "--", "tc", "qdisc", "add", "dev", dev]
        parent = ["root"]
        if self.delay_us:
            res = subprocess.run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_us}us"],
                                 capture_output=True, text=True, timeout=30)
            if res.returncode == 0:
                self.delay_shaped = True
                parent = ["parent", "1:1"]
            elif not getattr(self, "_warned_netem", False):
                self._warned_netem = True
                log.warning("test bed: no netem in this kernel (%s); links are rate-shaped only, not delayed",
                            res.stderr.strip())
        if rate:
            # burst: enough for the rate at a 250 Hz timer (rate/250), at least 64 KiB
            bits = _rate_bits(rate)
            burst = max(64 << 10, bits // 8 // 250)
            res = subprocess.run([*tc, *parent, "tbf", "rate", rate, "burst", str(burst), "latency", "20ms"],
                                 capture_output=True, text=True, timeout=30)
            if res.returncode != 0:
                raise IrdmaError(f"tc could not shape {dev} in {netns} to {rate}: {res.stderr.strip()}",
                                 "the kernel needs sch_tbf (CONFIG_NET_SCH_TBF)")

    # ------------------------------------------------------------ processes
    def popen(self, host: Host | int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host`` (``subprocess.Popen`` arguments in ``kwargs``); it is stopped
        by :meth:`close` if still running."""
        h = self.hosts[host] if isinstance(host, int) else host
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen([*h.nsenter, *argv], **kwargs)
        self._procs.append((h, proc))
        return proc

    def run(self, host: Host | int, argv: Sequence[str], timeout: float = 120.0,
            **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on ``host`` to completion within ``timeout`` seconds (``subprocess.run``)."""
        h = self.hosts[host] if isinstance(host, int) else host
        return subprocess.run([*h.nsenter, *argv], timeout=timeout, **kwargs)

    def track_mount(self, mountpoint: str) -> None:
        """Have :meth:`close` unmount ``mountpoint`` (lazily) if it is still mounted then."""
        self._mounts.append(os.path.abspath(mountpoint))

    def processes(self) -> dict[str, list[str]]:
        """Every process now running in each host's namespace: ``{netns: ["PID CMDLINE", ...]}``."""
        out: dict[str, list[str]] = {}
        for h in self.hosts:
            rows = []
            for pid in _ip("netns", "pids", h.netns, check=False).stdout.split():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    continue
                rows.append(f"{pid} {cmd[:160]}")
            out[h.netns] = rows
        return out

    def close(self) -> None:
        """Stop every process of the bed, unmount its mounts and delete its namespaces (twice is fine)."""
        if self._closed:
            return
        self._closed = True
        for mnt in self._mounts:
            if os.path.ismount(mnt):
                subprocess.run(["fusermount3", "-u", mnt], capture_output=True, timeout=30)
        for _, proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + 10
        for _, proc in self._procs:
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for mnt in self._mounts:
            if os.path.ismount(mnt):
                subprocess.run(["fusermount3", "-uz", mnt], capture_output=True, timeout=30)
        names = set(_netns_list())
        for ns in [h.netns for h in self.hosts] + [self.bridge_ns]:
            if ns in names:
                _kill_netns_processes(ns)
                _ip("netns", "del", ns, check=False)

    def __enter__(self) -> TestBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as ``1gbit``, ``500mbit``, ``100kbit`` or ``8000bit``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"unsupported rate {rate!r}: use e.g. 1gbit, 500mbit")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


PG_BIN = os.environ.get("IRDMA_PG_BIN", "/usr/lib/postgresql/15/bin")


def postgres_available() -> str:
    """Why :class:`PostgresServer` cannot run here ("" if it can)."""
    import pwd

    if not os.path.exists(os.path.join(PG_BIN, "pg_ctl")):
        return f"PostgreSQL 15 is not installed ({PG_BIN}/pg_ctl missing; `apt-get install postgresql-15`)"
    if os.geteuid() != 0:
        return "starting PostgreSQL as the postgres user needs root"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "there is no postgres OS user (Debian's postgresql package makes it)"
    return ""


def postgres_cannot_reach(*dirs: str) -> str:
    """Why the ``postgres`` OS user cannot reach the directories ``dirs`` ("" if it can): the
    first directory on the way to one of them (itself included) that it may not enter, asked of
    the system as that user (``runuser``, so ACLs count), not guessed from mode bits.

    PostgreSQL, ``initdb`` and Patroni run as ``postgres``: a data directory, socket directory,
    config or password file below a directory it cannot enter (a 0700 home directory, a private
    ``$TMPDIR``) fails inside them, late and obscurely; this names the directory at once.

    Raises:
        IrdmaError: nothing can run as the postgres user (not root, or ``runuser`` missing).
    """
    import pwd

    chain: dict[str, str] = {}  # every directory on the way -> the first of ``dirs`` it leads to
    for d in dirs:
        way = [os.path.abspath(d)]
        while os.path.dirname(way[-1]) != way[-1]:
            way.append(os.path.dirname(way[-1]))
        for x in reversed(way):
            chain.setdefault(x, d)
    script = 'for d; do [ -x "$d" ] || { printf %s "$d"; exit 1; }; done'
    try:
        res = subprocess.run(["runuser", "-u", "postgres", "--", "/bin/sh", "-c", script, "sh", *chain],
                             capture_output=True, text=True, timeout=30, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise IrdmaError(f"cannot run a command as the postgres user: {exc}", "run it as root") from None
    if res.returncode == 0:
        return ""
    if not res.stdout:
        raise IrdmaError(f"cannot run a command as the postgres user: {res.stderr.strip()}", "run it as root")
    try:
        st = os.stat(res.stdout)
    except OSError as exc:
        return f"{res.stdout}, on the way to {chain[res.stdout]}, cannot be entered: {exc.strerror}"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return (f"the postgres user cannot enter {res.stdout} (mode {st.st_mode & 0o7777:04o}, owner {owner}),"
            f" on the way to {chain[res.stdout]}")


def _unreachable(why: str) -> IrdmaError:
    """The error for a path :func:`postgres_cannot_reach` found out of the postgres user's reach."""
    return IrdmaError(f"PostgreSQL cannot start: {why}",
                      "set TMPDIR to a directory every user can enter (e.g. export TMPDIR=/tmp), or chmod o+x"
                      " the directory named")


class PostgresServer:
    """A throwaway PostgreSQL 15 server (Debian's ``postgresql-15``) in a temporary directory.

    ``initdb`` and ``pg_ctl`` run as the ``postgres`` OS user (``runuser``), the data directory
    and the unix socket live in a fresh temporary directory, the server listens on ``listen``
    only, and a login role with a random password owns one database. ``fsync`` is off unless
    ``durable``: this is for tests and demos, not for keeping data. :meth:`close` stops it (``pg_ctl stop -m fast``)
    and removes the directory.

    Args:
        listen: the address to listen on (``127.0.0.1``, or a test bed host's address).
        port: the TCP port (None: a free one on 127.0.0.1, else 5432).
        prefix: a command prefix to run the server under, e.g. ``Host.nsenter`` to run it on a
            test bed host.
        user, database: the login role and its database.
        durable: keep PostgreSQL's defaults (``fsync``, ``synchronous_commit``, full-page writes
            on): a commit waits for its WAL on disk, as a real server's does (benchmarks).

    Attributes:
        url: ``postgresql://USER@HOST:PORT/DB`` (no password: it is in :attr:`passfile`).
        passfile: a 0600 libpq password file for :attr:`url` (set ``PGPASSFILE`` to it), so the
            password never appears on a command line.
        password: the role's password.

    The postgres user's commands run in the server's directory, whatever the caller's working
    directory (which may be one postgres cannot enter, such as a checkout in a 0700 home).

    Raises:
        IrdmaError: PostgreSQL 15 is not installed, the postgres user cannot reach its temporary
            directory (``$TMPDIR`` below a directory it may not enter: the message names it), or
            it did not start within 60 s (the message quotes its log); whatever was made is
            removed first.
    """

    def __init__(self, listen: str = "127.0.0.1", port: int | None = None, prefix: Sequence[str] = (),
                 user: str = "irdma", database: str = "irdma", durable: bool = False) -> None:
        import pwd
        import secrets
        import shutil
        import tempfile

        if not os.path.exists(os.path.join(PG_BIN, "pg_ctl")):
            raise IrdmaError(f"PostgreSQL 15 is not installed ({PG_BIN}/pg_ctl is missing)",
                             "apt-get install postgresql-15 (`make install` does)")
        if port is None:
            port = free_port(listen) if listen.startswith("127.") else 5432
        self.listen, self.port, self.prefix = listen, port, list(prefix)
        self.user, self.database = user, database
        self.password = secrets.token_hex(16)
        self._serial = 0
        self.dir = tempfile.mkdtemp(prefix="irdma-pg-")
        self._rmtree = shutil.rmtree
        self._started = False
        pw = pwd.getpwnam("postgres")
        try:
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            os.chmod(self.dir, 0o700)
            why = postgres_cannot_reach(self.dir, PG_BIN)
            if why:
                raise _unreachable(why)
            self.data, self.sock, self.log = (os.path.join(self.dir, n) for n in ("data", "sock", "log"))
            self.socket_dir = self.sock
            os.mkdir(self.sock)
            os.chown(self.sock, pw.pw_uid, pw.pw_gid)
            self._as_postgres([f"{PG_BIN}/initdb", "-D", self.data, "-U", "postgres", "--auth-local=trust",
                               "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync"])
            with open(os.path.join(self.data, "pg_hba.conf"), "a") as f:
                f.write("host all all 0.0.0.0/0 scram-sha-256\n")
            fast = "" if durable else " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            self._opts = f"-c listen_addresses={listen} -p {port} -k {self.sock}{fast} -c max_connections=200"
            self._as_postgres([f"{PG_BIN}/pg_ctl", "-D", self.data, "-o", self._opts, "-l", self.log, "-w", "-t",
                               "60", "start"], prefix=True)
            self._started = True
            self.psql(f"CREATE ROLE {user} LOGIN PASSWORD '{self.password}'", stdin=True)  # not in `ps`
            self.psql(f"CREATE DATABASE {database} OWNER {user}")
            self.url = f"postgresql://{user}@{listen}:{port}/{database}"
            self.passfile = os.path.join(self.dir, "pgpass")
            with open(os.open(self.passfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(f"{listen}:{port}:*:{user}:{self.password}\n")
        except BaseException:
            self.close()
            raise

    def _as_postgres(self, argv: list[str], prefix: bool = False, input: str | None = None) -> str:
        cmd = [*(self.prefix if prefix else []), "runuser", "-u", "postgres", "--", *argv]
        # in its own directory: the caller's may be one postgres cannot enter (a 0700 home)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=90, input=input, cwd=self.dir)
        if res.returncode != 0:
            tail = ""
            with contextlib.suppress(OSError):
                with open(self.log) as f:
                    tail = f.read()[-1500:]
            raise IrdmaError(f"`{' '.join(argv[:2])}` failed: {res.stderr.strip()[-800:]} {tail}",
                             "check that postgresql-15 is installed and /tmp is writable")
        return res.stdout

    def psql(self, sql: str, database: str = "postgres", stdin: bool = False) -> str:
        """Run ``sql`` as the superuser over the unix socket (on psql's standard input with
        ``stdin``, so a secret in it never shows in ``ps``); returns psql's output."""
        args = [f"{PG_BIN}/psql", "-h", self.sock, "-p", str(self.port), "-d", database, "-v", "ON_ERROR_STOP=1", "-qAt"]
        return self._as_postgres(args if stdin else [*args, "-c", sql], input=sql if stdin else None)

    def create_database(self, name: str) -> str:
        """A new empty database owned by the login role; returns its URL (no password)."""
        self.psql(f"CREATE DATABASE {name} OWNER {self.user}")
        return self.url_of(name, password=False)

    def url_of(self, database: str, *, password: bool = True) -> str:
        """The TCP URL of ``database`` as the login role, with its password unless told not (tests)."""
        auth = f"{self.user}:{self.password}" if password else self.user
        return f"postgresql://{auth}@{self.listen}:{self.port}/{database}"

    def new_database(self) -> str:
        """A new empty database with a fresh name; returns its URL with the password (tests)."""
        self._serial += 1
        name = f"t{os.getpid()}_{self._serial}"
        self.psql(f"CREATE DATABASE {name} OWNER {self.user}")
        return self.url_of(name)

    def restart(self) -> None:
        """Restart the server (``pg_ctl restart -m fast``: every session is ended, committed data
        kept) and return once it accepts connections again (at most 60 s).

        Raises:
            IrdmaError: it did not come back (the message quotes its log)."""
        self._as_postgres([f"{PG_BIN}/pg_ctl", "-D", self.data, "-o", self._opts, "-l", self.log, "-m", "fast",
                           "-w", "-t", "60", "restart"], prefix=True)

    def close(self) -> None:
        """Stop the server and remove its directory (twice is fine)."""
        if self._started:
            self._started = False
            try:
                res = subprocess.run(["runuser", "-u", "postgres", "--", f"{PG_BIN}/pg_ctl", "-D", self.data, "-m",
                                      "fast", "-w", "-t", "30", "stop"], capture_output=True, timeout=60, cwd="/")
                stopped = res.returncode == 0
            except subprocess.TimeoutExpired:
                stopped = False
            if not stopped:  # the postmaster, by its pid file
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(os.path.join(self.data, "postmaster.pid")) as f:
                        os.kill(int(f.readline()), signal.SIGKILL)
        if os.path.isdir(self.dir):
            self._rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

