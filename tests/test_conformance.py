"""One conformance suite for every transport (as trio's testing/_check_streams.py is for
streams). Runs on TCP by default; ``pytest --transport verbs`` runs the same tests on RDMA
verbs (inside the Soft-RoCE VM, see tests/vm/).

Each test talks to real shard server processes through ``Transport.connect``. The
cancellation tests follow trio's rule (see :mod:`irdma.transport.base`): a call is cancelled at
each of its checkpoints in turn; afterwards the connection works, or says it is broken and a
fresh one works; and no byte lands in a buffer after its call returned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from helpers import assert_clean_log, wait_until
from irdma.server import optim
from optim_ref import CONFIGS, Reference, relative_error, spec_text

from irdma._errors import BadRequest, NoSpace, ShardUnavailable
from irdma.transport import ShardConnection, Transport, make_transport
from irdma.transport.tcp import recv_exactly, send_parts
from irdma.wire import compress
from irdma.wire import protocol as P
from irdma.wire.optimizers import parse_update
from irdma.wire.protocol import UpdateOp

CHUNK = 1 << 20
BIG = 8 << 20  # a chunk size whose requests go past typical device message limits


class ShardProcess:
    def __init__(self, directory: str, name: str, capacity: int, transport: str) -> None:
        self.port_file = os.path.join(directory, f"{name}.addr")
        self.log = os.path.join(directory, f"{name}.log")
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "irdma.ops.cli", "server", "--listen", "127.0.0.1:0", "--capacity", str(capacity),
                 "--shard-id", "1", "--port-file", self.port_file, "--transport", transport, "--no-auth"],
                stdout=logf, stderr=subprocess.STDOUT,
            )
        wait_until(lambda: os.path.exists(self.port_file) or self.proc.poll() is not None, 60, f"{name} to listen")
        assert self.proc.poll() is None, self.log_text()
        with open(self.port_file) as f:
            self.address = f.read().strip()

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(timeout=30) == 0, self.log_text()
        assert_clean_log(self.log)


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory, transport_name: str) -> Iterator[ShardProcess]:
    s = ShardProcess(str(tmp_path_factory.mktemp("shard")), "big", 256 << 20, transport_name)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small_shard(tmp_path_factory: pytest.TempPathFactory, transport_name: str) -> Iterator[ShardProcess]:
    s = ShardProcess(str(tmp_path_factory.mktemp("small")), "small", 4 * CHUNK, transport_name)
    yield s
    s.stop()


_file_ids = iter(range(1000, 1 << 40))


def new_file() -> int:
    return next(_file_ids) + os.getpid() * 100_000


_transports: dict[str, Transport] = {}


def transport_for(name: str) -> Transport:
    """One transport per name for the module (a verbs transport holds an open device)."""
    if name not in _transports:
        _transports[name] = make_transport(name)
    return _transports[name]


@pytest.fixture(scope="module", autouse=True)
def _close_transports() -> Iterator[None]:
    yield
    for t in _transports.values():
        device = getattr(t, "device", None)
        if device is not None:
            device.close()
    _transports.clear()


async def _connect(address: str, transport: str, nursery: trio.Nursery) -> ShardConnection:
    return await transport_for(transport).connect(address, nursery, client_name="conformance")


def run(fn, *args):  # type: ignore[no-untyped-def]
    async def main() -> None:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await fn(nursery, *args)
                nursery.cancel_scope.cancel()

    trio.run(main)


class _Conn:
    def __init__(self, shard: ShardProcess, transport: str) -> None:
        self.shard, self.transport = shard, transport

    async def __call__(self, nursery: trio.Nursery) -> ShardConnection:
        return await _connect(self.shard.address, self.transport, nursery)


@pytest.fixture
def conn(shard: ShardProcess, transport_name: str) -> _Conn:
    return _Conn(shard, transport_name)


# ---------------------------------------------------------------- reads and writes
def test_handshake_reports_the_shard(conn: _Conn) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        assert c.info.shard_id == 1 and c.info.capacity == 256 << 20 and c.info.max_payload >= 1 << 20
        st = await c.stat()
        assert st.capacity == 256 << 20
        await c.aclose()
        await c.aclose()  # safe twice

    run(body)


def test_a_hole_reads_as_zeros_with_version_zero(conn: _Conn) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        buf = bytearray(b"\xff" * 1000)
        assert await c.read(new_file(), 0, 10, memoryview(buf)) == 0
        assert buf == bytes(1000)

    run(body)


@pytest.mark.parametrize("offset,length", [(0, 1), (1, 4095), (4093, 10), (12345, 300_001), (0, CHUNK), (CHUNK - 7, 7)])
def test_write_then_read_back_any_range(conn: _Conn, offset: int, length: int) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        data = os.urandom(length)
        assert await c.write(fid, 0, CHUNK, offset, UpdateOp.ASSIGN, data) == 1
        buf = bytearray(length)
        assert await c.read(fid, 0, offset, memoryview(buf)) == 1
        assert buf == data
        # the bytes around the written range are still zero
        whole = bytearray(CHUNK)
        await c.read(fid, 0, 0, memoryview(whole))
        assert whole[:offset] == bytes(offset) and whole[offset + length :] == bytes(CHUNK - offset - length)

    run(body)


def test_large_chunk_round_trip(conn: _Conn) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        n = min(BIG, c.info.max_payload)
        data = os.urandom(n)
        await c.write(fid, 0, BIG, 0, UpdateOp.ASSIGN, data)
        buf = bytearray(n)
        await c.read(fid, 0, 0, memoryview(buf))
        assert buf == data

    run(body)


def test_versions_count_applied_updates(conn: _Conn) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        versions = [await c.write(fid, 0, CHUNK, 8 * i, UpdateOp.ASSIGN, b"12345678") for i in range(5)]
        versions.append(await c.write(fid, 0, CHUNK, 0, UpdateOp.ADD, np.ones(4, "<f4").tobytes()))
        assert versions == [1, 2, 3, 4, 5, 6]
        assert await c.read(fid, 0, 0, memoryview(bytearray(4))) == 6
        assert await c.punch(fid, 0, 16) == 7

    run(body)


def test_add_sums_float32_in_place(conn: _Conn) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        a = np.random.default_rng(0).standard_normal(1000).astype("<f4")
        b = np.random.default_rng(1).standard_normal(1000).astype("<f4")
        await c.write(fid, 0, CHUNK, 400, UpdateOp.ASSIGN, a.tobytes())
        await c.write(fid, 0, CHUNK, 400, UpdateOp.ADD, b.tobytes())
        out = np.empty(1000, "<f4")
        await c.read(fid, 0, 400, memoryview(out).cast("B"))
        np.testing.assert_array_equal(out, a + b)

    run(body)


def test_an_encoded_add_applies_the_decoded_gradient_and_a_malformed_one_changes_nothing(conn: _Conn) -> None:
    """Compressed gradients (protocol 8): a top-k and a sign payload, through the staging buffer
    on verbs, land as the decoded vector at their offset; a payload that does not decode is
    refused (BadRequest) with the chunk and its version untouched, and the connection goes on."""
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        rng = np.random.default_rng(12)
        n, at = 100_000, 4096  # elements, byte offset
        base = rng.standard_normal(n).astype("<f4")
        await c.write(fid, 0, CHUNK, at, UpdateOp.ASSIGN, base.tobytes())
        want = base.copy()
        for spec in ("topk:0.01", "sign"):
            coded = compress.parse_compress(spec)
            payload, decoded = compress.encode(rng.standard_normal(n).astype("<f4"), coded)
            assert len(payload) < n  # a quarter of the dense bytes or less
            await c.write(fid, 0, CHUNK, at, P.Update(UpdateOp.ADD, encoding=coded.kind), payload)
            want += decoded
        out = np.empty(n, "<f4")
        assert await c.read(fid, 0, at, memoryview(out).cast("B")) == 3
        np.testing.assert_array_equal(out, want)
        bad = bytearray(compress.encode(np.ones(n, "<f4"), compress.parse_compress("topk:0.01"))[0])
        k = compress.topk_count(n, 0.01)
        bad[4 + 4 * k : 8 + 4 * k] = (n + 5).to_bytes(4, "little")  # the last index: past the vector
        with pytest.raises(BadRequest, match="index"):
            await c.write(fid, 0, CHUNK, at, P.Update(UpdateOp.ADD, encoding=P.Encoding.TOPK), bytes(bad))
        with pytest.raises(BadRequest, match="fit"):  # decodes past the chunk
            await c.write(fid, 0, CHUNK, CHUNK - 4 * 100, P.Update(UpdateOp.ADD, encoding=P.Encoding.SIGN),
                          compress.encode(np.ones(101, "<f4"), compress.parse_compress("sign"))[0])
        assert await c.read(fid, 0, at, memoryview(out).cast("B")) == 3
        np.testing.assert_array_equal(out, want)

    run(body)


@pytest.mark.parametrize("name,args", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_optimizer_steps_match_the_reference_over_two_chunks(conn: _Conn, name: str, args: dict[str, Any]) -> None:
    """Six steps of random gradients, some over both chunks, some over part of one (so
    elements step different numbers of times): every element within 1e-5 (norm-wise relative)
    of a float64 reference; the state chunk holds the optimizer's state (Adam's per-element step)."""
    update = parse_update(spec_text(name, args))
    n = CHUNK // 4  # float32 elements per chunk

    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        rng = np.random.default_rng(7)
        w = rng.standard_normal(2 * n).astype("<f4")
        for i in range(2):
            await c.write(fid, i, CHUNK, 0, UpdateOp.ASSIGN, w[i * n : (i + 1) * n].tobytes())
        ref, want = Reference(name, args, 2 * n), w.astype(np.float64)
        for step in range(6):
            lo, hi = (0, 2 * n) if step % 2 == 0 else (n // 3, n // 2)  # whole file, then part of chunk 0
            g = rng.standard_normal(hi - lo).astype("<f4")
            ref.step(want, g.astype(np.float64), slice(lo, hi))
            for i in range(2):  # each chunk's part of the range, as the client splits a push
                a, b = max(lo, i * n), min(hi, (i + 1) * n)
                if a < b:
                    await c.write(fid, i, CHUNK, 4 * (a - i * n), update, g[a - lo : b - lo].tobytes())
        got = np.empty(2 * n, "<f4")
        for i in range(2):
            await c.read(fid, i, 0, memoryview(got[i * n : (i + 1) * n]).cast("B"))
        assert relative_error(got, want) <= 1e-5
        state = bytearray(optim.state_size(update.op, CHUNK))
        assert await c.read(fid, optim.state_index(0), 0, memoryview(state)) == 7  # its chunk's version
        assert optim.header_op(memoryview(state)) == update.op
        if name == "adam":
            steps = np.frombuffer(state, "<u4", count=n, offset=optim.HEADER + 2 * CHUNK)
            assert steps[0] == 3 and steps[n // 3] == 6 and steps[n - 1] == 3
        # refused: a misaligned gradient, and any op but assign on a state chunk; nothing changed
        with pytest.raises(BadRequest, match="alignment"):
            await c.write(fid, 0, CHUNK, 2, update, b"\x00" * 8)
        with pytest.raises(BadRequest, match="state"):
            await c.write(fid, optim.state_index(0), len(state), 0, UpdateOp.ADD, b"\x00" * 8)
        again = np.empty(2 * n, "<f4")
        for i in range(2):
            await c.read(fid, i, 0, memoryview(again[i * n : (i + 1) * n]).cast("B"))
        np.testing.assert_array_equal(again, got)
        assert await c.free(fid, 0) == 2  # the state goes with its chunks
        assert await c.read(fid, optim.state_index(0), 0, memoryview(state)) == 0

    run(body)


# ---------------------------------------------------------------- sparse rows: GATHER and SCATTER
def _row_extents(fid: int, ids: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The wire extents of rows ``ids`` (a row crossing a chunk boundary is two) and where each
    extent's bytes sit in the packed rows."""
    from irdma.client.native import Client
    from irdma.placement import Layout

    chunk, offset, length, at = Client.row_extents(Layout(fid, CHUNK, (1,), 1), ids, row_bytes)
    return P.extents(chunk, offset, length), at


