"""The SQLite metadata engine: namespace rules, xattrs, shard map, several processes."""

from __future__ import annotations

import multiprocessing
import os
import stat

import pytest

from irdma import _errors as E
from irdma.meta import ROOT_INO, XATTR_UPDATE, open_meta
from irdma.meta.sqlite import SqliteMeta

F = stat.S_IFREG | 0o644
D = stat.S_IFDIR | 0o755


@pytest.fixture
def meta(tmp_path: object) -> SqliteMeta:
    m = open_meta(f"sqlite://{tmp_path}/meta.db", create=True)
    m.add_shard("127.0.0.1:1")
    m.add_shard("127.0.0.1:2")
    yield m  # type: ignore[misc]
    m.close()


def test_missing_database_is_a_clear_error(tmp_path: object) -> None:
    with pytest.raises(E.NotFound, match="irdma up"):
        open_meta(f"sqlite://{tmp_path}/none.db")
    with pytest.raises(ValueError, match="sqlite"):
        open_meta("postgres://x")


def test_files_get_the_stripe_and_inherit_directory_defaults(meta: SqliteMeta) -> None:
    d = meta.create(ROOT_INO, b"grads", D, 0, 0)
    meta.setxattr(d.ino, XATTR_UPDATE, b"add")
    meta.setxattr(d.ino, b"user.irdma.chunk_size", b"65536")
    f = meta.create(d.ino, b"g0", F, 0, 0)
    assert f.stripe == (1, 2) and f.update_op == "add" and f.chunk_size == 65536
    with pytest.raises(E.Exists):
        meta.create(d.ino, b"g0", F, 0, 0)
    with pytest.raises(E.InvalidArgument):
        meta.create(d.ino, b"a/b", F, 0, 0)
    with pytest.raises(E.NameTooLong):
        meta.create(d.ino, b"x" * 256, F, 0, 0)


def test_rename_replaces_a_file_and_reports_it(meta: SqliteMeta) -> None:
    a = meta.create(ROOT_INO, b"a", F, 0, 0)
    b = meta.create(ROOT_INO, b"b", F, 0, 0)
    replaced = meta.rename(ROOT_INO, b"a", ROOT_INO, b"b")
    assert replaced is not None and replaced.ino == b.ino and replaced.nlink == 0
    assert meta.lookup(ROOT_INO, b"b").ino == a.ino
    with pytest.raises(E.NotFound):
        meta.lookup(ROOT_INO, b"a")
    assert [o.ino for o in meta.orphans()] == [b.ino]
    meta.delete_inode(b.ino)
    assert meta.orphans() == []


def test_rename_rules_for_directories(meta: SqliteMeta) -> None:
    d1 = meta.create(ROOT_INO, b"d1", D, 0, 0)
    meta.create(ROOT_INO, b"d2", D, 0, 0)
    meta.create(d1.ino, b"f", F, 0, 0)
    with pytest.raises(E.NotEmpty):
        meta.rename(ROOT_INO, b"d2", ROOT_INO, b"d1")
    with pytest.raises(E.IsADirectory):
        meta.rename(d1.ino, b"f", ROOT_INO, b"d2")
    with pytest.raises(E.NotADirectory):
        meta.rename(ROOT_INO, b"d2", d1.ino, b"f")
    with pytest.raises(E.InvalidArgument):
        meta.rename(ROOT_INO, b"d1", d1.ino, b"sub")
    with pytest.raises(E.Exists):
        meta.rename(ROOT_INO, b"d1", ROOT_INO, b"d2", flags=1)
    meta.rename(ROOT_INO, b"d1", ROOT_INO, b"d2")  # onto the empty one
    assert [n for n, _ in meta.readdir(ROOT_INO)] == [b"d2"]
    assert meta.getattr(ROOT_INO).nlink == 3


def test_bad_xattr_values_change_nothing(meta: SqliteMeta) -> None:
    f = meta.create(ROOT_INO, b"w", F, 0, 0)
    with pytest.raises(E.InvalidArgument, match="assign, add"):
        meta.setxattr(f.ino, XATTR_UPDATE, b"sgd")
    assert meta.getxattr(f.ino, XATTR_UPDATE) == b"assign"
    with pytest.raises(E.NoAttribute):
        meta.getxattr(f.ino, b"user.none")
    with pytest.raises(E.NoAttribute):
        meta.removexattr(f.ino, b"user.none")


def _creator(url: str, prefix: str) -> None:
    m = open_meta(url)
    for i in range(50):
        m.create(ROOT_INO, f"{prefix}{i}".encode(), F, 0, 0)
    m.close()


