"""Less and smarter communication: P3 priority slicing and layer dropping with a residual cache.

P3 (Jayarajan et al., "Priority-based Parameter Propagation for Distributed DNN Training",
SysML 2019) cuts every push and pull into *slices* (its reference code: about 40,000 float32,
160 KB) and sends them by *priority*: the layer the next forward pass needs first goes first,
so the forward pass of iteration t+1 starts while later layers of iteration t are still moving.
Here a caller sets the priority and slice size of the requests it makes with::

    with comm.priority(layer_index, slice_bytes=160_000):
        await client.write_from(layout, offset, grad_bytes, op)   # cut into slices, queued by priority

Each shard connection of a client admits at most ``window`` requests at a time
(:class:`PriorityWindow`); waiting requests are admitted lowest priority number first (FIFO
among equals), so a high-priority slice overtakes lower ones at the next slice boundary. A
request that was already admitted runs to its end (a slice is the unit of preemption). With
every priority equal the window is the FIFO semaphore it replaces. The shard answers the
requests of one connection in order; across connections (other workers) it serves them as they
arrive, so the order is decided where the queue is: at each client's window, whose small size
keeps the socket buffers (the link's queue) short.

Layer dropping (Abdelmoniem et al. style "skip small updates"; the seed paper of this project:
Applied Sciences 2020, -81% communication) skips a layer's push while the L1 norm of its
accumulated update is below a threshold relative to the L1 norm of its weights; the skipped
update stays in a :class:`ResidualCache` on the worker and is added to the next push of that
layer, so nothing computed is ever lost: pushed + cached == computed.

The per-file settings (xattrs, on the file or inherited from its nearest directory):
``user.irdma.slice`` (float32 elements per slice, ``0`` = no slicing), ``user.irdma.priority``
(an integer, 0 = most urgent) and ``user.irdma.drop`` (the relative threshold, e.g. ``0.001``;
``0`` = never drop).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import trio

from ..xattrs import (
    MAX_PRIORITY,
)


@dataclass(frozen=True)
class Scheduling:
    """How the requests made in a context are scheduled: ``level`` (0 = most urgent) and
    ``slice_bytes`` (the largest request; 0 = the transport's maximum)."""

    level: int = 0
    slice_bytes: int = 0


_DEFAULT = Scheduling()  # frozen: safe to share
_CURRENT: contextvars.ContextVar[Scheduling] = contextvars.ContextVar("irdma_scheduling", default=_DEFAULT)


def current() -> Scheduling:
    """The scheduling of requests made now (trio tasks inherit it from the task that started them)."""
    return _CURRENT.get()


@contextlib.contextmanager
def priority(level: int, slice_bytes: int | None = None) -> Iterator[Scheduling]:
    """Make the client requests started inside the block (and in tasks started from it) go at
    priority ``level`` (0 = most urgent) in slices of at most ``slice_bytes`` bytes.

    Args:
        level: 0 .. MAX_PRIORITY; P3 uses the layer's index in the forward pass.
        slice_bytes: a positive multiple of 4, or 0 for no slicing; None keeps the current one.

    Raises:
        ValueError: a level or slice size out of range (nothing changes).
    """
    s = Scheduling(check_priority(level), current().slice_bytes if slice_bytes is None else check_slice(slice_bytes))
    token = _CURRENT.set(s)
    try:
        yield s
    finally:
        _CURRENT.reset(token)


def check_priority(level: int) -> int:
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or not 0 <= level <= MAX_PRIORITY:
        raise ValueError(f"priority {level!r} is not an integer in 0..{MAX_PRIORITY} (0 is the most urgent)")
    return int(level)


def check_slice(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0 or nbytes % 4:
        raise ValueError(f"slice of {nbytes!r} bytes: use a multiple of 4 bytes (whole float32), or 0 for none")
    return int(nbytes)


class PriorityWindow:
    """At most ``size`` requests in flight; waiters admitted by priority (P3's scheduler).

    A drop-in for the ``trio.Semaphore`` of a shard connection: :meth:`acquire_nowait`,
    :meth:`acquire`, :meth:`release`. The priority is the caller's :func:`current` level;
    lower goes first, equal ones in arrival order; a waiter that has waited ``max_wait``
    seconds goes next whatever its level (aging: no starvation). A cancelled waiter takes
    nothing (a permit handed to it as it was cancelled is passed on).
    """

    def __init__(self, size: int, max_wait: float = math.inf) -> None:
        if size < 1:
            raise ValueError(f"a window of {size} requests: use at least 1")
        if not max_wait > 0:
            raise ValueError(f"max_wait {max_wait!r}: use seconds > 0")
        self.size = size
        self.max_wait = max_wait
        self._free = size
        self._waiters: list[list[object]] = []  # heap of [level, seq, event, state, arrived]
        self._arrivals: collections.deque[list[object]] = collections.deque()  # the same, oldest first
        self._seq = 0

    @property
    def in_flight(self) -> int:
        return self.size - self._free

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if w[3] == "waiting")

    def acquire_nowait(self) -> None:
        """Take a permit at once.

        Raises:
            trio.WouldBlock: none free, or others are waiting (they go first).
        """
        if self._free and not self._waiters:
            self._free -= 1
            return
        raise trio.WouldBlock

    async def acquire(self) -> None:
        """Wait for a permit; admitted by priority. Cancelled, it takes none."""
        if self._free and not self._waiters:
            # as trio.Semaphore: the cancellation point before the permit is taken, then a
            # schedule point that cannot be cancelled (a permit taken is never dropped)
            await trio.lowlevel.checkpoint_if_cancelled()
            self._free -= 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        self._seq += 1
        event = trio.Event()
        entry: list[object] = [current().level, self._seq, event, "waiting", trio.current_time()]
        heapq.heappush(self._waiters, entry)
        self._arrivals.append(entry)
        try:
            await event.wait()
        except BaseException:
            if entry[3] == "granted":  # handed over as we were cancelled: pass it on
                self.release()
            else:
                entry[3] = "cancelled"  # removed lazily by release
            raise

    def release(self) -> None:
        """Give a permit back: to the most urgent waiter (or to the oldest, once it has waited
        ``max_wait`` seconds: no request starves behind a stream of urgent ones), else to the pool."""
        while self._arrivals and self._arrivals[0][3] != "waiting":
            self._arrivals.popleft()
        while self._waiters:
            if self._arrivals and trio.current_time() - self._arrivals[0][4] >= self.max_wait:  # type: ignore[operator]
                entry = self._arrivals.popleft()  # aged: it goes now; its heap entry is skipped later
            else:
                entry = heapq.heappop(self._waiters)
                if entry[3] != "waiting":
                    continue
            entry[3] = "granted"
            event = entry[2]
            assert isinstance(event, trio.Event)
            event.set()
            return
        if self._free >= self.size:
            raise RuntimeError("PriorityWindow released more often than acquired")
        self._free += 1


class ResidualCache:
    """Layer dropping's residual cache: per layer, the updates not pushed yet (float32).

    :meth:`offer` adds a step's update to the layer's residual and says whether to push the
    sum now: when ``scale * ||residual||_1 >= threshold * ||weights||_1`` (``scale`` turns a
    gradient into the update it causes: the learning rate for SGD). Pushed or not, nothing is
    lost: the caller pushes exactly the array returned and the cache is then zero for that
    layer (a push that fails is given back with :meth:`restore`), so the sum of everything
    pushed plus :meth:`residual` equals the sum of everything offered (exactly, when float32
    sums of the values are exact, e.g. integer-valued ones).

    Args:
        threshold: the relative L1 threshold, >= 0 (0: push every step, never cache).
        scale: multiplies the residual's norm before comparing, > 0.
    """

    def __init__(self, threshold: float, scale: float = 1.0) -> None:
        if not (threshold >= 0.0 and math.isfinite(threshold)):
            raise ValueError(f"drop threshold {threshold!r}: use a finite number >= 0")
        if not (scale > 0.0 and math.isfinite(scale)):
            raise ValueError(f"drop scale {scale!r}: use a finite number > 0 (the learning rate)")
        self.threshold, self.scale = float(threshold), float(scale)
        self._residual: dict[object, np.ndarray] = {}
        self.offered = 0  # offers, pushes: counts over the cache's life
        self.pushed = 0

    def offer(self, key: object, update: np.ndarray, weights: np.ndarray | None) -> np.ndarray | None:
        """Add ``update`` (float32, any shape) to layer ``key``'s residual.

        Returns:
            The accumulated update to push now (float32, ``update``'s shape; the cache for
            ``key`` is then empty), or None: skipped, kept in the cache.

        Raises:
            ValueError: ``update``'s shape differs from what the layer accumulated so far.
        """
        u = np.asarray(update, dtype=np.float32)
        acc = self._residual.get(key)
        if acc is None:
            acc = self._residual[key] = np.zeros(u.shape, np.float32)
        elif acc.shape != u.shape:
            raise ValueError(f"layer {key!r}: an update of shape {u.shape} after ones of shape {acc.shape}")
        acc += u
        self.offered += 1
        if self.threshold > 0.0:
            wnorm = float(np.abs(weights, dtype=np.float64).sum()) if weights is not None else 0.0
            if self.scale * float(np.abs(acc, dtype=np.float64).sum()) < self.threshold * wnorm:
                return None
        self.pushed += 1
        out = acc.copy()
        acc[...] = 0.0
        return out

    def restore(self, key: object, update: np.ndarray) -> None:
        """Give back an update :meth:`offer` returned whose push failed: it is added to the
        layer's residual again (and goes with its next push)."""
        acc = self._residual.get(key)
        if acc is None or acc.shape != np.shape(update):
            raise ValueError(f"layer {key!r}: no residual of shape {np.shape(update)} to restore into")
        acc += np.asarray(update, dtype=np.float32)
        self.pushed -= 1

    def residual(self, key: object) -> np.ndarray | None:
        """What layer ``key`` holds back now (a copy), None if it never had an update."""
        acc = self._residual.get(key)
        return None if acc is None else acc.copy()

    def flush(self) -> dict[object, np.ndarray]:
        """Every non-zero residual, taken out of the cache (e.g. to push at the end of training)."""
        out = {k: v.copy() for k, v in self._residual.items() if v.any()}
        for k in out:
            self._residual[k][...] = 0.0
        return out
