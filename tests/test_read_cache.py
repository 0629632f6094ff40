"""The local read cache (``irdma mount --cache-dir/--cache-size/--cache-memory``, ``irdma warmup``,
``Client.open(cache=...)``): a real cluster whose shards serve their metrics, real mounts.

What a user checks: a second read does not touch the shards (their read counters stay), a write
by another client is read after the next open, the disk tier survives a remount and stays
within its size, ``user.irdma.cache=readonly`` skips the version query, warmup fills it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

import pytest
from helpers import Samples, irdma_cli, mounted, running_cluster, scrape, total, wait_until
from irdma.fs.mount import spawn_mount

import irdma
from irdma import metrics
from irdma._errors import InvalidArgument
from irdma.client.cache import ChunkCache
from irdma.ops import stats

CHUNK = 4 << 20  # the namespace's default chunk size



class Cached:
    """A two-shard cluster (replicas 2) whose shards serve Prometheus metrics."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        old = os.environ.get(metrics.SHARD_METRICS_ENV)
        os.environ[metrics.SHARD_METRICS_ENV] = "127.0.0.1:0"  # the shards `irdma up` starts inherit it
        try:
            self._cm = running_cluster(os.path.join(directory, "c"), shards=2)
            self.cluster = self._cm.__enter__()
        finally:
            if old is None:
                os.environ.pop(metrics.SHARD_METRICS_ENV, None)
            else:
                os.environ[metrics.SHARD_METRICS_ENV] = old
        self.meta_url = self.cluster.meta_url
        with irdma.connect(self.meta_url, transport="tcp") as c:
            self.shard_metrics = [st.metrics for _, st, _ in c.shard_stats() if st is not None]
        assert len(self.shard_metrics) == 2 and all(self.shard_metrics)

    def shards(self, name: str, **match: str) -> float:
        return sum(total(scrape(a), name, **match) for a in self.shard_metrics)

    def pulled(self) -> float:
        """Bytes the shards sent in READ replies (what a cache hit must not add to)."""
        return self.shards("irdma_shard_bytes_total", op="read", direction="out")

    def version_queries(self) -> float:
        return self.shards("irdma_shard_requests_total", op="gather")

    def write(self, path: str, data: bytes, offset: int = 0) -> None:
        """A write by another client (the native one), as a second host would make it."""
        with irdma.connect(self.meta_url, transport="tcp") as c:
            c.write(path, data, offset=offset)


def mount_metrics(mnt: str) -> Samples:
    return scrape(stats.mount_target(mnt).address)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def cc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cached]:
    c = Cached(str(tmp_path_factory.mktemp("readcache")))
    try:
        yield c
    finally:
        c._cm.__exit__(None, None, None)


def cached_mount(cc: Cached, mnt: str, cache_dir: str, **kwargs: object) -> object:
    # direct I/O: the kernel's page cache never answers instead of the mount
    return mounted(cc.meta_url, mnt, direct_io=True, metrics="127.0.0.1:0", cache_dir=cache_dir, **kwargs)


def test_second_read_hits_and_another_clients_write_is_read_after_reopen(cc: Cached, tmp_path: object) -> None:
    data = os.urandom(2 * CHUNK + 12345)
    cc.write("/hot.bin", data)
    with cached_mount(cc, f"{tmp_path}/m", f"{tmp_path}/cache") as m:  # type: ignore[attr-defined]
        path = os.path.join(m, "hot.bin")
        assert read(path) == data
        first = mount_metrics(m)
        assert total(first, "irdma_cache_misses_total") == 3  # one per chunk
        pulled, queries = cc.pulled(), cc.version_queries()

        assert read(path) == data
        second = mount_metrics(m)
        assert total(second, "irdma_cache_hits_total") >= 3
        assert total(second, "irdma_cache_misses_total") == 3
        assert cc.pulled() == pulled, "a cached read pulled bytes from the shards"
        # the price of close-to-open: one version query per shard holding kept chunks, at open
        assert 1 <= cc.version_queries() - queries <= 2
        assert total(second, "irdma_cache_bytes", tier="memory") == len(data)
        # written to disk behind the reads
        wait_until(lambda: total(mount_metrics(m), "irdma_cache_bytes", tier="disk") == len(data), 20,
                   "the disk tier to hold the file")

        new = b"written elsewhere" * 100
        cc.write("/hot.bin", new, offset=CHUNK + 10)  # chunk 1 only: its version moves
        pulled = cc.pulled()
        want = data[: CHUNK + 10] + new + data[CHUNK + 10 + len(new):]
        assert read(path) == want, "a chunk whose version moved was served from the cache"
        after = mount_metrics(m)
        assert total(after, "irdma_cache_validations_total", result="stale") == 1
        # chunks 0 and 2 kept their versions; the file's ctime moved, so a CRC-32 check confirmed them
        assert total(after, "irdma_cache_validations_total", result="checksum") == 2
        assert cc.pulled() - pulled == CHUNK, "only the chunk written is read again"