def test_several_processes_share_one_database(meta: SqliteMeta) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_creator, args=(meta.url, p)) for p in "abc"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    names = [n for n, _ in meta.readdir(ROOT_INO)]
    assert len(names) == 150 and len(set(names)) == 150
    inos = [i.ino for _, i in meta.readdir(ROOT_INO)]
    assert len(set(inos)) == 150


def test_shard_map_epoch_grows_and_addresses_are_unique(meta: SqliteMeta) -> None:
    e = meta.epoch()
    meta.add_shard("127.0.0.1:3")
    assert meta.epoch() == e + 1
    with pytest.raises(E.Exists):
        meta.add_shard("127.0.0.1:3")
    assert [s.shard_id for s in meta.shards()] == [1, 2, 3]


def test_a_file_needs_a_registered_shard(tmp_path: object) -> None:
    m = open_meta(os.path.join(str(tmp_path), "m.db"), create=True)
    with pytest.raises(E.InvalidArgument, match="irdma up"):
        m.create(ROOT_INO, b"f", F, 0, 0)
    m.close()


# ---------------------------------------------------------------- POSIX objects and rules
def test_symlinks_and_special_files_are_metadata_only(meta: SqliteMeta) -> None:
    ln = meta.symlink(ROOT_INO, b"ln", b"../some/target", 7, 8)
    assert stat.S_ISLNK(ln.mode) and ln.size == len(b"../some/target") and (ln.uid, ln.gid) == (7, 8)
    assert ln.stripe == () and ln.chunk_size is None
    assert meta.readlink(ln.ino) == b"../some/target"
    fifo = meta.mknod(ROOT_INO, b"fifo", stat.S_IFIFO | 0o644, 0, 0, rdev=1234)
    assert stat.S_ISFIFO(fifo.mode) and fifo.rdev == 0 and fifo.stripe == ()
    dev = meta.mknod(ROOT_INO, b"null", stat.S_IFCHR | 0o666, 0, 0, rdev=os.makedev(1, 3))
    assert meta.lookup(ROOT_INO, b"null").rdev == os.makedev(1, 3)
    with pytest.raises(E.InvalidArgument):
        meta.readlink(dev.ino)
    with pytest.raises(E.InvalidArgument):
        meta.mknod(ROOT_INO, b"reg", F, 0, 0)
    with pytest.raises(E.InvalidArgument):
        meta.create(ROOT_INO, b"fifo2", stat.S_IFIFO | 0o644, 0, 0)
    with pytest.raises(E.NameTooLong):
        meta.symlink(ROOT_INO, b"long", b"x" * 4096, 0, 0)
    with pytest.raises(E.Exists):
        meta.symlink(ROOT_INO, b"fifo", b"t", 0, 0)
    assert meta.file_sizes().keys().isdisjoint({ln.ino, fifo.ino, dev.ino})
    # removed like files: no chunks to free, the inode goes at delete_inode
    assert meta.unlink(ROOT_INO, b"ln").nlink == 0
    meta.delete_inode(ln.ino)
    with pytest.raises(E.NotFound):
        meta.readlink(ln.ino)


def test_hard_links_count_and_the_inode_stays_until_the_last_name(meta: SqliteMeta) -> None:
    d = meta.create(ROOT_INO, b"d", D, 0, 0)
    f = meta.create(ROOT_INO, b"f", F, 0, 0)
    assert meta.link(f.ino, d.ino, b"g").nlink == 2
    assert meta.lookup(d.ino, b"g").ino == f.ino
    with pytest.raises(E.Exists):
        meta.link(f.ino, ROOT_INO, b"d")
    with pytest.raises(E.NotPermitted):
        meta.link(d.ino, ROOT_INO, b"dlink")
    assert meta.unlink(ROOT_INO, b"f").nlink == 1
    meta.delete_inode(f.ino)  # still named: left alone
    assert meta.getattr(f.ino).nlink == 1 and meta.orphans() == []
    assert meta.unlink(d.ino, b"g").nlink == 0
    with pytest.raises(E.NotFound):
        meta.link(f.ino, ROOT_INO, b"again")  # no name left: no new one either
    meta.delete_inode(f.ino)
    with pytest.raises(E.NotFound):
        meta.getattr(f.ino)


