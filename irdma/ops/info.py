"""``irdma info PATH``: where the bytes of a file live, and what a directory holds (as
``juicefs info`` does for JuiceFS).

How it works. :func:`path_info` resolves a path in the namespace (:func:`irdma.ops.mountpath.resolve_target` maps a
path under an irdma mount to the mount's namespace and the path in it first), asks every shard for its STAT once
(:meth:`Client.shard_stats`, which also records each shard's incarnation and health in the shard
map, as ``irdma status`` does), then reads the metadata:

* a **file**: its inode, its settings (update op, chunk size, replicas, I/O mode, the
  ``user.irdma.*`` xattrs) and, per chunk the file spans, its chain: the replicas the placement
  gives it (:meth:`Client.placed`, head first; a move's target last) and any other replica the
  chunk map records. The chunk's version on each replica comes from the shard itself: one
  paged LIST request per shard that answers (the request ``fsck`` and ``gc`` page through a
  shard with), started at the file's first chunk, so a file of N chunks costs about
  N / 4096 round trips per shard. A shard that does not answer gives no version (None).
* a **directory**: the files, directories and other entries in it (with ``recursive``, in its
  whole tree), the bytes in its files, their chunks, and each shard's share. No shard is asked
  for versions: the numbers come from the chunk map.

Words (see :mod:`irdma.client.fsck` for the chunk map's rules):

* a replica is **in-sync** when its chunk-map row holds its shard's current incarnation,
  **out-of-sync** when the row is 0 (it missed acknowledged updates), **lost** when the row
  holds an older incarnation (the shard restarted on empty memory), **unrecorded** when the
  placement names it but the chunk map has no row (a chunk never written there, or a move's
  target not yet copied);
* a replica is **good** when it is in sync on a shard that answers and is neither down nor
  catching up (syncing); a chunk of one replica is served by its shard whatever its health,
  so there an in-sync replica on a shard that answers is good (as ``fsck`` counts);
* a chunk is **ok** (good replicas >= the replicas its file asks for), **under-replicated**
  (fewer, but at least one), **waiting** (no good replica, but an in-sync one on a shard that
  does not answer or is catching up: reads fail with EIO until it is back), **lost** (no
  in-sync replica left) or a **hole** (never written: it reads as zeros; a chunk whose rows are
  all out of sync was never acknowledged and counts as a hole).

Exit codes (:attr:`Totals.exit_code`, as ``irdma status`` picks them, for the chunks under the
path only): 2 when a chunk is waiting or lost (a read of it fails), 1 when one is
under-replicated, 0 otherwise.

Sizes are bytes throughout; a shard's share counts its in-sync replicas only: ``bytes`` are the
file bytes they hold (a chunk's length within its file), ``allocated_bytes`` the memory the
shard gives them (each chunk's extent: the size class of its length,
:func:`irdma.server.region.extent_for`; a chunk truncated since may hold a larger one).
"""

from __future__ import annotations

import dataclasses
import stat
from dataclasses import dataclass, field
from typing import Any

import trio

from .._concurrency import open_nursery
from .._errors import NotADirectory, NotFound, ShardUnavailable
from ..client.native import Client, layout_of
from ..meta.base import OUT_OF_SYNC, XATTR_IO, Inode, ShardRecord
from ..placement import Layout
from ..server.region import extent_for
from ..transport import ShardConnection
from .mountpath import (  # noqa: F401  (irdma.ops.info's names before the paths had a module)
    ASK_MOUNT_S,
    MOUNT_XATTR,
    IrdmaMount,
    Target,
    ask_mount,
    irdma_mounts,
    mount_table,
    namespace_key,
    namespace_path,
    resolve_target,
    same_namespace,
)

#: Shard states whose shards serve no chain any more.
RETIRED = ("drained", "removed")
#: Above this many files a directory's chunk map is read in one statement (SQL engines).
BULK_FILES = 256
#: xattrs shown whole up to this many bytes (longer values are cut, with "...").
XATTR_SHOWN = 256
#: The start of the LIST pages of file ``ino``: every chunk after (ino - 1, the last index).
_LAST_INDEX = (1 << 64) - 1

#: The JSON document's version: bumped when a key changes meaning or goes away.
JSON_VERSION = 1