def _pack(rows: np.ndarray, ext: np.ndarray, at: np.ndarray) -> bytes:
    flat = rows.reshape(-1).view(np.uint8)
    return b"".join(flat[a : a + n].tobytes() for a, n in zip(at.tolist(), ext["length"].tolist(), strict=True))


def _unpack(buf: bytes, ext: np.ndarray, at: np.ndarray, nbytes: int) -> np.ndarray:
    out = np.zeros(nbytes, dtype=np.uint8)
    pos = 0
    for a, n in zip(at.tolist(), ext["length"].tolist(), strict=True):
        out[a : a + n] = np.frombuffer(buf, dtype=np.uint8, count=n, offset=pos)
        pos += n
    return out.view("<f4")


@pytest.mark.parametrize("row_floats", [256, 250])  # rows that tile a chunk, and rows that cross chunks
def test_gather_and_scatter_of_random_rows_match_numpy(conn: _Conn, row_floats: int) -> None:
    """Sparse pull and push (GATHER, SCATTER) of random rows against numpy: holes read as zeros
    with version 0, assign and add per row, one version bump per chunk per request, and a refused
    request (overlapping extents) changes nothing."""

    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        rb = 4 * row_floats
        nrows = (3 * CHUNK) // rb
        rng = np.random.default_rng(row_floats)
        table = rng.integers(-1000, 1000, size=(nrows, row_floats)).astype("<f4") / 4  # sums stay exact
        for k in range(2):  # chunks 0 and 1 written; chunk 2 is a hole
            await c.write(fid, k, CHUNK, 0, UpdateOp.ASSIGN, table.reshape(-1).view(np.uint8)[k * CHUNK : (k + 1) * CHUNK])
        table.reshape(-1).view(np.uint8)[2 * CHUNK :] = 0
        ids = rng.choice(nrows, size=400, replace=False)
        ext, at = _row_extents(fid, ids, rb)
        versions, buf = await c.gather(fid, ext)
        assert len(buf) == int(ext["length"].sum())
        np.testing.assert_array_equal(_unpack(bytes(buf), ext, at, len(ids) * rb).reshape(len(ids), -1), table[ids])
        assert set(np.asarray(versions)[ext["chunk"] == 2].tolist()) <= {0}
        assert (np.asarray(versions)[ext["chunk"] < 2] > 0).all()

        delta = rng.integers(-64, 64, size=(len(ids), row_floats)).astype("<f4") / 8
        await c.scatter(fid, CHUNK, ext, UpdateOp.ADD, _pack(delta, ext, at))
        table[ids] += delta
        new = rng.integers(-64, 64, size=(50, row_floats)).astype("<f4")
        ext2, at2 = _row_extents(fid, ids[:50], rb)
        await c.scatter(fid, CHUNK, ext2, UpdateOp.ASSIGN, _pack(new, ext2, at2))
        table[ids[:50]] = new
        whole = bytearray(3 * CHUNK)
        for k in range(3):
            await c.read(fid, k, 0, memoryview(whole)[k * CHUNK : (k + 1) * CHUNK])
        np.testing.assert_array_equal(np.frombuffer(whole, "<f4")[: nrows * row_floats].reshape(nrows, -1), table)
        if row_floats == 256:  # one version bump per chunk per request: write 1, add 2, assign 3
            before = bytearray(4)
            assert await c.read(fid, int(ext2["chunk"][0]), 0, memoryview(before)) == 3

        # overlapping extents of one chunk are refused whole: nothing changes
        bad = P.extents([0, 1, 1], [0, 0, 8], [16, 16, 16])
        with pytest.raises(BadRequest, match="overlap"):
            await c.scatter(fid, CHUNK, bad, UpdateOp.ADD, bytes(48))
        with pytest.raises(BadRequest, match="leaves"):
            await c.scatter(fid, CHUNK, P.extents([0], [CHUNK - 4], [8]), UpdateOp.ASSIGN, bytes(8))
        again = bytearray(3 * CHUNK)
        for k in range(3):
            await c.read(fid, k, 0, memoryview(again)[k * CHUNK : (k + 1) * CHUNK])
        assert again == whole

    run(body)


