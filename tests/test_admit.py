"""The shard's side of a snapshot's cut (issue 23): a push whose first part was applied before a
FREEZE and whose second part comes after it is admitted whole by ADMIT (protocol 9), another
push's held update waits for the freeze's end, and a held update does not stop the
connection's later requests; a frozen replica holds forwarded updates and its CLONE takes
those the cut has before the clone and the rest after, then ends the freeze (protocol 10).
Driven through the dispatcher, frame by frame, no sockets."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import trio
from irdma.server import dispatch
from irdma.server.dispatch import ThreadWork
from irdma.server.serve import ShardServer
from irdma.server.shard import Region, Shard
from irdma.server.store import ShardStore

from irdma.wire import protocol as P

ONES = np.ones(1024, "<f4").tobytes()  # one 4 KiB chunk of 1.0


def _frame(msg: P.Request, rid: int) -> P.Frame:
    wire = b"".join(bytes(p) for p in P.encode_request(msg, rid))
    frame = P.parse_header(wire[: P.HEADER_SIZE], 1 << 20)
    frame.body = memoryview(wire[P.HEADER_SIZE :])
    return frame


def _add(index: int, rid: int, part: P.Part | None) -> P.Write:
    return P.Write(7, index, 4096, 0, P.UpdateOp.ADD, ONES, chain=P.Chain(rid, 0, 0, 1000, (), part))


async def _reply(handled: object) -> P.Reply:
    while isinstance(handled, ThreadWork):
        handled = await handled
    if inspect.isawaitable(handled):
        handled = await handled
    return handled  # type: ignore[return-value]


def test_a_push_split_by_a_freeze_is_admitted_whole_and_the_rest_waits_for_thaw() -> None:
    shard = Shard(1, Region(1 << 20))
    server = ShardServer(shard)

    async def main() -> None:
        push = 42
        assert await _reply(server.handle(_frame(_add(0, 1, P.Part(push, 0, 2)), 1))) == P.VersionReply(1)
        frozen = await _reply(server.handle(_frame(P.Freeze(99, 5000, (7,)), 2)))
        assert isinstance(frozen, P.FreezeReply) and frozen.parts == [P.Part(push, 0, 2)]
        held = server.handle(_frame(_add(1, 3, P.Part(push, 1, 2)), 3))  # the push's second part
        other = server.handle(_frame(_add(2, 4, None), 4))  # another push, not split
        assert inspect.iscoroutine(held) and inspect.iscoroutine(other)  # answered later
        # the connection goes on: a read of the frozen file is answered at once
        read = server.handle(_frame(P.Read(7, 1, 0, 4), 5))
        assert isinstance(read, P.ReadReply) and read.hole and shard.version_of(7, 1) == 0
        admitted = await _reply(server.handle(_frame(P.Admit(99, 5, (push,)), 6)))
        assert isinstance(admitted, P.FreezeReply)
        assert admitted.parts == [P.Part(push, 0, 2), P.Part(push, 1, 2)]
        assert {(e.chunk_index, e.version) for e in admitted.entries} == {(0, 1), (1, 1)}
        assert await _reply(held) == P.VersionReply(1)
        assert shard.version_of(7, 2) == 0  # not admitted: after the cut
        assert await _reply(server.handle(_frame(P.Thaw(99), 7))) == P.VersionReply(0)
        with trio.fail_after(5):
            assert await _reply(other) == P.VersionReply(1)
        assert np.frombuffer(shard.read(7, 2, 0, 4)[1], "<f4")[0] == 1.0  # type: ignore[arg-type]

    trio.run(main)


def test_an_admit_with_no_part_to_apply_answers_within_its_wait() -> None:
    shard = Shard(1, Region(1 << 20))
    server = ShardServer(shard)

    async def main() -> None:
        await _reply(server.handle(_frame(P.Freeze(5, 5000, (7,)), 1)))
        t0 = trio.current_time()
        with trio.fail_after(2):
            reply = await _reply(server.handle(_frame(P.Admit(5, 20, (123,)), 2)))
        assert isinstance(reply, P.FreezeReply) and reply.parts == [] and trio.current_time() - t0 >= 0.015
        bad = await _reply(server.handle(_frame(P.Admit(6, 0, (123,)), 3)))  # no such freeze
        assert isinstance(bad, P.ErrorReply) and "take the snapshot again" in bad.message

    trio.run(main)


def _forward(rid: int, reached: int) -> P.Write:
    """A predecessor's forward of an ``add`` of 1.0 into chunk 0 of file 7: it reached version ``reached``."""
    return P.Write(7, 0, 4096, 0, P.UpdateOp.ADD, ONES, chain=P.Chain(rid, 0, reached, 1000, ()))


def _first(shard: Shard, file_id: int) -> float:
    return float(np.frombuffer(shard.read(file_id, 0, 0, 4)[1], "<f4")[0])  # type: ignore[arg-type]


