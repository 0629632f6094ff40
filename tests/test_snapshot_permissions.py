"""Who may take and delete snapshots through a mount (issue 36, points 9 and 10), with a second
uid: ``setpriv --reuid=65534 --regid=65534 --clear-groups`` (and 65533, 65532) against a real
mount started with ``--allow-other``, on real shard processes; the tests run as root.

- ``DIR/.snapshots`` shows ``DIR``'s mode, owner and group at every look (it kept those of its
  first lookup: looked up while ``DIR`` was 0777, nobody could still take and delete snapshots
  in it after ``chmod 0755 DIR``).
- A snapshot is its maker's (it may delete it in a sticky ``DIR``, as a file in ``/tmp``);
  ``DIR``'s owner and root may delete any; a maker who may not read a file of the tree is
  refused (EPERM: it would pin bytes it may not read); ``user.irdma.max_snapshots`` bounds how
  many ``DIR`` holds (EDQUOT)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
from collections.abc import Iterator

import pg
import pytest
from helpers import Cluster, irdma_cli, mounted, running_cluster

from irdma import _errors as E
from irdma.meta import ROOT_INO, open_meta
from irdma.meta.base import SNAPSHOTS_DIR, XATTR_MAX_SNAPSHOTS
from irdma.meta.sql import SqlMeta

NOBODY = 65534
#: Runs one change as the user it is started as, and prints "ok" or the errno's name.
OP = """
import errno, os, sys
op, path = sys.argv[1], sys.argv[2]
try:
    {"mkdir": os.mkdir, "rmdir": os.rmdir, "write": lambda p: open(p, "x").write("mine")}[op](path)
    print("ok")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path_factory.mktemp("snapperm") / "c"), shards=2, replicas=2) as c:
        yield c


