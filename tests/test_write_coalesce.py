"""Adjacent writes through a mount are gathered into chunk-sized pushes (:mod:`irdma.fs.cache`),
through real mounts on real shard processes: ``dd bs=4k``'s writes reach the shards as a few
4 MiB pushes (counted by the mount's own Prometheus counters, not timed), read back byte for byte
through another handle of the same mount before any close and from a second mount after it;
interleaved writes, reads, truncates and rewrites inside the gathered range give the bytes a
local file gives; and a push that fails for want of room (a full shard: ENOSPC) is reported at
fsync and close, after which every byte the metadata counts in the file is one the shards hold
and the bytes an earlier fsync acknowledged are all there.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import Cluster, mounted, running_cluster
from prometheus_client.parser import text_string_to_metric_families

import irdma
from irdma.ops import stats

pytestmark = pytest.mark.fuse

KiB, MiB = 1 << 10, 1 << 20


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


def _count(mountpoint: str, name: str, op: str) -> float:
    """The mount's counter ``name`` (summed over its other labels) for ``op``."""
    with urllib.request.urlopen(f"http://{stats.mount_target(mountpoint).address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and s.labels.get("op") == op)


def _read_all(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n and (got := os.pread(fd, min(MiB, n - len(out)), len(out))):
        out += got
    return bytes(out)


def test_4k_writes_go_out_as_few_chunk_sized_pushes(metered: str, mnt2: str) -> None:
    """2,048 writes of 4 KiB (8 MiB, two 4 MiB chunks): a handful of pushes, not one a write;
    another handle of the same mount reads them before the writer closes (direct I/O: the
    mount answers, not the kernel's pages), a second mount after the close."""
    payload = np.random.default_rng(7).integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes()
    path = os.path.join(metered, "dd-4k.bin")
    fuse0 = _count(metered, "irdma_fuse_requests_total", "write")
    push0 = _count(metered, "irdma_client_requests_total", "write")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(payload), 4 * KiB):
            assert os.write(fd, payload[off : off + 4 * KiB]) == 4 * KiB
        reader = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            assert _read_all(reader, len(payload)) == payload  # read your writes, through another handle
        finally:
            os.close(reader)
        os.fsync(fd)
    finally:
        os.close(fd)
    writes = _count(metered, "irdma_fuse_requests_total", "write") - fuse0
    pushes = _count(metered, "irdma_client_requests_total", "write") - push0
    assert writes == 2048
    # 2 chunks -> 2 pushes when nothing cuts a range short (the read above may, and a range a
    # second old goes out anyway); one push a write before
    assert 2 <= pushes <= 8, f"{pushes:g} pushes for {writes:g} writes of 4 KiB"
    with open(os.path.join(mnt2, "dd-4k.bin"), "rb") as f:  # close-to-open: the other mount
        assert f.read() == payload
    os.unlink(path)


@pytest.mark.parametrize("io", ["page-cache", "direct"])
def test_interleaved_writes_reads_truncates_match_a_local_file(metered: str, mnt2: str, tmp_path: object,
                                                              io: str) -> None:
    """Mostly sequential small writes (they gather), with reads through the writer's and
    another handle, rewrites at earlier offsets inside and before the gathered range, truncates
    down and up, and gaps: every read and the final bytes (also from a second mount after the
    close) are a local file's."""
    name = f"interleaved-{io}.bin"
    path = os.path.join(metered, name)
    local = os.path.join(str(tmp_path), name)
    open(path, "wb").close()
    if io == "direct":
        os.setxattr(path, "user.irdma.io", b"direct")
    fds = [os.open(path, os.O_RDWR), os.open(local, os.O_CREAT | os.O_RDWR, 0o644)]
    readers = [os.open(path, os.O_RDONLY), os.open(local, os.O_RDONLY)]
    rng = random.Random(11)
    pos = 0
    try:
        for i in range(800):
            r = rng.random()
            size = os.fstat(fds[1]).st_size
            if r < 0.70:  # the next piece of a stream: 1 B to 16 KiB, mostly 4 KiB
                n = 4 * KiB if rng.random() < 0.6 else rng.randrange(1, 16 * KiB)
                off = pos
            elif r < 0.80:  # a rewrite at an earlier offset, often inside what was just written
                n = rng.randrange(1, 8 * KiB)
                off = max(0, pos - rng.randrange(1, 64 * KiB)) if rng.random() < 0.7 else rng.randrange(0, size + 1)
            elif r < 0.82:  # a jump past the end: a gap that reads as zeros
                n, off = rng.randrange(1, 8 * KiB), size + rng.randrange(1, 3 * MiB)
            elif r < 0.97:  # a read, through the writer or the other handle
                n, off = rng.randrange(1, 64 * KiB), rng.randrange(0, size + 4 * KiB)
                which = fds if rng.random() < 0.5 else readers
                got = [os.pread(fd, n, off) for fd in which]
                assert got[0] == got[1], f"op {i}: read of {n} at {off} differs from the local file's"
                continue
            else:  # truncate down or up, near the end
                new = max(0, size + rng.randrange(-256 * KiB, 256 * KiB))
                for fd in fds:
                    os.ftruncate(fd, new)
                pos = min(pos, new)
                continue
            data = rng.randbytes(n)
            for fd in fds:
                assert os.pwrite(fd, data, off) == n
            pos = off + n
            assert os.fstat(fds[0]).st_size == os.fstat(fds[1]).st_size, f"op {i}: size differs"
        size = os.fstat(fds[1]).st_size
        assert size > MiB
        assert _read_all(fds[0], size) == _read_all(fds[1], size)
    finally:
        for fd in fds + readers:
            os.close(fd)
    with open(local, "rb") as f:
        want = f.read()
    with open(os.path.join(mnt2, name), "rb") as f:
        assert f.read() == want, "the second mount sees other bytes after the close"
    os.unlink(path)


def test_a_write_clears_file_capabilities_each_time_they_are_set(metered: str) -> None:
    """The kernel asks ``getxattr security.capability`` before every write and removes the
    capability it finds (Linux clears file capabilities on a write); the mount answers from what
    it read at the file's open, and a capability set again while the file is open (this mount's
    setxattr) is seen, and cleared, by the next write."""
    if os.geteuid() != 0:
        pytest.skip("setting security.capability needs root (CAP_SETFCAP)")
    path = os.path.join(metered, "capable.bin")
    open(path, "wb").close()
    fd = os.open(path, os.O_WRONLY)
    try:
        for i in range(3):
            subprocess.run(["setcap", "cap_net_raw+ep", path], check=True, capture_output=True)
            assert os.getxattr(path, "security.capability")
            os.pwrite(fd, b"x" * 4096, i * 4096)
            with pytest.raises(OSError) as info:
                os.getxattr(path, "security.capability")
            assert info.value.errno == errno.ENODATA, f"write {i} left the capability"
    finally:
        os.close(fd)
    os.unlink(path)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    """One shard of 8 MiB (two 4 MiB chunks), one replica, and a mount of it."""
    with running_cluster(str(tmp_path_factory.mktemp("full")), shards=1, capacity=8 * MiB, replicas=1) as c:
        with mounted(c.meta_url, str(tmp_path_factory.mktemp("fullmnt") / "m"), allow_log=("failed",)) as m:
            yield c, m


def test_a_full_shard_fails_fsync_and_close_and_loses_nothing_acknowledged(full: tuple[Cluster, str]) -> None:
    """4 KiB writes into a cluster with room for 8 MiB: the first 2 MiB are fsynced (they must
    survive); the writes go on to 12 MiB, the pushes past the room fail with ENOSPC, and that
    is reported by a write, the fsync or the close (never all of them quiet); afterwards the
    file's size as the metadata has it counts only bytes the shards hold, each as written."""
    cluster, mnt = full
    payload = np.random.default_rng(3).integers(0, 256, 12 * MiB, dtype=np.uint8).tobytes()
    path = os.path.join(mnt, "full.bin")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    told: list[int] = []
    try:
        for off in range(0, 2 * MiB, 4 * KiB):
            os.write(fd, payload[off : off + 4 * KiB])
        os.fsync(fd)  # acknowledged: these bytes are on the shard
        for off in range(2 * MiB, len(payload), 4 * KiB):
            try:
                os.write(fd, payload[off : off + 4 * KiB])
            except OSError as exc:
                told.append(exc.errno)
                break
        with pytest.raises(OSError) as fsync_error:
            os.fsync(fd)
        told.append(fsync_error.value.errno)
    finally:
        try:
            os.close(fd)
        except OSError as exc:  # FUSE_FLUSH reports it too
            told.append(exc.errno)
    assert told and set(told) == {errno.ENOSPC}, told
    with irdma.connect(cluster.meta_url, transport="tcp") as c:
        size = c.stat("/full.bin").size
        assert 2 * MiB <= size < len(payload)  # what was fsynced is counted, what failed is not
        got = bytes(c.read("/full.bin", 0, size))
    assert got == payload[:size], "the file counts bytes the shard does not hold as written"