def test_scatter_applies_an_optimizer_per_row(conn: _Conn) -> None:
    """A SCATTER with SGD steps exactly the rows it names, as numpy computes it, and no other."""

    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        rng = np.random.default_rng(7)
        table = rng.standard_normal((CHUNK // 1024, 256)).astype("<f4")
        await c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, table.tobytes())
        ids = rng.choice(len(table), size=64, replace=False)
        grad = rng.standard_normal((64, 256)).astype("<f4")
        ext, at = _row_extents(fid, ids, 1024)
        update = parse_update("sgd learning_rate=0.5")
        await c.scatter(fid, CHUNK, ext, update, _pack(grad, ext, at))
        table[ids] -= grad * np.float32(0.5)
        out = bytearray(CHUNK)
        await c.read(fid, 0, 0, memoryview(out))
        np.testing.assert_array_equal(np.frombuffer(out, "<f4").reshape(table.shape), table)

    run(body)


# ---------------------------------------------------------------- errors change nothing
def test_refused_requests_change_nothing_and_the_connection_goes_on(conn: _Conn) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        data = os.urandom(4096)
        await c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, data)
        with pytest.raises(BadRequest, match="alignment"):
            await c.write(fid, 0, CHUNK, 2, UpdateOp.ADD, b"\x00" * 8)
        with pytest.raises(BadRequest, match="leaves"):
            await c.write(fid, 0, CHUNK, CHUNK - 2, UpdateOp.ASSIGN, b"abcd")
        with pytest.raises(BadRequest, match="size"):
            await c.write(fid, 0, 2 * CHUNK, 0, UpdateOp.ASSIGN, b"abcd")
        with pytest.raises(BadRequest, match="leaves"):
            await c.read(fid, 0, CHUNK - 2, memoryview(bytearray(4)))
        buf = bytearray(4096)
        assert await c.read(fid, 0, 0, memoryview(buf)) == 1  # version unchanged
        assert buf == data

    run(body)