@dataclass
class Replica:
    """One replica of a chunk.

    Attributes:
        shard_id, address: the shard holding it (or meant to).
        health: the shard now: ``up``, ``down`` (it did not answer), ``syncing`` (back, being
            resynced), ``unknown`` (never contacted), or ``drained`` / ``removed``.
        state: the replica in the chunk map: ``in-sync``, ``out-of-sync``, ``lost`` or
            ``unrecorded`` (see the module's docstring).
        incarnation: what the chunk map records for it (0: out of sync or unrecorded).
        version: the chunk's version on the shard (it counts applied updates); 0 when the
            shard answered without the chunk; None when it was not asked (it does not answer,
            or the chunk is a hole).
        joining: the target of a move in progress (the chain's tail, never read from).
        good: it counts towards the chunk's replicas (see the module's docstring).
    """

    shard_id: int
    address: str
    health: str
    state: str
    incarnation: int
    version: int | None
    joining: bool = False
    good: bool = False


@dataclass
class Chunk:
    """One chunk of a file.

    Attributes:
        index: the chunk's index; it holds bytes ``[offset, offset + length)`` of the file.
        offset, length: bytes (``length`` < the chunk size only for the last chunk).
        state: ``ok``, ``under-replicated``, ``waiting``, ``lost`` or ``hole``.
        wanted: replicas its file asks for (the placement's, at most the stripe's shards).
        good: its good replicas.
        replicas: the chain, head first, then replicas the chunk map records off the chain.
    """

    index: int
    offset: int
    length: int
    state: str
    wanted: int
    good: int
    replicas: list[Replica] = field(default_factory=list)


@dataclass
class ShardShare:
    """What one shard holds of a path: its in-sync replicas.

    Attributes:
        chunks: replicas held. bytes: the file bytes in them. allocated_bytes: their extents.
        share_pct: ``bytes`` as a percentage of every shard's ``bytes`` together (0 to 100).
    """

    shard_id: int
    address: str
    health: str
    chunks: int = 0
    bytes: int = 0
    allocated_bytes: int = 0
    share_pct: float = 0.0


@dataclass
class Totals:
    """Sums over the chunks under a path.

    Attributes:
        chunks: chunks the files span (size / chunk size, rounded up), holes included.
        written: of them, chunks written (not holes).
        holes, under_replicated, waiting, lost: chunks in that state.
        replicas_held: in-sync replicas, all shards together (the sum of ``shards``' chunks).
        shards: each shard holding a replica, or named by a chain, by shard id.
    """

    chunks: int = 0
    written: int = 0
    holes: int = 0
    under_replicated: int = 0
    waiting: int = 0
    lost: int = 0
    replicas_held: int = 0
    shards: list[ShardShare] = field(default_factory=list)

    @property
    def bytes_held(self) -> int:
        """The shards' memory given to the in-sync replicas (``allocated_bytes`` of every shard
        together: whole chunks), in bytes."""
        return sum(s.allocated_bytes for s in self.shards)

    @property
    def unavailable(self) -> int:
        """Chunks no read can get now: waiting and lost."""
        return self.waiting + self.lost

    @property
    def exit_code(self) -> int:
        """2 when a chunk is waiting or lost, 1 when one is under-replicated, else 0."""
        return 2 if self.unavailable else 1 if self.under_replicated else 0


@dataclass
class FileInfo:
    """What :func:`path_info` finds for anything but a directory.

    Attributes:
        path: the path in the namespace. kind: ``file``, ``symlink``, ``fifo``, ``socket``,
            ``char-device`` or ``block-device`` (only files have chunks).
        size: bytes. mode: the permission bits and file type (``st_mode``). mtime_ns: ns since
            the Unix epoch.
        chunk_size: bytes per chunk (None for no file). update_op: what a write does
            (``user.irdma.update``; ``assign`` when unset). replicas: copies of each chunk it
            asks for. stripe: the shards it is striped over, in placement order. io: the
            mount's I/O mode (``user.irdma.io``: ``cached`` or ``direct``).
        xattrs: every ``user.irdma.*`` xattr set on it, as text.
        chunks: every chunk the file spans, in order.
    """

    path: str
    ino: int
    kind: str
    size: int
    mode: int
    uid: int
    gid: int
    nlink: int
    mtime_ns: int
    chunk_size: int | None
    update_op: str
    replicas: int
    stripe: list[int]
    io: str
    xattrs: dict[str, str]
    chunks: list[Chunk]
    totals: Totals


