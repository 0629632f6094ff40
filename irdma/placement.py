"""Placement of chunks on shards: striping of a file over its stripe of shards.

A file of ``size`` bytes is cut in chunks of ``chunk_size`` bytes; chunk ``i`` holds bytes
``[i*chunk_size, (i+1)*chunk_size)`` and lives on shard
``stripe[(file_id + i) % len(stripe)]``. Consecutive chunks go to consecutive shards, so one
large file uses every shard's bandwidth at once: the virtually unified buffer built from the
segments of several memory servers of SoftMemoryBox II (Ahn et al., IEEE Access 2020). The
offset by ``file_id`` spreads the first chunks of small files over all shards.

With ``replicas`` R > 1 each chunk has R copies on distinct shards: the shards that follow
its own in the stripe, ``stripe[(file_id + i + k) % len(stripe)]`` for k = 0..R-1, in that
order, which is the chunk's replication chain (head first, tail last). So every shard is head
of some chunks and tail of others, and the copies of a file are spread as evenly as its first
copies.

The stripe is fixed when the file is created, so adding shards later never moves a chunk.
A new file is striped over every shard in service, so new files spread evenly over them.

Draining a shard (``irdma shard drain``) moves its chunks without touching any file's stripe,
and so does ``irdma rebalance``, for a share of them: the shard map records each *move* (the
shard, a frozen list of *targets*, the share of its chunks that moves), and :func:`substitute`
rewrites every chain that holds a moving chunk. While the move is in progress, the chain keeps
the shard and gains a *joining* tail (one of the targets not already in the chain, picked by a
hash of ``file_id + i``), which takes every update and is read from only once the move is done;
then the shard leaves the chain and the target stays as its tail. Every client of one
shard-map view computes the same chains, unwritten chunks included, with no per-chunk records:
the substitution is a pure function of the view, as the formula above is.

A move applies to the files that existed when it was recorded (it records the highest inode
number then, ``last_ino``): a rebalance evens out the chunks there were, and files created
after it keep the plain stripe formula, spread evenly over the shards in service, instead of
inheriting shares computed for a cluster that has changed since.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
        replicas: copies of each chunk (at most ``len(stripe)``).
        place_id: the file id whose placement this file's chunks follow; 0: its own. A
            snapshot's copy of a file shares the live file's chunks on the shards, so it is
            placed as that file is (chains and moves alike), not by its own inode number.
    """

    file_id: int
    chunk_size: int
    stripe: tuple[int, ...]
    replicas: int = 1
    place_id: int = 0

    @property
    def placed_as(self) -> int:
        """The file id the placement formulas use (``place_id``, else ``file_id``)."""
        return self.place_id or self.file_id

    def shard_of(self, chunk_index: int) -> int:
        """The chunk's first replica (the head of its chain)."""
        return self.stripe[(self.placed_as + chunk_index) % len(self.stripe)]

    def replicas_of(self, chunk_index: int) -> tuple[int, ...]:
        """The chunk's replicas in chain order: distinct shards, head first."""
        n = len(self.stripe)
        first = self.placed_as + chunk_index
        return tuple(self.stripe[(first + k) % n] for k in range(min(self.replicas, n)))

    def read_turn(self, chunk_index: int) -> int:
        """Which of the chunk's up-to-date replicas serves its reads: an index into them in
        chain order, taken modulo how many there are. It is the chunk's lap around the stripe
        (``(placed_as + chunk_index) // len(stripe)``), so consecutive chunks and files read
        from every replica of every shard in turn. (The chain's own start, ``placed_as +
        chunk_index``, turns with the chain: with as many replicas as shards every chunk would
        be read from the same shard, and with 4 shards and 2 replicas from 2 of the 4.)"""
        return (self.placed_as + chunk_index) // len(self.stripe)

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


#: A move's share of a shard's chunks is counted in 1/MOVE_ALL parts.
MOVE_ALL = 1 << 16


def _mix(x: int) -> int:
    """A 64-bit multiplicative hash (Fibonacci hashing, Knuth): deterministic across processes."""
    return ((x & 0xFFFFFFFFFFFFFFFF) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF) >> 24


@dataclass(frozen=True)
class Move:
    """Chunks leaving a shard (``irdma shard drain``: all of them; ``irdma rebalance``: a share),
    as the shard map records it.

    Attributes:
        seq: the move's number; moves apply in this order.
        shard_id: the shard the chunks leave.
        targets: shard ids they move to (fixed when the move began), in order.
        done: False while the move is in progress (the shard is still in the chains, a target
            joins them as tail); True once it is done (the target has replaced it).
        share: which of the shard's chunks move, in 1/MOVE_ALL parts (MOVE_ALL: all); a chunk
            moves when a hash of ``(file_id + index, seq)`` falls below it.
        last_ino: the highest inode number when the move was recorded: it applies to files up
            to it only. None (moves recorded before irdma kept it): to every file.
    """

    seq: int
    shard_id: int
    targets: tuple[int, ...]
    done: bool
    share: int = MOVE_ALL
    last_ino: int | None = None

    def covers(self, file_id: int | None) -> bool:
        """Whether the move applies to file ``file_id`` (None: unknown, taken as covered)."""
        return file_id is None or self.last_ino is None or file_id <= self.last_ino

    def takes(self, salt: int) -> bool:
        """Whether the move takes the chunk ``salt = file_id + index`` (if its chain holds the shard)."""
        return self.share >= MOVE_ALL or _mix(salt * 1000003 + self.seq) % MOVE_ALL < self.share


def substitute(chain: tuple[int, ...], moves: Sequence[Move], salt: int, *,
               file_id: int | None = None) -> tuple[tuple[int, ...], int | None]:
    """Apply the moves of the shard map to a chunk's chain (see the module's docstring).

    Args:
        chain: the chunk's replicas by the stripe formula, head first.
        moves: the shard map's moves, in ``seq`` order (at most one not ``done``).
        salt: ``file_id + chunk_index``: spreads a shard's chunks over the targets.
        file_id: the chunk's file: moves recorded before it was created (``last_ino`` below
            it) pass it by. None applies every move (as before moves recorded ``last_ino``):
            every caller must pass it, or clients disagree on where a new file's chunks are.

    Returns:
        ``(chain, joining)``: the replicas head first, and the one still catching up (a
        move's target, the chain's tail; never read) or None. A chunk whose chain holds every
        target already stays where it is, except when all of its shard's chunks went (a
        removal by force, after which the chunk has one copy fewer; a drain refuses to begin
        its copy while such a chunk exists).
    """
    joining = None
    for m in moves:
        if m.shard_id not in chain or not m.covers(file_id) or not m.takes(salt):
            continue
        cands = [t for t in m.targets if t not in chain]
        rest = tuple(s for s in chain if s != m.shard_id)
        if not cands:
            if m.done and m.share >= MOVE_ALL:
                chain = rest  # a shard removed by force: its replica is gone, not moved
            continue  # a partial move (rebalance) leaves a chunk it has nowhere to take
        # mixed: chunks of one chain recur every len(stripe) indices, and a plain modulo would
        # send them all to the same target
        target = cands[_mix(salt) % len(cands)]
        if m.done:
            chain = rest + (target,)
        else:
            chain, joining = chain + (target,), target
    return chain, joining
