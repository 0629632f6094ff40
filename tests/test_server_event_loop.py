"""The shard server's event loop never waits for the disk or for a slow reader, each on real
sockets:

* disk I/O runs in a worker thread, never on the loop: a SYNC over verbs (as over TCP), and a
  new chunk's zeroing and chunk-index record, while requests on one connection stay in order,
  two requests that create one chunk make it once, a retried request id is applied once, and a
  chunk that cannot be recorded fails only the request that needed it;
* a connection's reader goes on while its sender waits for the wire: a client that does not
  read its replies yet still has its next request applied.

The blocking calls are held by a gate (a threading.Event with a bounded wait): on the event loop
the gate would stall the whole shard (the bug), in a worker thread the shard serves on.
The client's checks on the replies it reads are in tests/test_reply_checks.py.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from irdma.server.serve import ShardServer
from irdma.server.shard import Region, Shard
from irdma.server.store import ShardStore

from irdma._errors import NoSpace
from irdma.transport.base import ShardConnection
from irdma.transport.tcp import TcpTransport
from irdma.wire import protocol as P
from irdma.wire.protocol import UpdateOp

MB = 1 << 20
PAGE = 4096
#: Longest a gate holds a call (a stalled event loop then resumes and the test fails, not hangs).
GATE_S = 3.0
#: A wait for something that takes milliseconds when the code is right.
WAIT_S = 10.0


class _Gate:
    """Wraps ``fn``: records the thread of every call; the first call waits until ``open`` is
    set (at most GATE_S seconds)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.open = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, *args: Any) -> Any:
        self.threads.append(threading.current_thread())
        if len(self.threads) == 1:
            self.entered.set()
            self.open.wait(GATE_S)
        return self.fn(*args)

    async def wait_entered(self) -> None:
        assert await trio.to_thread.run_sync(self.entered.wait, WAIT_S), "the gated call never came"

    @property
    def on_the_loop(self) -> bool:
        return any(t is threading.main_thread() for t in self.threads)  # trio.run runs in this thread


@contextlib.contextmanager
def _stored_shard(tmp_path: object) -> Iterator[tuple[ShardStore, Shard]]:
    """A shard with a data directory (what `irdma server --data-dir` runs)."""
    store = ShardStore(os.path.join(str(tmp_path), "shard"), 1, 16 * MB)
    shard = Shard(1, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions), store=store)
    try:
        yield store, shard
    finally:
        store.close()


async def _serve(server: ShardServer, nursery: trio.Nursery) -> str:
    host, port = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
    return f"{host}:{port}"


# ------------------------------------------------------------------ SYNC off the event loop
def test_a_verbs_sync_runs_in_a_worker_thread_and_the_loop_serves_meanwhile(tmp_path: object) -> None:
    """The verbs front end's request loop (fed as the queue pair would feed it)."""
    verbs_server = pytest.importorskip("irdma.server.verbs")
    from irdma.transport.verbs import RECV_SLOTS, SLOT_SIZE

    class Endpoint:  # the part of the queue pair the loop uses: received slots in, frames out
        def __init__(self) -> None:
            self.recv_view = memoryview(bytearray(RECV_SLOTS * SLOT_SIZE))
            self.sent: list[bytes] = []
            self.replied = trio.Event()

        def repost(self, slot: int) -> None:
            pass

        async def send_frame(self, parts: list[bytes | memoryview]) -> None:
            self.sent.append(b"".join(parts))
            self.replied.set()

    with _stored_shard(tmp_path) as (store, shard):
        gate = _Gate(store.sync)
        store.sync = gate  # type: ignore[method-assign]
        server = ShardServer(shard)

        async def main() -> None:
            ep = Endpoint()
            send_in, recv_out = trio.open_memory_channel[tuple[int, int]](RECV_SLOTS)
            frame = b"".join(P.encode_request(P.Sync(), 5))
            ep.recv_view[: len(frame)] = frame
            async with trio.open_nursery() as n:
                n.start_soon(verbs_server.VerbsShard._serve_requests, ep, server, memoryview(bytearray(PAGE)),
                             recv_out)
                await send_in.send((0, len(frame)))
                await gate.wait_entered()
                assert not ep.sent  # the msync is under way in its thread, and this task runs
                gate.open.set()
                with trio.fail_after(WAIT_S):
                    await ep.replied.wait()
                n.cancel_scope.cancel()
            dec = P.FrameDecoder()
            dec.feed(ep.sent[0])
            reply = dec.next_frame()
            assert reply is not None and reply.request_id == 5
            assert P.decode_reply(reply) == P.VersionReply(0)

        trio.run(main)
        assert len(gate.threads) == 1 and not gate.on_the_loop


