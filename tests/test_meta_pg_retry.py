"""PostgreSQL metadata through lost connections (issue 25, the client's part): every write
carries a transaction id, so a call whose COMMIT got no answer is settled by looking the id up,
never applied twice and never reported failed when it landed; calls wait for a server that
restarts; multi-host URLs.

A real PostgreSQL 15 per module (tests/pg.py) and a proxy that cuts a connection at a chosen
protocol message (tests/pgproxy.py): inside the transaction (``begin``), with the COMMIT
dropped before the server saw it (``commit-unsent``), and with the server's answer to the
COMMIT dropped after it committed (``commit-answered``).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pg
import pytest
from helpers import irdma_cli, wait_until
from pgproxy import Cut, PgProxy

from irdma import _errors as E
from irdma.meta import ROOT_INO, open_meta
from irdma.meta.base import MetaStore
from irdma.meta.postgres import PostgresMeta, server_of, split_failover

F = stat.S_IFREG | 0o644
D = stat.S_IFDIR | 0o755
CUTS: list[Cut] = ["begin", "commit-unsent", "commit-answered"]


@pytest.fixture(scope="module")
def server() -> Iterator[pg.PgServer]:
    """A PostgreSQL server of this module's own (one test restarts it)."""
    why = pg.available()
    if why:
        pytest.skip(why)
    with pg.postgres_server() as s:
        yield s


@pytest.fixture(scope="module")
def db_url(server: pg.PgServer) -> str:
    """A formatted namespace with two shards registered (tests work in directories of their own)."""
    url = server.new_database()
    m = open_meta(url, create=True)
    try:
        m.add_shard("127.0.0.1:1")
        m.add_shard("127.0.0.1:2")
    finally:
        m.close()
    return url


@pytest.fixture
def proxy(server: pg.PgServer) -> Iterator[PgProxy]:
    with PgProxy(server.port) as p:
        yield p


@pytest.fixture
def meta(proxy: PgProxy, db_url: str) -> Iterator[PostgresMeta]:
    """The namespace through the proxy."""
    m = PostgresMeta(proxy.url(db_url), failover_timeout=20)
    yield m
    m.close()


def _names(m: MetaStore, d: int) -> list[bytes]:
    return [n for n, _ in m.readdir(d)]


class Op(NamedTuple):
    """One kind of metadata write: what it needs first, the call, and the check that its
    effect is there exactly once (a second application would change the state or raise)."""

    setup: Callable[[MetaStore, int, str], dict[str, Any]]
    call: Callable[[MetaStore, int, dict[str, Any]], Any]
    check: Callable[[MetaStore, int, dict[str, Any], Any], None]


def _none(m: MetaStore, d: int, key: str) -> dict[str, Any]:
    return {"key": key}


def _file(m: MetaStore, d: int, key: str) -> dict[str, Any]:
    return {"key": key, "f": m.create(d, b"f", F, 0, 0)}


