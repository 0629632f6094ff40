"""Placement: every chunk maps to one shard; a large file uses every shard."""

from __future__ import annotations

import collections
import stat
from collections.abc import Iterator

import pg
import pytest

from irdma.meta import open_meta
from irdma.meta.base import ROOT_INO
from irdma.placement import MOVE_ALL, Layout, Move, check_chunk_size, substitute


def test_every_chunk_maps_to_exactly_one_shard_of_the_stripe() -> None:
    layout = Layout(file_id=17, chunk_size=4096, stripe=(3, 5, 8, 9))
    for i in range(1000):
        # the documented formula: stripe[(file_id + i) % len(stripe)], the same in a fresh Layout
        assert layout.shard_of(i) == (3, 5, 8, 9)[(17 + i) % 4]
        assert Layout(17, 4096, (3, 5, 8, 9)).shard_of(i) == layout.shard_of(i)
    # consecutive chunks go to consecutive shards of the stripe
    assert [layout.shard_of(i) for i in range(4)] == [5, 8, 9, 3]


def test_a_large_file_spreads_evenly_over_all_shards() -> None:
    layout = Layout(file_id=5, chunk_size=1 << 20, stripe=(1, 2, 3, 4))
    counts = collections.Counter(p.shard_id for p in layout.pieces(0, 1 << 30))
    assert set(counts) == {1, 2, 3, 4}
    assert max(counts.values()) - min(counts.values()) <= 1


def test_first_chunks_of_small_files_spread_over_shards() -> None:
    firsts = {Layout(fid, 4096, (1, 2, 3)).shard_of(0) for fid in range(30)}
    assert firsts == {1, 2, 3}


@pytest.mark.parametrize("shards,replicas", [(2, 2), (3, 2), (4, 2), (3, 3), (5, 3), (4, 1)])
def test_reads_of_replicated_chunks_spread_evenly_over_every_shard(shards: int, replicas: int) -> None:
    """The replica a pull reads (``replicas_of(c)[read_turn(c) % R]``): over consecutive
    chunks of a file, and over the first chunks of consecutive files, every shard serves the
    same share (the chain start alone read from 1 shard of 2, 2 of 4)."""
    stripe = tuple(range(1, shards + 1))
    big = Layout(7, 4096, stripe, replicas)
    by_chunk = collections.Counter(big.replicas_of(c)[big.read_turn(c) % replicas] for c in range(shards * replicas * 10))
    by_file = collections.Counter(Layout(f, 4096, stripe, replicas).replicas_of(0)[
        Layout(f, 4096, stripe, replicas).read_turn(0) % replicas] for f in range(1, shards * replicas * 10 + 1))
    for counts in (by_chunk, by_file):
        assert set(counts) == set(stripe) and len(set(counts.values())) == 1, counts


@pytest.mark.parametrize("offset,length", [(0, 1), (4095, 2), (100, 3 * 4096), (0, 10 * 4096), (12345, 0)])
def test_pieces_cover_the_range_exactly_once(offset: int, length: int) -> None:
    layout = Layout(1, 4096, (1, 2))
    pieces = list(layout.pieces(offset, length, max_piece=1000))
    assert sum(p.length for p in pieces) == length
    pos = offset
    for p in pieces:
        assert p.chunk_index * 4096 + p.chunk_offset == pos
        assert p.chunk_offset + p.length <= 4096 and p.length <= 1000
        assert p.buf_offset == pos - offset
        pos += p.length


def test_bad_ranges_and_chunk_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        list(Layout(1, 4096, (1,)).pieces(-1, 10))
    for bad in (1000, 4097, 2048, 1 << 30):
        with pytest.raises(ValueError):
            check_chunk_size(bad)
    assert check_chunk_size(1 << 20) == 1 << 20