def test_native_client_cache(cc: Cached, tmp_path: object) -> None:
    data = os.urandom(CHUNK + 100)
    cc.write("/native.bin", data)
    cache = ChunkCache("16MiB")
    with irdma.connect(cc.meta_url, transport="tcp", cache=cache) as c:
        assert bytes(c.read("/native.bin")) == data
        pulled = cc.pulled()
        assert bytes(c.read("/native.bin")) == data
        assert cc.pulled() == pulled
        cc.write("/native.bin", b"\x01" * 10)
        assert bytes(c.read("/native.bin")) == b"\x01" * 10 + data[10:]
        c.write("/native.bin", b"\x02" * 10, offset=CHUNK)  # its own write: read back at once
        assert bytes(c.read("/native.bin"))[CHUNK : CHUNK + 10] == b"\x02" * 10
    assert cache.mem_bytes <= 16 << 20


def test_disk_tier_survives_a_remount_and_stays_within_its_size(cc: Cached, tmp_path: object) -> None:
    data = os.urandom(6 * CHUNK)
    cc.write("/big.bin", data)
    cache_dir = f"{tmp_path}/cache"
    kw = {"cache_size": "10MiB", "cache_memory": "0"}
    with cached_mount(cc, f"{tmp_path}/m", cache_dir, **kw) as m:  # type: ignore[attr-defined]
        assert read(os.path.join(m, "big.bin")) == data
        got = mount_metrics(m)  # no memory tier: every chunk was written to disk before it was read
        assert total(got, "irdma_cache_bytes", tier="disk") <= 10 << 20
        assert total(got, "irdma_cache_bytes", tier="memory") == 0
        assert total(got, "irdma_cache_evictions_total", tier="disk") >= 4
    on_disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(cache_dir) for f in fs)
    assert 2 * CHUNK <= on_disk <= (10 << 20) + 68 * 4, on_disk  # the last two chunks, and their headers

    pulled = cc.pulled()
    with cached_mount(cc, f"{tmp_path}/m", cache_dir, **kw) as m:  # type: ignore[attr-defined]
        with open(os.path.join(m, "big.bin"), "rb") as f:
            f.seek(4 * CHUNK)
            assert f.read() == data[4 * CHUNK :]
        got = mount_metrics(m)
        assert total(got, "irdma_cache_hits_total", tier="disk") >= 2
        assert total(got, "irdma_cache_misses_total") == 0
    assert cc.pulled() == pulled, "a remount read what its disk cache kept from the shards"


