"""The job a worker of :mod:`irdma.keras` belongs to: :func:`init` and :func:`shutdown`, its
rank and size, its membership (join, heartbeat, rejoin at the job's clock), job barriers, the
data shard, the host group, and the wait for what rank 0 makes. Split from
:mod:`irdma.train.distributed` (the optimizer); :mod:`irdma.keras` exports its public names.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any

import tensorflow as tf

from .._errors import InvalidArgument, IrdmaError, NoAttribute, NotFound
from . import coord
from .coord import XATTR_ELASTIC, XATTR_WORKERS

#: Seconds a rank waits for what rank 0 makes (the job directory, the parameters, an embedding table).
SYNC_WAIT = 600.0

_world: dict[str, Any] = {}
log = logging.getLogger("irdma.keras")


def init(*, meta: str | None = None, job: str | None = None, rank: int | None = None, size: int | None = None,
         key_file: str | None = None, **client_options: Any) -> None:
    """Join the job this process is a worker of (Horovod's ``hvd.init()``).

    Each argument defaults to what ``irdma run`` put in the environment: ``IRDMA_META``,
    ``IRDMA_JOB``, ``IRDMA_RANK``, ``IRDMA_SIZE``, ``IRDMA_KEY_FILE`` (rank 0 of 1 when unset).
    Opens one native client (:func:`irdma.connect`, given ``client_options`` such as
    ``transport="tcp"`` or ``window=4``) shared by the process. Calling it again closes the
    previous client.

    Raises:
        InvalidArgument: no metadata URL or job (not under ``irdma run`` and none given), or a
            rank outside ``[0, size)``. IrdmaError: the namespace cannot be opened.
    """
    from ..client.sync import connect

    meta = meta or os.environ.get("IRDMA_META")
    job = job or os.environ.get("IRDMA_JOB")
    if not meta or not job:
        raise InvalidArgument("no job to join: IRDMA_META and IRDMA_JOB are unset",
                              "run the script with `irdma run -n N -- python SCRIPT`, or pass init(meta=URL, job=PATH)")
    rank = int(os.environ.get("IRDMA_RANK", "0")) if rank is None else int(rank)
    size = int(os.environ.get("IRDMA_SIZE", "1")) if size is None else int(size)
    if not 0 <= rank < size:
        raise InvalidArgument(f"rank {rank} is not one of {size} workers", "ranks run from 0 to size - 1")
    shutdown()
    _world.update(meta=meta, job="/" + job.strip("/"), rank=rank, size=size, run=os.environ.get("IRDMA_RUN_ID", ""),
                  client=connect(meta, key_file=key_file or os.environ.get("IRDMA_KEY_FILE"), **client_options))
    if not _world.get("atexit"):
        atexit.register(_at_exit)  # a script that never calls shutdown() still leaves the job
        previous = sys.excepthook

        def crashed(*exc: Any) -> None:  # an unhandled exception: the worker failed, it did not finish
            _crash.append(True)
            previous(*exc)

        sys.excepthook = crashed
        _world["atexit"] = True


_crash: list[bool] = []


def _at_exit() -> None:
    """At the interpreter's exit: leave the job unless the script died of an exception (then
    the others see a dead worker, never a finished one)."""
    shutdown(leave=not _crash)


def shutdown(leave: bool = True) -> None:
    """Leave the job (``leave``: no wait counts this worker any more; else the others see it
    die) and close the client :func:`init` opened (a no-op when none is open)."""
    client, ino, me = _world.pop("client", None), _world.pop("job_ino", None), _world.get("rank", 0)
    stop = _world.pop("beat_stop", None)
    if stop is not None:
        stop.set()  # the heartbeat ends before the leave: it never joins again after it
    for group in _world.pop("groups", []):
        group.close()
    registered = _world.get("atexit", False)
    _world.clear()
    _world["atexit"] = registered
    if client is None:
        return
    try:
        if ino is not None and leave:
            client.run(client.client.meta.member_leave, ino, me)
    except Exception as exc:  # noqa: BLE001 - closing goes on: the others see it as dead instead
        log.warning("could not leave the job cleanly (%s): the other workers will see this one as dead", exc)
    finally:
        client.close()


def _member() -> int:
    """Make this worker a member of its job, once per :func:`init` (:mod:`irdma.train.coord`:
    join, then a heartbeat on the client's loop); the job directory's inode. Rank 0 makes the
    directory when it is missing (not started by ``irdma run``); the others wait for it.

    Raises:
        InvalidArgument: the job directory did not appear within :data:`SYNC_WAIT` seconds.
    """
    if "job_ino" in _world:
        return int(_world["job_ino"])
    client, job, me, n = _need("client"), _need("job"), _need("rank"), _need("size")
    store = client.client.store
    if me == 0:
        ino = client.makedirs(job).ino
        if XATTR_WORKERS not in store.listxattr(ino):  # not started by `irdma run`
            store.setxattr(ino, XATTR_WORKERS, str(n).encode())
    else:
        ino = _wait_for(lambda: client.stat(job).ino, f"the job directory {job}")
    try:
        elastic = coord.parse_elastic(store.getxattr(ino, XATTR_ELASTIC))
    except NoAttribute:
        elastic = None
    meta = client.client.meta
    others = [m for m in client.run(meta.members, ino) if m.worker != me and not m.left]
    clocks = client.run(meta.clocks, ino)
    # a job in progress (another worker that has not finished has stepped; `irdma run` resets
    # the membership and clocks of a job it starts): this worker rejoins it, in the epoch of the
    # slowest live worker (of the furthest one when none is live)
    rejoin = any(clocks.get(m.worker, 0) > 0 for m in others)
    live = [m.epoch for m in others if m.live]
    clock = client.run(coord.join, meta, ino, me)
    stop = threading.Event()
    _world.update(job_ino=ino, elastic=elastic, rejoin=rejoin, clock=clock, beat_stop=stop,
                  rejoin_epoch=(min(live) if live else max(m.epoch for m in others)) if rejoin else 0,
                  beat=client.submit(lambda cl: coord.heartbeat(cl.meta, ino, me, stop)))
    if rejoin:
        log.warning("rank %d rejoins job %s at its current clock and epoch %d", me, job, _world["rejoin_epoch"])
    return int(ino)


def _need(name: str) -> Any:
    if "client" not in _world:
        raise InvalidArgument("irdma.keras.init() was not called", "call irdma.keras.init() first, as with Horovod")
    return _world[name]


def rank() -> int:
    """This worker's rank, 0 to ``size() - 1``."""
    return int(_need("rank"))


def size() -> int:
    """How many workers train the job."""
    return int(_need("size"))


def local_rank() -> int:
    """This worker's rank on its host (``IRDMA_LOCAL_RANK``; the rank when unset)."""
    return int(os.environ.get("IRDMA_LOCAL_RANK", rank()))


def local_size() -> int:
    """How many workers run on this host (``IRDMA_LOCAL_SIZE``; :func:`size` when unset)."""
    return int(os.environ.get("IRDMA_LOCAL_SIZE", size()))


def cross_size() -> int:
    """How many hosts the job's workers run on (Horovod's ``cross_size``: ``size() // local_size()``)."""
    return max(1, size() // max(1, local_size()))


def cross_rank() -> int:
    """This worker's host among :func:`cross_size` (ranks of a host are consecutive, as ``irdma run -H`` gives them)."""
    return rank() // max(1, local_size())


def is_initialized() -> bool:
    """Whether :func:`init` was called (and not :func:`shutdown` since)."""
    return "client" in _world


def job_dir() -> str:
    """The job directory's path in the namespace (``IRDMA_JOB``)."""
    return str(_need("job"))


def barrier(name: str = "barrier", timeout: float = 600.0) -> None:
    """Return once every worker of the job called ``barrier(name)`` (Horovod's ``hvd.barrier()``):
    a job barrier (:func:`irdma.train.coord.job_barrier`: of an elastic job, every live
    worker; a worker that finished is never waited for; a worker that rejoins passes a barrier
    the others passed).

    Raises:
        irdma.train.coord.SyncTimeout: not every worker arrived within ``timeout`` seconds (it
            names the missing ones).
    """
    _job_barrier(name, timeout)


def _job_barrier(name: str, timeout: float) -> str:
    """:func:`barrier`; returns the name it used: ``name`` numbered by its calls in this process
    (``NAME#K``: a name used twice is two barriers; a restarted worker counts the same way)."""
    ino = _member()
    client = _need("client")
    uses = _world.setdefault("uses", {})
    key = barrier_name(f"{name}#{uses.get(name, 0)}")
    uses[name] = uses.get(name, 0) + 1
    client.run(coord.job_barrier, client.client.meta, ino, key, _need("rank"), _need("size"),
                _world.get("elastic"), timeout)
    return key


def barrier_name(name: str) -> str:
    """The namespace-wide name of this job's barrier ``name``: the job's path and, under
    ``irdma run``, the launch's ``IRDMA_RUN_ID`` (an earlier run's stale arrivals never count)."""
    job, run = _need("job"), _world.get("run", "")
    return f"{job.strip('/').replace('/', '-')}{'-' + run if run else ''}-{name}"


def shard_dataset(data: Any) -> Any:
    """This rank's part of the training data: ``tf.data.Dataset.shard(size(), rank())`` for a
    dataset; every ``size()``-th row from ``rank()`` for an array or a tuple/list of arrays."""
    if isinstance(data, tf.data.Dataset):
        return data.shard(size(), rank())
    if isinstance(data, tuple | list):
        return type(data)(shard_dataset(d) for d in data)
    return data[rank() :: size()]


def _host_group(nbytes: int, timeout: float) -> Any:
    """This host's :class:`irdma.train.hier.HostGroup`: ranks ``rank - local_rank ..`` of
    ``IRDMA_LOCAL_SIZE`` (closed by :func:`shutdown`)."""
    import hashlib

    from .hier import HostGroup

    me = _need("rank")
    local_rank = int(os.environ.get("IRDMA_LOCAL_RANK", me))
    local_size = int(os.environ.get("IRDMA_LOCAL_SIZE", _need("size")))
    first = me - local_rank
    tag = hashlib.sha256(f"{_need('job')} {_world.get('run', '')}".encode()).hexdigest()[:16]
    group = HostGroup(f"irdma-{tag}-{first}", local_rank, local_size, nbytes, timeout=timeout)
    _world.setdefault("groups", []).append(group)
    return group


def _wait_for(check: Any, what: str, timeout: float = SYNC_WAIT, error: type[IrdmaError] = InvalidArgument) -> Any:
    """Poll ``check()`` (NotFound: not yet) every 0.1 s until it returns something true, for up
    to ``timeout`` seconds; returns that. Raises ``error`` (InvalidArgument: what rank 0 makes
    never came; SyncTimeout: too few workers) at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            out = check()
            if out:
                return out
        except NotFound:
            pass
        if time.monotonic() > deadline:
            raise error(f"{what} did not appear within {timeout:.0f} s",
                                  "check rank 0's output (`irdma run` prefixes it with [0])")
        time.sleep(0.1)
