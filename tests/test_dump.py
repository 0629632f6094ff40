"""`irdma dump` and `irdma load`: a round trip SQLite -> PostgreSQL -> SQLite gives the same
dump line for line; loads refuse what they must (a namespace already there, an unknown format
version, a damaged or truncated dump) and change nothing; a live cluster's metadata moves from
SQLite to a real PostgreSQL and every file reads back bit-identical through a mount of it."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator

import pg
import pytest
from helpers import Cluster, assert_clean_log, irdma_cli, mounted, wait_until

from irdma import _errors as E
from irdma.meta import dump as D
from irdma.meta import open_meta
from irdma.meta.base import MetaStore
from irdma.ops import cluster

F = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755
#: Header fields that name the dump's source and time, not the namespace.
VARIES = ("engine", "source", "dumped_at")


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[pg.PgServer]:
    why = pg.available()
    if why:
        pytest.skip(why)
    with pg.postgres_server() as server:
        yield server


def dump_bytes(meta: MetaStore) -> bytes:
    buf = io.BytesIO()
    D.dump(meta, buf)
    return buf.getvalue()


def load_bytes(meta: MetaStore, data: bytes) -> D.Header:
    return D.load(meta, D.DumpReader(io.BytesIO(data)))


def same_namespace(a: bytes, b: bytes) -> None:
    """Two dumps hold the same namespace: every line equal, the header's but for VARIES."""
    la, lb = a.decode().splitlines(), b.decode().splitlines()
    ha, hb = (json.loads(x[len('"header":'):-1]) for x in (la[1], lb[1]))
    for h in (ha, hb):
        for k in VARIES:
            h.pop(k)
    assert ha == hb
    assert la[:1] + la[2:] == lb[:1] + lb[2:]


EXTRA = "CREATE TABLE extra_state(id {pk}, note TEXT, raw {blob})"


def build(meta: MetaStore) -> int:
    """A namespace with some of everything a dump holds; returns the highest inode number
    handed out (a file made and deleted last: above every inode left)."""
    a, b, c = (meta.add_shard(f"127.0.0.1:{p}").shard_id for p in (7001, 7002, 7003))
    meta.set_replicas(2)
    d = meta.create(1, b"models", DIR, 1000, 1000)
    sub = meta.create(d.ino, b"layer \xe2\x9c\x93", DIR, 1000, 1000)
    w = meta.create(sub.ino, b"weights", F, 1000, 1000)
    meta.extend(w.ino, 9 << 20, 123, ((0, a, 1), (0, b, 1), (1, b, 1), (1, c, 1), (2, a, 1), (2, c, 1)))
    meta.withdraw_replicas(w.ino, [(2, c)])  # one replica out of its chunk's in-sync set
    odd = meta.create(1, b"bad \xff\xfe name", F, 0, 0)
    meta.setxattr(odd.ino, b"user.raw", bytes(range(256)))
    meta.setxattr(odd.ino, b"user.text", "größe".encode())
    meta.setxattr(odd.ino, b"user.\xff", b"")
    meta.setxattr(d.ino, b"user.irdma.update", b"add")
    meta.symlink(1, b"latest", b"models/layer \xe2\x9c\x93/weights", 0, 0)
    meta.symlink(1, b"dangling", b"\x80\x81", 0, 0)
    meta.link(w.ino, 1, b"hardlink")
    meta.mknod(1, b"fifo", stat.S_IFIFO | 0o600, 0, 0)
    meta.counter_add("steps", 41)  # type: ignore[attr-defined]
    meta.lock_acquire("ckpt", "0@host/1/2", 3600.0)  # type: ignore[attr-defined]
    meta.member_join(d.ino, 0, "host-a", 4242)  # type: ignore[attr-defined]
    meta.clock_tick(d.ino, 0)  # type: ignore[attr-defined]
    meta.begin_move(a, [b, c], 100)
    gone = meta.create(1, b"scratch", F, 0, 0)
    meta.unlink(1, b"scratch")
    meta.delete_inode(gone.ino)
    meta.open_session("a mount")  # transient: not in a dump
    return gone.ino