def test_a_frozen_replica_holds_forwards_and_its_clone_takes_those_of_the_cut_then_ends_the_freeze() -> None:
    """Forwards that reach a frozen replica wait; CLONE applies the one the cut has (version 1,
    what the head answered), clones, then ends the freeze: the forward past the cut (version 2,
    which the head applied after its own clone) and a client's held update land on the live
    file only, in the order they came. THAW after it changes nothing."""
    shard = Shard(2, Region(1 << 20))
    server = ShardServer(shard)

    async def main() -> None:
        frozen = await _reply(server.handle(_frame(P.Freeze(99, 5000, (7,)), 1)))
        assert isinstance(frozen, P.FreezeReply) and frozen.entries == []
        before = server.handle(_frame(_forward(11, 1), 2))
        after = server.handle(_frame(_forward(12, 2), 3))
        client = server.handle(_frame(_add(0, 13, None), 4))
        assert all(inspect.iscoroutine(x) for x in (before, after, client))  # all held
        assert shard.version_of(7, 0) == 0
        with trio.fail_after(5):
            cloned = await _reply(server.handle(_frame(P.Clone(99, ((7, 8),), ((7, 0, 1),)), 5)))
        assert cloned == P.FreeReply(1)
        assert _first(shard, 8) == 1.0 and shard.version_of(8, 0) == 1  # the clone: the cut's forward only
        assert [await _reply(x) for x in (before, after, client)] == [P.VersionReply(1), P.VersionReply(2),
                                                                      P.VersionReply(3)]
        assert _first(shard, 7) == 3.0  # the live file: all three
        assert await _reply(server.handle(_frame(_add(0, 14, None), 6))) == P.VersionReply(4)  # not held now
        assert await _reply(server.handle(_frame(P.Thaw(99), 7))) == P.VersionReply(0)
        assert _first(shard, 8) == 1.0

    trio.run(main)


def test_forwards_wait_one_second_at_most_and_the_late_clone_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A freeze whose CLONE does not come in time (FORWARD_HOLD_S) lets the forwards it holds go
    on, before their senders' deadlines, and then refuses the clone as past the cut; the
    client's update it holds waits for the freeze's end as before."""
    monkeypatch.setattr(dispatch, "FORWARD_HOLD_S", 0.05)
    shard = Shard(2, Region(1 << 20))
    server = ShardServer(shard)

    async def main() -> None:
        await _reply(server.handle(_frame(P.Freeze(99, 5000, (7,)), 1)))
        held = server.handle(_frame(_forward(11, 1), 2))
        assert inspect.iscoroutine(held)
        t0 = trio.current_time()
        with trio.fail_after(2):
            assert await _reply(held) == P.VersionReply(1)
        assert trio.current_time() - t0 >= 0.04
        assert await _reply(server.handle(_frame(_forward(12, 2), 3))) == P.VersionReply(2)  # not held any more
        client = server.handle(_frame(_add(0, 13, None), 4))
        assert inspect.iscoroutine(client)  # a client's update still is
        late = await _reply(server.handle(_frame(P.Clone(99, ((7, 8),), ((7, 0, 1),)), 5)))
        assert isinstance(late, P.ErrorReply) and "past the cut" in late.message and "again" in late.message
        assert not shard.has_file(8)
        assert await _reply(server.handle(_frame(P.Thaw(99), 6))) == P.VersionReply(0)
        with trio.fail_after(2):
            assert await _reply(client) == P.VersionReply(3)

    trio.run(main)


def test_a_clone_applies_held_forwards_that_make_a_chunk_in_order(tmp_path: str) -> None:
    """On a shard with a data directory a new chunk is made in a worker thread: of two held
    pre-cut forwards, the one that makes the chunk and the one after it, the clone applies the
    second only once the chunk is made (not STALE against a chunk not yet there)."""
    store = ShardStore(str(tmp_path), 2, 1 << 20)
    shard = Shard(2, Region(1 << 20, buffer=memoryview(store.region)), memoryview(store.versions), store=store)
    server = ShardServer(shard)

    async def main() -> None:
        await _reply(server.handle(_frame(P.Freeze(99, 5000, (7,)), 1)))
        first, second = server.handle(_frame(_forward(11, 1), 2)), server.handle(_frame(_forward(12, 2), 3))
        replies: list[P.Reply] = []

        async def answer(x: object) -> None:
            replies.append(await _reply(x))

        async with trio.open_nursery() as nursery:  # as the front end: each held request's answer awaited
            nursery.start_soon(answer, first)
            nursery.start_soon(answer, second)
            with trio.fail_after(5):
                cloned = await _reply(server.handle(_frame(P.Clone(99, ((7, 8),), ((7, 0, 2),)), 4)))
        assert cloned == P.FreeReply(1), cloned
        assert sorted(replies, key=str) == [P.VersionReply(1), P.VersionReply(2)]
        assert _first(shard, 8) == 2.0 and shard.version_of(8, 0) == 2

    try:
        trio.run(main)
    finally:
        store.close()


def test_a_held_forward_of_optimizer_state_is_cut_with_its_chunk() -> None:
    """A forward of a chunk's optimizer state chunk (a REPLACE's second half, or a client's
    restore of it) counts as its chunk's: held pre-cut, it is in the clone with the chunk."""
    from irdma.wire.optimizers import STATE_BASE

    shard = Shard(2, Region(1 << 20))
    server = ShardServer(shard)
    state = np.full(1024, 7.0, "<f4").tobytes()

    async def main() -> None:
        await _reply(server.handle(_frame(P.Freeze(99, 5000, (7,)), 1)))
        chunk = server.handle(_frame(_forward(11, 1), 2))
        moments = server.handle(_frame(P.Write(7, STATE_BASE, 4096, 0, P.UpdateOp.ASSIGN, state,
                                               chain=P.Chain(12, 0, 1, 1000, ())), 3))
        assert inspect.iscoroutine(chunk) and inspect.iscoroutine(moments)
        with trio.fail_after(5):
            cloned = await _reply(server.handle(_frame(P.Clone(99, ((7, 8),), ((7, 0, 1),)), 4)))
        assert cloned == P.FreeReply(2)  # the chunk and its state
        assert np.frombuffer(shard.read(8, STATE_BASE, 0, 4)[1], "<f4")[0] == 7.0  # type: ignore[arg-type]
        assert [await _reply(x) for x in (chunk, moments)] == [P.VersionReply(1), P.VersionReply(1)]

    trio.run(main)
