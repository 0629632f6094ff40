"""The local read cache's disk tier serves only the bytes it was given, and only to its user
(issue 36, points 2 and 11): a real two-shard cluster, real mounts, a second uid.

* A cache entry with 8 bytes changed (a flipped disk block, an edit) is never served: the
  mount and ``irdma.connect(cache=...)`` check each block's CRC-32 before serving, drop the
  entry (logged once) and read the chunk from the shards again (kept anew).
* Cache entries are the mount user's alone: ``DIR/irdma-<namespace>`` and its directories are
  0700, the entries 0600; another user (``setpriv --reuid=65534``) cannot read a cached chunk of
  a 0600 file; a cache left too open by an older version is made private at the next mount; a
  namespace directory of another user, a symbolic link, or a cache directory every user may
  write without the sticky bit is refused with a message that says what to do.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
from helpers import Cluster, mounted, running_cluster, wait_until
from irdma.fs.mount import spawn_mount

import irdma
from irdma._errors import InvalidArgument, IrdmaError
from irdma.client.cache import CRC_BLOCK, HEADER, ChunkCache

CHUNK = 1 << 20
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path_factory.mktemp("cacheint")), shards=2) as c:
        yield c


def entries(cache_dir: str) -> list[str]:
    """The chunk files of the disk tier, sorted (``irdma-*/<file id>/<chunk>-<version>``): whole
    entries only, not the ``.tmp`` file an entry is written to before its rename (a test that took
    one for the entry found it gone)."""
    return sorted(p for p in glob.glob(os.path.join(cache_dir, "irdma-*", "*", "*-*")) if not p.endswith(".tmp"))


def entry_of(cache_dir: str, ino: int, index: int) -> str:
    found = [p for p in glob.glob(os.path.join(cache_dir, "irdma-*", str(ino), f"{index}-*")) if not p.endswith(".tmp")]
    assert len(found) == 1, found
    return found[0]


def data_offset(length: int) -> int:
    """Where an entry's bytes start in its file: the header, then a CRC-32 per block."""
    return HEADER.size + 4 * -(-length // CRC_BLOCK)


def corrupt(path: str, at: int, n: int = 8) -> None:
    """Change ``n`` bytes of an entry's data from byte ``at`` (as the red-team probe did)."""
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in old))


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ---------------------------------------------------------------- point 2: integrity
def test_native_client_never_serves_a_corrupted_entry(cl: Cluster, tmp_path: object,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    data = os.urandom(2 * CHUNK + 5000)
    cache_dir = f"{tmp_path}/cache"
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write("/nat.bin", data, chunk_size=CHUNK)
        ino = c.stat("/nat.bin").ino
    with irdma.connect(cl.meta_url, transport="tcp", cache=ChunkCache("16MiB", cache_dir)) as c:
        assert bytes(c.read("/nat.bin")) == data
    assert len(entries(cache_dir)) == 3
    e0, e2 = entry_of(cache_dir, ino, 0), entry_of(cache_dir, ino, 2)
    corrupt(e0, data_offset(CHUNK) + 933)
    corrupt(e2, data_offset(5000) + 4990, 4)  # the last bytes of a short last chunk

    caplog.set_level(logging.INFO, logger="irdma.cache")
    cache = ChunkCache("16MiB", cache_dir)
    with irdma.connect(cl.meta_url, transport="tcp", cache=cache) as c:
        assert bytes(c.read("/nat.bin")) == data, "a corrupted cache entry was served"
        assert bytes(c.read("/nat.bin")) == data
    dropped = [r.getMessage() for r in caplog.records if "do not match their CRC-32" in r.getMessage()]
    assert len(dropped) == 2, dropped  # once per bad entry
    assert e0 in "".join(dropped) and e2 in "".join(dropped)
    # re-fetched from the shards and kept anew: the entries on disk hold the chunk's bytes
    assert read(entry_of(cache_dir, ino, 0))[data_offset(CHUNK):] == data[:CHUNK]
    assert read(entry_of(cache_dir, ino, 2))[data_offset(5000):] == data[2 * CHUNK:]

    # a disk tier without memory reads only the blocks asked for, and checks them
    corrupt(entry_of(cache_dir, ino, 1), data_offset(CHUNK) + 3 * CRC_BLOCK + 17)
    caplog.clear()
    with irdma.connect(cl.meta_url, transport="tcp", cache=ChunkCache(0, cache_dir)) as c:
        assert bytes(c.read("/nat.bin", 0, 100)) == data[:100]  # chunk 0: served, sound
        at = CHUNK + 3 * CRC_BLOCK
        assert bytes(c.read("/nat.bin", at, 64)) == data[at : at + 64]
        assert bytes(c.read("/nat.bin", at, 64)) == data[at : at + 64]
    assert sum("do not match their CRC-32" in r.getMessage() for r in caplog.records) == 1


def test_the_mount_never_serves_a_corrupted_entry(cl: Cluster, tmp_path: object) -> None:
    data = os.urandom(CHUNK + 3000)
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write("/m.bin", data, chunk_size=CHUNK)
        ino = c.stat("/m.bin").ino
    cache_dir, mnt = f"{tmp_path}/cache", f"{tmp_path}/m"
    with mounted(cl.meta_url, mnt, direct_io=True, cache_dir=cache_dir) as m:
        assert read(os.path.join(m, "m.bin")) == data
    assert len(entries(cache_dir)) == 2  # an unmount waits for the disk writes
    corrupt(entry_of(cache_dir, ino, 0), data_offset(CHUNK) + 933)
    with mounted(cl.meta_url, mnt, direct_io=True, cache_dir=cache_dir) as m:
        assert read(os.path.join(m, "m.bin")) == data, "the mount served a corrupted cache entry"
        assert read(os.path.join(m, "m.bin")) == data
    with open(f"{mnt}.log") as f:
        log = f.read()
    assert log.count("do not match their CRC-32") == 1, log[-2000:]
    assert read(entry_of(cache_dir, ino, 0))[data_offset(CHUNK):] == data[:CHUNK]


# ---------------------------------------------------------------- point 11: privacy
@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A directory every user may enter (pytest's own is root's 0700): what a user sees."""
    d = tempfile.mkdtemp(prefix="irdma-cachepriv-")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NOBODY, *cmd], capture_output=True, encoding="utf-8", errors="replace", timeout=30)


def modes(cache_dir: str) -> dict[str, tuple[int, int]]:
    """``{path: (mode bits, uid)}`` of everything under the cache's namespace directories."""
    out = {}
    for root in glob.glob(os.path.join(cache_dir, "irdma-*")):
        for r, _, files in os.walk(root):
            for p in [r] + [os.path.join(r, f) for f in files]:
                st = os.lstat(p)
                out[p] = (stat.S_IMODE(st.st_mode), st.st_uid)
    return out


def test_cache_entries_are_the_mount_users_alone(cl: Cluster, shared_dir: str) -> None:
    secret = b"the key: " + os.urandom(40).hex().encode()
    cache_dir, mnt = f"{shared_dir}/cache", f"{shared_dir}/m"
    os.makedirs(cache_dir, mode=0o755)  # as /var/cache/irdma would be
    os.chmod(cache_dir, 0o755)
    with mounted(cl.meta_url, mnt, allow_other=True, direct_io=True, cache_dir=cache_dir) as m:
        os.makedirs(f"{m}/sec", exist_ok=True)
        os.chmod(f"{m}/sec", 0o755)
        fd = os.open(f"{m}/sec/key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, secret)
        finally:
            os.close(fd)
        os.chmod(f"{m}/sec/key", 0o600)
        denied = as_nobody("cat", f"{m}/sec/key")
        assert denied.returncode != 0 and "Permission denied" in denied.stderr  # the mount's rule
        assert read(f"{m}/sec/key") == secret  # root reads it: now kept in the cache
        wait_until(lambda: len(entries(cache_dir)) == 1, 20, "the disk tier to keep the chunk")
        entry = entries(cache_dir)[0]
        got = as_nobody("cat", entry)
        assert got.returncode != 0 and "Permission denied" in got.stderr, "another user read a cached chunk"
        assert secret.decode() not in got.stdout
        found = modes(cache_dir)
        assert found and all(uid == os.geteuid() for _, uid in found.values())
        assert all(mode == (0o700 if os.path.isdir(p) else 0o600) for p, (mode, _) in found.items()), found

    # a cache an older version left open (0755 directories, 0644 entries): private at the next mount
    for p in found:
        os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)
    assert as_nobody("cat", entry).stdout.endswith(secret.decode())  # what the probe found
    with mounted(cl.meta_url, mnt, allow_other=True, direct_io=True, cache_dir=cache_dir) as m:
        assert modes(cache_dir) == found, "the open cache was not made private"
        assert as_nobody("cat", entry).returncode != 0
        assert read(f"{m}/sec/key") == secret  # the entry was kept and is served
    with open(f"{mnt}.log") as f:
        assert "was mode 0755, others could read cached chunks: now 0700" in f.read()


def test_a_cache_another_user_could_read_or_replace_is_refused(cl: Cluster, shared_dir: str) -> None:
    mnt = f"{shared_dir}/m"
    os.makedirs(mnt)
    # a namespace directory that another user made (planted in a shared cache directory)
    cache_dir = f"{shared_dir}/cache"
    with irdma.connect(cl.meta_url, transport="tcp", cache=ChunkCache(0, cache_dir)):
        pass
    [ns] = glob.glob(os.path.join(cache_dir, "irdma-*"))
    os.chown(ns, 65534, 65534)
    with pytest.raises(InvalidArgument, match="belongs to uid 65534"):
        with irdma.connect(cl.meta_url, transport="tcp", cache=ChunkCache(0, cache_dir)):
            pass
    with pytest.raises(IrdmaError, match="belongs to uid 65534"):
        spawn_mount(cl.meta_url, mnt, transport="tcp", log_file=f"{mnt}.log", cache_dir=cache_dir)
    assert not os.path.ismount(mnt)
    # a symbolic link in its place
    os.rmdir(ns)
    os.makedirs(f"{shared_dir}/elsewhere", mode=0o700)
    os.symlink(f"{shared_dir}/elsewhere", ns)
    with pytest.raises(InvalidArgument, match="cannot be opened as a directory"):
        with irdma.connect(cl.meta_url, transport="tcp", cache=ChunkCache(0, cache_dir)):
            pass
    # a cache directory every user may write, without the sticky bit: refused before mounting
    open_dir = f"{shared_dir}/open"
    os.makedirs(open_dir)
    os.chmod(open_dir, 0o777)
    with pytest.raises(InvalidArgument, match="writable by every user") as exc:
        spawn_mount(cl.meta_url, mnt, transport="tcp", log_file=f"{mnt}.log", cache_dir=open_dir)
    assert "chmod o-w" in str(exc.value)
    assert not os.path.ismount(mnt)
    os.chmod(open_dir, 0o1777)  # as /tmp: accepted
    with irdma.connect(cl.meta_url, transport="tcp", cache=ChunkCache(0, open_dir)):
        pass
    assert stat.S_IMODE(os.stat(glob.glob(f"{open_dir}/irdma-*")[0]).st_mode) == 0o700
