"""Placement: every chunk maps to one shard; a large file uses every shard."""

from __future__ import annotations

import collections

import pytest

from irdma.placement import Layout, check_chunk_size


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
