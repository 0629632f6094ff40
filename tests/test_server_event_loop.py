"""Review points of issue 20 in the shard server and the transports, each on real sockets:

* disk I/O runs in a worker thread, never on a shard's event loop: a SYNC over verbs (as over
  TCP), and a new chunk's zeroing and chunk-index record, while requests on one connection stay
  in order, two requests that create one chunk make it once, and a retried request id is
  applied once;
* a reply of the wrong kind is the peer's protocol error (not an ``assert``, which
  ``python -O`` strips) and breaks the connection.

The blocking calls are held by a gate (a threading.Event with a bounded wait): on the event loop
the gate would stall the whole shard (the bug), in a worker thread the shard serves on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing
from irdma.server.replicate import Link
from irdma.server.serve import ShardServer
from irdma.server.shard import Region, Shard
from irdma.server.store import ShardStore

from irdma._errors import IrdmaError, RemoteProtocolError, ReplicaFailed, ShardUnavailable
from irdma.transport.base import ShardConnection
from irdma.transport.tcp import TcpTransport, read_frame, send_parts
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
        assert shard.used == MB and shard.chunk_count == 1


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
                with pytest.raises(ShardUnavailable, match="cannot make a new chunk: .*No space left"):
                    await conn.write(5, 0, MB, 0, UpdateOp.ASSIGN, b"z" * 8)
                assert shard.used == 0 and shard.chunk_count == 0 and server._making == {}
                assert await conn.write(5, 0, MB, 0, UpdateOp.ASSIGN, b"z" * 8) == 1  # same connection
                n.cancel_scope.cancel()

        trio.run(main)
        assert threads and not any(t is threading.main_thread() for t in threads)
        assert [(f, i) for f, i, _, _ in store.chunks()] == [(5, 0)]


# ------------------------------------------------------------------ replies of the wrong kind
async def _misbehaving_shard(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Says HELLO (no authentication), then answers every request with a reply of another
    kind: a STAT reply (a FREE reply to a STAT), with the request's id."""

    async def handler(stream: trio.SocketStream) -> None:
        sock = stream.socket
        try:
            frame = await read_frame(sock, "client", 1 << 20, None, "handshake")
            await send_parts(sock, P.encode_reply(frame.opcode, frame.request_id,
                                                  P.HelloReply(P.PROTOCOL_VERSION, 1, 1 << 30, P.DEFAULT_MAX_PAYLOAD, 42)))
            while True:
                frame = await read_frame(sock, "client", 64 << 20, None, "request")
                if frame.opcode == P.Opcode.STAT:
                    wrong = P.encode_reply(P.Opcode.FREE, frame.request_id, P.FreeReply(0))
                else:
                    wrong = P.encode_reply(P.Opcode.STAT, frame.request_id, P.StatReply(1, 1 << 30, 0, 0))
                await send_parts(sock, wrong)
        except (IrdmaError, OSError):
            return  # the client hung up

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(f"127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    await trio.serve_listeners(handler, listeners)


def _one_extent(length: int) -> np.ndarray:
    return P.extents(np.array([0]), np.array([0]), np.array([length]))


_CALLS: dict[str, Callable[[ShardConnection], Awaitable[object]]] = {
    "write": lambda c: c.write(1, 0, PAGE, 0, UpdateOp.ASSIGN, b"abcd"),
    "read": lambda c: c.read(1, 0, 0, memoryview(bytearray(100))),
    "gather": lambda c: c.gather(1, _one_extent(4)),
    "scatter": lambda c: c.scatter(1, PAGE, _one_extent(4), UpdateOp.ASSIGN, b"abcd"),
    "stat": lambda c: c.stat(),
    "free": lambda c: c.free(1, 0),
    "punch": lambda c: c.punch(1, 0, 8),
    "checksum": lambda c: c.checksum(1, 0),
    "list": lambda c: c.list_chunks(),
    "sync": lambda c: c.sync(),
    "resync": lambda c: c.resync(1, 0, PAGE, P.Chain(1)),
}


async def _wrong_reply_outcome(call: str) -> tuple[BaseException | None, bool, BaseException | None]:
    """(what the call raised, whether the connection is broken then, what the next call raised)."""
    async with trio.open_nursery() as n:
        address = await n.start(_misbehaving_shard)
        conn = await TcpTransport().connect(address, n)
        first = after = None
        with trio.fail_after(WAIT_S):
            try:
                await _CALLS[call](conn)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                first = exc
            broken = conn.broken
            try:
                await conn.stat()
            except Exception as exc:  # noqa: BLE001
                after = exc
        await conn.aclose()
        n.cancel_scope.cancel()
    return first, broken, after


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_a_reply_of_the_wrong_kind_is_a_protocol_error_that_breaks_the_connection(call: str) -> None:
    first, broken, after = trio.run(_wrong_reply_outcome, call)
    assert isinstance(first, P.UnexpectedReply), repr(first)
    assert isinstance(first, RemoteProtocolError) and isinstance(first, ShardUnavailable)  # a lost shard to callers
    assert "StatReply" in str(first) or "FreeReply" in str(first)
    assert broken and isinstance(after, ShardUnavailable)


def test_the_reply_check_holds_under_python_O() -> None:
    """``python -O`` strips asserts: the check must not be one."""
    script = ("import trio, test_review_server as t\n"
              "first, broken, after = trio.run(t._wrong_reply_outcome, 'write')\n"
              "print(type(first).__name__, broken, type(after).__name__)\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["UnexpectedReply", "True", "ShardUnavailable"]


def test_a_forward_answered_with_the_wrong_kind_of_reply_fails_the_replica() -> None:
    """A successor that answers a forwarded WRITE with a STAT reply failed (FORWARD_FAILED to
    the client); its connection is dropped, the next forward reconnects."""

    async def main() -> None:
        async with trio.open_nursery() as n:
            address = await n.start(_misbehaving_shard)
            link = Link(address, 2, n, "test forwarder", None)
            for _ in range(2):
                fw = link.submit(P.Write(1, 0, PAGE, 0, UpdateOp.ASSIGN, b"abcd", chain=P.Chain(5, 0, 1)))
                with pytest.raises(ReplicaFailed, match="replica 2 .* answered a WRITE request with a StatReply"):
                    await link.result(fw, trio.current_time() + WAIT_S)
                assert fw.conn is not None and fw.conn.broken
            n.cancel_scope.cancel()

    trio.run(main)


class _TrickleSocket:
    """A socket whose every ``recv_into`` lands its bytes, then lets the other tasks run (what
    trio's own does after a system call that succeeded: ``cancel_shielded_checkpoint``).
    ``during_last``: what another task does while the ``recv_into`` that lands the last bytes
    waits there (called at that point: the test does not depend on the order in which trio
    runs ready tasks, which it varies on purpose)."""

    def __init__(self, data: bytes, step: int, during_last: Callable[[], None] = lambda: None) -> None:
        self.data, self.step, self.at = data, step, 0
        self.during_last = during_last

    async def recv_into(self, buf: memoryview, n: int) -> int:
        k = min(n, self.step, len(self.data) - self.at)
        buf[:k] = self.data[self.at : self.at + k]
        self.at += k
        if self.at == len(self.data):
            self.during_last()
        await trio.lowlevel.checkpoint()
        return k


@pytest.mark.parametrize("step", [100, 5000, 20000])
def test_no_reply_byte_lands_in_a_buffer_after_its_call_returned(step: int) -> None:
    """The reader copies a reply's tail (under Receiver.DIRECT bytes) out of its own buffer after
    an await: a caller cancelled during that await has returned and reuses its buffer, so the
    copy must not happen (it did: tests/test_conformance.py's cancelled pull saw it under load)."""
    from irdma.transport.tcp import Receiver

    n = 24 << 10
    dest = bytearray(n)
    gone = [False]

    def caller_returns() -> None:  # while the reader's last recv (of the tail, buffered) is in flight
        gone[0] = True
        dest[:] = b"\xa5" * n  # reused by its owner

    rx = Receiver(_TrickleSocket(b"\x5a" * n, step, caller_returns))

    async def main() -> None:
        with pytest.raises(ShardUnavailable, match="returned"):
            await rx.exactly(memoryview(dest), lambda: gone[0])

    trio.run(main)
    assert dest == b"\xa5" * n


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