def test_a_full_region_answers_enospc_and_keeps_what_it_holds(small_shard: ShardProcess, transport_name: str) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await _connect(small_shard.address, transport_name, nursery)
        fid = new_file()
        end = CHUNK - 100  # each chunk's last bytes: it takes its whole extent
        for i in range(4):
            await c.write(fid, i, CHUNK, end, UpdateOp.ASSIGN, bytes([i + 1]) * 100)
        with pytest.raises(NoSpace):
            await c.write(fid, 4, CHUNK, 0, UpdateOp.ASSIGN, b"x")
        st = await c.stat()
        assert (st.used, st.chunks) == (4 * CHUNK, 4)
        buf = bytearray(100)
        await c.read(fid, 3, end, memoryview(buf))
        assert buf == bytes([4]) * 100
        assert await c.free(fid, 2) == 2
        # an optimizer step whose state fits but whose chunk then does not: refused, nothing kept
        with pytest.raises(NoSpace):
            await c.write(fid, 9, CHUNK, CHUNK - 8, parse_update("sgd momentum=0.9"), bytes(8))
        assert (await c.stat()).used == 2 * CHUNK
        await c.write(fid, 4, CHUNK, 0, UpdateOp.ASSIGN, b"y")  # room again
        assert await c.free(fid, 0) == 3
        assert (await c.stat()).used == 0

    run(body)


