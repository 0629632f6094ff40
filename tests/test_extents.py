"""The byte movers under every sparse row (:func:`irdma.wire.extents.move`: GATHER on the shard,
SCATTER's assign and add, the client's pack and unpack) against one slice per extent, the
duplicate rows a sparse push sums (:func:`irdma.client.sparse.sum_duplicates`) against a sum
per id, and the payload buffers a sparse push reuses (:class:`irdma.client.buffers.BufferPool`)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from irdma.client.buffers import MIN_POOLED, BufferPool
from irdma.client.sparse import sum_duplicates
from irdma.wire.extents import move, positions


@st.composite
def _extents(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """A destination and a source buffer and extents between them: destinations that do not
    overlap, at any alignment (a multiple of 4 for add), lengths of one size or mixed, sources
    packed one after the other or anywhere (overlapping each other, as duplicates read)."""
    add = draw(st.booleans())
    q = 4 if add else 1
    dst_len = draw(st.integers(1, 600)) * q
    src_len = draw(st.integers(1, 600)) * q
    fixed = draw(st.sampled_from([0, 1, 3, 8, 16]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    d_at: list[int] = []
    lens: list[int] = []
    cur = 0
    for _ in range(draw(st.integers(0, 40))):
        n = (fixed or int(rng.choice([1, 2, 5, 8]))) * q
        gap = int(rng.integers(0, 9)) * q
        if cur + gap + n > dst_len or n > src_len:
            break
        d_at.append(cur + gap)
        lens.append(n)
        cur += gap + n
    packed = draw(st.booleans()) and sum(lens) <= src_len
    if packed:  # after the first, each source right behind the one before (a packed payload)
        base = int(rng.integers(0, (src_len - sum(lens)) // q + 1)) * q
        s_at = (base + positions(np.array(lens, dtype=np.int64))[:-1]).tolist()
    else:
        s_at = [int(rng.integers(0, (src_len - n) // q + 1)) * q for n in lens]
    if add:
        dst = rng.standard_normal(dst_len // 4).astype("<f4").view(np.uint8)
        src = rng.standard_normal(src_len // 4).astype("<f4").view(np.uint8)
    else:
        dst = rng.integers(0, 256, dst_len, dtype=np.uint8)
        src = rng.integers(0, 256, src_len, dtype=np.uint8)
    order = np.arange(len(lens)) if packed else rng.permutation(len(lens))  # else any order
    arr = [np.array(v, dtype=np.int64)[order] for v in (d_at, s_at, lens)]
    return dst, arr[0], src, arr[1], arr[2], add


@settings(max_examples=300, deadline=None)
@given(_extents())
def test_move_is_one_slice_per_extent(case: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]) -> None:
    dst, d_at, src, s_at, length, add = case
    want = dst.copy()
    for a, b, n in zip(d_at.tolist(), s_at.tolist(), length.tolist(), strict=True):
        if add:
            want[a : a + n] = (want[a : a + n].view("<f4") + src[b : b + n].view("<f4")).view(np.uint8)
        else:
            want[a : a + n] = src[b : b + n]
    source = np.frombuffer(src.tobytes(), dtype=np.uint8)  # read-only, as a received payload is
    move(dst, d_at, source, s_at, length, add=add)
    assert dst.tobytes() == want.tobytes()  # bit for bit: the same float32 sums, every other byte kept


def test_move_of_a_row_past_the_buffer_raises() -> None:
    dst = np.zeros(64, dtype=np.uint8)
    src = np.ones(64, dtype=np.uint8)
    try:
        move(dst, np.array([60], dtype=np.int64), src, np.array([0], dtype=np.int64), np.array([8], dtype=np.int64))
    except IndexError:
        pass
    else:
        raise AssertionError("an extent past the end of the destination moved")
    assert not dst.any()


def test_buffer_pool_reuses_only_what_was_given_back() -> None:
    pool = BufferPool(keep_bytes=8 * MIN_POOLED)
    a = pool.take(MIN_POOLED + 100)
    b = pool.take(MIN_POOLED + 100)
    assert len(a) == len(b) == MIN_POOLED + 100
    assert not np.shares_memory(a, b)  # two requests in flight never share a buffer
    a[:] = 7
    pool.give(a)
    c = pool.take(MIN_POOLED + 50)  # a little smaller: the buffer given back serves it
    assert np.shares_memory(c, a) and not np.shares_memory(c, b)
    d = pool.take(MIN_POOLED + 50)  # that one is out again: a fresh one
    assert not np.shares_memory(d, c)
    pool.give(b)
    huge = pool.take(3 * (MIN_POOLED + 100))  # more than twice the free one: not that one
    assert not np.shares_memory(huge, b)
    again = pool.take(MIN_POOLED + 100)
    assert np.shares_memory(again, b)
    for buf in (again, c, d, huge):
        pool.give(buf)
    pool.give(again)  # given twice: kept once
    assert pool._kept <= pool.keep_bytes
    assert len({id(x) for x in pool._free}) == len(pool._free)
    small = pool.take(100)
    pool.give(small)  # below MIN_POOLED: not kept
    assert all(len(x) >= MIN_POOLED for x in pool._free)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3000), st.sampled_from([1, 3, 64, 256]), st.integers(1, 4000), st.integers(0, 2**32 - 1),
       st.booleans())
def test_sum_duplicates_is_a_sum_per_id(n: int, k: int, span: int, seed: int, zipf: bool) -> None:
    rng = np.random.default_rng(seed)
    if zipf:  # a few ids repeated hundreds of times, most once: a recommendation batch
        ids = (rng.zipf(1.3, n) % span).astype(np.int64)
    else:
        ids = rng.integers(0, span, n).astype(np.int64)
    rows = rng.standard_normal((n, k)).astype("<f4")
    before = rows.copy()
    uniq, summed = sum_duplicates(ids, rows)
    want: dict[int, np.ndarray] = {}
    size: dict[int, np.ndarray] = {}  # the sum of magnitudes, for the rounding bound
    for i, r in zip(ids.tolist(), rows.astype(np.float64), strict=True):
        want[i] = want[i] + r if i in want else r.copy()
        size[i] = size[i] + np.abs(r) if i in size else np.abs(r)
    assert (rows == before).all()  # the caller's rows are left as they were
    if len(want) == n:
        assert uniq is ids and summed is rows  # nothing to sum: no copy
        return
    assert uniq.tolist() == sorted(want)
    assert summed.dtype == np.float32 and summed.shape == (len(want), k)
    ref = np.stack([want[i] for i in sorted(want)])
    counts = np.bincount(np.searchsorted(uniq, ids), minlength=len(uniq))[:, None]
    bound = counts * 2.0**-24 * np.stack([size[i] for i in sorted(size)])  # float32 summation, any order
    assert (np.abs(summed - ref) <= bound).all()