@pytest.fixture(scope="module")
def mnt(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mounted(cluster.meta_url, str(tmp_path_factory.mktemp("snappermm") / "m"), allow_other=True) as m:
        yield m


def as_user(uid: int, cwd: str, op: str, path: str) -> str:
    """``op`` (mkdir, rmdir, write) of ``path`` (relative to ``cwd``) by ``uid`` with no
    supplementary group: "ok" or the errno's name. It starts in ``cwd`` (entered as root), so
    no directory above it needs to let ``uid`` through."""
    res = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                          "/usr/bin/python3", "-I", "-c", OP, op, path], cwd=cwd, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _perm(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def test_snapshots_dir_takes_its_directorys_mode_and_owner_at_every_check(mnt: str) -> None:
    d = f"{mnt}/p9"
    os.mkdir(d)
    os.chmod(d, 0o777)
    assert _perm(f"{d}/.snapshots") == (0o777, 0, 0)  # its first lookup, while DIR is 0777
    os.chmod(d, 0o755)
    assert _perm(f"{d}/.snapshots") == (0o755, 0, 0)
    os.mkdir(f"{d}/.snapshots/roots")
    assert as_user(NOBODY, d, "mkdir", ".snapshots/mine") == "EACCES"  # root's tree: no write permission
    assert as_user(NOBODY, d, "rmdir", ".snapshots/roots") == "EACCES"
    os.chown(d, NOBODY, NOBODY)
    assert _perm(f"{d}/.snapshots") == (0o755, NOBODY, NOBODY)
    assert as_user(NOBODY, d, "mkdir", ".snapshots/mine") == "ok"  # its own directory now
    with pytest.raises(OSError) as e:
        os.chmod(f"{d}/.snapshots", 0o700)  # it has no mode of its own: DIR's is changed
    assert e.value.errno == errno.EROFS
    assert sorted(os.listdir(f"{d}/.snapshots")) == ["mine", "roots"]
    assert as_user(NOBODY, d, "rmdir", ".snapshots/roots") == "ok"  # DIR's owner deletes any
    os.rmdir(f"{d}/.snapshots/mine")


def test_a_snapshot_is_its_makers_and_nobody_pins_what_it_cannot_read(mnt: str) -> None:
    d = f"{mnt}/t10"  # a shared directory, as /tmp
    os.mkdir(d)
    os.chmod(d, 0o1777)
    with open(f"{d}/secret", "wb") as f:
        f.write(b"root's key" * 1000)
    os.chmod(f"{d}/secret", 0o600)
    assert as_user(NOBODY, d, "mkdir", ".snapshots/pin") == "EPERM"  # it would keep root's 0600 file
    assert os.listdir(f"{d}/.snapshots") == []
    os.unlink(f"{d}/secret")
    assert as_user(NOBODY, d, "write", "mine") == "ok"
    assert as_user(NOBODY, d, "mkdir", ".snapshots/n1") == "ok"
    assert os.stat(f"{d}/.snapshots/n1").st_uid == NOBODY  # its maker's
    os.mkdir(f"{d}/.snapshots/r1")
    assert os.stat(f"{d}/.snapshots/r1").st_uid == 0
    assert as_user(NOBODY, d, "rmdir", ".snapshots/r1") == "EPERM"  # sticky: another's
    assert as_user(NOBODY, d, "rmdir", ".snapshots/n1") == "ok"  # its own
    os.rmdir(f"{d}/.snapshots/r1")

    e = f"{mnt}/own10"  # no sticky bit: the kernel lets any writer rmdir; the mount checks the owner
    os.mkdir(e)
    os.chown(e, NOBODY, NOBODY)
    os.chmod(e, 0o777)
    assert as_user(65533, e, "mkdir", ".snapshots/by33") == "ok"
    assert os.stat(f"{e}/.snapshots/by33").st_uid == 65533
    assert as_user(65532, e, "rmdir", ".snapshots/by33") == "EPERM"  # neither its maker nor DIR's owner
    assert as_user(NOBODY, e, "rmdir", ".snapshots/by33") == "ok"  # DIR's owner
    assert os.listdir(f"{e}/.snapshots") == []


def test_max_snapshots_bounds_a_directorys_snapshots(mnt: str, cluster: Cluster) -> None:
    d = f"{mnt}/q10"
    os.mkdir(d)
    os.chmod(d, 0o1777)
    with pytest.raises(OSError) as e:
        os.setxattr(d, "user.irdma.max_snapshots", b"many")
    assert e.value.errno == errno.EINVAL
    os.setxattr(d, "user.irdma.max_snapshots", b"2")
    assert as_user(NOBODY, d, "write", "mine") == "ok"
    assert [as_user(NOBODY, d, "mkdir", f".snapshots/s{i}") for i in (1, 2, 3)] == ["ok", "ok", "EDQUOT"]
    assert sorted(os.listdir(f"{d}/.snapshots")) == ["s1", "s2"]
    res = irdma_cli("snapshot", "create", "--meta", cluster.meta_url, "/q10", "s3", check=False)
    assert res.returncode == 1 and "user.irdma.max_snapshots is 2" in res.stderr, res.stderr
    assert sorted(os.listdir(f"{d}/.snapshots")) == ["s1", "s2"]
    # --keep deletes the oldest once the new one is made: not counted against the limit
    irdma_cli("snapshot", "create", "--meta", cluster.meta_url, "/q10", "s3", "--keep", "2")
    assert sorted(os.listdir(f"{d}/.snapshots")) == ["s2", "s3"]
    os.mkdir(f"{d}/sub")  # a limit on an ancestor bounds its subdirectories too
    os.setxattr(f"{d}/sub", "user.irdma.max_snapshots", b"5")  # (the smallest applies)
    os.mkdir(f"{d}/sub/.snapshots/a")
    os.mkdir(f"{d}/sub/.snapshots/b")
    with pytest.raises(OSError) as e:
        os.mkdir(f"{d}/sub/.snapshots/c")
    assert e.value.errno == errno.EDQUOT
    assert as_user(NOBODY, d, "rmdir", ".snapshots/s2") == "ok"  # its own: room for one more
    assert as_user(NOBODY, d, "mkdir", ".snapshots/s4") == "ok"


def test_the_directorys_owner_snapshots_what_it_holds_and_nobody_reaches_through_a_shut_directory(mnt: str) -> None:
    """Review of point 10: the read check spares the directory's owner (it may delete the file
    anyway), and counts the directories on the way: a file of a 0700 directory another user
    may not enter is not that user's to pin, whatever the file's own mode."""
    d = f"{mnt}/own6"  # nobody's directory, holding root's 0600 file (left by a sudo job)
    os.mkdir(d)
    os.chown(d, NOBODY, NOBODY)
    with open(f"{d}/roots", "wb") as f:
        f.write(b"root's" * 100)
    os.chmod(f"{d}/roots", 0o600)
    assert as_user(NOBODY, d, "mkdir", ".snapshots/mine") == "ok"  # was EPERM
    assert os.listdir(f"{d}/.snapshots/mine") == ["roots"]
    assert as_user(NOBODY, d, "rmdir", ".snapshots/mine") == "ok"

    s = f"{mnt}/shut6"  # a shared directory holding root's 0700 directory with a 0644 file
    os.mkdir(s)
    os.chmod(s, 0o1777)
    os.mkdir(f"{s}/priv")
    os.chmod(f"{s}/priv", 0o700)
    with open(f"{s}/priv/f", "wb") as f:
        f.write(b"root's" * 100)
    os.chmod(f"{s}/priv/f", 0o644)
    assert as_user(NOBODY, s, "mkdir", ".snapshots/pin") == "EPERM"  # was ok: it pinned priv/f
    assert os.listdir(f"{s}/.snapshots") == []
    os.chmod(f"{s}/priv", 0o711)  # enterable: the file is within its reach
    assert as_user(NOBODY, s, "mkdir", ".snapshots/pin") == "ok"
    os.rmdir(f"{s}/.snapshots/pin")


def test_a_clone_of_anothers_snapshot_is_the_directorys_owners(mnt: str, cluster: Cluster) -> None:
    """Review of point 10: the maker is recorded with the snapshot, not as its tree's owner: a
    clone's top directory has the snapshotted directory's owner (it had the maker's)."""
    d = f"{mnt}/shared8"  # root's shared directory
    os.mkdir(d)
    os.chmod(d, 0o1777)
    assert as_user(NOBODY, d, "write", "mine") == "ok"
    assert as_user(NOBODY, d, "mkdir", ".snapshots/nightly") == "ok"
    assert os.stat(f"{d}/.snapshots/nightly").st_uid == NOBODY  # shown as its maker's
    irdma_cli("snapshot", "clone", "--meta", cluster.meta_url, "/shared8", "nightly", "/shared8-copy")
    st = os.stat(f"{mnt}/shared8-copy")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o1777)  # was nobody's
    assert os.stat(f"{mnt}/shared8-copy/mine").st_uid == NOBODY
    listed = json.loads(irdma_cli("snapshot", "list", "--meta", cluster.meta_url, "/shared8", "--json").stdout)
    assert [(s["name"], s["maker"]) for s in listed] == [("nightly", NOBODY)]
    assert as_user(NOBODY, d, "rmdir", ".snapshots/nightly") == "ok"  # still its own to delete


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def meta_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An empty metadata database of each engine (PostgreSQL: a real server, tests/pg.py)."""
    if request.param == "sqlite":
        yield f"sqlite://{tmp_path_factory.mktemp('snapmeta')}/meta.db"
        return
    why = pg.available()
    if why:
        pytest.skip(why)
    with pg.postgres_server() as server:
        yield server.new_database()


def test_the_engines_rules_on_sqlite_and_postgresql(meta_url: str) -> None:
    """What the mount relies on, in each engine: ``.snapshots`` shows its directory's mode and
    owner (and is not made without ``create``); a snapshot's owner; a maker who may not read a
    file, or a directory at its limit, is refused with nothing written."""
    meta = open_meta(meta_url, create=True)
    assert isinstance(meta, SqlMeta)  # both engines are
    try:
        meta.add_shard("127.0.0.1:1")
        d = meta.create(ROOT_INO, b"d", stat.S_IFDIR | 0o777, 0, 0)
        f = meta.create(d.ino, b"f", stat.S_IFREG | 0o600, 0, 0)
        count = meta.usage()[0]
        with pytest.raises(E.NotFound):
            meta.snapshots_dir(d.ino, create=False)  # a read-only mount's lookup
        assert meta.usage()[0] == count
        holder = meta.snapshots_dir(d.ino)
        assert meta.snapshots_dir(d.ino, create=False).ino == holder.ino
        meta.setattr(d.ino, mode=0o1755, uid=7, gid=8)
        for shown in (meta.getattr(holder.ino), meta.lookup(d.ino, SNAPSHOTS_DIR)):
            assert (shown.mode, shown.uid, shown.gid) == (stat.S_IFDIR | 0o1755, 7, 8)
        with pytest.raises(E.ReadOnly, match="chmod or chown the directory"):
            meta.setattr(holder.ino, mode=0o700)

        with pytest.raises(E.NotPermitted, match="/d/f"):
            meta.snapshot_begin(d.ino, b"pin", owner=42, reader=(42, [42]))
        assert meta.snapshots(d.ino) == []
        meta.setattr(f.ino, mode=0o640, gid=42)  # readable by its group now
        snap, files = meta.snapshot_begin(d.ino, b"s1", owner=42, reader=(42, [42]))
        assert [x.ino for x, _ in files] == [f.ino] and meta.getattr(snap.root).uid == 42

        with pytest.raises(E.InvalidArgument):
            meta.setxattr(d.ino, XATTR_MAX_SNAPSHOTS, b"-1")
        meta.setxattr(d.ino, XATTR_MAX_SNAPSHOTS, b" 1 ")
        assert meta.getxattr(d.ino, XATTR_MAX_SNAPSHOTS) == b"1"
        with pytest.raises(E.QuotaExceeded, match="/d holds 1 snapshots"):
            meta.snapshot_begin(f.ino, b"s2")
        assert [s.name for s in meta.snapshots(d.ino)] == [b"s1"]
        meta.snapshot_begin(f.ino, b"s2", spare=1)  # one its caller deletes after (keep)
        meta.setxattr(ROOT_INO, XATTR_MAX_SNAPSHOTS, b"0")  # an ancestor's smaller limit applies
        meta.removexattr(d.ino, XATTR_MAX_SNAPSHOTS)
        with pytest.raises(E.QuotaExceeded, match="set on /"):
            meta.snapshot_begin(d.ino, b"s3", spare=5)
    finally:
        meta.close()


def test_the_engines_keep_the_maker_apart_and_check_the_way_to_each_file(meta_url: str) -> None:
    """Review of point 10, in each engine: the directory's owner is not read-checked; a file
    only under a directory the maker may not search is refused; the maker is the snapshots
    row's (shown as the top directory's owner), the tree keeps the directory's owner, so a
    clone's top directory is the directory's owner's; a database made before the column gets
    it on open (its snapshots: no maker recorded, shown as the tree's owner)."""
    meta = open_meta(meta_url, create=True)
    assert isinstance(meta, SqlMeta)
    try:
        meta.add_shard("127.0.0.1:2")  # (the module's database: the test before added :1, and a limit on /)
        with contextlib.suppress(E.NoAttribute):
            meta.removexattr(ROOT_INO, XATTR_MAX_SNAPSHOTS)
        own = meta.create(ROOT_INO, b"own", stat.S_IFDIR | 0o755, 42, 42)
        meta.create(own.ino, b"roots", stat.S_IFREG | 0o600, 0, 0)
        mine, _ = meta.snapshot_begin(own.ino, b"s", owner=42, reader=(42, [42]))  # its own directory
        assert mine.maker == 42

        d = meta.create(ROOT_INO, b"e8", stat.S_IFDIR | 0o1777, 0, 0)
        meta.create(d.ino, b"f", stat.S_IFREG | 0o644, 42, 42)
        empty = meta.create(d.ino, b"empty", stat.S_IFDIR | 0o700, 0, 0)  # shut, but holds no file
        sub = meta.create(d.ino, b"priv", stat.S_IFDIR | 0o700, 0, 0)
        deep = meta.create(sub.ino, b"deeper", stat.S_IFDIR | 0o755, 0, 0)
        meta.create(deep.ino, b"g", stat.S_IFREG | 0o644, 0, 0)
        with pytest.raises(E.NotPermitted, match="/e8/priv/deeper/g.*/e8/priv"):
            meta.snapshot_begin(d.ino, b"pin", owner=42, reader=(42, [42]))
        assert meta.snapshots(d.ino) == []
        meta.setattr(sub.ino, mode=0o750, gid=42)  # its group may enter now
        snap, files = meta.snapshot_begin(d.ino, b"n", owner=42, reader=(42, [42]))
        assert len(files) == 2 and snap.maker == 42 and empty.ino
        holder = meta.snapshots_dir(d.ino)
        assert meta.getattr(snap.root).uid == 42 and meta.lookup(holder.ino, b"n").uid == 42
        assert [(n, i.uid) for n, i in meta.readdir(holder.ino)] == [(b"n", 42)]
        assert [s.maker for s in meta.snapshots(d.ino)] == [42]
        copy, _ = meta.clone_tree(snap.root, ROOT_INO, b"copy")
        assert (copy.uid, meta.getattr(copy.ino).uid, meta.getattr(copy.ino).mode) == (0, 0, stat.S_IFDIR | 0o1777)
        by_root, _ = meta.snapshot_begin(d.ino, b"r")  # root or the CLI: no maker recorded
        assert by_root.maker is None and meta.getattr(by_root.root).uid == 0
    finally:
        meta.close()

    _drop_maker_column(meta_url)  # as a database made before the column
    meta = open_meta(meta_url)
    try:
        assert [(s.name, s.maker) for s in meta.snapshots(d.ino)] == [(b"n", None), (b"r", None)]
        assert meta.getattr(snap.root).uid == 0  # the tree's owner
        again, _ = meta.snapshot_begin(d.ino, b"m", owner=42)
        assert [s.maker for s in meta.snapshots(d.ino)] == [None, None, 42] and again.maker == 42
    finally:
        meta.close()


def _drop_maker_column(url: str) -> None:
    """Take the snapshots table back to its shape before ``maker_uid``."""
    if url.startswith("sqlite://"):
        import sqlite3

        db = sqlite3.connect(url[len("sqlite://"):])
        db.execute("ALTER TABLE snapshots DROP COLUMN maker_uid")
        db.commit()
        db.close()
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER TABLE snapshots DROP COLUMN maker_uid")