def test_a_drain_moves_exactly_the_drained_shards_replicas_and_spreads_them() -> None:
    """While shard 2 drains, every chain that holds it gains one target as its joining tail and
    no other chain changes; once drained, the target replaces it; replicas stay distinct."""
    layout = Layout(file_id=7, chunk_size=4096, stripe=(1, 2, 3, 4), replicas=2)
    draining = [Move(1, 2, (1, 3, 4), done=False)]
    drained = [Move(1, 2, (1, 3, 4), done=True)]
    moved_to: collections.Counter[int] = collections.Counter()
    for i in range(400):
        chain = layout.replicas_of(i)
        during, joining = substitute(chain, draining, layout.file_id + i)
        after, none = substitute(chain, drained, layout.file_id + i)
        assert none is None
        if 2 not in chain:
            assert (during, joining, after) == (chain, None, chain)
            continue
        assert joining is not None and joining not in chain and during == chain + (joining,)
        assert after == tuple(s for s in chain if s != 2) + (joining,)  # the copy made while draining
        assert len(set(after)) == len(after) == 2
        moved_to[joining] += 1
    assert set(moved_to) == {1, 3, 4} and max(moved_to.values()) - min(moved_to.values()) <= len(moved_to) * 20
    # two drains, one after the other: the second applies to the chains the first made
    both = drained + [Move(2, 3, (1, 4), done=True)]
    for i in range(100):
        chain, _ = substitute(layout.replicas_of(i), both, layout.file_id + i)
        assert not {2, 3} & set(chain) and len(set(chain)) == len(chain) == 2


def test_a_drained_shard_with_nowhere_to_go_leaves_its_chain_shorter() -> None:
    chain, joining = substitute((1, 2), [Move(1, 2, (1,), done=True)], 0)
    assert (chain, joining) == ((1,), None)
    chain, joining = substitute((1, 2), [Move(1, 2, (1,), done=False)], 0)
    assert (chain, joining) == ((1, 2), None)  # still draining: stays where it is