def test_freed_chunks_read_as_holes_again(conn: _Conn) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        await c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, b"z" * 10)
        await c.write(fid, 1, CHUNK, 0, UpdateOp.ASSIGN, b"z" * 10)
        await c.punch(fid, 0, 5)
        buf = bytearray(10)
        await c.read(fid, 0, 0, memoryview(buf))
        assert buf == b"zzzzz" + bytes(5)
        await c.free(fid, 1)
        assert await c.read(fid, 1, 0, memoryview(buf)) == 0 and buf == bytes(10)

    run(body)


# ---------------------------------------------------------------- concurrency
def test_many_requests_in_flight_on_one_connection(conn: _Conn) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        data = os.urandom(CHUNK)
        await c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, data)
        out = bytearray(CHUNK)
        view = memoryview(out)
        async with trio.open_nursery() as n:
            for i in range(0, CHUNK, 4096):
                n.start_soon(c.read, fid, 0, i, view[i : i + 4096])
        assert out == data

    run(body)


def test_concurrent_adds_from_several_clients_sum_exactly(conn: _Conn) -> None:
    clients, rounds, n = 4, 25, 4096

    async def body(nursery: trio.Nursery) -> None:
        conns = [await conn(nursery) for _ in range(clients)]
        fid = new_file()
        await conns[0].write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, np.zeros(n, "<f4").tobytes())

        async def adder(c: ShardConnection, k: int) -> None:
            for _ in range(rounds):
                await c.write(fid, 0, CHUNK, 0, UpdateOp.ADD, np.full(n, k + 1, "<f4").tobytes())

        async with trio.open_nursery() as n_:
            for k, c in enumerate(conns):
                n_.start_soon(adder, c, k)
        out = np.empty(n, "<f4")
        version = await conns[1].read(fid, 0, 0, memoryview(out).cast("B"))
        assert version == 1 + clients * rounds
        np.testing.assert_array_equal(out, np.full(n, rounds * sum(range(1, clients + 1)), "<f4"))

    run(body)


# ---------------------------------------------------------------- cancellation (trio's rule)
SENTINEL = 0xA5  # written into a buffer once its call returned: must still be there later
SLACK = 5.0  # seconds a deadline may be overrun (a loaded machine, a VM under TCG)


class _AfterSteps(trio.abc.Instrument):
    """Call ``action`` after ``steps`` task steps of any task (the transport's reader or poller
    count too, so that a sweep also lands while a reply is being received)."""

    def __init__(self, steps: int, action: Callable[[], object]) -> None:
        self.left, self.action = steps, action

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.left -= 1
        if self.left == 0:
            self.action()


