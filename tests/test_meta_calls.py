"""A small file through the mount costs few metadata calls, and caching keeps close-to-open
(issue 39 item 2), through real mounts on real shard processes.

The calls are counted as a user could: the mount's own Prometheus counter
``irdma_meta_calls_total`` (one per metadata engine call, by method). A 4 KiB file's
create + write + close is its lookup, one ``create_open`` and one ``extend``, plus its share of
a ``close_inodes`` batch; an open + read + close of it is one ``open_file`` (and the lookup,
when the kernel's entry cache expired). The native client's ``write`` of a new small file is two
calls, its ``read`` one. With the attribute and entry caches on (1 s), a file
written and closed on one mount reads back byte for byte, at its new size, from an open on
another mount every time, also when that mount read an older version of it just before.
"""

from __future__ import annotations

import os
import random
import urllib.request
from collections.abc import Iterator

import pytest
from helpers import Cluster, mounted, wait_until
from prometheus_client.parser import text_string_to_metric_families

import irdma
from irdma.meta import open_meta
from irdma.metrics import meta_metrics
from irdma.ops import stats

pytestmark = pytest.mark.fuse

KiB = 1 << 10
#: engine calls the mount makes on its own (heartbeats, shard health), whatever files do
BACKGROUND = frozenset({"heartbeat", "shard_view", "note_incarnation", "set_shard_health", "mark_synced"})


@pytest.fixture(scope="module")
def metered(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A mount of the module's cluster that serves its metrics (found through $IRDMA_RUN_DIR)."""
    old = os.environ.get("IRDMA_RUN_DIR")
    os.environ["IRDMA_RUN_DIR"] = str(tmp_path_factory.mktemp("run"))  # the mount process inherits it
    try:
        with mounted(cluster.meta_url, str(tmp_path_factory.mktemp("metered") / "m"), metrics="127.0.0.1:0") as m:
            yield m
    finally:
        if old is None:
            os.environ.pop("IRDMA_RUN_DIR", None)
        else:
            os.environ["IRDMA_RUN_DIR"] = old


def _calls(mountpoint: str) -> dict[str, float]:
    """The mount's metadata engine calls so far, by method."""
    with urllib.request.urlopen(f"http://{stats.mount_target(mountpoint).address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.labels["call"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "irdma_meta_calls_total"}


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after
            if k not in BACKGROUND and after.get(k, 0) != before.get(k, 0)}


def test_a_small_file_costs_a_create_and_a_close(metered: str, cluster: Cluster) -> None:
    """20 files of 4 KiB: create + write + close is at most 3 engine calls each (the old code
    made 7: lookup, create, open_inode, getattr of the directory, getxattr of the file's
    capabilities, extend, close_inode), the session's open records closed in batches; reading
    them back is one call each beyond the lookup."""
    n = 20
    d = os.path.join(metered, "small")
    os.mkdir(d)
    os.setxattr(d, "user.irdma.chunk_size", b"65536")
    payloads = [random.Random(i).randbytes(4 * KiB) for i in range(n)]
    c0 = _calls(metered)
    for i, data in enumerate(payloads):
        with open(os.path.join(d, f"f{i}"), "wb", buffering=0) as f:
            assert f.write(data) == len(data)
    c1 = _calls(metered)
    spent = _spent(c0, c1)
    batches = spent.pop("close_inodes", 0)
    assert sum(spent.values()) <= 3 * n + 2, spent  # + the directory's first lookup and getattr
    assert spent.get("create_open") == n and spent.get("extend") == n, spent
    assert batches <= n
    meta = open_meta(cluster.meta_url)  # every open record closed, soon after the last close
    try:
        inos = {meta.resolve(f"/small/f{i}").ino for i in range(n)}
        wait_until(lambda: not any(meta.file_sizes()[ino][2] for ino in inos), 30, "the session closed the files")
    finally:
        meta.close()
    c2 = _calls(metered)
    for i, data in enumerate(payloads):
        with open(os.path.join(d, f"f{i}"), "rb", buffering=0) as f:
            assert f.read() == data
    spent = _spent(c2, _calls(metered))
    spent.pop("close_inodes", None)
    spent.pop("lookup", None)  # the kernel's entry cache may have expired
    assert spent.pop("getattr", 0) <= 3, spent  # the directory's, once its attributes expired
    assert spent == {"open_file": n}, spent


def test_close_to_open_across_mounts_with_caching_on(mnt: str, mnt2: str) -> None:
    """50 rounds: a new version of one of three files (a new size each time, from 1 byte to
    200 KiB) written and closed on one mount is what an open on the other mount reads, byte for
    byte, though that mount read the file's previous version moments before and caches
    attributes and names for 1 s."""
    d = "c2o"
    os.mkdir(os.path.join(mnt, d))
    rng = random.Random(39)
    last: dict[int, bytes] = {}
    for r in range(50):
        k = r % 3
        data = rng.randbytes(rng.randint(1, 200 * KiB))
        with open(os.path.join(mnt, d, f"f{k}"), "wb") as f:
            f.write(data)
        with open(os.path.join(mnt2, d, f"f{k}"), "rb") as f:
            got = f.read()
        assert len(got) == len(data) and got == data, f"round {r}: {len(got)} bytes read, {len(data)} written"
        assert os.stat(os.path.join(mnt2, d, f"f{k}")).st_size == len(data)
        last[k] = data
    for k, data in last.items():  # and back the other way
        with open(os.path.join(mnt2, d, f"f{k}"), "r+b") as f:
            f.write(data[::-1])
        with open(os.path.join(mnt, d, f"f{k}"), "rb") as f:
            assert f.read() == data[::-1]


def test_the_native_client_writes_a_small_file_in_two_calls_and_reads_it_in_one(cluster: Cluster) -> None:
    """``Client.write`` of a new 4 KiB file: one call to resolve or create it with its chunk map,
    one to record its size and chunks (the old code made 5: resolve, lookup, create, chunk_map,
    extend); ``Client.read``: one (was 2: resolve, chunk_map). Counted by this process's
    ``irdma_meta_calls_total``."""
    counter = meta_metrics().calls

    def calls() -> dict[str, float]:
        return {s.labels["call"]: s.value for fam in counter.collect() for s in fam.samples
                if s.name == "irdma_meta_calls_total"}

    data = random.Random(2).randbytes(4 * KiB)
    with irdma.connect(cluster.meta_url, transport="tcp") as c:
        c.makedirs("/native-small")
        for i in range(5):
            before = calls()
            assert c.write(f"/native-small/f{i}", data, chunk_size=65536) == len(data)
            mid = calls()
            assert bytes(c.read(f"/native-small/f{i}")) == data
            after = calls()
            assert _spent(before, mid) == {"resolve_chunks": 1, "extend": 1}
            assert _spent(mid, after) == {"resolve_chunks": 1}