def test_a_partial_move_takes_about_its_share_and_only_from_its_shard() -> None:
    layout = Layout(file_id=3, chunk_size=4096, stripe=(1, 2, 3), replicas=1)
    move = [Move(1, 1, (4,), done=True, share=MOVE_ALL // 4)]
    on_1 = [i for i in range(4000) if layout.replicas_of(i) == (1,)]
    moved = [i for i in on_1 if substitute((1,), move, layout.file_id + i)[0] == (4,)]
    assert 0.2 < len(moved) / len(on_1) < 0.3  # a quarter, by a hash
    for i in range(4000):
        chain = layout.replicas_of(i)
        if chain != (1,):
            assert substitute(chain, move, layout.file_id + i)[0] == chain


def test_a_partial_move_never_drops_a_replica_it_has_nowhere_to_take() -> None:
    move = [Move(1, 1, (2,), done=True, share=MOVE_ALL // 2)]
    for salt in range(200):
        assert substitute((1, 2), move, salt) == ((1, 2), None)


def test_a_move_applies_only_to_files_that_existed_when_it_was_recorded() -> None:
    """A rebalance's partial move recorded when inode 10 was the newest: chunks of files up to
    10 move by its share; files created later keep the stripe formula, spread evenly over the
    shards in service, whatever moves came before them (issue 20, point 6)."""
    move = Move(1, 1, (5,), done=True, share=MOVE_ALL // 2, last_ino=10)
    old = Layout(file_id=7, chunk_size=4096, stripe=(1, 2, 3, 4), replicas=1)
    moved = [i for i in range(400) if substitute(old.replicas_of(i), [move], old.file_id + i, file_id=7)[0] == (5,)]
    assert 30 < len(moved) < 70  # about half of its 100 chunks on shard 1
    counts: collections.Counter[int] = collections.Counter()
    for fid in range(11, 16):  # five new files of 10 chunks, 2 replicas, over five shards
        layout = Layout(file_id=fid, chunk_size=4096, stripe=(1, 2, 3, 4, 5), replicas=2)
        for i in range(10):
            chain, joining = substitute(layout.replicas_of(i), [move], fid + i, file_id=fid)
            assert (chain, joining) == (layout.replicas_of(i), None)
            counts.update(chain)
    assert counts == {s: 20 for s in (1, 2, 3, 4, 5)}
    # without the file (an older caller) or for a move recorded before moves kept last_ino, it applies
    assert any(substitute((1,), [move], salt)[0] == (5,) for salt in range(11, 40))
    legacy = Move(1, 1, (5,), done=True, share=MOVE_ALL)
    assert substitute((1,), [legacy], 99, file_id=99) == ((5,), None)
    assert Move(2, 1, (5,), done=False, last_ino=10).covers(10) and not move.covers(11)


@pytest.fixture(params=["sqlite", "postgresql"])
def engine_url(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[str]:
    """An empty metadata database of each engine (PostgreSQL: a real server of its own)."""
    if request.param == "sqlite":
        yield f"sqlite://{tmp_path}/meta.db"
        return
    why = pg.available()
    if why:
        pytest.skip(why)
    with pg.postgres_server() as server:
        yield server.new_database()


def test_every_move_records_the_newest_inode_on_every_engine(engine_url: str) -> None:
    """A rebalance's move, a drain and a forced removal each record the highest inode number
    there is (so they apply to those files only); the shard view reads it back."""
    meta = open_meta(engine_url, create=True)
    try:
        for k in range(4):
            meta.add_shard(f"127.0.0.1:{7000 + k}")
        made = [meta.create(ROOT_INO, f"f{k}".encode(), stat.S_IFREG | 0o644, 0, 0).ino for k in range(3)]
        meta.begin_move(1, (4,), MOVE_ALL // 2)
        (move,) = meta.shard_view()[2]
        assert move.last_ino == max(made) and not move.done and move.covers(max(made))
        assert not move.covers(max(made) + 1)
        meta.cancel_move(move.seq)
        later = meta.create(ROOT_INO, b"g", stat.S_IFREG | 0o644, 0, 0).ino
        meta.drain_shard(2)
        (drain,) = meta.shard_view()[2]
        assert (drain.shard_id, drain.last_ino) == (2, later)
        meta.cancel_move(drain.seq)
        meta.remove_shard(3, force=True)
        (removal,) = meta.shard_view()[2]
        assert (removal.shard_id, removal.last_ino, removal.done) == (3, later, True)
    finally:
        meta.close()


def test_a_namespace_made_before_moves_kept_last_ino_gains_it_on_open(engine_url: str) -> None:
    """An existing database of an older version (no ``moves.last_ino``) opened by this one
    (without ``create``: every mount and client) gets the column, and its old moves apply to
    every file (NULL) while new ones record the newest inode."""
    meta = open_meta(engine_url, create=True)
    try:
        for k in range(2):
            meta.add_shard(f"127.0.0.1:{7100 + k}")
        meta.remove_shard(2, force=True)  # a move recorded by the older version below
    finally:
        meta.close()
    if engine_url.startswith("sqlite"):
        import sqlite3

        db = sqlite3.connect(engine_url[len("sqlite://"):])
        db.execute("ALTER TABLE moves DROP COLUMN last_ino")
        db.commit()
        db.close()
    else:
        import psycopg

        with psycopg.connect(engine_url, autocommit=True) as conn:
            conn.execute("ALTER TABLE moves DROP COLUMN last_ino")
    meta = open_meta(engine_url)
    try:
        (old,) = meta.shard_view()[2]
        assert old.last_ino is None and old.covers(10**9)
        meta.add_shard("127.0.0.1:7102")
        ino = meta.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0).ino
        meta.begin_move(1, (3,), MOVE_ALL // 2)
        new = meta.shard_view()[2][-1]
        assert new.last_ino == ino and not new.covers(ino + 1)
    finally:
        meta.close()