def test_a_tcp_sync_runs_in_a_worker_thread_and_the_loop_serves_meanwhile(tmp_path: object) -> None:
    with _stored_shard(tmp_path) as (store, shard):
        gate = _Gate(store.sync)
        store.sync = gate  # type: ignore[method-assign]
        server = ShardServer(shard)

        async def main() -> None:
            async with trio.open_nursery() as n:
                address = await _serve(server, n)
                a = await TcpTransport().connect(address, n)
                b = await TcpTransport().connect(address, n)
                synced = trio.Event()

                async def sync() -> None:
                    await a.sync()
                    synced.set()

                n.start_soon(sync)
                await gate.wait_entered()
                with trio.fail_after(WAIT_S):
                    assert (await b.stat()).shard_id == 1  # served while the msync runs
                assert not synced.is_set()
                gate.open.set()
                with trio.fail_after(WAIT_S):
                    await synced.wait()
                n.cancel_scope.cancel()

        trio.run(main)
        assert len(gate.threads) == 1 and not gate.on_the_loop


# ------------------------------------------------------------------ new chunks off the event loop
def test_a_new_chunk_is_zeroed_and_recorded_in_a_worker_thread_while_the_loop_serves_others(
        tmp_path: object) -> None:
    with _stored_shard(tmp_path) as (store, shard):
        gate = _Gate(store._zero)
        store._zero = gate  # type: ignore[method-assign]
        server = ShardServer(shard)

        async def main() -> None:
            async with trio.open_nursery() as n:
                address = await _serve(server, n)
                a = await TcpTransport().connect(address, n)
                b = await TcpTransport().connect(address, n)
                versions: list[int] = []
                pushed = trio.Event()

                async def push() -> None:
                    versions.append(await a.write(7, 0, MB, 0, UpdateOp.ASSIGN, b"x" * PAGE))
                    pushed.set()

                n.start_soon(push)
                await gate.wait_entered()
                buf = memoryview(bytearray(16))
                with trio.fail_after(WAIT_S):  # served while the chunk is being made
                    assert (await b.stat()).shard_id == 1
                    assert await b.read(7, 0, 0, buf) == 0 and bytes(buf) == bytes(16)  # not made yet: a hole
                assert not versions
                gate.open.set()
                with trio.fail_after(WAIT_S):
                    await pushed.wait()
                assert versions == [1]
                assert await b.read(7, 0, 0, buf) == 1 and bytes(buf) == b"x" * 16
                n.cancel_scope.cancel()

        trio.run(main)
        assert len(gate.threads) == 1 and not gate.on_the_loop
        assert [(f, i, size) for f, i, _, size in store.chunks()] == [(7, 0, MB)]  # recorded, once
        assert shard.used == PAGE and shard.chunk_count == 1  # the extent of 16 bytes written


def test_two_requests_creating_one_chunk_make_it_once_and_a_retried_request_id_applies_once(
        tmp_path: object) -> None:
    """A chained ADD (request id 77) makes a new chunk; meanwhile its retry (same id, another
    connection) and another ADD (a third connection) need the same chunk: they wait, the chunk
    is made once, the retry is not applied again, the other ADD is."""
    ones = np.ones(1024, "<f4").tobytes()
    twos = np.full(1024, 2, "<f4").tobytes()
    with _stored_shard(tmp_path) as (store, shard):
        gate = _Gate(store._zero)
        store._zero = gate  # type: ignore[method-assign]
        server = ShardServer(shard)

        async def main() -> None:
            async with trio.open_nursery() as n:
                address = await _serve(server, n)
                a, b, c = [await TcpTransport().connect(address, n) for _ in range(3)]
                got: dict[str, int] = {}

                async def push(name: str, conn: ShardConnection, data: bytes, chain: P.Chain | None) -> None:
                    got[name] = await conn.write(9, 0, PAGE, 0, UpdateOp.ADD, data, chain=chain)

                with trio.fail_after(WAIT_S):
                    async with trio.open_nursery() as pushes:
                        pushes.start_soon(push, "first", a, ones, P.Chain(77))
                        await gate.wait_entered()
                        pushes.start_soon(push, "retry", b, ones, P.Chain(77))
                        pushes.start_soon(push, "other", c, twos, None)
                        await trio.testing.wait_all_tasks_blocked(0.05)
                        assert got == {}  # both wait for the chunk the first one is making
                        gate.open.set()
                assert got == {"first": 1, "retry": 1, "other": 2}
                buf = memoryview(bytearray(PAGE))
                assert await a.read(9, 0, 0, buf) == 2
                assert np.array_equal(np.frombuffer(buf, "<f4"), np.full(1024, 3, "<f4"))
                n.cancel_scope.cancel()

        trio.run(main)
        assert len(gate.threads) == 1 and not gate.on_the_loop  # made once, off the loop
        assert [(f, i) for f, i, _, _ in store.chunks()] == [(9, 0)]
        assert shard.used == PAGE and server._making == {}


