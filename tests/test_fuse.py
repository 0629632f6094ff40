"""The filesystem through a real FUSE mount, with plain ``os`` calls (as a user would), and the
tools a user runs (``ls``, ``find``)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import stat
import subprocess

import numpy as np
import pytest
from helpers import Cluster, wait_until

import irdma

pytestmark = pytest.mark.fuse


def test_large_and_unaligned_ranges_read_back(mnt: str) -> None:
    path = os.path.join(mnt, "big.bin")
    data = os.urandom(11 * (1 << 20) + 12345)  # several 4 MiB chunks, a ragged end
    with open(path, "wb") as f:
        f.write(data)
    assert os.path.getsize(path) == len(data)
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest()
        for off, n in ((1, 1), (4095, 3), ((4 << 20) - 5, 10), (7_777_777, 1_234_567), (len(data) - 3, 100)):
            f.seek(off)
            assert f.read(n) == data[off : off + n]
    # unaligned overwrite in the middle, across a chunk boundary
    patch = os.urandom(100_003)
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, patch, (4 << 20) - 50_001) == len(patch)
    finally:
        os.close(fd)
    expect = bytearray(data)
    expect[(4 << 20) - 50_001 : (4 << 20) - 50_001 + len(patch)] = patch
    with open(path, "rb") as f:
        assert f.read() == expect


def test_sparse_files_read_zeros_in_holes(mnt: str) -> None:
    path = os.path.join(mnt, "sparse")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.pwrite(fd, b"tail", 9 << 20)
    finally:
        os.close(fd)
    assert os.path.getsize(path) == (9 << 20) + 4
    with open(path, "rb") as f:
        data = f.read()
    assert data[: 9 << 20] == bytes(9 << 20) and data[-4:] == b"tail"


def test_truncate_shrinks_and_grows_with_zeros(mnt: str, cluster: Cluster) -> None:
    path = os.path.join(mnt, "trunc")
    data = os.urandom(6 << 20)
    with open(path, "wb") as f:
        f.write(data)
    os.truncate(path, 1000)
    assert os.path.getsize(path) == 1000
    os.truncate(path, 5 << 20)
    with open(path, "rb") as f:
        got = f.read()
    assert got[:1000] == data[:1000] and got[1000:] == bytes((5 << 20) - 1000)
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # O_TRUNC through open, no write
    try:
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    assert os.path.getsize(path) == 0
    with open(path, "rb") as f:
        assert f.read() == b""
    with open(path, "wb") as f:
        f.write(b"new")
    with open(path, "rb") as f:
        assert f.read() == b"new"
    # truncate up after O_TRUNC: zeros, never the old bytes
    os.truncate(path, 1 << 20)
    with open(path, "rb") as f:
        assert f.read() == b"new" + bytes((1 << 20) - 3)


def test_rename_over_an_existing_file_is_atomic_and_frees_the_old_one(mnt: str, cluster: Cluster) -> None:
    a, b = os.path.join(mnt, "ckpt.tmp"), os.path.join(mnt, "ckpt")
    with open(b, "wb") as f:
        f.write(b"old" * 1000)
    with open(a, "wb") as f:
        f.write(b"new" * 1000)
    os.rename(a, b)
    assert not os.path.exists(a)
    with open(b, "rb") as f:
        assert f.read() == b"new" * 1000
    assert sorted(n for n in os.listdir(mnt) if n.startswith("ckpt")) == ["ckpt"]
    # directories: onto a non-empty one fails, into an empty one works
    os.mkdir(os.path.join(mnt, "d1"))
    os.mkdir(os.path.join(mnt, "d2"))
    with open(os.path.join(mnt, "d2", "x"), "wb") as f:
        f.write(b"x")
    with pytest.raises(OSError) as exc:
        os.rename(os.path.join(mnt, "d1"), os.path.join(mnt, "d2"))
    assert exc.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as exc:
        os.rename(os.path.join(mnt, "d2"), os.path.join(mnt, "d2", "sub"))
    assert exc.value.errno == errno.EINVAL
    os.rename(os.path.join(mnt, "d2"), os.path.join(mnt, "d1"))
    assert os.listdir(os.path.join(mnt, "d1")) == ["x"]


def test_update_op_xattr_makes_writes_add(mnt: str) -> None:
    path = os.path.join(mnt, "weights.f32")
    w = np.linspace(-1, 1, 50_000, dtype="<f4")
    with open(path, "wb") as f:
        f.write(w.tobytes())
    assert os.getxattr(path, "user.irdma.update") == b"assign"
    os.setxattr(path, "user.irdma.update", b"add")
    assert "user.irdma.update" in os.listxattr(path)
    g = np.full(50_000, 0.5, dtype="<f4")
    for _ in range(3):
        with open(path, "r+b") as f:
            f.write(g.tobytes())
    with open(path, "rb") as f:
        got = np.frombuffer(f.read(), dtype="<f4")
    np.testing.assert_array_equal(got, w + g + g + g)
    # an unknown value is refused and changes nothing
    with pytest.raises(OSError) as exc:
        os.setxattr(path, "user.irdma.update", b"multiply")
    assert exc.value.errno == errno.EINVAL
    assert os.getxattr(path, "user.irdma.update") == b"add"
    # a write that is not float32 aligned is refused on an add file
    fd = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as exc:
            os.pwrite(fd, b"\x00" * 8, 2)
        assert exc.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        np.testing.assert_array_equal(np.frombuffer(f.read(), dtype="<f4"), w + g + g + g)


def test_user_xattrs_round_trip(mnt: str) -> None:
    path = os.path.join(mnt, "tagged")
    open(path, "wb").close()
    os.setxattr(path, "user.owner", b"team-a")
    assert os.getxattr(path, "user.owner") == b"team-a"
    assert {"user.owner", "user.irdma.update", "user.irdma.chunk_size"} <= set(os.listxattr(path))
    os.removexattr(path, "user.owner")
    with pytest.raises(OSError) as exc:
        os.getxattr(path, "user.owner")
    assert exc.value.errno == errno.ENODATA


def test_chunk_size_is_settable_while_empty(mnt: str, cluster: Cluster) -> None:
    path = os.path.join(mnt, "small-chunks")
    open(path, "wb").close()
    os.setxattr(path, "user.irdma.chunk_size", b"65536")
    with open(path, "wb") as f:
        f.write(os.urandom(300_000))
    assert os.getxattr(path, "user.irdma.chunk_size") == b"65536"
    with pytest.raises(OSError) as exc:
        os.setxattr(path, "user.irdma.chunk_size", b"1048576")
    assert exc.value.errno == errno.EBUSY
    with pytest.raises(OSError) as exc:
        os.setxattr(path, "user.irdma.chunk_size", b"1000")
    assert exc.value.errno == errno.EINVAL


def test_fsync_means_the_bytes_are_on_the_shards(mnt: str, cluster: Cluster) -> None:
    path = os.path.join(mnt, "durable")
    data = os.urandom(3 << 20)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
        # still open: the native client, with no FUSE in the way, reads them from the shards
        with irdma.connect(cluster.meta_url, transport="tcp") as c:
            assert c.read("/durable") == data
    finally:
        os.close(fd)


def test_a_second_mount_sees_what_the_first_wrote(mnt: str, mnt2: str) -> None:
    data = os.urandom(5 << 20)
    with open(os.path.join(mnt, "shared.bin"), "wb") as f:
        f.write(data)
    with open(os.path.join(mnt2, "shared.bin"), "rb") as f:
        assert f.read() == data
    os.mkdir(os.path.join(mnt2, "from2"))
    assert os.path.isdir(os.path.join(mnt, "from2"))


def test_unlink_of_an_open_file(mnt: str, cluster: Cluster) -> None:
    def used() -> int:
        with irdma.connect(cluster.meta_url, transport="tcp") as c:
            return sum(st.used for _, st, _ in c.shard_stats())

    path = os.path.join(mnt, "doomed")
    data = os.urandom(9 << 20)
    with open(path, "wb") as f:
        f.write(data)
    base = used()
    f = open(path, "rb")
    try:
        os.unlink(path)
        assert not os.path.exists(path)
        assert f.read() == data  # still readable through the open descriptor
        assert used() == base  # chunks are kept while it is open
    finally:
        f.close()
    wait_until(lambda: used() <= base - (9 << 20), 10, "the unlinked file's chunks to be freed")


def test_directories_modes_and_times(mnt: str) -> None:
    d = os.path.join(mnt, "dir")
    os.mkdir(d, 0o750)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o750 & ~_umask()
    for name in ("b", "a", "c"):
        open(os.path.join(d, name), "wb").close()
    assert sorted(os.listdir(d)) == ["a", "b", "c"]
    with pytest.raises(OSError) as exc:
        os.rmdir(d)
    assert exc.value.errno == errno.ENOTEMPTY
    p = os.path.join(d, "a")
    os.chmod(p, 0o600)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)
    for name in ("a", "b", "c"):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)
    assert not os.path.exists(d)
    with pytest.raises(FileNotFoundError):
        open(os.path.join(mnt, "no", "such"), "rb")
    os.mkdir(d)
    with pytest.raises(FileExistsError):
        os.mkdir(d)
    os.rmdir(d)


def test_statfs_reports_cluster_capacity(mnt: str, cluster: Cluster) -> None:
    st = os.statvfs(mnt)
    assert st.f_blocks * st.f_frsize == 2 * (256 << 20) // 2  # two shards, two replicas of everything
    assert 0 < st.f_bavail <= st.f_blocks


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_close_to_open_a_reopen_sees_the_other_mounts_new_bytes(mnt: str, mnt2: str) -> None:
    a, b = os.path.join(mnt, "c2o.bin"), os.path.join(mnt2, "c2o.bin")
    first, second = os.urandom(1 << 20), os.urandom(1 << 20)  # same size: only mtime tells
    with open(a, "wb") as f:
        f.write(first)
    for _ in range(2):  # the second open keeps mount 2's page cache: the file did not change
        with open(b, "rb") as f:
            assert f.read() == first
    with open(a, "r+b") as f:
        f.write(second)
    with open(b, "rb") as f:
        assert f.read() == second


# ---------------------------------------------------------------- . and .. in readdir
class _Dirent(ctypes.Structure):
    _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64), ("d_reclen", ctypes.c_ushort),
                ("d_type", ctypes.c_ubyte), ("d_name", ctypes.c_char * 256)]


DT_DIR = 4


def dirents(path: str) -> dict[bytes, tuple[int, int]]:
    """Every entry readdir(3) gives, ``.`` and ``..`` included: name -> (d_ino, d_type)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.opendir.argtypes = [ctypes.c_char_p]
    libc.readdir.restype = ctypes.POINTER(_Dirent)
    libc.readdir.argtypes = [ctypes.c_void_p]
    libc.closedir.argtypes = [ctypes.c_void_p]
    d = libc.opendir(os.fsencode(path))
    if not d:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), path)
    out = {}
    try:
        while True:
            ent = libc.readdir(d)
            if not ent:
                break
            out[ent.contents.d_name] = (ent.contents.d_ino, ent.contents.d_type)
    finally:
        libc.closedir(d)
    return out