def test_rename_exchange_swaps_and_moves_parent_links(meta: SqliteMeta) -> None:
    a = meta.create(ROOT_INO, b"a", F, 0, 0)
    d1 = meta.create(ROOT_INO, b"d1", D, 0, 0)
    sub = meta.create(d1.ino, b"sub", D, 0, 0)
    assert meta.rename(ROOT_INO, b"a", d1.ino, b"sub", flags=2) is None
    assert meta.lookup(ROOT_INO, b"a").ino == sub.ino and meta.lookup(d1.ino, b"sub").ino == a.ino
    assert meta.getattr(d1.ino).nlink == 2 and meta.getattr(ROOT_INO).nlink == 4  # sub's ".." moved
    assert meta.lookup(sub.ino, b"..").ino == ROOT_INO
    with pytest.raises(E.NotFound):
        meta.rename(ROOT_INO, b"a", ROOT_INO, b"none", flags=2)
    inner = meta.create(d1.ino, b"inner", F, 0, 0)
    with pytest.raises(E.InvalidArgument):
        meta.rename(d1.ino, b"inner", ROOT_INO, b"d1", flags=2)  # d1 into itself by exchange
    with pytest.raises(E.InvalidArgument):
        meta.rename(ROOT_INO, b"a", ROOT_INO, b"d1", flags=3)
    with pytest.raises(E.InvalidArgument):
        meta.rename(ROOT_INO, b"a", ROOT_INO, b"d1", flags=4)  # RENAME_WHITEOUT
    assert meta.lookup(d1.ino, b"inner").ino == inner.ino


def test_setgid_directories_and_setid_bits(meta: SqliteMeta) -> None:
    d = meta.create(ROOT_INO, b"shared", stat.S_IFDIR | 0o2775, 0, 50)
    f = meta.create(d.ino, b"f", F, 1000, 1000)
    sub = meta.create(d.ino, b"sub", D, 1000, 1000)
    ln = meta.symlink(d.ino, b"ln", b"f", 1000, 1000)
    assert (f.uid, f.gid, ln.gid, sub.gid) == (1000, 50, 50, 50)
    assert sub.mode & stat.S_ISGID and not f.mode & stat.S_ISGID
    g = meta.create(ROOT_INO, b"g", stat.S_IFREG | 0o6755, 0, 0)
    assert stat.S_IMODE(meta.setattr(g.ino, uid=5).mode) == 0o755  # chown drops both
    meta.setattr(g.ino, mode=0o2745)  # S_ISGID without group-execute stays
    assert stat.S_IMODE(meta.setattr(g.ino, gid=6).mode) == 0o2745
    assert stat.S_IMODE(meta.setattr(g.ino, uid=7, mode=0o4755).mode) == 0o4755  # a mode given wins
    assert stat.S_IMODE(meta.clear_setid(g.ino).mode) == 0o755
    assert stat.S_IMODE(meta.setattr(sub.ino, uid=1).mode) == 0o2755  # directories keep them


def test_names_over_255_bytes(meta: SqliteMeta) -> None:
    long = b"n" * 256
    f = meta.create(ROOT_INO, b"n" * 255, F, 0, 0)
    for call in (lambda: meta.lookup(ROOT_INO, long), lambda: meta.create(ROOT_INO, long, D, 0, 0),
                 lambda: meta.mknod(ROOT_INO, long, stat.S_IFIFO | 0o644, 0, 0),
                 lambda: meta.symlink(ROOT_INO, long, b"t", 0, 0), lambda: meta.link(f.ino, ROOT_INO, long),
                 lambda: meta.rename(ROOT_INO, b"n" * 255, ROOT_INO, long)):
        with pytest.raises(E.NameTooLong):
            call()


def test_a_database_from_before_device_and_symlink_columns_opens(tmp_path: object) -> None:
    import sqlite3

    path = os.path.join(str(tmp_path), "old.db")
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE inodes(ino INTEGER PRIMARY KEY AUTOINCREMENT, mode INTEGER NOT NULL, uid INTEGER NOT NULL,
            gid INTEGER NOT NULL, size INTEGER NOT NULL DEFAULT 0, nlink INTEGER NOT NULL,
            atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
            chunk_size INTEGER, stripe TEXT NOT NULL DEFAULT '', update_op TEXT);
        INSERT INTO inodes(ino, mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns) VALUES (1, 16877, 0, 0, 2, 1, 1, 1);
    """)
    db.close()
    m = open_meta(path)
    assert m.getattr(ROOT_INO).rdev == 0
    assert m.readlink(m.symlink(ROOT_INO, b"ln", b"t", 0, 0).ino) == b"t"
    m.close()
