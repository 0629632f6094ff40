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
import trio

from irdma._errors import BadRequest
from irdma.wire import compress
from irdma.wire import protocol as P
from irdma.wire.extents import elements, positions
from irdma.wire.protocol import Encoding, Update, as_update

from .region import ChunksPending
from .rows import split_extents

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
#: What applies a round's sparse rows: the dispatcher's SCATTER path (chain or not).
ApplyRows = Callable[[P.Scatter], int | Awaitable[int]]
#: The offset field of a :data:`Key` that names a chunk's sparse rows (a SCATTER's round).
ROWS = -1


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
    #: Sparse rows (a SCATTER's round): the float32 positions in the chunk summed so far (int64,
    #: ascending, distinct); ``sum`` holds their sums, in that order.
    where: np.ndarray | None = None
    #: The last contribution's message without its payload: what a close applies the round with.
    msg: P.Write | P.Scatter | None = None
    #: Closed with fewer members than expected (:meth:`Rounds.close`).
    short: bool = False


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
        #: Rounds' updates being applied (chained down the replicas): (series, round) and the
        #: event set when that ends; a close waits for those of its run.
        self._inflight: dict[trio.Event, tuple[int, int]] = {}
        #: A close's updates under way when it met chunks to make: awaited by the next close.
        self._deferred: list[Awaitable[int]] = []
        self._short = 0  # and how many of its ranges were short

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
        u, r = _round_of(msg)
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
        elif (acc.members != r.members and not r.elastic) or acc.update != want or acc.total != r.total:
            raise BadRequest(f"round {r.round}: member {r.member}'s push of chunk ({msg.file_id}, {msg.chunk_index})"
                             f" disagrees with the round's others ({r.members} members, {want} against"
                             f" {acc.members} members, {acc.update}): every member pushes the same update")
        if r.member in acc.contributed:
            if acc.complete:  # its update failed or waits for a new chunk: applied again
                return self._apply(key, acc, msg, apply)
            return self._version_of(msg.file_id, msg.chunk_index)
        acc.members = max(acc.members, r.members)  # an elastic round's: the largest expected
        acc.msg = dataclasses.replace(msg, data=b"")
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
        return self._track(acc, out, lambda version: self._finished(key, acc, version))

    def _track(self, acc: _Open, out: Awaitable[int], then: Callable[[int], None]) -> Awaitable[int]:
        """``out`` (a round's update being applied) awaited, then ``then(version)``; a close of
        the round's run meanwhile waits for it (:meth:`close`)."""
        ended = trio.Event()
        self._inflight[ended] = (acc.series, acc.round)

        async def applied() -> int:
            try:
                version = await out
            finally:
                del self._inflight[ended]
                ended.set()
            then(version)
            return version

        return applied()

    def contribute_rows(self, msg: P.Scatter, data: memoryview | bytes, apply: ApplyRows) -> int | Awaitable[int]:
        """Add ``msg`` (a SCATTER whose update has a round: one member's sparse rows; ``data``
        its payload) to its round, chunk by chunk; apply the rounds it completes with ``apply``,
        as one SCATTER of their rows.

        A chunk's round sums the rows its members pushed: the float32 elements any member named,
        each the sum of the members' values for it (a row no member pushed is not in the round;
        one pushed by some members counts zero for the others, as Horovod's average of sparse
        gradients does). The round completes when every member ``0 .. members - 1`` contributed to
        the chunk: a member with no rows in a chunk this round sends an extent of length 0 in
        it (its empty contribution), so a round never waits for rows that do not come. The
        update op is then applied once to the mean (or sum) of the rows, state included: the
        lazy update of TensorFlow's sparse ``apply`` on the rows the round touched.

        Returns:
            The highest version of the request's chunks (the applied round's, if it completed one).

        Raises:
            BadRequest: extents that leave their chunk, overlap, are not float32 aligned or do not
                match the payload; a contribution that disagrees with its round's others. Nothing
                changed. And what ``apply`` raises (the rounds stay complete, applied again when the
                last contribution is sent again).
        """
        u, r = _round_of(msg)
        chunk = msg.extents["chunk"].astype(np.int64)
        length = msg.extents["length"].astype(np.int64)
        if not len(chunk):
            raise BadRequest("a scatter names no extent")
        if int(positions(length)[-1]) != len(data) or len(data) % 4:
            raise BadRequest(f"a round's scatter carries {len(data)} bytes for extents of {int(length.sum())}")
        rows = length > 0
        parts = split_extents(msg.extents[rows], msg.chunk_size, u.op, len(data)) if rows.any() else []
        mine = {index: (offs, lens, at) for index, offs, lens, at in parts}
        values = np.frombuffer(data, dtype="<f4")
        want = dataclasses.replace(u, round=None, encoding=Encoding.NONE)
        names = sorted(set(chunk.tolist()))
        for index in names:  # every check first: a contribution that disagrees changes nothing
            acc = self._open.get((msg.file_id, index, ROWS, 0, int(u.op)))
            if acc is not None and (acc.series, acc.round) == (r.series, r.round) and (
                    (acc.members != r.members and not r.elastic) or acc.update != want or acc.total != r.total):
                raise BadRequest(f"round {r.round}: member {r.member}'s rows of chunk ({msg.file_id}, {index})"
                                 f" disagree with the round's others ({r.members} members, {want} against"
                                 f" {acc.members} members, {acc.update}): every member pushes the same update")
        self._expire()
        versions: list[int] = [0]
        ready: list[tuple[Key, _Open]] = []
        for index in names:
            key: Key = (msg.file_id, index, ROWS, 0, int(u.op))
            done = self._done.get(key)
            if done is not None and done[:2] == (r.series, r.round):
                versions.append(done[2])  # sent again after its round was applied
                continue
            acc = self._open.get(key)
            if acc is not None and (acc.series, acc.round) != (r.series, r.round):
                self._drop(key, acc, f"a contribution to round {r.round} of run {r.series:#x} came")
                acc = None
            if acc is None:
                acc = _Open(r.series, r.round, r.members, want, r.total, np.zeros(0, np.float32), time.monotonic(),
                            where=np.zeros(0, np.int64))
                self._open[key] = acc
            if r.member in acc.contributed:
                if acc.complete:  # its update failed: applied again
                    ready.append((key, acc))
                else:
                    versions.append(self._version_of(msg.file_id, index))
                continue
            acc.members = max(acc.members, r.members)  # an elastic round's: the largest expected
            acc.msg = dataclasses.replace(msg, data=b"", extents=msg.extents[:0])
            if index in mine:
                offs, lens, at = mine[index]
                _add_rows(acc, elements(offs // 4, lens // 4), values[elements(at // 4, lens // 4)])
            acc.contributed.add(r.member)
            if len(acc.contributed) < acc.members:
                versions.append(self._version_of(msg.file_id, index))
                continue
            acc.complete = True
            ready.append((key, acc))
        if not ready:
            return max(versions)
        return self._apply_rows(msg, ready, apply, max(versions))

    def _apply_rows(self, msg: P.Scatter, ready: list[tuple[Key, _Open]], apply: ApplyRows,
                    version: int) -> int | Awaitable[int]:
        """One SCATTER of the rows of the completed rounds ``ready`` (contiguous elements in one
        extent), their mean (or sum)."""
        chunks, offsets, lengths, means = [], [], [], []
        for key, acc in ready:
            where = acc.where
            assert where is not None
            if not len(where):
                continue
            cuts = np.flatnonzero(np.diff(where) != 1) + 1
            starts, ends = np.r_[0, cuts], np.r_[cuts, len(where)]
            chunks.append(np.full(len(starts), key[1], dtype=np.int64))
            offsets.append(4 * where[starts])
            lengths.append(4 * (ends - starts))
            means.append(acc.sum if acc.total else acc.sum / np.float32(acc.members))
        if not chunks:  # every member's contribution was empty: nothing to apply
            for key, acc in ready:
                del self._open[key]
                self._finished(key, acc, max(version, self._version_of(key[0], key[1])))
            return max([version] + [self._version_of(key[0], key[1]) for key, _ in ready])
        update = ready[0][1].update
        data = memoryview(np.ascontiguousarray(np.concatenate(means), dtype="<f4")).cast("B")  # type: ignore[arg-type]
        push = dataclasses.replace(msg, op=update if update.op.is_optimizer else update.op, data=data,
                                   extents=P.extents(np.concatenate(chunks), np.concatenate(offsets),
                                                     np.concatenate(lengths)), staged=False, staging_offset=0)
        out = apply(push)  # raises: the rounds stay complete and are applied again when asked
        for key, _ in ready:
            del self._open[key]

        def finished(got: int) -> None:
            for key, acc in ready:
                self._finished(key, acc, got)

        if isinstance(out, int):
            finished(out)
            return max(out, version)
        tracked = self._track(ready[0][1], out, finished)

        async def applied() -> int:
            return max(await tracked, version)

        return applied()

    def close(self, series: int, round: int, apply: Apply, apply_rows: ApplyRows) -> int | Awaitable[int]:
        """Apply every open round of run ``series`` up to ``round`` with the contributions it has:
        the mean over the members that contributed (an elastic job's round whose member died,
        :data:`irdma.wire.protocol.ROUND_CLOSE`), logged when fewer than expected; and wait for
        those of the run being applied.

        Returns:
            How many ranges were applied with fewer members than expected (or its awaitable).

        Raises:
            What ``apply`` raises (the rounds left open are applied by the next close).
        """
        short = 0
        pending: ChunksPending | None = None
        for key, acc in list(self._open.items()):
            if acc.series != series or acc.round > round or acc.msg is None:
                continue
            if len(acc.contributed) < acc.members:
                log.warning("shard %d: round %d of run %#x for chunk (%d, %d) %s closed by a member: %d of %d"
                            " members pushed (%s; not %s), so its step is on their mean", self.shard_id, acc.round,
                            acc.series, key[0], key[1], "(its rows)" if key[2] == ROWS else f"at offset {key[2]}",
                            len(acc.contributed), acc.members, sorted(acc.contributed),
                            sorted(set(range(acc.members)) - acc.contributed))
                acc.members, acc.short = len(acc.contributed), True
            acc.complete = True
            try:
                if isinstance(acc.msg, P.Scatter):
                    out = self._apply_rows(acc.msg, [(key, acc)], apply_rows, 0)
                else:
                    out = self._apply(key, acc, acc.msg, apply)
            except ChunksPending as more:  # made by the dispatcher, then this close is applied again
                if pending is None:
                    pending = more
                else:
                    pending.add(more)
                continue
            short += acc.short
            if not isinstance(out, int):
                self._deferred.append(out)
        short += self._short
        if pending is not None:
            self._short = short  # said by the close applied again
            raise pending  # the updates under way are awaited by the close applied again
        outs, self._deferred, self._short = self._deferred, [], 0
        waits = [e for e, (s_, r_) in self._inflight.items() if s_ == series and r_ <= round]
        if not outs and not waits:
            return short

        async def closed() -> int:
            for o in outs:
                await o
            for e in waits:
                await e.wait()
            return short

        return closed()

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
        log.warning("shard %d: round %d of run %#x for chunk (%d, %d) %s dropped incomplete (%s): members"
                    " %s pushed, %s did not; its step was not applied", self.shard_id, acc.round, acc.series, key[0],
                    key[1], "(its rows)" if key[2] == ROWS else f"at offset {key[2]}", why, sorted(acc.contributed),
                    missing)


def _round_of(msg: P.Write | P.Scatter) -> tuple[Update, P.Round]:
    """A contribution's update and round (float32 ops only, one member at least).

    Raises:
        BadRequest: an assign, or a round of no member.
    """
    u = as_update(msg.op)
    r = u.round
    assert r is not None
    if not u.op.is_float32:
        raise BadRequest("a round sums float32 gradients: its update op is add or an optimizer, not assign")
    if r.members < 1:
        raise BadRequest("a round has at least one member")
    return u, r


def _add_rows(acc: _Open, where: np.ndarray, values: np.ndarray) -> None:
    """Add ``values`` (float32) at float32 positions ``where`` (distinct) to a round's sparse sum."""
    if acc.where is None or not len(acc.where):
        order = np.argsort(where, kind="stable")
        acc.where, acc.sum = where[order], values[order].astype(np.float32)
        return
    union, inverse = np.unique(np.concatenate([acc.where, where]), return_inverse=True)
    total = np.zeros(len(union), dtype=np.float32)
    np.add.at(total, inverse.reshape(-1), np.concatenate([acc.sum, values]))  # the sum so far, then this member's
    acc.where, acc.sum = union, total


__all__ = ["Rounds", "ROUND_HOLD_S", "DONE_REMEMBERED", "ROWS"]
