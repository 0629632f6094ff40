"""Moving many small byte extents between buffers at once (sparse rows: GATHER, SCATTER).

An extent is ``(position, length)`` in a buffer of bytes (a numpy ``uint8`` array). Copying
thousands of them one Python slice at a time costs a microsecond or more each; :func:`move`
does it with one fancy-indexed copy per distinct length over a view of each buffer as
overlapping ``n``-byte void elements, one starting at every byte (:func:`row_view`): any
alignment works, not only rows that tile the buffer, and numpy copies each element as one
``memcpy`` of ``n`` bytes (a float32 or uint8 view copies element by element, 2-4x slower
on rows of 1 KiB here). ``add`` takes the rows out, adds, and puts them back, so the
float32 arithmetic runs over contiguous rows.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def positions(length: np.ndarray) -> np.ndarray:
    """Where each extent starts in a buffer of them one after the other, plus the total
    (int64, ``len(length) + 1`` entries)."""
    pos = np.zeros(len(length) + 1, dtype=np.int64)
    np.cumsum(length, out=pos[1:])
    return pos


def row_view(buf: np.ndarray, n: int) -> np.ndarray:
    """``buf`` (1-D uint8, contiguous) as ``len(buf) - n + 1`` void elements of ``n`` bytes,
    element ``i`` being bytes ``i .. i + n - 1`` (they overlap: a view, no copy; writable
    when ``buf`` is)."""
    raw = buf if buf.dtype == np.uint8 else buf.view(np.uint8)  # lengths in bytes, whatever it was typed as
    return np.ndarray((max(len(raw) - n + 1, 0),), dtype=np.dtype((np.void, n)), buffer=raw, offset=0,
                      strides=(1,))


def move(dst: np.ndarray, dst_at: np.ndarray, src: np.ndarray, src_at: np.ndarray, length: np.ndarray,
         add: bool = False) -> None:
    """``dst[dst_at[k] : dst_at[k] + length[k]] = src[src_at[k] : ...]`` for every k (``+=`` as
    little-endian float32 with ``add``: positions and lengths then multiples of 4).

    ``dst`` and ``src`` are 1-D contiguous uint8 arrays; the extents of ``dst`` must not
    overlap (the caller checks). Ranges are the caller's to check too: an extent outside a
    buffer raises IndexError and may leave earlier lengths' extents moved.
    """
    if not len(length):
        return
    lengths = np.unique(length)
    for n in lengths.tolist():
        if n <= 0:
            continue
        sel = slice(None) if len(lengths) == 1 else length == n
        d_at, s_at = dst_at[sel], src_at[sel]
        d, s = row_view(dst, n), row_view(src, n)
        if not add:
            d[d_at] = s[s_at]
            continue
        rows = d[d_at]  # taken out, added to as float32 rows, put back
        sum_ = rows.view("<f4")
        first = int(s_at[0])
        if len(s_at) > 1 and int(s_at[-1]) - first == (len(s_at) - 1) * n and bool((np.diff(s_at) == n).all()):
            sum_ += src[first : first + len(s_at) * n].view("<f4")  # the sources one after the other
        else:
            sum_ += s[s_at].view("<f4")
        d[d_at] = rows


def fill(dst: np.ndarray, dst_at: np.ndarray, length: np.ndarray, value: int = 0) -> None:
    """``dst[dst_at[k] : dst_at[k] + length[k]] = value`` for every k (holes read as zeros)."""
    for n in np.unique(length).tolist():
        if n > 0:
            sliding_window_view(dst, n, writeable=True)[dst_at[length == n]] = value


def elements(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The positions ``starts[k] .. starts[k] + counts[k] - 1`` of every run, one run after the
    other (int64 arrays in, int64 out): the element indices of a request's extents, for one
    fancy-indexed pass over all of them."""
    before = np.cumsum(counts) - counts
    return np.repeat(starts - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)