def test_round_trip_sqlite_postgresql_sqlite_is_line_for_line_equal(tmp_path: object,
                                                                      postgres_server: pg.PgServer) -> None:
    src = open_meta(f"sqlite://{tmp_path}/src.db", create=True)
    src._db.execute(EXTRA.format(pk="INTEGER PRIMARY KEY AUTOINCREMENT", blob="BLOB"))  # type: ignore[attr-defined]
    last_ino = build(src)
    src._db.execute("INSERT INTO extra_state(note, raw) VALUES ('a table this module never heard of', x'00ff')")  # type: ignore[attr-defined]
    first = dump_bytes(src)
    src.close()
    doc = json.loads(first)  # one valid JSON document
    header = doc["header"]
    assert header["engine"] == "sqlite" and header["rows"] == sum(len(v) for v in doc["rows"].values())
    assert "sessions" not in doc["rows"] and "extra_state" in doc["rows"]
    assert header["counters"]["inodes.ino"] == last_ino
    names = [r[1] for r in doc["rows"]["dentries"]]
    assert {"b64": "YmFkIP/+IG5hbWU="} in names and "layer ✓" in names  # b64 only where not UTF-8

    pg_url = postgres_server.new_database()
    mid = open_meta(pg_url, create=True)
    with pytest.raises(E.InvalidArgument, match="has no table extra_state"):
        load_bytes(mid, first)
    mid._call(lambda self: self._db.execute(  # type: ignore[attr-defined]
        EXTRA.format(pk="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", blob="BYTEA")), (), {})
    assert load_bytes(mid, first).rows == header["rows"]
    second = dump_bytes(mid)
    same_namespace(first, second)
    assert json.loads(second.decode().splitlines()[1][len('"header":'):-1])["engine"] == "postgresql"
    new = mid.create(1, b"after the load", F, 0, 0)
    assert new.ino == last_ino + 1  # the sequence went on from the dump's counter
    assert mid.readlink(mid.lookup(1, b"dangling").ino) == b"\x80\x81"
    assert mid.getxattr(mid.lookup(1, b"bad \xff\xfe name").ino, b"user.raw") == bytes(range(256))
    mid.close()

    dst = open_meta(f"sqlite://{tmp_path}/dst.db", create=True)
    dst._db.execute(EXTRA.format(pk="INTEGER PRIMARY KEY AUTOINCREMENT", blob="BLOB"))  # type: ignore[attr-defined]
    load_bytes(dst, second)
    same_namespace(first, dump_bytes(dst))
    assert dst.create(1, b"after", F, 0, 0).ino == last_ino + 1
    assert dst._db.execute("INSERT INTO extra_state(note) VALUES ('x') RETURNING id").fetchone()[0] == 2  # type: ignore[attr-defined]
    dst.close()


def test_values_encode_losslessly() -> None:
    for raw in (b"", b"plain", "ünïcode ✓".encode(), b"\xff", b"\x00\x80", bytes(range(256))):
        enc = D.encode_value(raw, "bytes")
        assert isinstance(enc, str) == (raw.decode("utf-8", "ignore").encode() == raw)
        assert D.decode_value(json.loads(json.dumps(enc)), "bytes") == raw
    assert D.encode_value(None, "bytes") is None and D.encode_value(-(1 << 63), "int") == -(1 << 63)
    with pytest.raises(ValueError):
        D.decode_value({"b64": "!!"}, "bytes")
    with pytest.raises(ValueError):
        D.decode_value("1", "int")
    with pytest.raises(TypeError):
        D.encode_value("text", "bytes")


