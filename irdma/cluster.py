"""A local cluster on one machine: SQLite metadata in a directory and N shard processes.

``irdma up`` and ``irdma down`` are built on :func:`up` and :func:`down`. The directory holds
``meta.db`` (the namespace and the shard map), ``cluster.json`` (pids and addresses) and
``logs/``. Shard memory is volatile: ``down`` ends the data, so it also removes the namespace
unless asked to keep it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import trio

from ._concurrency import open_nursery
from ._errors import InvalidArgument, IrdmaError, ShardUnavailable
from ._proc import last_log_line, pid_alive, spawn_detached
from .meta import open_meta
from .transport import make_transport

STATE_FILE = "cluster.json"


@dataclass
class ShardProc:
    shard_id: int
    address: str
    pid: int
    log: str


def default_dir() -> str:
    return os.environ.get("IRDMA_HOME") or os.path.join(os.path.expanduser("~"), ".irdma")


def meta_url_of(cluster_dir: str) -> str:
    return f"sqlite://{os.path.abspath(os.path.join(cluster_dir, 'meta.db'))}"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def read_state(cluster_dir: str) -> list[ShardProc]:
    """The shard processes ``irdma up`` started in ``cluster_dir`` (empty when it started none).

    Raises:
        IrdmaError: ``cluster.json`` is there but unreadable or not what ``irdma up`` writes.
    """
    path = os.path.join(cluster_dir, STATE_FILE)
    try:
        with open(path) as f:
            return [ShardProc(**s) for s in json.load(f)["shards"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IrdmaError(f"cannot read the cluster state {path}: {exc}",
                         f"stop its shards by hand and remove {path}, or pick another --dir") from None


async def wait_for_shard(address: str, transport: str, deadline: float, pid: int | None = None) -> None:
    """Wait until the shard at ``address`` answers the handshake, or raise at ``deadline``.

    Args:
        pid: the shard's process, if it is ours: stop waiting as soon as it exits.

    Raises:
        ShardUnavailable: no answer by ``deadline``, or the process ``pid`` exited.
    """
    tr = make_transport(transport)
    last: Exception | None = None
    while time.monotonic() < deadline:
        if pid is not None and not pid_alive(pid):
            raise ShardUnavailable(f"the shard process (pid {pid}) exited")
        try:
            with trio.move_on_at(trio.current_time() + deadline - time.monotonic()):
                async with open_nursery() as nursery:
                    conn = await tr.connect(address, nursery, client_name="irdma up")
                    await conn.aclose()
                return
        except ShardUnavailable as exc:
            last = exc
            await trio.sleep(0.05)
    raise ShardUnavailable(f"shard at {address} did not answer in time: {last}")


async def check_shard(address: str, timeout: float, *, credentials: bytes = b"") -> None:
    """Check that an irdma shard answers the handshake at ``address`` within ``timeout`` seconds.

    One try: a refused connection fails at once, an address that does not answer (a firewall,
    a host that is down, a service that is not irdma) after ``timeout``.

    Raises:
        ShardUnavailable: no irdma shard answered; the message says why.
    """
    tr = make_transport("tcp")
    with trio.move_on_after(timeout) as scope:
        async with open_nursery() as nursery:
            conn = await tr.connect(address, nursery, client_name="irdma shard add", credentials=credentials)
            await conn.aclose()
    if scope.cancelled_caught:
        raise ShardUnavailable(f"no answer from {address} in {timeout:g} s")


def check_up_args(cluster_dir: str, shards: int, capacity: int, host: str) -> None:
    """Validate the arguments of :func:`up` before anything is created or started.

    Raises:
        InvalidArgument: fewer than one shard, a capacity under one page, a host this machine
            cannot listen on, or a ``cluster_dir`` that cannot be a directory.
    """
    from irdma.server.shard import PAGE

    if not host.strip():
        raise InvalidArgument("the host is empty", "pass --host an address of this machine, such as 127.0.0.1")
    if shards < 1:
        raise InvalidArgument(f"a cluster needs at least one shard, not {shards}", "pass --shards 1 or more")
    if capacity < PAGE:
        raise InvalidArgument(f"a shard's capacity of {capacity} bytes is less than one page ({PAGE} bytes)",
                              "pass --capacity 64MiB or more")
    try:
        _free_port(host)
    except OSError as exc:
        raise InvalidArgument(f"cannot listen on host {host!r}: {exc.strerror or exc}",
                              "pass --host an address of this machine, such as 127.0.0.1") from None
    probe = os.path.abspath(cluster_dir)
    while not os.path.exists(probe):  # the nearest existing ancestor must be a writable directory
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        why = "is not a directory" if not os.path.isdir(probe) else "is not writable"
        raise InvalidArgument(f"cannot make the cluster directory {cluster_dir}: {probe} {why}",
                              "pass --dir a directory you can write, such as ~/.irdma")


def up(
    cluster_dir: str,
    shards: int,
    capacity: int,
    *,
    host: str = "127.0.0.1",
    transport: str = "tcp",
    fresh: bool = False,
    progress: Callable[[str], None] = lambda msg: None,
    timeout: float = 60.0,
) -> str:
    """Start a local cluster; returns its metadata URL.

    Bad arguments are refused before anything is created; a cluster that fails to start is
    taken down again (its shards stopped, its namespace removed, its logs kept).

    Raises:
        InvalidArgument: see :func:`check_up_args`.
        IrdmaError: a cluster already runs in ``cluster_dir``, an old namespace is there
            (pass ``fresh`` to wipe it), or a shard did not start (the message names its log).
    """
    check_up_args(cluster_dir, shards, capacity, host)
    running = [s for s in read_state(cluster_dir) if pid_alive(s.pid)]
    if running:
        raise IrdmaError(f"a cluster already runs in {cluster_dir}", f"irdma down --dir {cluster_dir}")
    meta_path = os.path.join(cluster_dir, "meta.db")
    if os.path.exists(meta_path):
        if not fresh:
            raise IrdmaError(
                f"{cluster_dir} holds the namespace of a stopped cluster (its shard memory is gone)",
                "pass --fresh to start over there, or pick another --dir",
            )
        _remove_namespace(cluster_dir)
    try:
        os.makedirs(os.path.join(cluster_dir, "logs"), exist_ok=True)
    except OSError as exc:
        raise IrdmaError(f"cannot make the cluster directory {cluster_dir}: {exc.strerror}",
                         "pass --dir a directory you can write, such as ~/.irdma") from None
    meta = open_meta(meta_path, create=True)
    procs: list[ShardProc] = []
    try:
        for _ in range(shards):
            address = f"{host}:{_free_port(host)}"
            rec = meta.add_shard(address)
            log = os.path.abspath(os.path.join(cluster_dir, "logs", f"shard-{rec.shard_id}.log"))
            pid = spawn_detached(
                ["-m", "irdma.cli", "server", "--listen", address, "--capacity", str(capacity),
                 "--shard-id", str(rec.shard_id), "--transport", transport],
                log,
            )
            procs.append(ShardProc(rec.shard_id, address, pid, log))
            progress(f"started shard {rec.shard_id} on {address} (pid {pid})")
        _write_state(cluster_dir, procs)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                trio.run(wait_for_shard, p.address, "tcp", deadline, p.pid)
            except ShardUnavailable as exc:
                raise IrdmaError(f"shard {p.shard_id} did not start ({exc.args[0]}): {last_log_line(p.log)}",
                                 f"its log is {p.log}") from None
            progress(f"shard {p.shard_id} answers on {p.address}")
    except BaseException:
        _stop(procs, 10.0)
        meta.close()
        _remove_namespace(cluster_dir)
        raise
    meta.close()
    return meta_url_of(cluster_dir)


def _remove_namespace(cluster_dir: str) -> None:
    for name in ("meta.db", "meta.db-wal", "meta.db-shm", STATE_FILE):
        path = os.path.join(cluster_dir, name)
        if os.path.exists(path):
            os.unlink(path)


def _write_state(cluster_dir: str, procs: list[ShardProc]) -> None:
    tmp = os.path.join(cluster_dir, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"meta_url": meta_url_of(cluster_dir), "shards": [asdict(p) for p in procs]}, f, indent=1)
    os.replace(tmp, os.path.join(cluster_dir, STATE_FILE))


def _stop(procs: list[ShardProc], timeout: float) -> None:
    for p in procs:
        if pid_alive(p.pid):
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        while pid_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(p.pid):
            os.kill(p.pid, signal.SIGKILL)


def down(cluster_dir: str, *, keep: bool = False, progress: Callable[[str], None] = lambda msg: None) -> int:
    """Stop the shards of the cluster in ``cluster_dir``; remove its namespace unless ``keep``.

    Returns:
        How many shard processes were stopped.

    Raises:
        IrdmaError: no cluster state in ``cluster_dir``.
    """
    procs = read_state(cluster_dir)
    if not procs and not os.path.exists(os.path.join(cluster_dir, STATE_FILE)):
        raise IrdmaError(f"no cluster in {cluster_dir}", "pass the --dir given to `irdma up`")
    alive = [p for p in procs if pid_alive(p.pid)]
    _stop(alive, 10.0)
    for p in alive:
        progress(f"stopped shard {p.shard_id} (pid {p.pid})")
    if not keep:
        _remove_namespace(cluster_dir)
        shutil.rmtree(os.path.join(cluster_dir, "logs"), ignore_errors=True)
    else:
        os.unlink(os.path.join(cluster_dir, STATE_FILE))
    return len(alive)
