"""Horovod's collectives of small values through the shards: :func:`allreduce`, :func:`allgather`,
:func:`broadcast` (``hvd.allreduce`` and friends, for metrics, counters, a seed, a learning
rate; the model's gradients go through :class:`irdma.train.distributed.DistributedOptimizer`).

Each call writes this rank's value (a NumPy ``.npy``: dtype, shape and byte order kept) to
``JOB/collectives/RUN-NAME-rRANK.npy`` in the namespace, passes a job barrier
(:func:`irdma.train.world.barrier`: every worker of the job, the live ones of an elastic job) and
reads the files it needs: every arrived rank's (allreduce, allgather) or the root's (broadcast).
A rank removes its file of the call before once it passed the next call's barrier (by then
every rank has read it). As in Horovod every rank makes the same calls in the same order; a call
without ``name`` is named by its kind and its count in this process.

A value may be a NumPy array, a number, or a TensorFlow tensor (the result is then a tensor).

Raises (every function):
    irdma.train.coord.SyncTimeout: a rank did not make the call within ``timeout`` seconds.
    InvalidArgument: values whose shapes cannot be reduced (allreduce), or a bad ``op``/root.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from .._errors import InvalidArgument
from .distributed import MIN_CHUNK, Average, Sum
from .world import _job_barrier, _member, _need, _world, job_dir, rank, size

#: Adasum is Horovod's third op; the shards have no counterpart.
_OPS = (Average, Sum)


def _as_array(value: Any) -> tuple[np.ndarray, bool]:
    tensor = hasattr(value, "numpy") and callable(value.numpy)
    return np.asarray(value.numpy() if tensor else value), tensor


def _back(result: np.ndarray, tensor: bool) -> Any:
    if tensor:
        import tensorflow as tf

        return tf.convert_to_tensor(result)
    return result


def _exchange(kind: str, name: str | None, value: np.ndarray, readers: list[int] | None,
              timeout: float) -> dict[int, np.ndarray]:
    """Write ``value``, pass the call's barrier, read the arrived ranks' (or ``readers``') values."""
    client, job = _need("client"), job_dir()
    run = _world.get("run", "") or "run"
    calls = _world.setdefault("collectives", {})
    count = calls.get(kind, 0)
    calls[kind] = count + 1
    key = name if name is not None else f"{kind}.{count}"
    if not key or "/" in key:
        raise InvalidArgument(f"collective name {key!r}", "a name of one path component, the same on every rank")
    where = f"{job}/collectives"
    mine = f"{where}/{run}-{key}-r{rank()}.npy"
    if readers is None or rank() in readers:
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        client.makedirs(where)
        client.write(mine, buf.getvalue(), op="assign", chunk_size=MIN_CHUNK)
    barrier = _job_barrier(f"coll-{key}", timeout)
    who = readers if readers is not None else client.run(client.client.meta.arrivals, _member(), barrier)
    got = {r: np.load(io.BytesIO(bytes(client.read(f"{where}/{run}-{key}-r{r}.npy"))), allow_pickle=False)
           for r in who}
    last = _world.setdefault("collective_files", [])
    for old in last:  # the call before's: every rank passed this barrier, so read them
        try:
            client.unlink(old)
        except Exception:  # noqa: BLE001 - a file already gone is no error; the next call tries no more
            pass
    last[:] = [mine] if readers is None or rank() in readers else []
    return got


def allreduce(value: Any, average: bool | None = None, name: str | None = None, op: str | None = None,
              timeout: float = 600.0) -> Any:
    """The mean (``op=hvd.Average``, the default; ``average=True``) or sum (``op=hvd.Sum``;
    ``average=False``) of ``value`` over the job's ranks, on every rank: same shape, float64 for
    integer inputs averaged, else the input's dtype. Horovod's ``hvd.allreduce``."""
    if op is None:
        op = Sum if average is False else Average
    if op not in _OPS:
        raise InvalidArgument(f"op={op!r}", f"pass op={Average!r} (hvd.Average) or {Sum!r} (hvd.Sum)")
    arr, tensor = _as_array(value)
    got = _exchange("allreduce", name, arr, None, timeout)
    shapes = {v.shape for v in got.values()}
    if len(shapes) != 1:
        raise InvalidArgument(f"allreduce of values of shapes {sorted(shapes)}", "every rank passes the same shape")
    total = np.sum(np.stack([got[r] for r in sorted(got)]), axis=0)
    out = total / len(got) if op == Average else total
    if op == Sum or np.issubdtype(arr.dtype, np.floating):
        out = np.asarray(out, dtype=arr.dtype)
    return _back(np.asarray(out), tensor)


def allgather(value: Any, name: str | None = None, timeout: float = 600.0) -> Any:
    """Every rank's ``value`` concatenated along the first axis, in rank order (a scalar counts
    as one element); the same on every rank. Horovod's ``hvd.allgather``."""
    arr, tensor = _as_array(value)
    got = _exchange("allgather", name, np.atleast_1d(arr), None, timeout)
    return _back(np.concatenate([got[r] for r in sorted(got)]), tensor)


def broadcast(value: Any, root_rank: int, name: str | None = None, timeout: float = 600.0) -> Any:
    """Rank ``root_rank``'s ``value`` on every rank (Horovod's ``hvd.broadcast``)."""
    if not 0 <= root_rank < size():
        raise InvalidArgument(f"root_rank {root_rank} of {size()} workers", "ranks run from 0 to size - 1")
    arr, tensor = _as_array(value)
    got = _exchange("broadcast", name, arr, [root_rank], timeout)
    return _back(got[root_rank], tensor)


__all__ = ["allreduce", "allgather", "broadcast"]
