"""The mount options operators expect (issue 24), as ``juicefs mount`` has them: ``--read-only``
(``-o ro``), ``--subdir``, ``--attr-cache``, ``--entry-cache``; the source ``irdma:URL`` and type
``fuse.irdma`` in ``/proc/mounts``; and ``mount -t fuse.irdma`` / fstab lines through the
mount(8) helper ``mount.fuse.irdma``.

A real cluster and real mounts; what is checked is what an operator would check: errno of
``os`` calls, ``/proc/mounts``, ``mount``'s exit status and message.
"""

from __future__ import annotations

import configparser
import errno
import importlib
import os
import shlex
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner
from helpers import REPO, Cluster, assert_clean_log, irdma_cli, mounted, wait_until
from irdma.fs.mount import find_mount, mount_source, unmount

from irdma.meta import open_meta
from irdma.ops.cli import cli, fstab_args

HELPER = "/sbin/mount.fuse.irdma"


@pytest.fixture(scope="module")
def tree(mnt: str) -> str:
    """/data/a.txt, /data/sub/b.txt and /outside.txt, written through a read-write mount."""
    os.makedirs(f"{mnt}/data/sub")
    for path, text in (("data/a.txt", b"alpha"), ("data/sub/b.txt", b"beta"), ("outside.txt", b"out")):
        with open(f"{mnt}/{path}", "wb") as f:
            f.write(text)
    return mnt


def proc_mounts(mountpoint: str) -> tuple[str, str, list[str]]:
    """(source, type, options) of ``mountpoint`` in /proc/mounts, as `grep` shows it."""
    with open("/proc/mounts") as f:
        for line in f:
            source, target, fstype, opts = line.split()[:4]
            if target == mountpoint:
                return source, fstype, opts.split(",")
    raise AssertionError(f"{mountpoint} is not in /proc/mounts")


def errno_of(fn: Callable[[], object]) -> int:
    try:
        fn()
    except OSError as exc:
        return exc.errno or 0
    raise AssertionError("the call succeeded")


def writes(m: str) -> dict[str, Callable[[], object]]:
    """Every kind of change, aimed at the files of ``tree`` as a mount of /data sees them."""
    return {
        "create": lambda: open(f"{m}/new", "wb"),
        "open for write": lambda: open(f"{m}/a.txt", "r+b"),
        "truncate": lambda: os.truncate(f"{m}/a.txt", 0),
        "mkdir": lambda: os.mkdir(f"{m}/d"),
        "mknod": lambda: os.mkfifo(f"{m}/fifo"),
        "symlink": lambda: os.symlink("a.txt", f"{m}/l"),
        "link": lambda: os.link(f"{m}/a.txt", f"{m}/h"),
        "unlink": lambda: os.unlink(f"{m}/a.txt"),
        "rmdir": lambda: os.rmdir(f"{m}/sub"),
        "rename": lambda: os.rename(f"{m}/a.txt", f"{m}/z.txt"),
        "chmod": lambda: os.chmod(f"{m}/a.txt", 0o600),
        "utime": lambda: os.utime(f"{m}/a.txt", (1, 1)),
        "setxattr": lambda: os.setxattr(f"{m}/a.txt", "user.x", b"1"),
        "removexattr": lambda: os.removexattr(f"{m}/a.txt", "user.x"),
    }


def test_a_read_only_mount_reads_and_refuses_every_change(cluster: Cluster, tree: str, tmp_path: object) -> None:
    m = f"{tmp_path}/ro"
    with mounted(cluster.meta_url, m, read_only=True, subdir="/data"):
        source, fstype, opts = proc_mounts(m)
        assert (source, fstype, opts[0]) == (f"irdma:{cluster.meta_url}", "fuse.irdma", "ro")
        with open(f"{m}/a.txt", "rb") as f:
            assert f.read() == b"alpha"
        assert sorted(os.listdir(m)) == ["a.txt", "sub"]
        assert {op: errno_of(fn) for op, fn in writes(m).items()} == dict.fromkeys(writes(m), errno.EROFS)
        # the kernel refuses those first; made writable under it (-i: no helper), the mount itself does
        subprocess.run(["mount", "-i", "-o", "remount,rw", m], check=True, capture_output=True)
        assert proc_mounts(m)[2][0] == "rw"
        assert {op: errno_of(fn) for op, fn in writes(m).items()} == dict.fromkeys(writes(m), errno.EROFS)
    with open(f"{tree}/data/a.txt", "rb") as f:
        assert f.read() == b"alpha"
    assert sorted(os.listdir(f"{tree}/data")) == ["a.txt", "sub"]


