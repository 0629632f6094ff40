"""What the verbs transport lends to transfers: numbered slots and registered buffers.

:class:`_Lender` lends a fixed set of numbered resources (send-queue slots, SEND slots, pool
buffers, credits, staging slots) first come first served, and gets each back only when the
completion or the reply that frees it arrives; :class:`_Hold` is one pool buffer lent to a
call and the work requests it posted (a reference count); :class:`_Pool` is a client's
registered buffers. The rules they keep are the module docstring of :mod:`irdma.transport.verbs`
("Cancellation and failure").
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from irdma._errors import IrdmaError, ShardUnavailable, message_of

from ._pyverbs import e
from .verbs_device import VerbsDevice, view_of

POOL_BUFFERS = 8  # registered client buffers
POOL_BUFFER_SIZE = 4 << 20  # bytes each; also the largest piece a request moves
STAGING_SLOTS = 4  # staging buffers per connection on the shard, POOL_BUFFER_SIZE each


class _Lender:
    """A fixed set of numbered resources (send-queue slots, SEND slots, pool buffers, credits,
    staging slots), lent first come first served.

    What a call takes goes back with :meth:`give`, called by whoever sees the completion or the
    reply that frees it: never by a cancelled call that posted work using it. After
    :meth:`close` every waiting and later :meth:`take` raises ShardUnavailable, and what was
    lent at that moment is never lent again (the device may have been using it).
    """

    def __init__(self, items: Iterable[int], what: str) -> None:
        self._free = list(items)
        self.size = len(self._free)
        self.what = what
        self._sem = trio.Semaphore(self.size)
        self._many = trio.Lock()
        self.error: IrdmaError | None = None

    @property
    def available(self) -> int:
        """How many are free now."""
        return len(self._free)

    async def take(self) -> int:
        """Wait for one and take it. Cancelled while waiting: nothing was taken.

        Raises:
            ShardUnavailable: the lender was closed (the connection broke).
        """
        await self._sem.acquire()  # atomic: cancelled before it took one, or took one and returns
        if self.error is not None:
            self._sem.release()  # wake the next waiter: it fails the same way
            raise ShardUnavailable(message_of(self.error))
        return self._free.pop()

    async def take_many(self, n: int) -> list[int]:
        """Take ``n`` at once: one caller at a time gathers, so two callers never each hold part
        of what both need. Cancelled: nothing was taken.

        Raises:
            ShardUnavailable: the lender was closed.
        """
        assert n <= self.size, f"{n} {self.what}s asked of {self.size}"
        taken: list[int] = []
        try:
            async with self._many:
                for _ in range(n):
                    taken.append(await self.take())
        except BaseException:
            for item in taken:
                self.give(item)
            raise
        return taken

    def give(self, item: int) -> None:
        """Give one back (ignored once closed: it stays lent forever)."""
        if self.error is None:
            self._free.append(item)
            self._sem.release()

    def close(self, err: IrdmaError) -> None:
        """Fail every waiting and later :meth:`take` with ``err``. Safe twice."""
        if self.error is None:
            self.error = err
            self._sem.release()


class _Hold:
    """A pool buffer lent to one call and to the work requests it posted: it goes back to the
    pool when the call and every one of them are done with it (a reference count)."""

    def __init__(self, lender: _Lender, index: int, offset: int) -> None:
        self._lender, self._index, self.offset = lender, index, offset
        self.refs = 1  # the call's own

    def drop(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            self._lender.give(self._index)

class _Pool:
    """Registered client buffers, allocated once and lent per request (see :class:`_Hold`)."""

    def __init__(self, dev: VerbsDevice, count: int, size: int) -> None:
        self.size = size
        self.stride = size + 64  # room after each buffer for an 8-byte version read
        self.mr = dev.register(count * self.stride, e.IBV_ACCESS_LOCAL_WRITE, "client buffer pool", keep=False)
        self.view = view_of(self.mr)
        self.lender = _Lender(range(count), "client buffer")

    async def take(self) -> _Hold:
        i = await self.lender.take()
        return _Hold(self.lender, i, i * self.stride)