def test_readonly_xattr(cc: Cached, tmp_path: object) -> None:
    data = os.urandom(CHUNK // 2)
    cc.write("/frozen.bin", data)
    cc.write("/plain.bin", data)
    with cached_mount(cc, f"{tmp_path}/m", f"{tmp_path}/cache") as m:  # type: ignore[attr-defined]
        frozen, plain = os.path.join(m, "frozen.bin"), os.path.join(m, "plain.bin")
        with pytest.raises(OSError) as exc:
            os.setxattr(frozen, "user.irdma.cache", b"sometimes")
        assert exc.value.errno == errno.EINVAL
        assert "user.irdma.cache" not in os.listxattr(frozen)  # the bad value changed nothing
        os.setxattr(frozen, "user.irdma.cache", b"readonly")
        assert os.getxattr(frozen, "user.irdma.cache") == b"readonly"
        assert "user.irdma.cache" in os.listxattr(frozen)  # what getfattr -d shows

        for p in (frozen, plain):
            assert read(p) == data  # kept
            assert read(p) == data  # validated (a version query), and readonly remembers it
        queries = cc.version_queries()
        assert read(frozen) == data
        assert cc.version_queries() == queries, "a readonly file was validated again at the same ctime"
        assert read(plain) == data
        assert cc.version_queries() == queries + 1, "a default file is validated at every open"

        cc.write("/frozen.bin", b"new bytes")  # moves its ctime: the next open checks again
        assert read(frozen) == b"new bytes" + data[9:]

        os.setxattr(plain, "user.irdma.cache", b"off")
        hits = total(mount_metrics(m), "irdma_cache_hits_total")
        assert read(plain) == data
        assert total(mount_metrics(m), "irdma_cache_hits_total") == hits
        os.removexattr(plain, "user.irdma.cache")  # back to default: served from the cache again
        assert read(plain) == data
        assert total(mount_metrics(m), "irdma_cache_hits_total") > hits


def test_warmup_fills_the_cache(cc: Cached, tmp_path: object) -> None:
    a, b = os.urandom(CHUNK + 1), os.urandom(3000)
    with irdma.connect(cc.meta_url, transport="tcp") as c:
        c.makedirs("/warm")
    cc.write("/warm/a", a)
    cc.write("/warm/b", b)
    with cached_mount(cc, f"{tmp_path}/m", f"{tmp_path}/cache") as m:  # type: ignore[attr-defined]
        res = irdma_cli("warmup", os.path.join(m, "warm"), "--threads", "2")
        assert "warmed 2 files" in res.stderr
        misses = total(mount_metrics(m), "irdma_cache_misses_total")
        assert misses == 3
        pulled = cc.pulled()
        assert read(os.path.join(m, "warm", "a")) == a
        assert read(os.path.join(m, "warm", "b")) == b
        assert total(mount_metrics(m), "irdma_cache_misses_total") == misses
        assert cc.pulled() == pulled

    # a namespace path into a disk cache that a later mount uses
    res = irdma_cli("warmup", "--meta", cc.meta_url, "--cache-dir", f"{tmp_path}/cache2", "/warm")
    assert "warmed 2 files" in res.stderr
    pulled = cc.pulled()
    with cached_mount(cc, f"{tmp_path}/m2", f"{tmp_path}/cache2") as m:  # type: ignore[attr-defined]
        assert read(os.path.join(m, "warm", "a")) == a
        assert total(mount_metrics(m), "irdma_cache_hits_total", tier="disk") >= 2
    assert cc.pulled() == pulled


def test_bad_cache_settings_are_refused_before_mounting(cc: Cached, tmp_path: object) -> None:
    mnt = f"{tmp_path}/m"
    os.makedirs(mnt)
    not_dir = f"{tmp_path}/file"
    open(not_dir, "w").close()
    with pytest.raises(InvalidArgument, match="is not writable"):
        spawn_mount(cc.meta_url, mnt, transport="tcp", log_file=f"{mnt}.log", cache_dir=f"{not_dir}/cache")
    assert not os.path.ismount(mnt)
    res = irdma_cli("mount", cc.meta_url, mnt, "--cache-dir", f"{not_dir}/cache", check=False)
    assert res.returncode != 0 and "is not writable" in res.stderr
    res = irdma_cli("mount", cc.meta_url, mnt, "--cache-dir", f"{tmp_path}/c", "--cache-size", "lots", check=False)
    assert res.returncode != 0 and "is not a size" in res.stderr
    assert not os.path.ismount(mnt)
    with pytest.raises(InvalidArgument, match="needs --cache-dir"):
        ChunkCache(0, None, "1G")


def test_stats_summary_shows_the_cache() -> None:
    from irdma.ops.stats import Scrape, summary_of

    prev = Scrape(0.0, {"irdma_cache_hits_total": [({"tier": "memory"}, 10.0)], "irdma_cache_misses_total": [({}, 5.0)],
                        "irdma_cache_bytes": [({"tier": "memory"}, 0.0)]})
    cur = Scrape(1.0, {"irdma_cache_hits_total": [({"tier": "memory"}, 40.0), ({"tier": "disk"}, 8.0)],
                       "irdma_cache_misses_total": [({}, 7.0)],
                       "irdma_cache_bytes": [({"tier": "memory"}, float(1 << 30)), ({"tier": "disk"}, 0.0)]})
    assert summary_of(prev, cur) == "cache 95% hits 1.0G"
    assert summary_of(prev, prev) == "cache 0B"