def test_an_unmount_returns_once_the_mount_process_has_exited(cluster: Cluster, tree: str, tmp_path: object) -> None:
    """The kernel lets go before the process has finished (its session, its read cache's disk
    writes): `irdma umount` and :func:`unmount` return when the process is gone, so a next mount
    of the same cache directory, or a look at it, sees everything the last one wrote."""
    from irdma.fs.mount import spawn_mount

    from irdma.ops._proc import pid_alive

    for i, subdir in enumerate((None, "/data")):
        m = f"{tmp_path}/gone{i}"
        os.makedirs(m)
        pid = spawn_mount(cluster.meta_url, m, transport="tcp", log_file=f"{m}.log", subdir=subdir,
                          cache_dir=f"{tmp_path}/cache{i}")
        with open(f"{m}/{'data/' if subdir is None else ''}a.txt", "rb") as f:
            assert f.read() == b"alpha"
        if i == 0:
            unmount(m)
        else:
            res = CliRunner().invoke(cli, ["umount", m])
            assert res.exit_code == 0, res.output
        assert not pid_alive(pid), "unmount returned while the mount process still ran"
        assert find_mount(m) is None
        assert_clean_log(f"{m}.log")


def test_the_source_shown_has_no_password() -> None:
    assert mount_source("postgresql://u:secret@h:5432/db") == "irdma:postgresql://u@h:5432/db"
    assert mount_source("postgres://u@h/db?password=secret&sslmode=require") == "irdma:postgres://u@h/db?sslmode=require"
    assert mount_source("sqlite:///var/lib/irdma/meta.db") == "irdma:sqlite:///var/lib/irdma/meta.db"
    assert mount_source("meta.db") == "irdma:meta.db"


def test_a_subdir_mount_sees_only_that_directory(cluster: Cluster, tree: str, tmp_path: object) -> None:
    m = f"{tmp_path}/sub"
    os.makedirs(m)
    log = f"{tmp_path}/sub.log"
    irdma_cli("mount", cluster.meta_url, m, "--subdir", "/data", "--transport", "tcp", "--log-file", log)
    try:
        assert sorted(os.listdir(m)) == ["a.txt", "sub"]
        assert not os.path.exists(f"{m}/outside.txt")
        root = os.stat(m)
        assert root.st_ino == 1 and stat.S_ISDIR(root.st_mode)
        # `..` of a directory at the top is the mount's root, and the root is its own `..`
        assert os.stat(f"{m}/sub/..").st_ino == 1 and sorted(os.listdir(f"{m}/sub/..")) == ["a.txt", "sub"]
        with open(f"{m}/sub/b.txt", "rb") as f:
            assert f.read() == b"beta"
        with open(f"{m}/made-here", "wb") as f:  # a change lands in /data of the namespace
            f.write(b"x")
        os.mkdir(f"{m}/newdir")
        assert os.path.exists(f"{tree}/data/made-here") and os.path.isdir(f"{tree}/data/newdir")
        os.rmdir(f"{m}/newdir")
        os.unlink(f"{m}/made-here")
        assert sorted(os.listdir(f"{tree}/data")) == ["a.txt", "sub"]
    finally:
        if os.path.ismount(m):
            unmount(m)


@pytest.mark.parametrize(("subdir", "says"), [("/nope", "no such directory"), ("/data/a.txt", "not a directory")])
def test_a_missing_subdir_is_one_clear_line(cluster: Cluster, tree: str, tmp_path: object, subdir: str,
                                            says: str) -> None:
    m = f"{tmp_path}/m"
    os.makedirs(m)
    res = irdma_cli("mount", cluster.meta_url, m, "--subdir", subdir, "--transport", "tcp", check=False)
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().count("\n") == 0 and f"--subdir {subdir}: {says}" in res.stderr, res.stderr
    assert find_mount(m) is None


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "3601", "soon"])
def test_bad_cache_times_are_refused(cluster: Cluster, tmp_path: object, bad: str) -> None:
    m = f"{tmp_path}/m"
    os.makedirs(m)
    for option in ("--attr-cache", "--entry-cache"):
        res = CliRunner().invoke(cli, ["mount", cluster.meta_url, m, option, bad])
        assert res.exit_code == 2 and f"Invalid value for '{option}'" in res.output, res.output
        assert find_mount(m) is None


def test_cache_times_are_what_the_kernel_uses(cluster: Cluster, tree: str, tmp_path: object) -> None:
    """--attr-cache 0: a change through another mount shows at once; --entry-cache E raises the
    namespace's unlink grace to 2E (irdma.meta.base.UNLINK_GRACE_S)."""
    m = f"{tmp_path}/c"
    with mounted(cluster.meta_url, m, attr_cache=0.0, entry_cache=3.0):
        assert os.stat(f"{m}/data/a.txt").st_mode & 0o777 == 0o644
        os.chmod(f"{tree}/data/a.txt", 0o640)
        assert os.stat(f"{m}/data/a.txt").st_mode & 0o777 == 0o640  # asked again, not cached
        os.chmod(f"{tree}/data/a.txt", 0o644)
        meta = open_meta(cluster.meta_url)
        try:
            assert meta.unlink_grace() == 6.0
        finally:
            meta.close()