def test_readdir_lists_dot_and_dotdot(mnt: str) -> None:
    top = os.path.join(mnt, "dots")
    sub = os.path.join(top, "sub")
    os.makedirs(sub)
    with open(os.path.join(sub, "f"), "w") as f:
        f.write("x")
    root_ino = os.stat(mnt).st_ino
    got = dirents(mnt)
    assert got[b"."] == (root_ino, DT_DIR) and got[b".."] == (root_ino, DT_DIR)  # the root is its own parent
    got = dirents(top)
    assert got[b"."] == (os.stat(top).st_ino, DT_DIR)
    assert got[b".."] == (root_ino, DT_DIR)
    assert got[b"sub"][0] == os.stat(sub).st_ino
    got = dirents(sub)
    assert set(got) == {b".", b"..", b"f"}
    assert got[b"."][0] == os.stat(sub).st_ino and got[b".."][0] == os.stat(top).st_ino
    # the control tree too
    ctl = os.path.join(mnt, ".irdma")
    got = dirents(os.path.join(ctl, "barrier"))
    assert got[b".."][0] == os.stat(ctl).st_ino and got[b"."][0] == os.stat(os.path.join(ctl, "barrier")).st_ino
    assert dirents(ctl)[b".."][0] == root_ino
    assert dirents(os.path.join(top, ".irdma"))[b".."][0] == os.stat(top).st_ino  # a directory's own
    # tools: os.listdir and find hide them, ls -a shows them once each
    assert os.listdir(sub) == ["f"]
    assert sorted(os.listdir(top)) == ["sub"]
    ls = subprocess.run(["ls", "-a1", sub], capture_output=True, text=True, check=True).stdout.split()
    assert ls == [".", "..", "f"]
    found = subprocess.run(["find", top], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(found) == sorted([top, sub, os.path.join(sub, "f")])
    # a listing longer than one reply keeps every name once, the dots first
    many = os.path.join(mnt, "dots-many")
    os.mkdir(many)
    for i in range(300):
        os.close(os.open(os.path.join(many, f"file-with-a-longish-name-{i:04d}"), os.O_CREAT | os.O_WRONLY, 0o644))
    ls = subprocess.run(["ls", "-a1f", many], capture_output=True, text=True, check=True).stdout.split()
    assert ls[:2] == [".", ".."] and len(ls) == 302 and len(set(ls)) == 302
    subprocess.run(["rm", "-rf", top, many], check=True)
    assert not os.path.exists(top) and not os.path.exists(many)


# ---------------------------------------------------------------- xattrs of control files
def test_xattrs_of_control_files_are_enodata_not_enoent(mnt: str) -> None:
    """A control directory or sync object exists: asking it for an xattr it lacks is ENODATA
    (what `getfattr`, `cp -a` and the kernel's security.capability probe expect), never ENOENT."""
    for path in (os.path.join(mnt, ".irdma"), os.path.join(mnt, ".irdma", "barrier"),
                 os.path.join(mnt, ".irdma", "counter", "xattr-probe")):
        os.stat(path)  # it exists
        with pytest.raises(OSError) as info:
            os.getxattr(path, "user.irdma.update")
        assert info.value.errno == errno.ENODATA, path
        with pytest.raises(OSError) as info:
            os.getxattr(path, "security.capability")
        assert info.value.errno == errno.ENODATA, path
        assert os.listxattr(path) == []
