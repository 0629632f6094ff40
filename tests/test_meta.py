"""The MetaStore conformance suite: every test runs on SQLite and on PostgreSQL (a real
PostgreSQL 15 server per test session, a database per test: see tests/pg.py); namespace
rules, xattrs, the shard map, several processes. SQLite- and PostgreSQL-only checks are
marked by their names."""

from __future__ import annotations

import multiprocessing
import os
import stat
from collections.abc import Iterator

import pg
import pytest

from irdma import _errors as E
from irdma.meta import ROOT_INO, XATTR_UPDATE, open_meta
from irdma.meta.base import UNLINK_GRACE_S, MetaStore

F = stat.S_IFREG | 0o644
D = stat.S_IFDIR | 0o755
ENGINES = ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[pg.PgServer]:
    """One PostgreSQL server for the whole test session (skipped with the reason where it
    cannot run)."""
    why = pg.available()
    if why:
        pytest.skip(why)
    with pg.postgres_server() as server:
        yield server


@pytest.fixture(params=ENGINES)
def meta_url(request: pytest.FixtureRequest, tmp_path: object) -> str:
    """The URL of an empty, not yet formatted metadata database of each engine."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/meta.db"
    server: pg.PgServer = request.getfixturevalue("postgres_server")
    return server.new_database()


@pytest.fixture
def store(meta_url: str) -> Iterator[MetaStore]:
    """A new namespace with no shard registered."""
    m = open_meta(meta_url, create=True)
    yield m
    m.close()


@pytest.fixture
def meta(store: MetaStore) -> MetaStore:
    """A new namespace with two shards registered."""
    store.add_shard("127.0.0.1:1")
    store.add_shard("127.0.0.1:2")
    return store


def test_sqlite_missing_database_is_a_clear_error(tmp_path: object) -> None:
    with pytest.raises(E.NotFound, match="irdma up"):
        open_meta(f"sqlite://{tmp_path}/none.db")
    with pytest.raises(ValueError, match="sqlite"):
        open_meta("mysql://x")


def test_files_get_the_stripe_and_inherit_directory_defaults(meta: MetaStore) -> None:
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


def test_rename_replaces_a_file_and_reports_it(meta: MetaStore) -> None:
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


def test_rename_rules_for_directories(meta: MetaStore) -> None:
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


def test_bad_xattr_values_change_nothing(meta: MetaStore) -> None:
    f = meta.create(ROOT_INO, b"w", F, 0, 0)
    with pytest.raises(E.InvalidArgument, match="assign, add"):
        meta.setxattr(f.ino, XATTR_UPDATE, b"lamb")
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


def test_several_processes_share_one_database(meta: MetaStore, meta_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_creator, args=(meta_url, p)) for p in "abc"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    names = [n for n, _ in meta.readdir(ROOT_INO)]
    assert len(names) == 150 and len(set(names)) == 150
    inos = [i.ino for _, i in meta.readdir(ROOT_INO)]
    assert len(set(inos)) == 150


def test_shard_map_epoch_grows_and_addresses_are_unique(meta: MetaStore) -> None:
    e = meta.epoch()
    meta.add_shard("127.0.0.1:3")
    assert meta.epoch() == e + 1
    with pytest.raises(E.Exists):
        meta.add_shard("127.0.0.1:3")
    assert [s.shard_id for s in meta.shards()] == [1, 2, 3]


def test_a_file_needs_a_registered_shard(store: MetaStore) -> None:
    with pytest.raises(E.InvalidArgument, match="irdma up"):
        store.create(ROOT_INO, b"f", F, 0, 0)


# ---------------------------------------------------------------- POSIX objects and rules
def test_symlinks_and_special_files_are_metadata_only(meta: MetaStore) -> None:
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


def test_hard_links_count_and_the_inode_stays_until_the_last_name(meta: MetaStore) -> None:
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


def test_rename_exchange_swaps_and_moves_parent_links(meta: MetaStore) -> None:
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


def test_setgid_directories_and_setid_bits(meta: MetaStore) -> None:
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


def test_names_over_255_bytes(meta: MetaStore) -> None:
    long = b"n" * 256
    f = meta.create(ROOT_INO, b"n" * 255, F, 0, 0)
    for call in (lambda: meta.lookup(ROOT_INO, long), lambda: meta.create(ROOT_INO, long, D, 0, 0),
                 lambda: meta.mknod(ROOT_INO, long, stat.S_IFIFO | 0o644, 0, 0),
                 lambda: meta.symlink(ROOT_INO, long, b"t", 0, 0), lambda: meta.link(f.ino, ROOT_INO, long),
                 lambda: meta.rename(ROOT_INO, b"n" * 255, ROOT_INO, long)):
        with pytest.raises(E.NameTooLong):
            call()


def test_sqlite_a_database_from_before_device_and_symlink_columns_opens(tmp_path: object) -> None:
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


# ---------------------------------------------------------------- sessions (both engines)
def test_sessions_heartbeats_and_reaping(meta: MetaStore) -> None:
    sid = meta.open_session("mount-a")
    other = meta.open_session("mount-b")
    assert sid != other and [s.name for s in meta.sessions()] == ["mount-a", "mount-b"]
    s = meta.sessions()[0]
    assert s.pid == os.getpid() and s.heartbeat_ns >= s.started_ns
    meta.heartbeat(sid)
    f = meta.create(ROOT_INO, b"f", F, 0, 0)
    inode, io_mode, chunks = meta.open_inode(other, f.ino)
    assert (inode.ino, io_mode, chunks) == (f.ino, b"cached", {})
    assert meta.dead_sessions() == []
    meta.reap_session(other)
    with pytest.raises(E.NotFound, match="reaped"):
        meta.heartbeat(other)
    meta.close_session(sid)
    assert meta.sessions() == []


def test_a_file_opens_creates_and_closes_in_one_call_each(meta: MetaStore) -> None:
    """The calls a small file's open, create and close cost (issue 39): create_open makes the
    file and records it open, with its directory's inherited xattrs; open_file reads the inode,
    I/O mode, chunk map, its own xattrs and the inherited ones (the file's over its
    directory's); close_inodes drops several open records at once and says which files are
    now reclaimable; resolve_chunks resolves (or creates) a path and reads its chunk map."""
    sid = meta.open_session("mount")
    d = meta.create(ROOT_INO, b"job", D, 0, 0)
    meta.setxattr(d.ino, b"user.irdma.priority", b"3")
    meta.setxattr(d.ino, b"user.irdma.io", b"direct")
    got = meta.create_open(sid, d.ino, b"f", F, 5, 6, inherited=(b"user.irdma.priority", b"user.irdma.slice"))
    f = got.inode
    assert (f.uid, f.gid, f.size, got.io_mode, got.chunks) == (5, 6, 0, b"direct", {})
    assert got.xattrs == {b"user.irdma.priority": b"3"}
    assert meta.lookup(d.ino, b"f").ino == f.ino and got.parent == meta.getattr(d.ino)  # its new mtime
    with pytest.raises(E.Exists):
        meta.create_open(sid, d.ino, b"f", F, 0, 0)
    meta.extend(f.ino, 4096, 7, ((0, 1, 0),))
    meta.setxattr(f.ino, b"user.irdma.priority", b"1")
    meta.setxattr(f.ino, b"security.capability", b"caps")
    opened = meta.open_file(sid, f.ino, own=(b"security.capability",),
                            inherited=(b"user.irdma.priority", b"user.irdma.slice"))
    assert (opened.inode.size, opened.inode.mtime_ns, opened.chunks) == (4096, 7, {0: {1: 0}})
    assert opened.xattrs == {b"security.capability": b"caps", b"user.irdma.priority": b"1"}
    assert meta.open_file(sid, f.ino).xattrs == {}
    # open elsewhere: not reclaimable once unlinked; reclaimable when the last session closes it
    other = meta.open_session("other")
    meta.open_file(other, f.ino)
    g = meta.create_open(sid, ROOT_INO, b"g", F, 0, 0).inode
    meta.unlink(d.ino, b"f")
    out = meta.close_inodes(sid, [f.ino, g.ino, 10**9])
    assert [(ino, inode is not None, reclaim) for ino, inode, reclaim in out] == [
        (f.ino, True, False), (g.ino, True, False), (10**9, False, False)]
    assert meta.close_inodes(other, [f.ino])[0][2] is (meta.reclaimable(f.ino) is not None)
    # the native client's open: resolve (or create) and the chunk map in one call
    inode, chunks = meta.resolve_chunks("/job/h", create_mode=0o600, uid=5, gid=6, chunk_size=65536)
    assert (inode.mode, inode.chunk_size, chunks) == (F & ~0o777 | 0o600, 65536, {})
    meta.extend(inode.ino, 10, 8, ((0, 2, 0),))
    assert meta.resolve_chunks("/job/h", create_mode=0o600) == (meta.getattr(inode.ino), {0: {2: 0}})
    with pytest.raises(E.NotFound):
        meta.resolve_chunks("/job/missing")


def test_the_unlink_grace_only_rises(meta: MetaStore) -> None:
    """A mount with a longer entry cache raises it to twice that (irdma.meta.base.UNLINK_GRACE_S);
    a shorter one leaves it; an unlinked file stays openable for that long."""
    assert meta.unlink_grace() == UNLINK_GRACE_S
    assert meta.raise_unlink_grace(1.0) == UNLINK_GRACE_S
    assert meta.raise_unlink_grace(60.0) == 60.0 and meta.raise_unlink_grace(10.0) == 60.0
    assert meta.unlink_grace() == 60.0
    sid = meta.open_session("mount")
    f = meta.create(ROOT_INO, b"f", F, 0, 0)
    meta.unlink(ROOT_INO, b"f")
    assert meta.reclaimable(f.ino) is None and meta.reclaimable(f.ino, grace=False) is not None
    assert meta.open_inode(sid, f.ino)[0].ino == f.ino


# ---------------------------------------------------------------- PostgreSQL only
@pytest.fixture
def pg_url(postgres_server: pg.PgServer) -> str:
    """The URL of a new empty PostgreSQL database (with the password of its owner)."""
    return postgres_server.new_database()


@pytest.fixture
def pg_meta(pg_url: str) -> Iterator[MetaStore]:
    """A new namespace in PostgreSQL with two shards registered."""
    m = open_meta(pg_url, create=True)
    m.add_shard("127.0.0.1:1")
    m.add_shard("127.0.0.1:2")
    yield m
    m.close()


def _namespace_worker(url: str, dir_ino: int, prefix: str, rounds: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """A client on "another host": creates, links and renames its own names in a shared
    directory, and flips one shared name between ``A`` and ``B``."""
    m = open_meta(url)
    flips = 0
    try:
        for i in range(rounds):
            f = m.create(dir_ino, f"{prefix}{i}".encode(), F, 0, 0)
            m.link(f.ino, dir_ino, f"{prefix}{i}.l".encode())
            m.rename(dir_ino, f"{prefix}{i}".encode(), dir_ino, f"{prefix}{i}.r".encode())
            for src, dst in ((b"A", b"B"), (b"B", b"A")):
                try:
                    m.rename(dir_ino, src, dir_ino, dst, flags=1)  # RENAME_NOREPLACE
                    flips += 1
                    break
                except (E.NotFound, E.Exists):
                    continue
        out.put((prefix, flips, m.retries))
    finally:
        m.close()


def test_postgresql_processes_rename_create_and_link_in_one_directory(pg_meta: MetaStore, pg_url: str) -> None:
    d = pg_meta.create(ROOT_INO, b"shared", D, 0, 0)
    token = pg_meta.create(d.ino, b"A", F, 0, 0)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    rounds = 25
    procs = [ctx.Process(target=_namespace_worker, args=(pg_url, d.ino, p, rounds, out)) for p in "pq"]
    for p in procs:
        p.start()
    seen = 0
    while any(p.is_alive() for p in procs) and seen < 5000:  # a reader: one name of the token, always
        names = {n for n, _ in pg_meta.readdir(d.ino)} & {b"A", b"B"}
        assert len(names) == 1, f"the renamed file had names {names}"
        seen += 1
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    results = sorted(out.get(timeout=10) for _ in procs)
    entries = dict(pg_meta.readdir(d.ino))
    expected = {f"{p}{i}{s}".encode() for p in "pq" for i in range(rounds) for s in (".l", ".r")}
    assert set(entries) - {b"A", b"B"} == expected  # nothing lost, nothing doubled
    assert len({b"A", b"B"} & set(entries)) == 1 and {i.ino for n, i in entries.items() if n in (b"A", b"B")} == {
        token.ino}
    for p in "pq":
        for i in range(rounds):
            a, b = entries[f"{p}{i}.l".encode()], entries[f"{p}{i}.r".encode()]
            assert a.ino == b.ino and a.nlink == 2
    assert len({i.ino for i in entries.values()}) == 2 * rounds + 1  # inode numbers never shared
    assert pg_meta.getattr(d.ino).nlink == 2
    assert sum(r[1] for r in results) > 0


def _cluster_worker(url: str, ino: int, shard: int, base: int, rounds: int) -> None:
    m = open_meta(url)
    try:
        sid = m.open_session(f"w{base}")
        for i in range(rounds):
            m.heartbeat(sid)
            m.extend(ino, (base + i + 1) * 65536, i, ((base + i, shard, 7),))
            m.add_shard(f"10.0.{base}.{i}:1")
        m.close_session(sid)
    finally:
        m.close()


def test_postgresql_concurrent_heartbeats_chunk_map_and_epoch(pg_meta: MetaStore, pg_url: str) -> None:
    pg_meta.setxattr(ROOT_INO, b"user.irdma.chunk_size", b"65536")
    f = pg_meta.create(ROOT_INO, b"f", F, 0, 0)
    epoch = pg_meta.epoch()
    ctx = multiprocessing.get_context("spawn")
    rounds = 20
    procs = [ctx.Process(target=_cluster_worker, args=(pg_url, f.ino, s, b, rounds)) for s, b in ((1, 0), (2, 100))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    chunks = pg_meta.chunk_map(f.ino)
    assert chunks == {**{i: {1: 7} for i in range(rounds)}, **{100 + i: {2: 7} for i in range(rounds)}}
    assert pg_meta.getattr(f.ino).size == (100 + rounds) * 65536  # the larger end won, never shrank
    assert pg_meta.epoch() == epoch + 2 * rounds  # every bump counted once
    ids = [s.shard_id for s in pg_meta.shards()]
    assert len(ids) == len(set(ids)) == 2 + 2 * rounds
    assert pg_meta.sessions() == []


def test_postgresql_conflicting_transaction_is_retried_then_busy(pg_meta: MetaStore, pg_url: str) -> None:
    import threading

    import psycopg

    pg_meta.create(ROOT_INO, b"before", F, 0, 0)
    with psycopg.connect(pg_url, autocommit=True) as other:
        # another client's transaction holds the root's row: a create there waits, then
        # conflicts (40001) when it commits, and runs again by itself
        other.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
        other.execute("UPDATE inodes SET mtime_ns = mtime_ns + 1 WHERE ino = 1")
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(pg_meta.create(ROOT_INO, b"after", F, 0, 0)))
        retries = pg_meta.retries  # type: ignore[attr-defined]
        t.start()
        t.join(0.3)
        assert t.is_alive()  # waiting for the row lock
        other.execute("COMMIT")
        t.join(10)
        assert got and pg_meta.lookup(ROOT_INO, b"after").ino == got[0].ino  # type: ignore[attr-defined]
        assert pg_meta.retries > retries  # type: ignore[attr-defined]
        # a lock held past busy_timeout: Busy, on time
        before = pg_meta.busy_timeout  # type: ignore[attr-defined]
        pg_meta.busy_timeout = 0.5  # type: ignore[attr-defined]
        other.execute("BEGIN")
        other.execute("UPDATE inodes SET mtime_ns = mtime_ns + 1 WHERE ino = 1")
        import time

        failed: list[Exception] = []

        def blocked() -> None:
            try:
                pg_meta.create(ROOT_INO, b"blocked", F, 0, 0)
            except Exception as exc:  # noqa: BLE001 - checked below
                failed.append(exc)

        t0 = time.monotonic()
        t = threading.Thread(target=blocked, daemon=True)
        t.start()
        # The message names the setting, not the wait: that the wait is the 0.5 s just set, and
        # not the lock_timeout the connection had (the 10 s default) nor never, is this bound, half
        # of that: 10 x 0.5 s, which a loaded machine stays under.
        assert before >= 10
        t.join(before / 2)
        assert not t.is_alive(), f"the create still waits for the row lock after {before / 2:g} s"
        assert time.monotonic() - t0 >= 0.5  # it waited busy_timeout first
        assert len(failed) == 1 and isinstance(failed[0], E.Busy), failed
        assert "waited 0.5 s" in str(failed[0])
        other.execute("ROLLBACK")
    assert pg_meta.create(ROOT_INO, b"blocked", F, 0, 0).nlink == 1


def test_postgresql_unreachable_server_is_a_clear_error_on_time(caplog: pytest.LogCaptureFixture) -> None:
    import socket
    import time

    from irdma.meta.postgres import PostgresMeta

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(E.IrdmaError, match=f"127.0.0.1:{port}.*pg_hba.conf") as err:
        open_meta(f"postgresql://irdma:s3cret-pw@127.0.0.1:{port}/db")
    assert "s3cret-pw" not in str(err.value)
    with socket.socket() as silent:  # accepts connections, never answers: connect_timeout ends the wait
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(E.IrdmaError, match=f"127.0.0.1:{port}"):
            PostgresMeta(f"postgresql://irdma:s3cret-pw@127.0.0.1:{port}/db", connect_timeout=2)
        assert time.monotonic() - t0 < 6
    assert "s3cret-pw" not in caplog.text


def test_postgresql_password_is_never_shown(postgres_server: pg.PgServer, caplog: pytest.LogCaptureFixture) -> None:
    url = postgres_server.new_database()
    secret = postgres_server.password
    with pytest.raises(E.IrdmaError, match="password authentication failed") as err:
        open_meta(url.replace(secret, "wrong-" + secret[:4]), create=True)
    assert secret[:4] + "@" not in str(err.value)
    m = open_meta(url, create=True)
    try:
        shown = [m.url, repr(m), str(m), str(err.value), caplog.text]
        assert m.url == url.replace(secret, "***")
        assert all(secret not in s for s in shown)
    finally:
        m.close()
    m.close()  # twice is fine


def test_postgresql_password_from_pgpassword(postgres_server: pg.PgServer, monkeypatch: pytest.MonkeyPatch) -> None:
    url = postgres_server.new_database()
    monkeypatch.setenv("PGPASSWORD", postgres_server.password)
    bare = url.replace(":" + postgres_server.password, "")
    m = open_meta(bare, create=True)
    try:
        assert m.url == bare and m.getattr(ROOT_INO).is_dir
    finally:
        m.close()


def test_postgresql_format_an_empty_database_then_reopen(postgres_server: pg.PgServer) -> None:
    url = postgres_server.new_database()
    with pytest.raises(E.InvalidArgument, match="irdma format"):
        open_meta(url)
    m = open_meta(url, create=True)
    m.add_shard("127.0.0.1:1")
    f = m.create(ROOT_INO, b"f", F, 0, 0)
    epoch = m.epoch()
    m.close()
    for create in (False, True):  # formatting again keeps what is there
        m = open_meta(url, create=create)
        assert m.lookup(ROOT_INO, b"f").ino == f.ino and m.epoch() == epoch
        assert m.getattr(ROOT_INO).nlink == 2 and m.usage()[0] == 2 + create  # one root, f, g of the last round
        g = m.create(ROOT_INO, f"g{create}".encode(), F, 0, 0)
        assert g.ino > f.ino  # numbers go on, never reused
        m.close()
    via_socket = f"postgresql:///{url.rsplit('/', 1)[1]}?host={postgres_server.socket_dir}&port={postgres_server.port}&user=postgres"
    m = open_meta(via_socket)
    try:
        assert m.lookup(ROOT_INO, b"f").ino == f.ino
    finally:
        m.close()


def test_the_typed_async_metadata_facade_is_up_to_date() -> None:
    """irdma/meta/aio.pyi gives every ``await client.meta.NAME(...)`` the engine's signature
    (issue 21: a typed async metadata facade, not ``Any``); it must match the engines."""
    from irdma.meta import aio

    with open(aio.__file__[: -len(".py")] + ".pyi") as f:
        assert f.read() == aio.stub(), "regenerate it: python -m irdma.meta.aio > irdma/meta/aio.pyi"


def test_clocks_members_barriers_locks_and_counters_work_on_every_engine(store: MetaStore) -> None:
    """The synchronization state of training jobs (irdma.train.coord) on SQLite and on
    PostgreSQL (where every statement needs the engine call's connection)."""
    import os
    import socket

    from irdma.meta.sql import SqlMeta

    m: SqlMeta = store  # type: ignore[assignment]
    host, pid = socket.gethostname(), os.getpid()
    assert m.clock_tick(5, 0) == 1 and m.clock_tick(5, 0) == 2
    assert m.member_join(5, 1, host, pid) == 0  # worker 0 is no member yet: its clock does not count
    assert m.member_join(5, 0, host, pid) == 2  # its own clock stays
    assert m.member_join(5, 1, host, pid) == 2  # joins again at the job's clock
    assert m.member_beat(5, 0, 3)
    assert [(x.worker, x.live, x.epoch) for x in m.members(5)] == [(0, True, 3), (1, True, 0)]
    m.member_park(5, 1, "e0")
    assert m.arrivals(5, "e0") == [1]
    # leaving a job barrier: up to the clock its arrivals had, not to one reached since
    m.member_park(5, 0, "e0")
    assert m.member_join(5, 0, host, pid, barrier="e0") == 2 and m.clock_tick(5, 0) == 3
    assert m.member_join(5, 1, host, pid, barrier="e0") == 2  # not worker 0's 3: a step it never took
    m.member_leave(5, 1)
    assert not m.member_beat(5, 1) and m.members(5)[1].left
    assert m.barrier_arrive("b", 2) == (0, False) and m.barrier_arrive("b", 2) == (0, True)
    assert m.barrier_generation("b") == 1
    assert m.lock_acquire("l", "me", 5.0)[0] and not m.lock_acquire("l", "you", 5.0)[0]
    assert m.lock_release("l", "me")
    assert m.counter_add("c", 2) == 0 and m.counter_add("c", 1) == 2
    m.clock_reset(5)
    assert m.clocks(5) == {} and m.members(5) == []


def test_abandoned_snapshots_are_those_still_creating_that_began_before_a_time(meta: MetaStore) -> None:
    """``irdma gc``'s query on every engine: snapshots of any directory still ``creating`` and
    begun before the time given; a committed one, or one begun after it, is not."""
    import time

    a = meta.create(ROOT_INO, b"a", stat.S_IFDIR | 0o755, 0, 0)
    b = meta.create(ROOT_INO, b"b", stat.S_IFDIR | 0o755, 0, 0)
    left, _ = meta.snapshot_begin(a.ino, b"left")
    done, _ = meta.snapshot_begin(b.ino, b"done")
    meta.snapshot_commit(done.id, [])
    cut = time.time_ns() + 1
    later, _ = meta.snapshot_begin(b.ino, b"later")
    assert [(s.name, s.dir, s.state) for s in meta.abandoned_snapshots(cut)] == [(b"left", a.ino, "creating")]
    assert {s.name for s in meta.abandoned_snapshots(time.time_ns() + 1)} == {b"left", b"later"}
    meta.snapshot_drop(left.id)
    assert [s.name for s in meta.abandoned_snapshots(cut)] == []


def test_a_snapshot_copy_has_the_link_counts_of_its_tree(meta: MetaStore) -> None:
    """Directories: 2 + subdirectories; files: their names inside the tree (a hard link out
    of the tree is not in the copy)."""
    d = meta.create(ROOT_INO, b"job", stat.S_IFDIR | 0o755, 0, 0)
    sub = meta.create(d.ino, b"sub", stat.S_IFDIR | 0o755, 0, 0)
    meta.create(sub.ino, b"deeper", stat.S_IFDIR | 0o755, 0, 0)
    f = meta.create(d.ino, b"w", stat.S_IFREG | 0o644, 0, 0)
    meta.link(f.ino, sub.ino, b"w2")  # two names in the tree
    g = meta.create(d.ino, b"g", stat.S_IFREG | 0o644, 0, 0)
    meta.link(g.ino, ROOT_INO, b"outside")  # one name in the tree, one outside
    snap, files = meta.snapshot_begin(d.ino, b"s")
    root = meta.getattr(snap.root)
    names = dict(meta.readdir(snap.root))
    assert root.nlink == 3  # ".", its name, "sub"
    assert names[b"sub"].nlink == 3  # ".", its name, "deeper"
    assert names[b"w"].nlink == 2 and names[b"g"].nlink == 1
    assert dict(meta.readdir(names[b"sub"].ino))[b"w2"].ino == names[b"w"].ino  # one copy per inode
    assert sorted(src.ino for src, _ in files) == sorted([f.ino, g.ino])
