"""What the dispatcher reads off a request: its file, its push part, whether another shard
forwarded it (and which chunk), its ``op`` label in the shard's metrics, and a copy of it out of
the connection's staging buffer to hold while a snapshot's freeze lasts. Pure functions of the
messages of :mod:`irdma.wire.protocol`; :class:`irdma.server.dispatch.Dispatcher` uses them.
"""

from __future__ import annotations

import dataclasses

from irdma.wire import optimizers
from irdma.wire import protocol as P


def opcode_name(opcode: int) -> str:
    try:
        return P.Opcode(opcode).name.lower()
    except ValueError:
        return "unknown"


OP_NAMES = {P.Read: "read", P.Write: "write", P.RemoteWrite: "remote_write", P.Resync: "resync",
            P.Checksum: "checksum", P.List: "list", P.Sync: "sync", P.Stat: "stat", P.Free: "free",
            P.Punch: "punch", P.Locate: "locate", P.Gather: "gather", P.Scatter: "scatter",
            P.Freeze: "freeze", P.Clone: "clone", P.Thaw: "thaw", P.Usage: "usage", P.Admit: "admit",
            P.FreeFiles: "free_files"}

#: The requests that may carry a push part.
PARTED = (P.Write, P.RemoteWrite, P.Scatter)
#: The requests that change neither the region nor the chunk index (all others may: a shard
#: syncs what they did within :data:`irdma.wire.protocol.SYNC_INTERVAL_S`).
READ_ONLY = (P.Read, P.Checksum, P.List, P.Sync, P.Stat, P.Gather, P.Usage)
#: The requests a freeze holds (updates).
UPDATES = (P.Write, P.Scatter, P.RemoteWrite, P.Punch, P.Free)


def push_of(msg: P.Request) -> int:
    chain = getattr(msg, "chain", None)
    return chain.part.push_id if chain is not None and chain.part is not None else 0


def detached(msg: P.Request, staging: memoryview | None) -> P.Request:
    """``msg`` with its payload copied out of the connection's staging buffer (verbs), so it
    can wait for a thaw while the connection's next requests reuse the buffer."""
    if isinstance(msg, P.RemoteWrite) and not msg.in_place:
        if staging is None or msg.staging_offset + msg.length > len(staging):
            return msg  # refused when applied, as it would be now
        data = bytes(staging[msg.staging_offset : msg.staging_offset + msg.length])
        return P.Write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, data, msg.existing, msg.chain)
    if isinstance(msg, P.Scatter) and msg.staged:
        if staging is None or msg.staging_offset + msg.length > len(staging):
            return msg
        return dataclasses.replace(msg, data=bytes(staging[msg.staging_offset : msg.staging_offset + msg.length]),
                                   staged=False)
    return msg



def file_of(msg: P.Request) -> int:
    return int(getattr(msg, "file_id", 0))


def is_forward(msg: P.Request) -> bool:
    """An update a replica forwarded down a chain (its ``expect`` set, or a REPLACE)."""
    chain = getattr(msg, "chain", None)
    return chain is not None and bool(chain.expect or getattr(msg, "replace", False))


def forward_key(msg: P.Request) -> tuple[int, int] | None:
    """The chunk a forwarded update is of (a forward names one chunk; one of an optimizer state
    chunk counts as its chunk's: the state's version follows the chunk's, and the two are
    ordered and cut together), or None for another request."""
    if not is_forward(msg):
        return None
    if isinstance(msg, P.Scatter):
        return (msg.file_id, int(msg.extents["chunk"][0])) if len(msg.extents) else None
    index = int(getattr(msg, "chunk_index", 0))
    if optimizers.is_state(index):
        index -= optimizers.STATE_BASE
    return (int(getattr(msg, "file_id", 0)), index)


def op_of(msg: P.Request) -> str:
    """The ``op`` label of a request: ``forward`` for an update another shard forwarded."""
    if is_forward(msg):
        return "forward"
    return OP_NAMES.get(type(msg), type(msg).__name__.lower())


def status_name(status: int) -> str:
    try:
        return P.Status(status).name.lower()
    except ValueError:
        return "unknown_status"