def test_requests_pipelined_on_one_connection_apply_in_order_across_a_chunk_creation(tmp_path: object) -> None:
    """A WRITE that makes a chunk, then a READ of it, sent back to back on one connection
    before the chunk is made: the READ is applied after the WRITE and sees its bytes."""
    with _stored_shard(tmp_path) as (store, shard):
        gate = _Gate(store._zero)
        store._zero = gate  # type: ignore[method-assign]
        server = ShardServer(shard)

        async def main() -> None:
            async with trio.open_nursery() as n:
                address = await _serve(server, n)
                conn = await TcpTransport().connect(address, n)
                into = memoryview(bytearray(PAGE))
                w = await conn.start(P.Write(3, 0, MB, 0, UpdateOp.ASSIGN, b"y" * PAGE))
                r = await conn.start(P.Read(3, 0, 0, PAGE), into)
                await gate.wait_entered()
                await trio.testing.wait_all_tasks_blocked(0.05)
                gate.open.set()
                with trio.fail_after(WAIT_S):
                    written = await conn.finish(w)
                    read = await conn.finish(r)
                assert written == P.VersionReply(1)
                assert isinstance(read, P.ReadReply) and read.version == 1 and bytes(into) == b"y" * PAGE
                n.cancel_scope.cancel()

        trio.run(main)
        assert not gate.on_the_loop


def test_a_new_chunk_that_cannot_be_recorded_fails_that_request_only_and_leaves_nothing(tmp_path: object) -> None:
    with _stored_shard(tmp_path) as (store, shard):
        real = store.add_chunks
        threads: list[threading.Thread] = []

        def failing(rows: Any) -> None:
            threads.append(threading.current_thread())
            store.add_chunks = real  # type: ignore[method-assign]
            raise OSError(28, "No space left on device")

        store.add_chunks = failing  # type: ignore[method-assign]
        server = ShardServer(shard)

        async def main() -> None:
            async with trio.open_nursery() as n:
                conn = await TcpTransport().connect(await _serve(server, n), n)
                with pytest.raises(NoSpace, match="cannot make a new chunk: the disk of its data directory is full"
                                   r" \(other files on that disk count too\) \(free space \(rm files") as err:
                    await conn.write(5, 0, MB, 0, UpdateOp.ASSIGN, b"z" * 8)
                assert str(err.value).count("free space") == 1  # the advice once
                assert shard.used == 0 and shard.chunk_count == 0 and server._making == {}
                assert await conn.write(5, 0, MB, 0, UpdateOp.ASSIGN, b"z" * 8) == 1  # same connection
                n.cancel_scope.cancel()

        trio.run(main)
        assert threads and not any(t is threading.main_thread() for t in threads)
        assert [(f, i) for f, i, _, _ in store.chunks()] == [(5, 0)]


# ------------------------------------------------------------------ reading on while a reply is sent
def test_a_connection_reads_and_applies_its_next_request_while_a_reply_is_still_being_sent(
        tmp_path: object) -> None:
    """Issue 21 (pipelined connections): a client that has not yet read the 16 MiB of its four
    READ replies (more than the socket buffers hold) still has the WRITE it sent after them
    applied: the shard's reader goes on while its sender waits for the wire. The replies then
    arrive whole, in the order of the requests."""
    import socket

    from helpers import RawShard, running_cluster, wait_until

    from irdma.ops.cluster import key_file_of
    from irdma.wire import auth

    with running_cluster(os.path.join(str(tmp_path), "c"), shards=1, capacity=64 << 20) as c:
        ring = auth.read_key_file(key_file_of(c.dir))
        address = c.shards[0].address
        chunk = 4 << 20
        base = np.arange(chunk // 4, dtype="<f4").tobytes()
        other = RawShard(address, ring, "other")
        other.request(P.Write(4343, 0, chunk, 0, UpdateOp.ASSIGN, base), 1)
        assert isinstance(other.reply(), P.VersionReply)

        slow = RawShard(address, ring, "slow reader")
        slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        for rid in range(1, 5):  # 16 MiB of replies that this client does not read yet
            slow.request(P.Read(4343, 0, 0, chunk), rid)
        flag = np.full(1024, 7.0, dtype="<f4").tobytes()
        slow.request(P.Write(4344, 0, 4096, 0, UpdateOp.ASSIGN, flag), 5)

        def applied() -> bool:
            other.request(P.Read(4344, 0, 0, 4096), 2)
            r = other.reply()
            return isinstance(r, P.ReadReply) and not r.hole and bytes(r.data) == flag

        wait_until(applied, WAIT_S, "the WRITE sent behind four unread 4 MiB READ replies to be applied")
        got = []
        for _ in range(5):
            got.append(slow.reply())
        assert [type(r) for r in got] == [P.ReadReply] * 4 + [P.VersionReply]
        for r in got[:4]:
            assert bytes(r.data) == base  # type: ignore[attr-defined]
        slow.close()
        other.close()
