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
from ._errors import IrdmaError, ShardUnavailable
from ._proc import pid_alive, spawn_detached
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
    try:
        with open(os.path.join(cluster_dir, STATE_FILE)) as f:
            return [ShardProc(**s) for s in json.load(f)["shards"]]
    except FileNotFoundError:
        return []


async def wait_for_shard(address: str, transport: str, deadline: float) -> None:
    """Wait until the shard at ``address`` answers the handshake, or raise at ``deadline``."""
    tr = make_transport(transport)
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            async with open_nursery() as nursery:
                conn = await tr.connect(address, nursery, client_name="irdma up")
                await conn.aclose()
            return
        except ShardUnavailable as exc:
            last = exc
            await trio.sleep(0.05)
    raise ShardUnavailable(f"shard at {address} did not answer in time: {last}")


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

    Raises:
        IrdmaError: a cluster already runs in ``cluster_dir``, an old namespace is there
            (pass ``fresh`` to wipe it), or a shard did not start (its log is quoted).
    """
    if shards < 1:
        raise IrdmaError(f"a cluster needs at least one shard, not {shards}")
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
        for name in ("meta.db", "meta.db-wal", "meta.db-shm", STATE_FILE):
            with_path = os.path.join(cluster_dir, name)
            if os.path.exists(with_path):
                os.unlink(with_path)
    os.makedirs(os.path.join(cluster_dir, "logs"), exist_ok=True)
    meta = open_meta(meta_path, create=True)
    procs: list[ShardProc] = []
    try:
        for _ in range(shards):
            address = f"{host}:{_free_port(host)}"
            rec = meta.add_shard(address)
            log = os.path.join(cluster_dir, "logs", f"shard-{rec.shard_id}.log")
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
                trio.run(wait_for_shard, p.address, "tcp", deadline)
            except ShardUnavailable as exc:
                with open(p.log, errors="replace") as f:
                    tail = "".join(f.readlines()[-15:])
                raise IrdmaError(f"shard {p.shard_id} did not start: {exc}\n{p.log} ends:\n{tail}") from None
            progress(f"shard {p.shard_id} answers on {p.address}")
    except BaseException:
        _stop(procs, 10.0)
        meta.close()
        raise
    meta.close()
    return meta_url_of(cluster_dir)


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
        for name in ("meta.db", "meta.db-wal", "meta.db-shm", STATE_FILE):
            path = os.path.join(cluster_dir, name)
            if os.path.exists(path):
                os.unlink(path)
        shutil.rmtree(os.path.join(cluster_dir, "logs"), ignore_errors=True)
    else:
        os.unlink(os.path.join(cluster_dir, STATE_FILE))
    return len(alive)
