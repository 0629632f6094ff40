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
