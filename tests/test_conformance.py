"""One conformance suite for every transport (as trio's testing/_check_streams.py is for
streams). Runs on TCP by default; ``pytest --transport verbs`` runs the same tests on RDMA
verbs (inside the Soft-RoCE VM, see tests/vm/).

Each test talks to real shard server processes through ``Transport.connect``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import trio
from helpers import assert_clean_log, wait_until

from irdma._errors import BadRequest, NoSpace
from irdma.protocol import UpdateOp
from irdma.transport import ShardConnection, make_transport

CHUNK = 1 << 20
BIG = 8 << 20  # a chunk size whose requests go past typical device message limits


class ShardProcess:
    def __init__(self, directory: str, name: str, capacity: int, transport: str) -> None:
        self.port_file = os.path.join(directory, f"{name}.addr")
        self.log = os.path.join(directory, f"{name}.log")
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "irdma.cli", "server", "--listen", "127.0.0.1:0", "--capacity", str(capacity),
                 "--shard-id", "1", "--port-file", self.port_file, "--transport", transport],
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


async def _connect(address: str, transport: str, nursery: trio.Nursery) -> ShardConnection:
    return await make_transport(transport).connect(address, nursery, client_name="conformance")


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
        for i in range(4):
            await c.write(fid, i, CHUNK, 0, UpdateOp.ASSIGN, bytes([i + 1]) * 100)
        with pytest.raises(NoSpace):
            await c.write(fid, 4, CHUNK, 0, UpdateOp.ASSIGN, b"x")
        st = await c.stat()
        assert (st.used, st.chunks) == (4 * CHUNK, 4)
        buf = bytearray(100)
        await c.read(fid, 3, 0, memoryview(buf))
        assert buf == bytes([4]) * 100
        assert await c.free(fid, 2) == 2
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
