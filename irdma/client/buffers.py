"""Reused byte buffers for the per-request payloads of sparse rows (a SCATTER's packed rows).

A fresh numpy buffer of a few MiB is fresh pages: the first write of each 4 KiB page is a
page fault, about 640 of them for the 2.5 MiB a shard's share of a 10,000-row push packs, and
here that was 1.9 ms of the 2.6 ms the packing took (``benchmarks/rows.py``). A training loop
pushes the same sizes step after step, so :class:`BufferPool` hands back buffers that earlier
requests are done with, as a slab allocator does (Bonwick, USENIX Summer 1994).

The rule of every transfer holds: a buffer goes back to the pool only when its request has
completed (:meth:`BufferPool.give`); one whose request failed or was cancelled is dropped, so
nothing a transport may still read from is ever handed out again.
"""

from __future__ import annotations

import numpy as np

#: Buffers smaller than this are not pooled (malloc serves them from its own free lists).
MIN_POOLED = 256 << 10
#: Granularity of pooled capacities: a request a little larger than the last reuses its buffer.
ROUND = 256 << 10


class BufferPool:
    """Free 1-D uint8 buffers, by capacity (see the module docstring).

    Args:
        keep_bytes: at most this many bytes of free buffers are kept (the rest are dropped).
    """

    def __init__(self, keep_bytes: int = 64 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []
        self._kept = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A contiguous uint8 array of exactly ``nbytes`` bytes (not zeroed): a view of a free
        buffer of at most twice that capacity, else of a new one. Give its ``base`` back with
        :meth:`give` once its request has completed."""
        if nbytes < MIN_POOLED:
            return np.empty(nbytes, dtype=np.uint8)
        best = -1
        for k, buf in enumerate(self._free):
            if nbytes <= len(buf) <= 2 * nbytes and (best < 0 or len(buf) < len(self._free[best])):
                best = k
        if best >= 0:
            buf = self._free.pop(best)
            self._kept -= len(buf)
        else:
            buf = np.empty(-(-nbytes // ROUND) * ROUND, dtype=np.uint8)
        return buf[:nbytes]

    def give(self, view: np.ndarray) -> None:
        """Return what :meth:`take` handed out (its request is complete: no transport reads or
        writes it any more). Small buffers and those past ``keep_bytes`` are dropped; the
        largest free buffers go first when the pool is full."""
        buf = view.base if isinstance(view.base, np.ndarray) else view
        if len(buf) < MIN_POOLED or any(b is buf for b in self._free):
            return
        self._free.append(buf)
        self._kept += len(buf)
        while self._kept > self.keep_bytes and self._free:
            big = max(range(len(self._free)), key=lambda k: len(self._free[k]))
            self._kept -= len(self._free.pop(big))