def _check_create(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    entries = dict(m.readdir(d))
    assert list(entries) == [b"f"] and entries[b"f"].ino == got.ino and got.nlink == 1
    assert m.getattr(d).nlink == 2


def _check_mkdir(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert _names(m, d) == [b"sub"] and m.lookup(d, b"sub").ino == got.ino and got.is_dir
    assert m.getattr(d).nlink == 3  # the parent gained one ".." link, not two


def _check_mknod(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert _names(m, d) == [b"p"] and stat.S_ISFIFO(m.lookup(d, b"p").mode) and m.lookup(d, b"p").ino == got.ino


def _check_symlink(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert _names(m, d) == [b"s"] and m.readlink(got.ino) == b"target"


def _link_setup(m: MetaStore, d: int, key: str) -> dict[str, Any]:
    ctx = _file(m, d, key)
    m.link(ctx["f"].ino, d, b"l")
    return ctx


def _check_link(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got.nlink == 2 and m.getattr(ctx["f"].ino).nlink == 2 and _names(m, d) == [b"f", b"l"]


def _check_unlink(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got.ino == ctx["f"].ino and got.nlink == 1
    assert m.getattr(ctx["f"].ino).nlink == 1 and _names(m, d) == [b"f"]


def _check_rmdir(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got is None and _names(m, d) == [] and m.getattr(d).nlink == 2


def _check_rename(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got is None and _names(m, d) == [b"g"] and m.lookup(d, b"g").ino == ctx["f"].ino


def _replace_setup(m: MetaStore, d: int, key: str) -> dict[str, Any]:
    return {**_file(m, d, key), "g": m.create(d, b"g", F, 0, 0)}


def _check_replace(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got.ino == ctx["g"].ino and got.nlink == 0  # the replaced file, its last name gone
    assert _names(m, d) == [b"g"] and m.lookup(d, b"g").ino == ctx["f"].ino


def _check_setattr(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert stat.S_IMODE(got.mode) == 0o600 and got.size == 5 and m.getattr(ctx["f"].ino) == got


def _check_extend(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got.size == 100 and m.getattr(ctx["f"].ino).size == 100 and m.chunk_map(ctx["f"].ino) == {0: {1: 7}}


def _check_setxattr(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got is None and m.getxattr(d, b"user.k") == b"v" and m.listxattr(d) == [b"user.k"]


def _xattr_setup(m: MetaStore, d: int, key: str) -> dict[str, Any]:
    m.setxattr(d, b"user.k", b"v")
    return {"key": key}


def _check_removexattr(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got is None and m.listxattr(d) == []


def _check_tick(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got == 1 and m.clocks(d) == {0: 1}


def _check_arrive(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got == (0, False) and m.barrier_state(ctx["key"]) == (0, 1, 3)


def _check_lock(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got[:2] == (True, "me") and m.lock_state(ctx["key"]) == ("me", got[2])


def _check_counter(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got == 0 and m.counter_add(ctx["key"], 0) == 5


def _join_setup(m: MetaStore, d: int, key: str) -> dict[str, Any]:
    m.member_join(d, 1, socket.gethostname(), os.getpid())
    m.clock_tick(d, 1)
    m.clock_tick(d, 1)
    return {"key": key}


def _check_join(m: MetaStore, d: int, ctx: dict[str, Any], got: Any) -> None:
    assert got == 2  # it starts at the live member's clock
    assert [w.worker for w in m.members(d)] == [0, 1] and m.clocks(d) == {0: 2, 1: 2}


OPS: dict[str, Op] = {
    "create": Op(_none, lambda m, d, c: m.create(d, b"f", F, 0, 0), _check_create),
    "mkdir": Op(_none, lambda m, d, c: m.create(d, b"sub", D, 0, 0), _check_mkdir),
    "mknod": Op(_none, lambda m, d, c: m.mknod(d, b"p", stat.S_IFIFO | 0o644, 0, 0), _check_mknod),
    "symlink": Op(_none, lambda m, d, c: m.symlink(d, b"s", b"target", 0, 0), _check_symlink),
    "link": Op(_file, lambda m, d, c: m.link(c["f"].ino, d, b"l"), _check_link),
    "unlink": Op(_link_setup, lambda m, d, c: m.unlink(d, b"l"), _check_unlink),
    "rmdir": Op(lambda m, d, k: {"sub": m.create(d, b"sub", D, 0, 0)}, lambda m, d, c: m.rmdir(d, b"sub"),
                _check_rmdir),
    "rename": Op(_file, lambda m, d, c: m.rename(d, b"f", d, b"g"), _check_rename),
    "rename-replace": Op(_replace_setup, lambda m, d, c: m.rename(d, b"f", d, b"g"), _check_replace),
    "setattr": Op(_file, lambda m, d, c: m.setattr(c["f"].ino, mode=0o600, size=5), _check_setattr),
    "extend": Op(_file, lambda m, d, c: m.extend(c["f"].ino, 100, 7, ((0, 1, 7),)), _check_extend),
    "setxattr": Op(_none, lambda m, d, c: m.setxattr(d, b"user.k", b"v"), _check_setxattr),
    "removexattr": Op(_xattr_setup, lambda m, d, c: m.removexattr(d, b"user.k"), _check_removexattr),
    "clock_tick": Op(_none, lambda m, d, c: m.clock_tick(d, 0), _check_tick),
    "barrier_arrive": Op(_none, lambda m, d, c: m.barrier_arrive(c["key"], 3), _check_arrive),
    "lock_acquire": Op(_none, lambda m, d, c: m.lock_acquire(c["key"], "me", 60.0), _check_lock),
    "counter_add": Op(_none, lambda m, d, c: m.counter_add(c["key"], 5), _check_counter),
    "member_join": Op(_join_setup, lambda m, d, c: m.member_join(d, 0, socket.gethostname(), os.getpid()),
                      _check_join),
}


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("op", list(OPS))
def test_a_write_whose_connection_is_cut_is_applied_exactly_once(
        meta: PostgresMeta, proxy: PgProxy, op: str, cut: Cut) -> None:
    """The call returns what it computed, its effect is there once, and the transaction id
    settled the commits whose answer was lost (found when it landed, run again when not)."""
    key = f"{op}-{cut}"
    d = meta.create(ROOT_INO, key.encode(), D, 0, 0).ino
    spec = OPS[op]
    ctx = spec.setup(meta, d, key)
    before = (meta.commits_resolved, meta.commits_landed, meta.reconnects)
    proxy.cut_next(cut)
    got = spec.call(meta, d, ctx)
    assert proxy.cuts == 1, "the call sent no message the cut waits for"
    spec.check(meta, d, ctx, got)
    resolved, landed = meta.commits_resolved - before[0], meta.commits_landed - before[1]
    assert (resolved, landed) == {"begin": (0, 0), "commit-unsent": (1, 0), "commit-answered": (1, 1)}[cut]
    assert meta.reconnects > before[2]


@pytest.mark.parametrize("cut", ["commit-unsent", "commit-answered"])
def test_a_cut_that_leaves_the_server_process_running(meta: PostgresMeta, proxy: PgProxy, db_url: str,
                                                      cut: Cut, caplog: pytest.LogCaptureFixture) -> None:
    """The client's side of the connection is gone but the server's process still runs (idle
    after its commit, or idle in its transaction holding its locks): the call stops that
    process before it looks its transaction id up, so the answer is final, and the rerun does
    not wait for the old transaction's locks."""
    import psycopg

    caplog.set_level(logging.INFO, "irdma.meta")
    key = f"kept-{cut}"
    assert meta.counter_add(key, 1) == 0
    proxy.cut_next(cut, keep_server=True)
    t0 = time.monotonic()
    assert meta.counter_add(key, 5) == 1
    assert proxy.cuts == 1 and time.monotonic() - t0 < meta.busy_timeout
    assert meta.counter_add(key, 0) == 6
    assert (meta.commits_resolved, meta.commits_landed) == (1, int(cut == "commit-answered"))
    assert "stopping server process" in caplog.text
    with psycopg.connect(db_url, autocommit=True) as conn:  # the old process was stopped, not left behind
        rows = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                            " AND state LIKE 'idle in transaction%'").fetchone()
        assert rows == (0,)


def test_a_read_only_transaction_and_a_read_are_run_again(meta: PostgresMeta, proxy: PgProxy) -> None:
    """shard_view commits without a transaction id (nothing to apply twice): a lost answer
    to its COMMIT runs it again; a read on a cut connection too."""
    epoch = meta.epoch()
    proxy.cut_next("commit-answered")
    assert meta.shard_view()[0] == epoch and proxy.cuts == 1
    assert meta.commits_resolved == 0
    proxy.refuse(True)  # every pooled connection cut
    proxy.refuse(False)
    assert meta.getattr(ROOT_INO).is_dir and meta.reconnects >= 2


def test_calls_wait_for_a_server_that_comes_back_then_fail_after_the_deadline(
        meta: PostgresMeta, proxy: PgProxy, caplog: pytest.LogCaptureFixture) -> None:
    proxy.refuse(True)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(meta.counter_add("waits", 1)))
    t.start()
    try:
        wait_until(lambda: meta.reconnects >= 3, 15, "the call to try the lost server again")
        assert t.is_alive() and not got  # waiting, not failed
    finally:
        proxy.refuse(False)
        t.join(30)
    assert got == [0] and meta.counter_add("waits", 0) == 1
    assert "lost the connection" in caplog.text and "answers again" in caplog.text

    before, meta.failover_timeout = meta.failover_timeout, 1.0
    proxy.refuse(True)
    failed: list[Exception] = []

    def gives_up() -> None:
        try:
            meta.counter_add("waits", 1)
        except Exception as exc:  # noqa: BLE001 - checked below
            failed.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=gives_up, daemon=True)
    t.start()
    # The message names the setting, not the wait: that the wait is the 1 s just set, and not the
    # fixture's 20 s (nor never), is this bound, the deadline x 5 + 10 s, which a loaded machine
    # stays under.
    assert before == 20
    t.join(meta.failover_timeout * 5 + 10)
    assert not t.is_alive(), "the call still waits for the lost server past its 1 s deadline"
    assert time.monotonic() - t0 >= 0.9  # it waited its deadline first
    (err,) = failed
    assert isinstance(err, E.MetadataError) and "did not answer again within 1 s" in str(err), repr(err)
    assert "failover_timeout=SECONDS" in err.hint and "target_session_attrs=read-write" in err.hint
    proxy.refuse(False)
    assert meta.counter_add("waits", 0) == 1  # the failed call changed nothing


def test_a_commit_whose_outcome_cannot_be_settled_says_so(meta: PostgresMeta, proxy: PgProxy) -> None:
    """The COMMIT's answer is lost and the server stays away past the deadline: the error says
    that the outcome is unknown (never a guess either way)."""
    meta.failover_timeout = 1.0
    proxy.cut_next("commit-answered")
    real_landed = meta._landed

    def away(*args: Any) -> bool:  # the server goes away right after the cut
        proxy.refuse(True)
        return bool(real_landed(*args))

    meta._landed = away  # type: ignore[method-assign]
    try:
        with pytest.raises(E.MetadataError, match="whether the operation's commit landed is unknown"):
            meta.counter_add("unsettled", 1)
    finally:
        del meta._landed
        proxy.refuse(False)
    assert meta.counter_add("unsettled", 0) == 1  # it had landed, once


def test_a_server_restart_in_a_series_of_calls(server: pg.PgServer, db_url: str) -> None:
    """pg_ctl restart, three times, while two writers run: every call returns success, none is
    applied twice (each fetch-and-add returned a different old value, each clock went up by one
    per tick, each file has one name and one inode)."""
    m = PostgresMeta(db_url, failover_timeout=60)
    try:
        d = m.create(ROOT_INO, b"restart", D, 0, 0).ino
        done: list[tuple[int, int, int, int]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def writer(worker: int) -> None:
            i = 0
            try:
                while not stop.is_set():
                    name = f"w{worker}-{i}".encode()
                    f = m.create(d, name, F, 0, 0)
                    old = m.counter_add("restart", 1)
                    clock = m.clock_tick(d, worker)
                    m.rename(d, name, d, name + b".r")
                    m.setxattr(f.ino, b"user.i", str(i).encode())
                    done.append((worker, f.ino, old, clock))
                    i += 1
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        def ten_more(n: int) -> bool:
            return len(done) >= n + 10 or bool(errors)

        threads = [threading.Thread(target=writer, args=(w,)) for w in (0, 1)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: len(done) >= 10 or bool(errors), 60, "calls before the restart")
            for _ in range(3):
                server.restart()
                wait_until(functools.partial(ten_more, len(done)), 90, "calls after the restart")
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert not errors, errors
        assert m.reconnects >= 3  # every restart was seen
        print(f"{len(done)} rounds, {m.reconnects} reconnects, {m.commits_resolved} commits settled by id"
              f" ({m.commits_landed} landed)")
        assert sorted(old for _, _, old, _ in done) == list(range(len(done)))
        assert m.counter_add("restart", 0) == len(done)
        for w in (0, 1):
            ticks = [clock for worker, _, _, clock in done if worker == w]
            assert ticks == list(range(1, len(ticks) + 1))
        assert m.clocks(d) == {w: sum(1 for x in done if x[0] == w) for w in (0, 1) if any(x[0] == w for x in done)}
        entries = dict(m.readdir(d))
        assert set(entries) == {f"w{w}-{i}.r".encode() for w in (0, 1) for i in range(sum(x[0] == w for x in done))}
        assert {e.ino for e in entries.values()} == {ino for _, ino, _, _ in done}
        assert all(e.nlink == 1 for e in entries.values())
    finally:
        m.close()


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_multi_host_url_whose_first_host_is_dead(server: pg.PgServer, db_url: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    dead = _dead_port()
    url = db_url.replace(f"127.0.0.1:{server.port}", f"127.0.0.1:{dead},127.0.0.1:{server.port}")
    url += "?target_session_attrs=read-write&failover_timeout=45"
    m = open_meta(url)
    try:
        assert isinstance(m, PostgresMeta)
        assert m.server == f"127.0.0.1:{dead}, 127.0.0.1:{server.port}" and m.failover_timeout == 45
        d = m.create(ROOT_INO, b"multi", D, 0, 0)
        assert m.lookup(ROOT_INO, b"multi").ino == d.ino
        assert m.counter_add("multi", 2) == 0  # a write with its transaction id
        shown = [m.url, repr(m), m.server, caplog.text]
        assert all(server.password not in s for s in shown) and "***" in m.url
    finally:
        m.close()


def test_multi_host_urls_in_the_cli_and_the_native_client(server: pg.PgServer, tmp_path: Any) -> None:
    """`irdma format` and `irdma shard list --meta` (open_meta in a new process) and
    irdma.connect take the same multi-host URL."""
    import irdma

    fresh = server.new_database()
    url = fresh.replace(f"127.0.0.1:{server.port}", f"127.0.0.1:{_dead_port()},127.0.0.1:{server.port}")
    url += "?target_session_attrs=read-write"
    key = str(tmp_path / "cluster.key")
    env = {**os.environ, "IRDMA_KEY_FILE": key}
    res = irdma_cli("format", url, env=env)
    said = res.stdout + res.stderr
    assert f"127.0.0.1:{server.port}/" in said and "namespace postgresql://" in said and server.password not in said
    res = irdma_cli("shard", "list", "--meta", url, env=env)
    assert server.password not in res.stdout + res.stderr
    with irdma.connect(url, transport="tcp", key_file=key) as client:
        client.makedirs("/a/b")
        assert client.listdir("/") == ["a"]


def test_server_of_and_the_failover_parameter() -> None:
    assert server_of("postgresql://u:pw@h1:5432,h2:5433,h3/db") == "h1:5432, h2:5433, h3:5432"
    assert server_of("postgresql://h1,h2:6000/db") == "h1:5432, h2:6000"
    assert server_of("postgresql://h1,h2/db?port=7000") == "h1:7000, h2:7000"
    assert server_of("postgresql:///db?host=/run/pg") == "/run/pg (unix socket, port 5432)"
    assert split_failover("postgresql://h/db") == ("postgresql://h/db", None)
    assert split_failover("postgresql://h/db?failover_timeout=12.5") == ("postgresql://h/db", 12.5)
    assert split_failover("postgresql://h1,h2/db?target_session_attrs=read-write&failover_timeout=9&sslmode=require") \
        == ("postgresql://h1,h2/db?target_session_attrs=read-write&sslmode=require", 9.0)
    for bad in ("0", "-1", "x", "301", "nan"):
        with pytest.raises(E.InvalidArgument, match="failover_timeout"):
            split_failover(f"postgresql://u:pw@h/db?failover_timeout={bad}")


def test_an_older_database_gets_the_transaction_id_table(server: pg.PgServer) -> None:
    """A database formatted before transaction ids: opening it adds the table (as every
    schema change is added, see PostgresMeta._init_schema), then writes carry ids."""
    import psycopg

    url = server.new_database()
    open_meta(url, create=True).close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE txids")
    m = open_meta(url)
    try:
        m.create(ROOT_INO, b"f", D, 0, 0)
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM txids").fetchone() == (1,)
    finally:
        m.close()


def test_old_transaction_ids_are_pruned(meta: PostgresMeta, db_url: str) -> None:
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO txids(id, at) VALUES (gen_random_uuid(), now() - interval '11 minutes')")
        meta._next_prune = 0.0  # the next commit prunes
        meta.counter_add("prune", 1)
        assert conn.execute("SELECT count(*) FROM txids WHERE at < now() - interval '10 minutes'").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM txids").fetchone()[0] >= 1  # type: ignore[index]
