"""POSIX through a real mount made with ``allow_other``, as root and as an ordinary user.

The user (``irdma-test-user-PID``) is created for the session and deleted at its end; its checks
run in a forked child that drops to the user's uid, gid and groups, so they are plain ``os``
calls whose result or ``OSError`` comes back to the test (see :class:`Who`). Permission rules
(modes, the sticky bit, chmod/chown/utimensat) are the kernel's under ``default_permissions``:
these tests check that the mount gives it what it needs and does the rest itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import pickle
import pwd
import select
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from helpers import Cluster, mounted, wait_until

import irdma
from irdma.ops._proc import pid_alive

pytestmark = pytest.mark.fuse

#: The ordinary user's name: one per test session (sessions of other engineers may overlap).
USER_PREFIX = "irdma-test-user-"
USER = f"{USER_PREFIX}{os.getpid()}"
#: A group the user is given as a supplementary group (it needs no entry in /etc/group).
EXTRA_GID = 54321
#: Seconds a step run as the user may take.
USER_STEP_S = 30.0

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2

_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(old: str, new: str, flags: int) -> None:
    """rename(2) with flags (``os.rename`` has none)."""
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), old, None, new)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def utimensat(path: str, atime_ns: int, mtime_ns: int) -> None:
    """utimensat(2); a time may be UTIME_NOW or UTIME_OMIT (``os.utime`` cannot say OMIT)."""

    def ts(t: int) -> _Timespec:
        return _Timespec(0, t) if t in (UTIME_NOW, UTIME_OMIT) else _Timespec(t // 10**9, t % 10**9)

    times = (_Timespec * 2)(ts(atime_ns), ts(mtime_ns))
    if _libc.utimensat(AT_FDCWD, os.fsencode(path), times, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)


@dataclass
class Who:
    """Runs calls as one identity, in a forked child (so root's run with umask 022 too)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as this identity (umask 022); its result, or its exception raised here."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop privileges, run, report, never return into pytest
            code = 0
            try:
                os.close(r)
                os.setgroups(list(self.groups))
                os.setgid(self.gid)
                os.setuid(self.uid)
                os.umask(0o022)
                try:
                    out: tuple[str, Any] = ("ok", fn(*args))
                except BaseException as exc:  # noqa: B036 - reported to the parent
                    out = ("raise", exc)
                try:
                    data = pickle.dumps(out)
                except Exception:
                    data = pickle.dumps(("raise", RuntimeError(repr(out))))
                with os.fdopen(w, "wb") as f:
                    f.write(data)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        data = b""
        deadline = time.monotonic() + USER_STEP_S
        try:
            with os.fdopen(r, "rb") as f:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([f], [], [], left)[0]:
                        os.kill(pid, signal.SIGKILL)
                        raise AssertionError(f"{fn!r} as {self.name} took over {USER_STEP_S} s")
                    chunk = os.read(f.fileno(), 1 << 16)
                    if not chunk:
                        break
                    data += chunk
        finally:
            _, status = os.waitpid(pid, 0)
        assert data, f"{fn!r} as {self.name}: the child reported nothing (wait status {status})"
        kind, value = pickle.loads(data)
        if kind == "raise":
            raise value
        return value


@pytest.fixture(scope="session")
def user() -> Iterator[Who]:
    """An ordinary user, created for the session and deleted at its end."""
    if os.geteuid() != 0:
        pytest.fail("the POSIX tests create a user and mount with allow_other: run them as root")
    for pw in pwd.getpwall():  # left behind by interrupted runs
        pid = pw.pw_name.removeprefix(USER_PREFIX)
        if pw.pw_name.startswith(USER_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
            subprocess.run(["userdel", pw.pw_name], capture_output=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True,
                   capture_output=True)
    try:
        pw = pwd.getpwnam(USER)
        yield Who("user", pw.pw_uid, pw.pw_gid, (pw.pw_gid, EXTRA_GID))
    finally:
        subprocess.run(["userdel", USER], check=True, capture_output=True)


ROOT = Who("root", 0, 0)


@contextlib.contextmanager
def _open_mount(cluster: Cluster, allow_other: bool) -> Iterator[str]:
    """A mount in a directory every user may traverse (pytest's own temporary directories are
    0700, which would hide the mount's own answer)."""
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: FUSE tests cannot run (load the fuse module)")
    base = tempfile.mkdtemp(prefix="irdma-posix-")
    try:
        os.chmod(base, 0o755)
        with mounted(cluster.meta_url, os.path.join(base, "m"), allow_other=allow_other) as m:
            yield m
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pmnt(cluster: Cluster) -> Iterator[str]:
    """The mount these tests use: ``allow_other``."""
    with _open_mount(cluster, allow_other=True) as m:
        yield m


@pytest.fixture(scope="module")
def omnt(cluster: Cluster) -> Iterator[str]:
    """A second mount of the same namespace, without ``allow_other``."""
    with _open_mount(cluster, allow_other=False) as m:
        yield m


@pytest.fixture(params=["root", "user"])
def who(request: pytest.FixtureRequest, user: Who) -> Who:
    return ROOT if request.param == "root" else user


@pytest.fixture
def home(pmnt: str, who: Who, request: pytest.FixtureRequest) -> str:
    """A fresh directory on the mount owned by ``who`` (0755)."""
    d = os.path.join(pmnt, request.node.name.replace("[", "-").rstrip("]"))
    os.mkdir(d, 0o755)
    os.chown(d, who.uid, who.gid)
    return d


@pytest.fixture
def shared(pmnt: str, request: pytest.FixtureRequest) -> str:
    """A fresh root-owned directory on the mount (0755)."""
    d = os.path.join(pmnt, request.node.name.replace("[", "-").rstrip("]"))
    os.mkdir(d, 0o755)
    return d


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def raises_errno(code: int, fn: Callable[..., Any], *args: Any) -> None:
    with pytest.raises(OSError) as exc:
        fn(*args)
    assert exc.value.errno == code, f"{exc.value} is not {errno.errorcode[code]}"


# ---------------------------------------------------------------- the mount itself
def test_without_allow_other_only_root_may_use_the_mount(omnt: str, pmnt: str, user: Who) -> None:
    assert stat.S_ISDIR(user(os.stat, os.path.dirname(omnt)).st_mode)
    raises_errno(errno.EACCES, user, os.stat, omnt)
    assert stat.S_ISDIR(os.stat(omnt).st_mode)
    assert stat.S_ISDIR(user(os.stat, pmnt).st_mode)


def test_new_entries_belong_to_their_creator(home: str, who: Who) -> None:
    def make(d: str) -> None:
        write_file(os.path.join(d, "f"), b"mine")
        os.mkdir(os.path.join(d, "d"))
        os.symlink("f", os.path.join(d, "ln"))
        os.mkfifo(os.path.join(d, "fifo"))

    who(make, home)
    for name in ("f", "d", "ln", "fifo"):
        st = os.lstat(os.path.join(home, name))
        assert (st.st_uid, st.st_gid) == (who.uid, who.gid), name
    assert who(read_file, os.path.join(home, "f")) == b"mine"
    assert mode_of(os.path.join(home, "f")) == 0o644 and mode_of(os.path.join(home, "d")) == 0o755


# ---------------------------------------------------------------- symlinks, hard links, special files
def test_symlink_and_readlink_round_trip(home: str, who: Who) -> None:
    target, ln = os.path.join(home, "target"), os.path.join(home, "ln")
    who(write_file, target, b"through the link")
    who(os.symlink, "target", ln)
    assert who(os.readlink, ln) == "target"
    st = os.lstat(ln)
    assert stat.S_ISLNK(st.st_mode) and st.st_size == len("target")
    assert who(read_file, ln) == b"through the link"
    assert os.stat(ln).st_ino == os.stat(target).st_ino
    who(os.symlink, "../" + "x" * 200 + "/nowhere", os.path.join(home, "dangling"))
    raises_errno(errno.ENOENT, who, read_file, os.path.join(home, "dangling"))
    who(os.unlink, ln)
    assert not os.path.lexists(ln) and who(read_file, target) == b"through the link"


def test_hard_link_keeps_the_bytes_after_the_first_name_goes(home: str, who: Who) -> None:
    a, b = os.path.join(home, "a"), os.path.join(home, "b")
    data = os.urandom(5 << 20)
    who(write_file, a, data)
    who(os.link, a, b)
    assert os.stat(a).st_nlink == 2 and os.stat(a).st_ino == os.stat(b).st_ino
    who(os.unlink, a)
    assert not os.path.exists(a)
    assert os.stat(b).st_nlink == 1
    assert who(read_file, b) == data


def test_hard_linked_data_is_freed_after_the_last_name_and_the_last_handle(shared: str, cluster: Cluster) -> None:
    def used() -> int:
        with irdma.connect(cluster.meta_url, transport="tcp") as c:
            return sum(st.used for _, st, _ in c.shard_stats())

    a, b = os.path.join(shared, "a"), os.path.join(shared, "b")
    data = os.urandom(8 << 20)
    write_file(a, data)
    os.link(a, b)
    base = used()
    with open(b, "rb") as f:
        os.unlink(a)
        os.unlink(b)
        assert f.read() == data  # no name left, still open: still there
    wait_until(lambda: used() <= base - (8 << 20), 10, "the last link's chunks to be freed")


def test_no_hard_link_to_a_directory(home: str, who: Who) -> None:
    os.mkdir(os.path.join(home, "d"))
    raises_errno(errno.EPERM, who, os.link, os.path.join(home, "d"), os.path.join(home, "d2"))


def test_mkfifo_makes_a_working_fifo(home: str, who: Who) -> None:
    p = os.path.join(home, "fifo")
    who(os.mkfifo, p, 0o600)
    st = os.stat(p)
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == who.uid

    def through(path: str) -> bytes:
        r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            w = os.open(path, os.O_WRONLY)
            os.write(w, b"piped")
            os.close(w)
            return os.read(r, 100)
        finally:
            os.close(r)

    assert who(through, p) == b"piped"


def test_device_nodes_and_sockets_keep_their_type_and_rdev(shared: str) -> None:
    dev = os.path.join(shared, "null")
    os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    st = os.stat(dev)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    os.mknod(os.path.join(shared, "blk"), stat.S_IFBLK | 0o600, os.makedev(7, 0))
    assert os.stat(os.path.join(shared, "blk")).st_rdev == os.makedev(7, 0)
    sock = os.path.join(shared, "sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(sock)
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    os.mknod(os.path.join(shared, "reg"), stat.S_IFREG | 0o640)
    assert stat.S_ISREG(os.stat(os.path.join(shared, "reg")).st_mode)
    assert sorted(os.listdir(shared)) == ["blk", "null", "reg", "sock"]
    for name in os.listdir(shared):
        os.unlink(os.path.join(shared, name))
    assert os.listdir(shared) == []


# ---------------------------------------------------------------- permissions
def test_a_user_cannot_write_a_root_file_with_mode_0644(shared: str, user: Who) -> None:
    p = os.path.join(shared, "ro")
    write_file(p, b"root's")
    os.chmod(p, 0o644)
    raises_errno(errno.EACCES, user, open, p, "ab")
    raises_errno(errno.EACCES, user, write_file, os.path.join(shared, "new"), b"x")  # 0755 directory
    assert user(read_file, p) == b"root's"
    assert read_file(p) == b"root's"


def test_sticky_directory_only_owners_remove(shared: str, user: Who) -> None:
    t = os.path.join(shared, "tmp")
    os.mkdir(t)
    os.chmod(t, 0o1777)
    theirs, mine = os.path.join(t, "roots"), os.path.join(t, "users")
    write_file(theirs, b"r")
    os.chmod(theirs, 0o666)  # writable by anyone, still not removable by them
    user(write_file, mine, b"u")
    raises_errno(errno.EPERM, user, os.unlink, theirs)
    raises_errno(errno.EPERM, user, os.rename, theirs, os.path.join(t, "stolen"))
    assert read_file(theirs) == b"r"
    user(os.rename, mine, os.path.join(t, "users2"))
    user(os.unlink, os.path.join(t, "users2"))
    # the owner of the directory may remove anyone's entry; so may root
    own = os.path.join(shared, "usertmp")
    os.mkdir(own)
    os.chmod(own, 0o1777)
    os.chown(own, user.uid, user.gid)
    write_file(os.path.join(own, "roots"), b"r")
    user(os.unlink, os.path.join(own, "roots"))
    user(write_file, os.path.join(own, "users"), b"u")
    os.unlink(os.path.join(own, "users"))
    assert os.listdir(own) == [] and os.listdir(t) == ["roots"]


def test_chmod_only_by_the_owner_or_root(shared: str, user: Who) -> None:
    p, q = os.path.join(shared, "roots"), os.path.join(shared, "users")
    write_file(p, b"")
    os.chmod(p, 0o666)
    raises_errno(errno.EPERM, user, os.chmod, p, 0o777)
    assert mode_of(p) == 0o666
    write_file(q, b"")
    os.chown(q, user.uid, user.gid)
    user(os.chmod, q, 0o600)
    assert mode_of(q) == 0o600
    os.chmod(q, 0o640)
    assert mode_of(q) == 0o640


def test_chown_by_a_user_only_to_a_group_they_are_in(shared: str, user: Who) -> None:
    p = os.path.join(shared, "users")
    write_file(p, b"")
    os.chown(p, user.uid, user.gid)
    raises_errno(errno.EPERM, user, os.chown, p, 0, -1)  # give it away
    raises_errno(errno.EPERM, user, os.chown, p, -1, 0)  # a group they are not in
    user(os.chown, p, -1, EXTRA_GID)  # a supplementary group
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (user.uid, EXTRA_GID)
    os.chown(p, 0, 0)  # root may
    assert (os.stat(p).st_uid, os.stat(p).st_gid) == (0, 0)


def test_chown_clears_setuid_and_setgid(shared: str, user: Who) -> None:
    p = os.path.join(shared, "prog")
    write_file(p, b"#!/bin/sh\n")
    os.chmod(p, 0o6755)
    assert mode_of(p) == 0o6755
    os.chown(p, user.uid, user.gid)
    assert mode_of(p) == 0o755
    q = os.path.join(shared, "users-prog")  # and when the user gives it to a group of theirs
    write_file(q, b"")
    os.chown(q, user.uid, user.gid)
    user(os.chmod, q, 0o6750)
    user(os.chown, q, -1, EXTRA_GID)
    assert mode_of(q) == 0o750


@pytest.mark.parametrize("io", ["cached", "direct"])
def test_a_write_by_a_user_clears_setuid_and_setgid(shared: str, user: Who, io: str) -> None:
    p = os.path.join(shared, f"prog-{io}")
    write_file(p, b"old")
    os.setxattr(p, "user.irdma.io", io.encode())
    os.chmod(p, 0o6777)

    def overwrite(path: str) -> None:
        with open(path, "r+b") as f:
            f.write(b"new")

    user(overwrite, p)
    assert mode_of(p) == 0o777 and read_file(p) == b"new"
    os.chmod(p, 0o6777)
    user(write_file, p, b"truncated")  # an O_TRUNC open
    assert mode_of(p) == 0o777 and read_file(p) == b"truncated"
    os.chmod(p, 0o6777)
    overwrite(p)  # root keeps them
    assert mode_of(p) == 0o6777


def test_setgid_directory_passes_its_group_down(shared: str, user: Who) -> None:
    d = os.path.join(shared, "project")
    os.mkdir(d)
    os.chown(d, 0, EXTRA_GID)
    os.chmod(d, 0o2777)

    def make(path: str) -> None:
        write_file(os.path.join(path, "f"), b"x")
        os.mkdir(os.path.join(path, "sub"))
        write_file(os.path.join(path, "sub", "g"), b"y")

    user(make, d)
    f, sub, g = (os.stat(os.path.join(d, n)) for n in ("f", "sub", "sub/g"))
    assert (f.st_uid, f.st_gid) == (user.uid, EXTRA_GID)
    assert sub.st_gid == EXTRA_GID and sub.st_mode & stat.S_ISGID
    assert g.st_gid == EXTRA_GID and not f.st_mode & stat.S_ISGID
    os.mkdir(os.path.join(shared, "plain"), 0o777)
    os.chmod(os.path.join(shared, "plain"), 0o777)
    user(write_file, os.path.join(shared, "plain", "h"), b"z")
    assert os.stat(os.path.join(shared, "plain", "h")).st_gid == user.gid


# ---------------------------------------------------------------- times
def test_utimensat_now_and_omit(home: str, who: Who) -> None:
    p = os.path.join(home, "f")
    who(write_file, p, b"x")
    who(lambda: os.utime(p, ns=(1_000_000_000, 2_000_000_000)))  # explicit, as the owner
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)
    who(utimensat, p, 3_000_000_007, UTIME_OMIT)
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (3_000_000_007, 2_000_000_000)
    who(utimensat, p, UTIME_OMIT, UTIME_NOW)
    st = os.stat(p)
    assert st.st_atime_ns == 3_000_000_007 and abs(st.st_mtime_ns - time.time_ns()) < 10**10
    who(utimensat, p, UTIME_OMIT, UTIME_OMIT)  # changes nothing
    assert os.stat(p).st_atime_ns == 3_000_000_007


def test_utimensat_permissions(shared: str, user: Who) -> None:
    rw, ro = os.path.join(shared, "rw"), os.path.join(shared, "ro")
    for p, mode in ((rw, 0o666), (ro, 0o644)):
        write_file(p, b"")
        os.chmod(p, mode)
        os.utime(p, ns=(10**9, 10**9))
    user(utimensat, rw, UTIME_NOW, UTIME_NOW)  # "now" needs only write permission
    assert os.stat(rw).st_mtime_ns > 10**9
    raises_errno(errno.EPERM, user, lambda: os.utime(rw, ns=(5, 5)))  # explicit times: the owner only
    raises_errno(errno.EACCES, user, os.utime, ro)  # "now" without write permission
    assert os.stat(ro).st_mtime_ns == 10**9


# ---------------------------------------------------------------- open flags
def test_o_excl_fails_on_an_existing_name(home: str, who: Who) -> None:
    p = os.path.join(home, "once")

    def create_excl(path: str) -> None:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))

    who(create_excl, p)
    raises_errno(errno.EEXIST, who, create_excl, p)
    os.symlink("dangling", os.path.join(home, "ln"))
    raises_errno(errno.EEXIST, who, create_excl, os.path.join(home, "ln"))  # not followed