def test_mount_options_become_mount_arguments() -> None:
    assert fstab_args(["sqlite:///m.db", "/mnt", "-o", "rw,_netdev,nofail,ro,subdir=/x,attr_cache=0,entry_cache=2,"
                       "x-systemd.automount,allow_other,dev,suid"]) == [
        "mount", "sqlite:///m.db", "/mnt", "--read-only", "--subdir", "/x", "--attr-cache", "0", "--entry-cache", "2",
        "--allow-other"]
    assert fstab_args(["mount", "u", "/m", "--transport", "tcp", "-o", "ro,log_file=/l"]) == [
        "mount", "u", "/m", "--transport", "tcp", "--read-only", "--log-file", "/l"]
    for bad, says in (("bogus", "unknown mount option 'bogus'"), ("subdir", "needs a value"),
                      ("ro=1", "takes no value")):
        with pytest.raises(Exception, match=says):
            fstab_args(["sqlite:///m.db", "/mnt", "-o", bad])
    res = irdma_cli("sqlite:///m.db", "/mnt", "-o", "rw,bogus", check=False)
    assert res.returncode == 1 and "unknown mount option 'bogus'" in res.stderr, res.stderr


def test_the_helper_is_a_console_script() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(f"{REPO}/setup.cfg")
    scripts = dict(line.split(" = ") for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines())
    module, _, name = scripts["mount.fuse.irdma"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))


@pytest.fixture
def helper() -> Iterator[None]:
    """``/sbin/mount.fuse.irdma`` for the test's length: the console script as pip writes it,
    running this interpreter (and this tree), removed after."""
    if os.geteuid() != 0 or not os.access(os.path.dirname(os.path.realpath(HELPER)), os.W_OK):
        pytest.skip("mount(8) with an external helper needs root and a writable /sbin")
    if os.path.lexists(HELPER):
        pytest.skip(f"{HELPER} is installed already: this test would replace it")
    env = "".join(f"export {k}={shlex.quote(os.environ[k])}\n" for k in ("PYTHONPATH", "IRDMA_TREE")
                  if k in os.environ)
    with open(HELPER, "w") as f:
        f.write(f"#!/bin/sh\n{env}exec {shlex.quote(sys.executable)} -c"
                " 'import sys; from irdma.ops.cli.mount_helper import helper_main; sys.exit(helper_main())' \"$@\"\n")
    os.chmod(HELPER, 0o755)
    try:
        yield
    finally:
        os.unlink(HELPER)


def test_mount_t_fuse_irdma_and_an_fstab_line(cluster: Cluster, tree: str, tmp_path: object, helper: None) -> None:
    m = f"{tmp_path}/t"
    os.makedirs(m)
    log = f"{tmp_path}/t.log"
    opts = f"_netdev,ro,subdir=/data,entry_cache=1,transport=tcp,log_file={log}"
    res = subprocess.run(["mount", "-t", "fuse.irdma", cluster.meta_url, m, "-o", opts + ",bogus"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "unknown mount option 'bogus'" in res.stderr, res.stderr
    assert find_mount(m) is None
    res = subprocess.run(["mount", "-t", "fuse.irdma", cluster.meta_url, m, "-o", opts],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    try:
        source, fstype, opts_seen = proc_mounts(m)
        assert (source, fstype, opts_seen[0]) == (f"irdma:{cluster.meta_url}", "fuse.irdma", "ro")
        assert sorted(os.listdir(m)) == ["a.txt", "sub"]
        assert errno_of(lambda: open(f"{m}/new", "wb")) == errno.EROFS
    finally:
        subprocess.run(["umount", m], check=True, timeout=60)
    wait_until(lambda: find_mount(m) is None, 30, f"{m} unmounted")
    # an fstab line: `mount --fstab FILE MOUNTPOINT` reads it as `mount MOUNTPOINT` reads /etc/fstab
    fstab = f"{tmp_path}/fstab"
    with open(fstab, "w") as f:
        f.write(f"{cluster.meta_url} {m} fuse.irdma _netdev,noauto,transport=tcp,log_file={log} 0 0\n")
    res = subprocess.run(["mount", "--fstab", fstab, m], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    try:
        source, fstype, opts_seen = proc_mounts(m)
        assert (source, fstype, opts_seen[0]) == (f"irdma:{cluster.meta_url}", "fuse.irdma", "rw")
        with open(f"{m}/data/a.txt", "rb") as f:
            assert f.read() == b"alpha"
    finally:
        subprocess.run(["umount", m], check=True, timeout=60)
    wait_until(lambda: find_mount(m) is None, 30, f"{m} unmounted")
    assert_clean_log(log)
