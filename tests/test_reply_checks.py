"""The client's checks on the replies it reads, on real sockets:

* a reply of the wrong kind (a STAT reply to a WRITE) is the peer's protocol error (not an
  ``assert``, which ``python -O`` strips) and breaks the connection, for every call of a
  connection and for a forwarded WRITE (the replica failed);
* no byte of a reply lands in a caller's buffer after its call returned (a cancelled call's
  buffer is its owner's again).

A misbehaving shard (a trio server that says HELLO, then answers every request with a reply of
another kind) and a socket that hands its bytes over in steps stand in for the peer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.lowlevel
from irdma.server.replicate import Link

from irdma._errors import IrdmaError, RemoteProtocolError, ReplicaFailed, ShardUnavailable
from irdma.transport.base import ShardConnection
from irdma.transport.tcp import TcpTransport, read_frame, send_parts
from irdma.wire import protocol as P
from irdma.wire.protocol import UpdateOp

PAGE = 4096
#: A wait for something that takes milliseconds when the code is right.
WAIT_S = 10.0


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
    script = ("import trio, test_reply_checks as t\n"
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


# ------------------------------------------------------------------ no reply byte after its call returned
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
