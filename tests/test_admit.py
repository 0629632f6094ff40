"""The shard's side of a cut that keeps pushes whole (issue 23, protocol 9): a push whose first
part was applied before a FREEZE and whose second part comes after it is admitted whole by
ADMIT, another push's held update waits for THAW, and a held update does not stop the
connection's later requests. Driven through the dispatcher, frame by frame, no sockets."""

from __future__ import annotations

import inspect

import numpy as np
import trio
from irdma.server.dispatch import ThreadWork
from irdma.server.serve import ShardServer
from irdma.server.shard import Region, Shard

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