@dataclass
class DirInfo:
    """What :func:`path_info` finds for a directory.

    Attributes:
        recursive: the numbers cover the whole tree (else the directory's own entries; the
            subdirectories are counted, not entered).
        files: regular files (a file with several names once). dirs: directories below it.
        others: symbolic links, FIFOs, sockets and device nodes.
        bytes: the sizes of the files together.
        chunk_size, update_op: the defaults new files in it take (None: inherited, unset).
    """

    path: str
    ino: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    recursive: bool
    files: int
    dirs: int
    others: int
    bytes: int
    chunk_size: int | None
    update_op: str | None
    xattrs: dict[str, str]
    totals: Totals


def as_dict(info: FileInfo | DirInfo) -> dict[str, Any]:
    """The JSON document of ``irdma info --json``: the dataclass's fields (sizes in bytes,
    times in ns), ``type`` (``file`` or ``directory``; a file's ``kind`` says which sort),
    ``version`` (:data:`JSON_VERSION`), ``mode`` also as ``mode_text`` (``-rw-r--r--``), and
    in ``totals`` also ``unavailable``, ``exit_code``, ``bytes_held`` (:attr:`Totals.bytes_held`)
    and ``bytes_in_files`` (the size of a file, the sizes of a directory's files together; 0 for
    anything else) (the CLI adds ``mount``: the irdma mountpoint PATH was under, or null)."""
    doc = dataclasses.asdict(info)
    doc["totals"]["bytes_held"] = info.totals.bytes_held
    doc["totals"]["bytes_in_files"] = bytes_in_files(info)
    doc["totals"]["unavailable"] = info.totals.unavailable
    doc["totals"]["exit_code"] = info.totals.exit_code
    doc["mode_text"] = stat.filemode(info.mode)
    return {"version": JSON_VERSION, "type": "directory" if isinstance(info, DirInfo) else "file", **doc}


def bytes_in_files(info: FileInfo | DirInfo) -> int:
    """The bytes of the files ``info`` covers, as their sizes say: a file's size, the sizes of a
    directory's files together, 0 for a symbolic link or device."""
    if isinstance(info, DirInfo):
        return info.bytes
    return info.size if info.kind == "file" else 0


async def resolve(client: Client, path: str) -> Inode:
    """The inode at ``path`` in the namespace.

    Raises:
        NotFound: no such path (the message names it and says what to check).
        NotADirectory: a component before the last is not a directory.
    """
    try:
        return await trio.to_thread.run_sync(client.store.resolve, path)
    except NotFound:
        raise NotFound(f"no such path in the namespace: {path}",
                       "check the path and --meta; `irdma info /` summarises the namespace's root") from None
    except NotADirectory:
        raise NotADirectory(f"{path}: a component of it is not a directory",
                            "check the path; `irdma info DIR` shows what a directory holds") from None


# ---------------------------------------------------------------- shards and chunks
@dataclass
class _Shards:
    recs: dict[int, ShardRecord]
    answering: set[int]

    def health(self, sid: int) -> str:
        rec = self.recs.get(sid)
        if rec is None:
            return "unknown"
        if rec.state in RETIRED:
            return rec.state
        return rec.health if sid in self.answering else "down"

    def address(self, sid: int) -> str:
        rec = self.recs.get(sid)
        return rec.address if rec is not None else "?"

    def in_sync(self, sid: int, incarnation: int) -> bool:
        rec = self.recs.get(sid)
        return (incarnation != OUT_OF_SYNC and rec is not None and rec.state != "removed"
                and rec.incarnation != 0 and incarnation == rec.incarnation)


async def _shards(client: Client) -> _Shards:
    stats = await client.shard_stats()  # notes each shard's incarnation and health first
    return _Shards({r.shard_id: r for r, _, _ in stats},
                   {r.shard_id for r, st, _ in stats if st is not None and r.state != "removed"})