@pytest.mark.parametrize("io", ["cached", "direct"])
def test_o_append_from_two_fds_lands_at_the_end(shared: str, io: str) -> None:
    p = os.path.join(shared, f"log-{io}")
    write_file(p, b"H" * 100)
    os.setxattr(p, "user.irdma.io", io.encode())
    fds = [os.open(p, os.O_WRONLY | os.O_APPEND) for _ in range(2)]
    records, size = 150, 4096 + 3

    def append(i: int) -> None:
        rec = bytes([ord("A") + i]) * size
        for _ in range(records):
            assert os.write(fds[i], rec) == size

    try:
        threads = [threading.Thread(target=append, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for fd in fds:
            os.close(fd)
    data = read_file(p)
    assert len(data) == 100 + 2 * records * size and data[:100] == b"H" * 100
    recs = [data[i : i + size] for i in range(100, len(data), size)]
    assert all(r == r[:1] * size for r in recs)  # no record overlaps another
    assert sorted(r[:1] for r in recs) == [b"A"] * records + [b"B"] * records


def test_o_append_after_another_mount_wrote(shared: str, omnt: str, pmnt: str) -> None:
    here = os.path.join(shared, "log")
    there = os.path.join(omnt, os.path.relpath(here, pmnt))
    write_file(here, b"")
    assert os.path.getsize(here) == 0  # the kernel caches that size for a while
    fd = os.open(here, os.O_RDWR | os.O_APPEND)
    try:
        with open(there, "ab") as f:
            f.write(b"from the other mount;")
        os.write(fd, b"from here")
    finally:
        os.close(fd)
    assert read_file(here) == b"from the other mount;from here"
    assert read_file(there) == b"from the other mount;from here"


# ---------------------------------------------------------------- rename flags
def test_rename_noreplace(home: str, who: Who) -> None:
    a, b, c = (os.path.join(home, n) for n in "abc")
    who(write_file, a, b"a")
    who(write_file, b, b"b")
    raises_errno(errno.EEXIST, who, renameat2, a, b, RENAME_NOREPLACE)
    assert read_file(a) == b"a" and read_file(b) == b"b"
    who(renameat2, a, c, RENAME_NOREPLACE)
    assert not os.path.exists(a) and read_file(c) == b"a"


def test_rename_exchange_swaps_two_files(home: str, who: Who) -> None:
    a, b = os.path.join(home, "a"), os.path.join(home, "b")
    who(write_file, a, b"A" * 1000)
    who(write_file, b, b"B" * 3)
    ino_a, ino_b = os.stat(a).st_ino, os.stat(b).st_ino
    who(renameat2, a, b, RENAME_EXCHANGE)
    assert read_file(a) == b"B" * 3 and read_file(b) == b"A" * 1000
    assert (os.stat(a).st_ino, os.stat(b).st_ino) == (ino_b, ino_a)
    raises_errno(errno.ENOENT, who, renameat2, a, os.path.join(home, "none"), RENAME_EXCHANGE)


def test_rename_exchange_of_a_directory_and_a_file_across_directories(home: str, who: Who) -> None:
    d1, d2 = os.path.join(home, "d1"), os.path.join(home, "d2")
    who(os.mkdir, d1)
    who(os.mkdir, d2)
    who(os.mkdir, os.path.join(d1, "sub"))
    who(write_file, os.path.join(d1, "sub", "inside"), b"in sub")
    who(write_file, os.path.join(d2, "f"), b"file")
    assert (os.stat(d1).st_nlink, os.stat(d2).st_nlink) == (3, 2)
    who(renameat2, os.path.join(d1, "sub"), os.path.join(d2, "f"), RENAME_EXCHANGE)
    assert read_file(os.path.join(d1, "sub")) == b"file"
    assert read_file(os.path.join(d2, "f", "inside")) == b"in sub"
    assert (os.stat(d1).st_nlink, os.stat(d2).st_nlink) == (2, 3)
    assert os.stat(os.path.join(d2, "f", "..")).st_ino == os.stat(d2).st_ino
    raises_errno(errno.EINVAL, who, renameat2, d2, os.path.join(d2, "f", "inside"), RENAME_EXCHANGE)


# ---------------------------------------------------------------- names
LONG = "n" * 256


@pytest.mark.parametrize("call", [
    pytest.param(lambda d: write_file(os.path.join(d, LONG), b""), id="create"),
    pytest.param(lambda d: os.mkdir(os.path.join(d, LONG)), id="mkdir"),
    pytest.param(lambda d: os.mkfifo(os.path.join(d, LONG)), id="mknod"),
    pytest.param(lambda d: os.symlink("t", os.path.join(d, LONG)), id="symlink"),
    pytest.param(lambda d: os.link(os.path.join(d, "ok"), os.path.join(d, LONG)), id="link"),
    pytest.param(lambda d: os.rename(os.path.join(d, "ok"), os.path.join(d, LONG)), id="rename"),
    pytest.param(lambda d: os.stat(os.path.join(d, LONG)), id="lookup"),
])
def test_names_longer_than_255_bytes(home: str, who: Who, call: Callable[[str], None]) -> None:
    who(write_file, os.path.join(home, "ok"), b"")
    raises_errno(errno.ENAMETOOLONG, who, call, home)
    who(write_file, os.path.join(home, "n" * 255), b"at the limit")
    assert sorted(os.listdir(home)) == ["n" * 255, "ok"]