async def cancelled_after(steps: int, afn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
    """Run ``afn(*args)``, cancelled after ``steps`` task steps (0: before it starts).

    Returns:
        True if the call finished before the cancellation reached it.
    """
    with trio.CancelScope() as scope:
        inst = _AfterSteps(steps, scope.cancel)
        if steps == 0:
            scope.cancel()
        trio.lowlevel.add_instrument(inst)
        try:
            await afn(*args)
            return True
        finally:
            trio.lowlevel.remove_instrument(inst)
    return False


async def sweep(trial: Callable[[int], Awaitable[bool]], limit: int = 300) -> int:
    """``trial(steps)`` for steps = 0, 1, 2, ... until its call finishes uncancelled three times
    running (every checkpoint of the call was hit once); returns the last ``steps``."""
    in_a_row = 0
    for steps in range(limit):
        in_a_row = in_a_row + 1 if await trial(steps) else 0
        if in_a_row == 3:
            return steps
    return limit


class _Live:
    """A connection that a test replaces when it says it is broken."""

    def __init__(self, conn: _Conn, nursery: trio.Nursery) -> None:
        self._conn, self._nursery = conn, nursery
        self.replaced = 0
        self.c: ShardConnection

    async def open(self) -> _Live:
        self.c = await self._conn(self._nursery)
        return self

    async def usable(self) -> ShardConnection:
        """The connection, or a fresh one if it is broken (after checking it fails calls)."""
        if self.c.broken:
            with pytest.raises(ShardUnavailable):
                await self.c.stat()
            await self.c.aclose()
            self.c = await self._conn(self._nursery)
            self.replaced += 1
        return self.c


@pytest.mark.parametrize("n", [4096, 256 << 10])
def test_a_cancelled_pull_leaves_nothing_behind(conn: _Conn, n: int) -> None:
    async def body(nursery: trio.Nursery) -> None:
        live = await _Live(conn, nursery).open()
        fid = new_file()
        a = os.urandom(n)
        await live.c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, a)

        async def trial(steps: int) -> bool:
            dest = bytearray(n)
            finished = await cancelled_after(steps, live.c.read, fid, 0, 0, memoryview(dest))
            if finished:
                assert dest == a
            dest[:] = bytes([SENTINEL]) * n  # the call returned: nothing may land here now
            c = await live.usable()
            # later requests on the same connection (a push, then a pull, of other bytes) reuse
            # whatever the cancelled pull used; they must not see its bytes, nor it theirs
            other = os.urandom(n)
            await c.write(fid, 1, CHUNK, 0, UpdateOp.ASSIGN, other)
            got = bytearray(n)
            await c.read(fid, 1, 0, memoryview(got))
            assert got == other
            assert dest == bytes([SENTINEL]) * n
            return finished

        await sweep(trial)

    run(body)


@pytest.mark.parametrize("n", [4096, 256 << 10])
def test_a_cancelled_assign_is_applied_whole_or_not_at_all(conn: _Conn, n: int) -> None:
    async def body(nursery: trio.Nursery) -> None:
        live = await _Live(conn, nursery).open()
        fid = new_file()
        state = {"bytes": bytes(n), "version": 0}

        async def trial(steps: int) -> bool:
            new = os.urandom(n)
            src = bytearray(new)
            finished = await cancelled_after(steps, live.c.write, fid, 0, CHUNK, 0, UpdateOp.ASSIGN, memoryview(src))
            src[:] = bytes([SENTINEL]) * n  # the call returned: these bytes must never reach the shard
            c = await live.usable()
            later = os.urandom(n)  # a later push elsewhere reuses whatever the cancelled one used
            await c.write(fid, 1, CHUNK, 0, UpdateOp.ASSIGN, later)
            await c.stat()  # answered after the cancelled request, if that left
            got = bytearray(n)
            await c.read(fid, 1, 0, memoryview(got))
            assert got == later
            version = await c.read(fid, 0, 0, memoryview(got))
            if finished or version != state["version"]:
                assert version == state["version"] + 1
                assert got == new
            else:
                assert got == state["bytes"]
            state.update(bytes=bytes(got), version=version)
            return finished

        await sweep(trial)

    run(body)