def _chunk(client: Client, layout: Layout, size: int, index: int, rows: dict[int, int], shards: _Shards,
           versions: dict[int, dict[int, int] | None] | None) -> Chunk:
    """Classify chunk ``index`` of a file (see the module's docstring)."""
    chain, joining = client.placed(layout, index)
    wanted = len([s for s in chain if s != joining])
    order = list(chain) + sorted(s for s in rows if s not in chain)
    written = any(n != OUT_OF_SYNC for n in rows.values())
    offset = index * layout.chunk_size
    length = max(0, min(layout.chunk_size, size - offset))
    reps = []
    for sid in order:
        inc = rows.get(sid)
        if inc is None:
            state = "unrecorded"
        elif inc == OUT_OF_SYNC:
            state = "out-of-sync"
        elif shards.in_sync(sid, inc):
            state = "in-sync"
        else:
            state = "lost"
        health = shards.health(sid)
        listed = versions.get(sid) if versions is not None else None
        version = None if listed is None or not written else listed.get(index, 0)
        # held: in sync, on a shard that answers, and (where the shard was asked) there
        held = written and state == "in-sync" and sid in shards.answering and sid != joining and version != 0
        serves = held and (health not in ("down", "syncing") or wanted == 1)
        reps.append(Replica(sid, shards.address(sid), health, state, inc or 0, version, sid == joining, serves))
    good = sum(r.good for r in reps)
    if not written:
        what = "hole"
    elif good >= wanted:
        what = "ok"
    elif good:
        what = "under-replicated"
    elif any(r.state == "in-sync" and (r.shard_id not in shards.answering or r.version != 0) for r in reps):
        what = "waiting"  # an in-sync replica on a shard that does not answer, or is catching up
    else:
        what = "lost"  # none in sync, or every one answers without the chunk
    return Chunk(index, offset, length, what, wanted, good, reps)


def _add(totals: Totals, shares: dict[int, ShardShare], chunk: Chunk, chunk_size: int) -> None:
    totals.chunks += 1
    if chunk.state == "hole":
        totals.holes += 1
    else:
        totals.written += 1
    if chunk.state == "under-replicated":
        totals.under_replicated += 1
    elif chunk.state == "waiting":
        totals.waiting += 1
    elif chunk.state == "lost":
        totals.lost += 1
    for r in chunk.replicas:  # every shard of a chain is listed, holding something or not
        share = shares.get(r.shard_id)
        if share is None:
            share = shares[r.shard_id] = ShardShare(r.shard_id, r.address, r.health)
        if r.state == "in-sync" and chunk.state != "hole":
            share.chunks += 1
            share.bytes += chunk.length
            share.allocated_bytes += extent_for(chunk.length, chunk_size)
            totals.replicas_held += 1


def _finish(totals: Totals, shares: dict[int, ShardShare]) -> Totals:
    held = sum(s.bytes for s in shares.values())
    for s in shares.values():
        s.share_pct = round(100.0 * s.bytes / held, 2) if held else 0.0
    totals.shards = [shares[k] for k in sorted(shares)]
    return totals


async def _versions(client: Client, ino: int, shard_ids: set[int]) -> dict[int, dict[int, int] | None]:
    """Each shard's versions of the chunks of file ``ino`` (chunk index -> version), by paged
    LIST requests; None for a shard that failed to answer."""
    out: dict[int, dict[int, int] | None] = {}

    async def one(sid: int) -> None:
        got: dict[int, int] = {}
        after = (ino - 1, _LAST_INDEX)
        try:
            while True:
                page = await client.shard_call(sid, ShardConnection.list_chunks, *after)
                for e in page:
                    if e.file_id == ino:
                        got[e.chunk_index] = e.version
                if not page or page[-1].file_id > ino:
                    break
                after = (page[-1].file_id, page[-1].chunk_index)
        except ShardUnavailable:
            out[sid] = None
            return
        out[sid] = got

    async with open_nursery() as nursery:
        for sid in sorted(shard_ids):
            nursery.start_soon(one, sid)
    return out


