"""What a small request costs: one pass of trio's scheduler for its caller, metrics without a
lock (issue 39, "a 4 KiB request costs close to a socket's round trip")."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import trio
from helpers import Cluster, running_cluster
from prometheus_client import CollectorRegistry

from irdma import Client
from irdma.client.view import layout_of
from irdma.metrics import LATENCY_BUCKETS, ClientMetrics, ShardMetrics
from irdma.placement import Layout
from irdma.wire.protocol import UpdateOp

MiB = 1 << 20
WAIT_S = 60.0


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path_factory.mktemp("small")), shards=1, capacity=64 * MiB) as c:
        yield c


async def _one_chunk_file(c: Client, path: str, seed: int) -> tuple[Layout, np.ndarray]:
    """A new file of one 4 MiB chunk of random bytes (uint8, seeded): its layout and its bytes."""
    layout = layout_of(await c.create(path, chunk_size=4 * MiB))
    data = np.random.default_rng(seed).integers(0, 255, 4 * MiB, dtype=np.uint8)
    await c.write_from(layout, 0, memoryview(data), UpdateOp.ASSIGN)
    return layout, data


class _Steps(trio.abc.Instrument):
    """Counts the steps trio runs of one task (each is a resumption after a pass of the scheduler)."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


def test_a_small_read_costs_its_caller_one_pass_of_the_scheduler_and_a_cancelled_one_sends_nothing(
        one_shard: Cluster) -> None:
    async def main() -> None:
        with trio.fail_after(WAIT_S):
            async with Client.open(one_shard.meta_url, transport="tcp") as c:
                layout, data = await _one_chunk_file(c, "/steps", 7)
                conn = await c.pool.connection(layout.shard_of(0))
                buf = memoryview(bytearray(4096))
                await conn.read(layout.file_id, 0, 0, buf)  # warm: the connection is open
                steps = _Steps(trio.lowlevel.current_task())
                trio.lowlevel.add_instrument(steps)
                try:
                    for i in range(100):
                        off = (i * 37 % 1024) * 4096
                        await conn.read(layout.file_id, 0, off, buf)
                        assert bytes(buf) == data[off:off + 4096].tobytes()
                finally:
                    trio.lowlevel.remove_instrument(steps)
                # the wait for the reply, nothing else (the lock and the send once cost one each)
                assert steps.steps <= 100, f"{steps.steps} passes of the scheduler for 100 reads"

                with trio.CancelScope() as cs:
                    cs.cancel()
                    await conn.read(layout.file_id, 0, 0, buf)
                assert cs.cancelled_caught
                assert not conn.broken  # nothing went on the wire: the connection goes on
                await conn.read(layout.file_id, 0, 8192, buf)
                assert bytes(buf) == data[8192:12288].tobytes()

    trio.run(main)


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in registry.collect():
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_request_tallies_recorded_from_many_threads_are_exact() -> None:
    reg = CollectorRegistry()
    shard, client = ShardMetrics(reg), ClientMetrics(reg)
    per, threads = 5000, 4

    def work() -> None:
        for i in range(per):
            t0 = shard.begin()
            shard.end(t0, "read", "tcp", "ok", 0, 4096)
            t1 = client.begin()
            client.end(t1, "write", "tcp", "ok" if i % 10 else "no_space", 100, "out")

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(WAIT_S)
    got = _scrape(reg)
    n = per * threads
    read = (("op", "read"), ("status", "ok"), ("transport", "tcp"))
    assert got[("irdma_shard_requests_total", read)] == n
    assert got[("irdma_shard_bytes_total", (("direction", "out"), ("op", "read"), ("transport", "tcp")))] == 4096 * n
    assert got[("irdma_shard_request_duration_seconds_count", (("op", "read"), ("transport", "tcp")))] == n
    assert got[("irdma_shard_inflight_requests", ())] == 0
    assert got[("irdma_client_requests_total", (("op", "write"), ("status", "no_space"), ("transport", "tcp")))] == n // 10
    assert got[("irdma_client_requests_total", (("op", "write"), ("status", "ok"), ("transport", "tcp")))] == n - n // 10
    assert got[("irdma_client_errors_total", (("kind", "no_space"),))] == n // 10
    assert got[("irdma_client_bytes_total", (("direction", "out"), ("op", "write")))] == 100 * n
    assert got[("irdma_client_inflight_requests", ())] == 0