def _cli_dump(tmp_path: object) -> tuple[str, str]:
    """A namespace (see :func:`build`) and its dump by `irdma dump`: (its URL, the dump's path)."""
    src = f"sqlite://{tmp_path}/src.db"
    meta = open_meta(src, create=True)
    build(meta)
    meta.close()
    path = f"{tmp_path}/meta.json"
    res = irdma_cli("dump", src, path)
    assert "dumped" in res.stderr and " rows of " in res.stderr  # the summary line (not a terminal: no bars)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    return src, path


def body(url: str) -> list[str]:
    """The lines of a dump of ``url`` but its header."""
    meta = open_meta(url)
    try:
        lines = dump_bytes(meta).decode().splitlines()
    finally:
        meta.close()
    return lines[:1] + lines[2:]


def test_load_refuses_and_changes_nothing(tmp_path: object, postgres_server: pg.PgServer) -> None:
    src, path = _cli_dump(tmp_path)
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)

    # a namespace is there already: refused, with what to do, and it is as it was
    before = body(src)
    res = irdma_cli("load", src, path, check=False)
    assert res.returncode == 1 and "already holds a namespace" in res.stderr and "nothing was changed" in res.stderr
    assert body(src) == before

    # an unknown format version: refused before anything is made
    newer = f"{tmp_path}/v9.json"
    with open(newer, "wb") as f:
        f.writelines([lines[0].replace(b":1,", b":9,"), *lines[1:]])
    res = irdma_cli("load", f"sqlite://{tmp_path}/new.db", newer, check=False)
    assert res.returncode == 1 and "format version 9" in res.stderr
    assert not os.path.exists(f"{tmp_path}/new.db")
    with open(src.removeprefix("sqlite://"), "rb") as f, pytest.raises(E.InvalidArgument,
                                                                         match="not an irdma metadata dump"):
        D.DumpReader(f)

    # a truncated dump, and one with a row missing: refused, the empty target stays empty (and
    # a new SQLite file made for the load is removed again)
    rows = [i for i, line in enumerate(lines) if line.startswith(b"[")]
    cuts = (lines[:-4], lines[:rows[3]] + lines[rows[3] + 1:])
    bad = f"{tmp_path}/bad.json"
    with open(bad, "wb") as f:
        f.writelines(cuts[0])
    res = irdma_cli("load", f"sqlite://{tmp_path}/new.db", bad, check=False)
    assert res.returncode == 1 and "damaged or truncated" in res.stderr and "nothing was loaded" in res.stderr
    assert not os.path.exists(f"{tmp_path}/new.db")
    pg_url = postgres_server.new_database()
    for url in (f"sqlite://{tmp_path}/empty.db", pg_url):
        meta = open_meta(url, create=True)
        try:
            pristine = dump_bytes(meta).splitlines()[2:]
            for cut in cuts:
                with pytest.raises(E.InvalidArgument, match="damaged or truncated"):
                    load_bytes(meta, b"".join(cut))
                assert dump_bytes(meta).splitlines()[2:] == pristine
        finally:
            meta.close()
    # nothing was left behind in PostgreSQL: the whole dump loads there now, once
    irdma_cli("load", pg_url, path)
    assert body(pg_url) == body(src)
    meta = open_meta(pg_url)
    try:
        with pytest.raises(E.InvalidArgument, match="already holds a namespace"):
            load_bytes(meta, b"".join(lines))
    finally:
        meta.close()