# ---------------------------------------------------------------- files and directories
_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "char-device"), (stat.S_ISBLK, "block-device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "other")


async def _xattrs(client: Client, ino: int) -> dict[str, str]:
    """The ``user.irdma.*`` xattrs of an inode, as text (binary values with escapes; long ones cut)."""
    from .._errors import NoAttribute

    out = {}
    for name in await client.meta.listxattr(ino):
        if not name.startswith(b"user.irdma."):
            continue
        try:
            value = await client.meta.getxattr(ino, name)
        except NoAttribute:
            continue  # removed meanwhile
        text = value[:XATTR_SHOWN].decode("utf-8", "backslashreplace")
        out[name.decode("utf-8", "backslashreplace")] = text + ("..." if len(value) > XATTR_SHOWN else "")
    return out


def _is_file(inode: Inode) -> bool:
    return stat.S_ISREG(inode.mode) and inode.chunk_size is not None and bool(inode.stripe)


async def file_info(client: Client, path: str, inode: Inode, shards: _Shards | None = None,
                    versions: bool = True) -> FileInfo:
    """Where the bytes of the file at ``path`` (``inode``) live, chunk by chunk.

    Args:
        shards: the shards as :func:`path_info` read them (default: ask them now).
        versions: ask every shard that answers for its chunk versions (paged LIST).

    Raises:
        IrdmaError: the metadata engine failed.
    """
    shards = shards or await _shards(client)
    kind = _kind(inode.mode)
    xattrs = await _xattrs(client, inode.ino)
    totals, shares = Totals(), dict[int, ShardShare]()
    chunks: list[Chunk] = []
    io = "cached"
    if _is_file(inode):
        _, io_raw = await client.meta.getattr_io(inode.ino)
        io = io_raw.decode("ascii", "replace")
        layout = layout_of(inode)
        rows = await client.meta.chunk_map(inode.ino)
        n = layout.chunk_count(inode.size)
        involved = {s for i in range(n) for s in client.placed(layout, i)[0]} | {s for r in rows.values() for s in r}
        listed = await _versions(client, inode.ino, involved & shards.answering) if versions and rows else None
        for i in range(n):
            chunk = _chunk(client, layout, inode.size, i, rows.get(i, {}), shards, listed)
            _add(totals, shares, chunk, layout.chunk_size)
            chunks.append(chunk)
    else:
        io = xattrs.get(XATTR_IO.decode(), "cached")
    return FileInfo(path, inode.ino, kind, inode.size, inode.mode, inode.uid, inode.gid, inode.nlink, inode.mtime_ns,
                    inode.chunk_size if kind == "file" else None, inode.update_op or "assign", inode.replicas,
                    list(inode.stripe), io, xattrs, chunks, _finish(totals, shares))


async def dir_info(client: Client, path: str, inode: Inode, recursive: bool = False,
                   shards: _Shards | None = None) -> DirInfo:
    """What the directory at ``path`` (``inode``) holds: its entries (with ``recursive``, its
    whole tree), the bytes in its files and each shard's share of their chunks.

    Raises:
        IrdmaError: the metadata engine failed (an entry removed while it is read is skipped).
    """
    shards = shards or await _shards(client)
    files: dict[int, Inode] = {}
    dirs = others = 0
    todo = [inode.ino]
    while todo:
        at = todo.pop()
        try:
            entries = await client.meta.readdir(at)
        except (NotFound, NotADirectory):
            continue  # removed or replaced meanwhile
        for _, child in entries:
            if child.is_dir:
                dirs += 1
                if recursive:
                    todo.append(child.ino)
            elif _is_file(child):
                files[child.ino] = child
            else:
                others += 1
    if len(files) > BULK_FILES and hasattr(client.store, "_call"):
        from ..client.fsck import chunk_rows

        every = await chunk_rows(client)
        maps = {ino: every.get(ino, {}) for ino in files}
    else:
        maps = {ino: await client.meta.chunk_map(ino) for ino in files}
    totals, shares = Totals(), dict[int, ShardShare]()
    for ino, f in sorted(files.items()):
        layout = layout_of(f)
        rows = maps[ino]
        for i in range(layout.chunk_count(f.size)):
            _add(totals, shares, _chunk(client, layout, f.size, i, rows.get(i, {}), shards, None),
                 layout.chunk_size)
    return DirInfo(path, inode.ino, inode.mode, inode.uid, inode.gid, inode.mtime_ns, recursive, len(files), dirs,
                   others, sum(f.size for f in files.values()), inode.chunk_size, inode.update_op,
                   await _xattrs(client, inode.ino), _finish(totals, shares))


async def path_info(client: Client, path: str, recursive: bool = False, versions: bool = True) -> FileInfo | DirInfo:
    """:func:`file_info` or :func:`dir_info` of the namespace path ``path``.

    Args:
        recursive: a directory's whole tree (else its own entries).
        versions: a file's chunk versions from its shards.

    Raises:
        NotFound: no such path. NotADirectory: a component of it is a file.
        IrdmaError: the metadata engine failed.
    """
    shards = await _shards(client)
    inode = await resolve(client, path)
    if inode.is_dir:
        return await dir_info(client, path, inode, recursive, shards)
    return await file_info(client, path, inode, shards, versions)


__all__ = ["Chunk", "DirInfo", "FileInfo", "IrdmaMount", "Replica", "ShardShare", "Target", "Totals", "as_dict",
           "ask_mount", "bytes_in_files", "dir_info", "file_info", "irdma_mounts", "mount_table", "namespace_key",
           "namespace_path", "path_info", "resolve", "resolve_target", "same_namespace"]
