"""Synchronous rounds: one update per round of the members' pushes (BSP as Horovod means it).

A push whose update carries a :class:`irdma.wire.protocol.Round` (protocol 11) is one member's
*contribution* to round ``round`` of run ``series``. The shard at the head of the chunk's chain
keeps, per range of bytes pushed (file, chunk, offset, length: a P3 slice is a range of its
own; a step's weight decay, op ``add``, a round beside its gradient's), one float32 sum of the
contributions of the round so far (no copy per member: memory is
one round's sum per range). When the contribution of every member ``0 .. members - 1`` is in,
the shard applies the update op **once** to their mean (their sum with ``ROUND_SUM``), the
optimizer state included, as one ordinary push (chained down the replicas as any other, so
they never aggregate themselves). That is Horovod's averaging allreduce followed by one step
of the wrapped optimizer (Sergeev & Del Balso, 2018), done where ps-lite's servers merge a key's
pushes (Li et al., OSDI 2014; BytePS's summation service, Jiang et al., OSDI 2020).

A contribution is answered as soon as it is added (the version the chunk has then), and the
one that completes the round is answered once the round's update is applied (and on every
replica): the members then end their round at the job's clock (:mod:`irdma.client.coord`), so
the pulls of round ``k + 1`` that follow it see the step of round ``k`` on every chunk.

* A member's contribution sent again (a retry on a new connection) counts once; one sent again
  after its round was applied is answered with that round's version and changes nothing.
* Contributions of one round must agree on the update (op, arguments: the learning rate) and
  the member count; one that disagrees is refused (BAD_REQUEST), nothing changed.
* A contribution to another round of the same range while a round is incomplete (a member died
  and its run is over, or a new run of the same job) drops the incomplete round, logged with the
  members that did and did not contribute: a run never mixes into another's. A round left
  incomplete for :data:`ROUND_HOLD_S` is dropped likewise at the next contribution.
* Limit: the sum lives in the head shard's memory until the round completes; a head that dies
  mid-round loses the contributions it had answered (the round's step is lost for its chunks;
  the new head's log says so when the round's later contributions meet no earlier ones).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from irdma._errors import BadRequest
from irdma.wire import compress
from irdma.wire import protocol as P
from irdma.wire.protocol import Encoding, Update, as_update

log = logging.getLogger("irdma.server")

#: Seconds an incomplete round is kept at most (then dropped at the next contribution).
ROUND_HOLD_S = 600.0
#: Completed rounds remembered (their version, for contributions sent again), the oldest forgotten.
DONE_REMEMBERED = 1 << 16

#: (file id, chunk index, offset, length in bytes, update op): the bytes a round sums, and how
#: (a step's weight decay, op ``add``, is a round of its own beside its gradient's).
Key = tuple[int, int, int, int, int]
#: What applies a push: the dispatcher's write path (chain or not); a version or its awaitable.
Apply = Callable[[P.Write], int | Awaitable[int]]


@dataclass
class _Open:
    """A round being summed for one range."""

    series: int
    round: int
    members: int
    update: Update  # without its round or encoding: what the round applies
    total: bool
    sum: np.ndarray  # float32, the range's elements
    started: float  # time.monotonic()
    contributed: set[int] = field(default_factory=set)
    complete: bool = False


class Rounds:
    """The rounds a shard is summing (see the module docstring); one per dispatcher.

    Args:
        shard_id: for messages.
        version_of: ``(file id, chunk index) -> version`` of the chunk now (0: none).
    """

    def __init__(self, shard_id: int, version_of: Callable[[int, int], int]) -> None:
        self.shard_id = shard_id
        self._version_of = version_of
        self._open: OrderedDict[Key, _Open] = OrderedDict()
        #: Completed rounds per range: (series, round) -> the version their update reached.
        self._done: OrderedDict[Key, tuple[int, int, int]] = OrderedDict()

    @property
    def open_rounds(self) -> int:
        """Ranges with a round being summed."""
        return len(self._open)

    def contribute(self, msg: P.Write, data: memoryview | bytes, apply: Apply) -> int | Awaitable[int]:
        """Add ``msg`` (a WRITE whose update has a round; ``data`` its payload, encoded or
        not) to its round; apply the round's update with ``apply`` when it is the last.

        Returns:
            The chunk's version now (a contribution that does not complete its round), or what
            ``apply`` returns for the round's update.

        Raises:
            BadRequest: not float32 aligned, an encoded payload that does not decode, or a
                contribution that disagrees with its round's others. Nothing changed.
            And what ``apply`` raises (the round stays complete: the last contribution sent
            again applies it).
        """
        u = as_update(msg.op)
        r = u.round
        assert r is not None
        if not u.op.is_float32:
            raise BadRequest("a round sums float32 gradients: its update op is add or an optimizer, not assign")
        grad = self._dense(msg, u, data)
        key: Key = (msg.file_id, msg.chunk_index, msg.offset, 4 * len(grad), int(u.op))
        done = self._done.get(key)
        if done is not None and done[:2] == (r.series, r.round):
            return done[2]  # sent again after its round was applied
        self._expire()
        acc = self._open.get(key)
        if acc is not None and (acc.series, acc.round) != (r.series, r.round):
            self._drop(key, acc, f"a contribution to round {r.round} of run {r.series:#x} came")
            acc = None
        want = dataclasses.replace(u, round=None, encoding=Encoding.NONE)
        if acc is None:
            acc = _Open(r.series, r.round, r.members, want, r.total, np.zeros(len(grad), np.float32),
                        time.monotonic())
            self._open[key] = acc
            if done is not None and done[0] == r.series and done[1] + 1 < r.round:
                log.warning("shard %d: round %d of chunk (%d, %d) at offset %d follows round %d: the rounds between"
                            " were summed elsewhere (another head of the chain) or lost with it", self.shard_id,
                            r.round, msg.file_id, msg.chunk_index, msg.offset, done[1])
        elif acc.members != r.members or acc.update != want or acc.total != r.total:
            raise BadRequest(f"round {r.round}: member {r.member}'s push of chunk ({msg.file_id}, {msg.chunk_index})"
                             f" disagrees with the round's others ({r.members} members, {want} against"
                             f" {acc.members} members, {acc.update}): every member pushes the same update")
        if r.member in acc.contributed:
            if acc.complete:  # its update failed or waits for a new chunk: applied again
                return self._apply(key, acc, msg, apply)
            return self._version_of(msg.file_id, msg.chunk_index)
        acc.sum += grad
        acc.contributed.add(r.member)
        if len(acc.contributed) < acc.members:
            return self._version_of(msg.file_id, msg.chunk_index)
        acc.complete = True
        return self._apply(key, acc, msg, apply)

    def _apply(self, key: Key, acc: _Open, msg: P.Write, apply: Apply) -> int | Awaitable[int]:
        mean = acc.sum if acc.total else acc.sum / np.float32(acc.members)
        # the mean is a new array nobody writes again: its bytes are the push's, no copy
        data = memoryview(np.ascontiguousarray(mean, dtype="<f4")).cast("B")  # type: ignore[arg-type]
        push = dataclasses.replace(msg, op=acc.update if acc.update.op.is_optimizer else acc.update.op, data=data)
        out = apply(push)  # raises: the round stays complete and is applied again when asked
        del self._open[key]
        if isinstance(out, int):
            self._finished(key, acc, out)
            return out

        async def applied() -> int:
            version = await out
            self._finished(key, acc, version)
            return version

        return applied()

    def _finished(self, key: Key, acc: _Open, version: int) -> None:
        self._done[key] = (acc.series, acc.round, version)
        self._done.move_to_end(key)
        while len(self._done) > DONE_REMEMBERED:
            self._done.popitem(last=False)

    def _dense(self, msg: P.Write, u: Update, data: memoryview | bytes) -> np.ndarray:
        if msg.offset % 4:
            raise BadRequest(f"a round's push at offset {msg.offset}: float32 gradients start at a multiple of 4")
        if u.encoding:
            try:
                return compress.decode(data, u.encoding, limit=max(0, msg.chunk_size - msg.offset) // 4)
            except ValueError as exc:
                raise BadRequest(f"a round's {Encoding(u.encoding).name.lower()} payload refused: {exc}") from None
        if len(data) % 4:
            raise BadRequest(f"a round's push of {len(data)} bytes: float32 gradients are a multiple of 4 bytes")
        return np.frombuffer(data, dtype="<f4")

    def _expire(self) -> None:
        limit = time.monotonic() - ROUND_HOLD_S
        while self._open:
            key, acc = next(iter(self._open.items()))
            if acc.started >= limit or acc.complete:
                break
            self._drop(key, acc, f"it waited {ROUND_HOLD_S:.0f} s")

    def _drop(self, key: Key, acc: _Open, why: str) -> None:
        del self._open[key]
        missing = sorted(set(range(acc.members)) - acc.contributed)
        log.warning("shard %d: round %d of run %#x for chunk (%d, %d) at offset %d dropped incomplete (%s): members"
                    " %s pushed, %s did not; its step was not applied", self.shard_id, acc.round, acc.series, key[0],
                    key[1], key[2], why, sorted(acc.contributed), missing)


__all__ = ["Rounds", "ROUND_HOLD_S", "DONE_REMEMBERED"]