def test_a_latency_lands_in_the_bucket_prometheus_would_put_it_in() -> None:
    reg = CollectorRegistry()
    m = ShardMetrics(reg)
    for seconds in (LATENCY_BUCKETS[6], 2e-3, 20.0):  # on a bound, between two, past the last
        m.tally.observe("irdma_shard_request_duration_seconds", ("read", "tcp"), seconds)
    got = _scrape(reg)

    def le(bound: str) -> float:
        return got[("irdma_shard_request_duration_seconds_bucket", (("le", bound), ("op", "read"), ("transport", "tcp")))]

    assert le("0.0005") == 0 and le("0.001") == 1  # le: at most the bound
    assert le("0.0025") == 2 and le("10.0") == 2 and le("+Inf") == 3
    assert got[("irdma_shard_request_duration_seconds_sum", (("op", "read"), ("transport", "tcp")))] == pytest.approx(
        1e-3 + 2e-3 + 20.0)


def test_callers_sharing_a_connection_each_get_their_own_bytes_and_a_cancelled_reader_hands_it_on(
        one_shard: Cluster) -> None:
    """Leader/followers on one TCP connection (irdma.transport.tcp): many tasks read at once,
    each caller in turn reads the socket for all. Every read gets its own bytes; callers
    cancelled at random points (while reading for others, or parked) leave no byte in their
    buffers after they returned, and the others go on (on a fresh connection if it broke)."""
    from irdma._errors import ShardUnavailable

    async def main() -> None:
        with trio.fail_after(WAIT_S):
            async with Client.open(one_shard.meta_url, transport="tcp") as c:
                layout, data = await _one_chunk_file(c, "/shared-conn", 11)
                shard = layout.shard_of(0)
                first = await c.pool.connection(shard)
                done = {"reads": 0, "cancelled": 0, "broken": 0}
                returned: list[bytearray] = []  # buffers of cancelled reads: must stay as left

                async def reader(seed: int, cancel: bool) -> None:
                    rng = np.random.default_rng(seed)
                    for _ in range(40):
                        off = int(rng.integers(0, 1024)) * 4096
                        buf = bytearray(4096)
                        conn = await c.pool.connection(shard)
                        finished = False
                        try:
                            with trio.move_on_after(float(rng.uniform(0, 400e-6)) if cancel else math.inf):
                                await conn.read(layout.file_id, 0, off, memoryview(buf))
                                finished = True
                        except ShardUnavailable:
                            done["broken"] += 1  # a cancelled caller broke it mid-reply: a fresh one next
                            continue
                        if finished:
                            assert bytes(buf) == data[off:off + 4096].tobytes()
                            done["reads"] += 1
                        else:
                            buf[:] = b"\xa5" * 4096
                            returned.append(buf)
                            done["cancelled"] += 1

                async with trio.open_nursery() as n:
                    for i in range(24):
                        n.start_soon(reader, i, False)
                assert done["reads"] == 24 * 40 and not first.broken  # no cancellation: nothing broke
                async with trio.open_nursery() as n:
                    for i in range(24):
                        n.start_soon(reader, 100 + i, i % 2 == 0)
                assert done["cancelled"] > 0 and done["reads"] > 24 * 40 + 12 * 40 // 2, done
                conn = await c.pool.connection(shard)
                buf = bytearray(4096)
                await conn.read(layout.file_id, 0, 8192, memoryview(buf))
                assert bytes(buf) == data[8192:12288].tobytes()
                assert all(b == b"\xa5" * 4096 for b in returned)  # nothing landed after its call returned

    trio.run(main)