def test_a_cancelled_add_is_applied_whole_or_not_at_all(conn: _Conn) -> None:
    m = 16384  # float32 values: 64 KiB

    async def body(nursery: trio.Nursery) -> None:
        live = await _Live(conn, nursery).open()
        fid = new_file()
        expected = np.zeros(m, "<f4")
        version = await live.c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, expected.tobytes())

        async def trial(steps: int) -> bool:
            nonlocal expected, version
            delta = np.full(m, float(steps % 7 + 1), "<f4")
            src = bytearray(delta.tobytes())
            finished = await cancelled_after(steps, live.c.write, fid, 0, CHUNK, 0, UpdateOp.ADD, memoryview(src))
            src[:] = np.full(m, 1e9, "<f4").tobytes()  # the call returned: never to be added
            c = await live.usable()
            # a later add right behind it reuses whatever the cancelled one used (a staging slot)
            later = np.full(m, 100.0, "<f4")
            await c.write(fid, 0, CHUNK, 0, UpdateOp.ADD, later.tobytes())
            await c.stat()
            out = np.empty(m, "<f4")
            now = await c.read(fid, 0, 0, memoryview(out).cast("B"))
            applied = now - version - 1
            assert applied in ((1,) if finished else (0, 1))
            np.testing.assert_array_equal(out, expected + applied * delta + later)
            expected, version = out, now
            return finished

        await sweep(trial)

    run(body)


