"""Placement of chunks on shards: striping of a file over its stripe of shards.

A file of ``size`` bytes is cut in chunks of ``chunk_size`` bytes; chunk ``i`` holds bytes
``[i*chunk_size, (i+1)*chunk_size)`` and lives on shard
``stripe[(file_id + i) % len(stripe)]``. Consecutive chunks go to consecutive shards, so one
large file uses every shard's bandwidth at once: the virtually unified buffer built from the
segments of several memory servers of SoftMemoryBox II (Ahn et al., IEEE Access 2020). The
offset by ``file_id`` spreads the first chunks of small files over all shards.

The stripe is fixed when the file is created, so adding shards later never moves a chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

#: Default chunk size: 4 MiB.
DEFAULT_CHUNK_SIZE = 4 << 20
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 256 << 20


def check_chunk_size(chunk_size: int) -> int:
    """Validate a chunk size in bytes.

    Raises:
        ValueError: not a power of two between 4 KiB and 256 MiB.
    """
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE or chunk_size & (chunk_size - 1):
        raise ValueError(
            f"chunk size {chunk_size} must be a power of two from {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE} bytes"
        )
    return chunk_size


@dataclass(frozen=True)
class Piece:
    """The part of one I/O that falls in one chunk (and fits one request)."""

    shard_id: int
    chunk_index: int
    chunk_offset: int  # bytes into the chunk
    length: int  # bytes
    buf_offset: int  # bytes into the caller's buffer


@dataclass(frozen=True)
class Layout:
    """Where the bytes of one file live.

    Attributes:
        file_id: the file's id on the shards (its inode number).
        chunk_size: bytes per chunk, a power of two.
        stripe: shard ids the file is striped over, in order.
    """

    file_id: int
    chunk_size: int
    stripe: tuple[int, ...]

    def shard_of(self, chunk_index: int) -> int:
        return self.stripe[(self.file_id + chunk_index) % len(self.stripe)]

    def pieces(self, offset: int, length: int, max_piece: int | None = None) -> Iterator[Piece]:
        """Split ``[offset, offset+length)`` at chunk boundaries and at ``max_piece`` bytes.

        Raises:
            ValueError: negative offset or length.
        """
        if offset < 0 or length < 0:
            raise ValueError(f"bad range: offset {offset}, length {length}")
        limit = min(self.chunk_size, max_piece or self.chunk_size)
        pos, end = offset, offset + length
        while pos < end:
            index, within = divmod(pos, self.chunk_size)
            n = min(end - pos, self.chunk_size - within, limit)
            yield Piece(self.shard_of(index), index, within, n, pos - offset)
            pos += n

    def chunk_count(self, size: int) -> int:
        """Chunks that a file of ``size`` bytes spans."""
        return -(-size // self.chunk_size)