def test_dump_to_stdout_load_from_stdin_and_gzip(tmp_path: object) -> None:
    src, path = _cli_dump(tmp_path)
    cmd = [sys.executable, "-m", "irdma.ops.cli"]
    out = subprocess.run([*cmd, "dump", "-q", src, "-"], capture_output=True, check=True, timeout=60)
    assert out.stderr == b"" and json.loads(out.stdout)["end"]["rows"] > 0
    res = subprocess.run([*cmd, "load", f"sqlite://{tmp_path}/piped.db", "-"], input=out.stdout,
                         capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    gz = f"{tmp_path}/meta.json.gz"
    irdma_cli("dump", f"sqlite://{tmp_path}/piped.db", gz, "--quiet")
    irdma_cli("load", f"sqlite://{tmp_path}/unzipped.db", gz)
    assert body(f"sqlite://{tmp_path}/unzipped.db") == body(src)


def test_migrate_a_live_cluster_from_sqlite_to_postgresql(tmp_path: object, postgres_server: pg.PgServer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Write through a mount of a cluster on SQLite, stop it, dump, load into PostgreSQL, start
    the shards again on their data with --meta of the PostgreSQL database (each checks its id
    and address in the loaded shard map), and read everything back through a mount of it."""
    cdir = f"{tmp_path}/cluster"
    c = Cluster(cdir, 2, 64 << 20)  # 2 shards, 2 replicas of every chunk
    hand: list[subprocess.Popen[bytes]] = []
    try:
        mnt = f"{tmp_path}/mnt"
        files: dict[bytes, bytes] = {}
        with mounted(c.meta_url, mnt):
            m = os.fsencode(mnt)
            os.makedirs(os.path.join(m, b"a/b/c"))
            for name, size in ((b"a/empty", 0), (b"a/b/one", 1), (b"a/b/c/page", 4096), (b"big", (9 << 20) + 7),
                               (b"a/caf\xe9 \xff", 1000)):
                data = os.urandom(size)
                with open(os.path.join(m, name), "wb") as f:
                    f.write(data)
                files[name] = data
            os.setxattr(os.path.join(m, b"big"), "user.tag", b"\xff\x00 binary")
            os.chmod(os.path.join(m, b"a/b/one"), 0o600)
            os.symlink(b"b/c/page", os.path.join(m, b"a/link"))
            with open(os.path.join(m, b"scratch"), "wb") as f:
                f.write(b"gone")
            scratch_ino = os.stat(os.path.join(m, b"scratch")).st_ino
            os.unlink(os.path.join(m, b"scratch"))
            seen = {name: os.stat(os.path.join(m, name)) for name in files}
        dump = f"{tmp_path}/meta.json"
        irdma_cli("dump", c.meta_url, dump)
        pg_url = postgres_server.new_database()
        irdma_cli("load", pg_url, dump)
        shards = c.shards
        c.stop()  # the SQLite cluster's shards stop (their logs are clean)

        key = cluster.key_file_of(cdir)
        for s in shards:
            port_file, log = f"{tmp_path}/port-{s.shard_id}", f"{tmp_path}/hand-{s.shard_id}.log"
            with open(log, "wb") as out:
                hand.append(subprocess.Popen(
                    [sys.executable, "-m", "irdma.ops.cli", "server", "--listen", s.address, "--meta", pg_url,
                     "--data-dir", cluster.shard_dir(cdir, s.shard_id), "--key-file", key, "--transport", "tcp",
                     "--port-file", port_file], stdout=out, stderr=subprocess.STDOUT))
            wait_until(lambda pf=port_file: os.path.exists(pf) or any(p.poll() is not None for p in hand), 30,
                       f"shard {s.shard_id} on PostgreSQL metadata")
            assert all(p.poll() is None for p in hand), open(log).read()
        monkeypatch.setenv("IRDMA_KEY_FILE", key)
        with mounted(pg_url, f"{tmp_path}/mnt2") as mnt2:
            m = os.fsencode(mnt2)
            for name, data in files.items():
                with open(os.path.join(m, name), "rb") as f:
                    assert f.read() == data, name
                st = os.stat(os.path.join(m, name))
                assert (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns) == (
                    seen[name].st_ino, seen[name].st_mode, seen[name].st_size, seen[name].st_mtime_ns)
            assert os.getxattr(os.path.join(m, b"big"), "user.tag") == b"\xff\x00 binary"
            assert os.readlink(os.path.join(m, b"a/link")) == b"b/c/page"
            assert sorted(os.listdir(os.path.join(m, b"a"))) == sorted([b"b", b"empty", b"link", b"caf\xe9 \xff"])
            assert not os.path.exists(os.path.join(m, b"scratch"))
            new = os.urandom(5 << 20)
            with open(os.path.join(m, b"a/new"), "wb") as f:
                f.write(new)
            with open(os.path.join(m, b"a/new"), "rb") as f:
                assert f.read() == new
            assert os.stat(os.path.join(m, b"a/new")).st_ino > scratch_ino  # no inode number again
        meta = open_meta(pg_url)
        try:
            ino = meta.resolve("/big").ino
            assert all(len(replicas) == 2 for replicas in meta.chunk_map(ino).values())  # both chains came along
        finally:
            meta.close()
    finally:
        for p in hand:
            p.terminate()
        for p in hand:
            p.wait(timeout=30)
        if os.path.exists(os.path.join(cdir, cluster.STATE_FILE)):
            cluster.down(cdir)
    for s in c.shards:
        assert_clean_log(f"{tmp_path}/hand-{s.shard_id}.log")


class _Sink(io.RawIOBase):
    """A write-only stream that keeps only the count of bytes written."""

    def __init__(self) -> None:
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        n = len(b)  # type: ignore[arg-type]
        self.size += n
        return n


def test_dump_and_load_stream_rather_than_hold_a_table(tmp_path: object, postgres_server: pg.PgServer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """15,000 rows (about 2 MiB of dump) in pages of 100: the Python memory a load and a dump
    take at their peak stays a fraction of the dump (a page, not a table)."""
    import tracemalloc

    from irdma.meta import dump_sql

    monkeypatch.setattr(dump_sql, "PAGE_ROWS", 100)
    monkeypatch.setattr(D, "PAGE_ROWS", 100)
    n = 5000
    src = open_meta(f"sqlite://{tmp_path}/big.db", create=True)
    c = src._db  # type: ignore[attr-defined]
    c.execute("BEGIN")
    c.executemany("INSERT INTO inodes(ino, mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns) VALUES (?,?,0,0,1,1,1,1)",
                  [(i, F) for i in range(2, n + 2)])
    c.executemany("INSERT INTO dentries VALUES (1, ?, ?)", [(b"file-%08d" % i, i) for i in range(2, n + 2)])
    c.executemany("INSERT INTO xattrs VALUES (?, ?, ?)", [(i, b"user.blob", os.urandom(200)) for i in range(2, n + 2)])
    c.execute("COMMIT")

    def peak(fn: object) -> int:
        tracemalloc.start()
        try:
            fn()  # type: ignore[operator]
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    path = f"{tmp_path}/big.json"
    with open(path, "wb") as f:  # measured on PostgreSQL below: the same code but for the cursor
        D.dump(src, f)
    peaks: list[int] = []
    src.close()
    size = os.path.getsize(path)
    assert size > 1 << 20
    dst = open_meta(postgres_server.new_database(), create=True)
    try:
        fresh = open_meta(f"sqlite://{tmp_path}/fresh.db", create=True)
        load_bytes(dst, dump_bytes(fresh))  # a new namespace's dump (so dst is still empty): the
        fresh.close()  # first COPY imports psycopg's copy machinery, which is not what is measured
        with open(path, "rb") as f:
            peaks.append(peak(lambda: D.load(dst, D.DumpReader(f))))
        again = _Sink()
        peaks.append(peak(lambda: D.dump(dst, again)))
        assert abs(again.size - size) < 200  # the header's source and engine differ
    finally:
        dst.close()
    # a page's rows, and CPython's free lists of tuples (up to 2000 per size, which tracemalloc
    # counts as live): about 0.5 MiB; holding the xattrs table alone would take more than the dump
    assert max(peaks) < size / 3, (peaks, size)