# ---------------------------------------------------------------- close and dead shards
@contextlib.contextmanager
def stopped(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """The shard process stopped (SIGSTOP): it accepts connections but answers nothing."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_aclose_twice_is_safe_and_later_calls_fail(conn: _Conn) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await conn(nursery)
        fid = new_file()
        await c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, b"before close")
        await c.read(fid, 0, 0, memoryview(bytearray(4)))
        assert not c.broken
        await c.aclose()
        await c.aclose()
        assert c.broken
        with pytest.raises(ShardUnavailable):
            await c.stat()
        with pytest.raises(ShardUnavailable):
            await c.read(fid, 0, 0, memoryview(bytearray(4)))
        with pytest.raises(ShardUnavailable):
            await c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, b"after close")
        with pytest.raises(ShardUnavailable):
            await c.write(fid, 0, CHUNK, 0, UpdateOp.ADD, bytes(8))
        # a cancelled aclose still closes
        c2 = await conn(nursery)
        with trio.CancelScope() as scope:
            scope.cancel()
            await c2.aclose()
        assert c2.broken
        with pytest.raises(ShardUnavailable):
            await c2.stat()
        c3 = await conn(nursery)
        buf = bytearray(12)
        await c3.read(fid, 0, 0, memoryview(buf))
        assert buf == b"before close"

    run(body)


async def _outcome(outcomes: list[str], afn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    try:
        await afn(*args)
        outcomes.append("returned")
    except ShardUnavailable:
        outcomes.append("unavailable")


@pytest.mark.parametrize("op", ["pull", "assign", "add"])
def test_aclose_at_any_point_of_a_call_ends_it(conn: _Conn, op: str) -> None:
    """aclose from another task at each step of a call: the call returns (right bytes) or
    raises ShardUnavailable, at once; nothing lands in its buffer afterwards."""
    n = 1 << 20

    async def body(nursery: trio.Nursery) -> None:
        fid = new_file()
        data = np.ones(n // 4, "<f4").tobytes()
        c0 = await conn(nursery)
        await c0.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, data)

        async def trial(steps: int) -> bool:
            c = await conn(nursery)
            buf = bytearray(n) if op == "pull" else bytearray(data)
            outcomes: list[str] = []
            closing = trio.Event()
            inst = _AfterSteps(steps, closing.set)

            async def closer() -> None:
                await closing.wait()
                await c.aclose()

            with trio.fail_after(30):
                async with trio.open_nursery() as calls:
                    calls.start_soon(closer)
                    trio.lowlevel.add_instrument(inst)
                    try:
                        if op == "pull":
                            await _outcome(outcomes, c.read, fid, 0, 0, memoryview(buf))
                        else:
                            uop = UpdateOp.ASSIGN if op == "assign" else UpdateOp.ADD
                            await _outcome(outcomes, c.write, fid, 0, CHUNK, 0, uop, memoryview(buf))
                    finally:
                        trio.lowlevel.remove_instrument(inst)
                        finished_first = not closing.is_set()
                        closing.set()
            assert outcomes in (["returned"], ["unavailable"])
            assert c.broken
            if op == "pull":
                if outcomes == ["returned"]:
                    assert buf == data
                buf[:] = bytes([SENTINEL]) * n
                await c0.stat()  # the shard has answered whatever it got
                assert buf == bytes([SENTINEL]) * n
            return finished_first

        await sweep(trial, limit=100)

    run(body)


def test_aclose_fails_pending_calls_at_once(small_shard: ShardProcess, transport_name: str) -> None:
    async def body(nursery: trio.Nursery) -> None:
        c = await _connect(small_shard.address, transport_name, nursery)
        await c.stat()
        outcomes: list[str] = []
        with stopped(small_shard.proc), trio.fail_after(30):
            async with trio.open_nursery() as calls:
                for _ in range(4):
                    calls.start_soon(_outcome, outcomes, c.stat)
                calls.start_soon(_outcome, outcomes, c.list_chunks)
                await trio.testing.wait_all_tasks_blocked(0.05)
                await c.aclose()
        assert outcomes == ["unavailable"] * 5
        assert c.broken
        c2 = await _connect(small_shard.address, transport_name, nursery)  # it answers again
        assert (await c2.stat()).capacity == 4 * CHUNK

    run(body)


def test_connect_to_a_stopped_shard_fails_within_its_timeout(small_shard: ShardProcess, transport_name: str) -> None:
    async def body(nursery: trio.Nursery) -> None:
        transport = transport_for(transport_name)
        with stopped(small_shard.proc):
            t0 = trio.current_time()
            with pytest.raises(ShardUnavailable, match="within 1 s"):
                await transport.connect(small_shard.address, nursery, timeout=1.0)
            assert 0.9 < trio.current_time() - t0 < 1.0 + SLACK
        c = await transport.connect(small_shard.address, nursery, timeout=30)
        await c.stat()

    run(body)


async def _hung_shard(answer_hello: bool, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A listener that accepts connections and never answers (or answers HELLO and then nothing)."""
    listener = trio.socket.socket()
    held = [listener]
    try:
        await listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        task_status.started("{}:{}".format(*listener.getsockname()))
        while True:
            sock, _ = await listener.accept()
            held.append(sock)
            if answer_hello:
                hdr = bytearray(P.HEADER_SIZE)
                await recv_exactly(sock, memoryview(hdr))
                frame = P.parse_header(hdr, 1 << 16, any_version=True)
                await recv_exactly(sock, memoryview(bytearray(frame.body_len)))
                hello = P.HelloReply(P.PROTOCOL_VERSION, 9, 64 << 20, 1 << 20, 1)
                await send_parts(sock, P.encode_reply(frame.opcode, frame.request_id, hello))
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("answers_hello", [False, True], ids=["silent", "hello-only"])
def test_a_shard_that_never_answers_fails_connect_within_its_timeout(transport_name: str, answers_hello: bool) -> None:
    async def body(nursery: trio.Nursery) -> None:
        address = await nursery.start(_hung_shard, answers_hello)
        transport = transport_for(transport_name)
        t0 = trio.current_time()
        if answers_hello and transport_name == "tcp":
            # TCP's handshake is HELLO alone: it connects, and calls wait for their caller's deadline
            c = await transport.connect(address, nursery, timeout=1.0)
            with trio.move_on_after(0.5) as scope:
                await c.stat()
            assert scope.cancelled_caught
            await c.aclose()
            return
        with pytest.raises(ShardUnavailable, match="within 1 s"):  # verbs: VERBS_CONNECT is never answered
            await transport.connect(address, nursery, timeout=1.0)
        assert 0.9 < trio.current_time() - t0 < 1.0 + SLACK

    run(body)


def test_a_shard_that_dies_fails_pending_and_later_calls(tmp_path: Any, transport_name: str) -> None:
    doomed = ShardProcess(str(tmp_path), "doomed", 4 * CHUNK, transport_name)

    async def body(nursery: trio.Nursery) -> None:
        c = await _connect(doomed.address, transport_name, nursery)
        fid = new_file()
        await c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, b"doomed")
        await c.read(fid, 0, 0, memoryview(bytearray(6)))
        outcomes: list[str] = []
        with trio.fail_after(30):
            async with trio.open_nursery() as calls:
                os.kill(doomed.proc.pid, signal.SIGSTOP)  # so that the calls are pending when it dies
                for _ in range(3):
                    calls.start_soon(_outcome, outcomes, c.stat)
                calls.start_soon(_outcome, outcomes, c.write, fid, 0, CHUNK, 0, UpdateOp.ADD, bytes(8))
                await trio.testing.wait_all_tasks_blocked(0.05)
                doomed.proc.kill()
        assert outcomes == ["unavailable"] * 4
        assert c.broken
        with pytest.raises(ShardUnavailable):
            await c.read(fid, 0, 0, memoryview(bytearray(6)))
        with pytest.raises(ShardUnavailable):
            await c.write(fid, 0, CHUNK, 0, UpdateOp.ASSIGN, b"x")

    try:
        run(body)
    finally:
        doomed.proc.kill()
        doomed.proc.wait(timeout=30)
