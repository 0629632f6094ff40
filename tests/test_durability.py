"""When written bytes reach the shards' disks (issue 39): a mount's ``close`` returns once every
replica acknowledged its pushes, without a SYNC; each shard syncs what it applied within
:data:`irdma.wire.protocol.SYNC_INTERVAL_S` by itself; ``fsync`` and the unmount sync the shards
written. Seen as an operator sees it: the shards' ``irdma_shard_requests_total{op="sync"}`` and
``irdma_shard_unsynced_seconds`` on a real cluster (``irdma up``: data directories, durability
``fsync``) under a real mount."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from helpers import assert_clean_log, mounted, scrape, total, wait_until

import irdma
from irdma.ops import cluster
from irdma.wire.protocol import SYNC_INTERVAL_S


@pytest.fixture
def durable(tmp_path: object) -> Iterator[tuple[str, list[str]]]:
    """A cluster of 2 shards, 2 replicas, durability fsync, metrics on: its URL and the shards'
    metrics addresses."""
    d = str(tmp_path)
    url = cluster.up(d, 2, 64 << 20, fresh=True, replicas=2, metrics="127.0.0.1:0")
    try:
        with irdma.connect(url, transport="tcp") as c:
            addrs = [st.metrics for _, st, _ in c.shard_stats() if st is not None and st.metrics]
        assert len(addrs) == 2, addrs
        yield url, addrs
    finally:
        for s in cluster.read_state(d):
            assert_clean_log(s.log)
        cluster.down(d)


def syncs(addrs: list[str]) -> list[float]:
    return [total(scrape(a), "irdma_shard_requests_total", op="sync", status="ok") for a in addrs]


def unsynced(addrs: list[str]) -> list[float]:
    return [total(scrape(a), "irdma_shard_unsynced_seconds") for a in addrs]


@pytest.mark.long  # 31 s: make test-long (CI's time)
def test_close_leaves_the_sync_to_the_shards_and_fsync_and_unmount_wait_for_it(
        durable: tuple[str, list[str]], tmp_path: object) -> None:
    url, addrs = durable
    data = os.urandom(8192)
    with mounted(url, os.path.join(str(tmp_path), "m")) as mp:
        before = syncs(addrs)
        with open(f"{mp}/closed.bin", "wb") as f:
            f.write(data)
        # close returned: both replicas hold the bytes (another client reads them) ...
        with irdma.connect(url, transport="tcp") as c:
            assert c.read("/closed.bin") == data
        # ... and no shard was asked to sync for it; they hold it unsynced, then sync by themselves
        assert syncs(addrs) == before
        assert max(unsynced(addrs)) > 0
        wait_until(lambda: max(unsynced(addrs)) == 0, SYNC_INTERVAL_S + 10, "the shards to sync by themselves")
        assert syncs(addrs) == before  # the shards' own syncs are not requests

        # fsync: each replica written is asked to sync before it returns, and holds nothing unsynced
        before = syncs(addrs)
        fd = os.open(f"{mp}/fsynced.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
            after = syncs(addrs)
            assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
            assert max(unsynced(addrs)) < SYNC_INTERVAL_S
        finally:
            os.close(fd)

        # the unmount syncs what was closed since
        with open(f"{mp}/last.bin", "wb") as f:
            f.write(data)
        before = syncs(addrs)
    after = syncs(addrs)  # unmounted: the mount process has ended
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    with irdma.connect(url, transport="tcp") as c:
        assert [c.read(p) for p in ("/closed.bin", "/fsynced.bin", "/last.bin")] == [data] * 3
