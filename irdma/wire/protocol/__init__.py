"""The irdma wire protocol: pure code over bytes, no I/O (in the manner of h11).

How it works
------------
Every message is a *frame*: a fixed 16-byte header followed by a body. All integers of
headers and bodies are unsigned and in network byte order (big-endian). Tensor payloads are
carried verbatim; irdma's convention for parameters is little-endian IEEE-754 float32, C order.

Header, ``struct`` format ``!2sBBIHHI`` (16 bytes)::

    magic      2s  b"IR"
    version    u8  protocol version of this frame (PROTOCOL_VERSION)
    opcode     u8  Opcode
    request_id u32 chosen by the client, echoed by the reply (requests may be pipelined)
    status     u16 Status; 0 in requests
    flags      u16 FLAG_REPLY on replies, FLAG_HOLE on a READ reply of a missing chunk
    body_len   u32 bytes that follow; at most the decoder's ``max_body``

A connection opens with HELLO (protocol versions the client speaks, its name and its *auth
offer*: the cluster id and a fresh nonce) and the shard answers with its id, capacity, largest
payload and *incarnation*: a random non-zero u64 made with the shard's memory, so a client tells a
shard that lost its chunks (a restart) from one that kept them. A shard with a cluster key
(protocol 4) first answers HELLO with a challenge (FLAG_CHALLENGE: its own nonce), the client
proves the key with AUTH, and the shard's HELLO-style reply to AUTH carries its proof back; from
then on every frame in both directions is followed by a 16-byte tag (not counted in
``body_len``). See :mod:`irdma.wire.auth` for the exchange and the tags; anything else is answered
AUTH_FAILED and the connection closed. The header version of a HELLO frame is not checked (the body
carries the range the client speaks, and the shard answers UNSUPPORTED_VERSION); every later frame
must carry the negotiated version.

A request may set FLAG_EXISTING: a WRITE with it is applied only to a chunk that exists (one the
metadata records as written); a missing chunk is answered CHUNK_LOST and nothing is created, so a
lost chunk never silently comes back as zeros plus the new bytes. LIST pages through the shard's
chunks (for ``irdma gc`` and ``irdma fsck``). SYNC returns once every update the shard applied
before it is durable (``msync``/``fsync`` of a shard with a data directory; nothing to do for
one whose memory is volatile or whose durability is ``memory``). Requests are
applied in order per connection and answered in order unless replicated (below) or held by a
snapshot's FREEZE (answered once applied, after THAW; the connection's later requests to
other files go on meanwhile). A reply whose status is not OK carries a UTF-8 message as
its body. :class:`FrameDecoder` turns a byte stream, fed in pieces of any size, into frames;
:func:`decode_body` turns a frame into a message; :func:`encode` does the reverse and returns a
list of buffers so payloads are sent without being copied.

Replication (protocol 3): a WRITE or REMOTE_WRITE with FLAG_CHAIN carries a :class:`Chain`
after its fixed part (request id, shard-map epoch, expected version, forward deadline and the
replicas after the receiver); the receiver applies it once per request id, forwards it in order
and answers when the rest of the chain did (replies may then come out of order: match them by
request id). FLAG_REPLACE marks a forward that carries a whole chunk and its version (how a
replica that missed updates is brought level); RESYNC asks a replica to send its copy of a chunk
down a chain; CHECKSUM answers a chunk's version and CRC-32 and, like every chained request,
fences views older than its own. The statuses STALE, FENCED, DIRTY
and FORWARD_FAILED belong to replication; STALE and FORWARD_FAILED bodies start with the u32 id
of the replica concerned. See :mod:`irdma.server.replicate`.

Sparse access (protocol 7): GATHER pulls a list of *extents* (chunk index, offset, length) of
one file in one request and SCATTER pushes one with an update op, ps-lite's sparse pull and push
(Li et al., OSDI 2014) as vectored I/O in the manner of ``preadv``/``pwritev``. An extent lies
inside one chunk; a SCATTER applies its extents of each chunk atomically with one version bump
per chunk (extents of one chunk must not overlap); a GATHER reply carries one u64 version per
extent (0: a hole, read as zeros), after a u32 count and 4 pad bytes, and then the extents' bytes in request order. Extents travel
as ``!QII`` records (16 bytes each) after the fixed part.

The update ops and their semantics (applied atomically per chunk by the shard, each bumps the
chunk's version by one) follow the parameter-server model of ps-lite (Li et al., OSDI 2014)
and the server-side accumulate of SoftMemoryBox II (Ahn et al., IEEE Access 2020).

Compressed gradients (protocol 8): the op byte of WRITE and REMOTE_WRITE is ``op | encoding << 4``
(:class:`Encoding`: 0 none, 1 top-k, 2 scaled sign; the layouts are in :mod:`irdma.wire.compress`).
The payload of an encoded write is the encoded gradient; the shard decodes it (refusing a
malformed one, BAD_REQUEST, nothing changed) and applies the op to the ``4 * n`` decoded bytes
at ``offset``, exactly as a dense write of them. ``assign`` and SCATTER are never encoded.

Modules
-------
The package is cut by subject; every message class owns its layout (its ``struct`` beside its
fields) and its codec (``encode()``, ``decode(body, flags)``, ``decode_reply(body, flags)``):

* :mod:`._core`: versions, the header, flags, opcodes, statuses, the common VERSION reply.
* :mod:`._update`: update ops, :class:`Update` and the op byte.
* :mod:`._chain`: chain replication (:class:`Chain`, :class:`Part`) and RESYNC.
* :mod:`._data`: READ, WRITE, GATHER, SCATTER, PUNCH, FREE; extents.
* :mod:`._inventory`: STAT, LIST, CHECKSUM, SYNC.
* :mod:`._snapshots`: FREEZE, ADMIT, CLONE, THAW, USAGE, FREE_FILES.
* :mod:`._handshake`: HELLO, AUTH.
* :mod:`._verbs`: VERBS_CONNECT, LOCATE, REMOTE_WRITE (the verbs transport).
* :mod:`._errors`: error replies and the status<->exception table.
* :mod:`._table`: :data:`MESSAGES`, built from the request classes; :class:`Call` and
  :func:`reply_kind` (a request's reply class, from its ``decode_reply``).
* :mod:`._frames`: frames, their encoding and decoding.

Every name is re-exported here; import them from :mod:`irdma.wire.protocol`.
"""

from __future__ import annotations

from ._chain import Chain, Part, Resync
from ._core import (
    BODY_SLACK,
    DEFAULT_MAX_PAYLOAD,
    FLAG_CHAIN,
    FLAG_CHALLENGE,
    FLAG_CLEAN,
    FLAG_EXISTING,
    FLAG_HOLE,
    FLAG_PART,
    FLAG_REPLACE,
    FLAG_REPLY,
    FLAG_STAGED,
    FLAG_STAGED_EXTENTS,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    SHORT_COPIES,
    SYNC_INTERVAL_S,
    Opcode,
    Status,
    VersionReply,
)
from ._data import (
    EXTENT,
    EXTENT_SIZE,
    GATHER_REPLY_FIXED,
    READ_REPLY_FIXED,
    WRITE_FIXED,
    Free,
    FreeReply,
    Gather,
    GatherReply,
    Punch,
    Read,
    ReadReply,
    Scatter,
    Write,
    extents,
)
from ._errors import REFUSED_STATUSES, SHARD_STATUSES, STATUS_ERRORS, ErrorReply, error_reply, raise_for_error
from ._frames import (
    Frame,
    FrameDecoder,
    FrameTooLarge,
    Parts,
    UnexpectedReply,
    UnknownOpcode,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    expect_reply,
    parse_header,
)
from ._handshake import AUTH_PROOF_SIZE, Auth, AuthChallenge, Hello, HelloReply
from ._inventory import MAX_LIST_ENTRIES, Checksum, ChecksumReply, ChunkEntry, List, ListReply, Stat, StatReply, Sync
from ._snapshots import (
    MAX_ADMIT,
    MAX_SNAPSHOT_FILES,
    PART_MEMORY_S,
    Admit,
    Clone,
    FreeFiles,
    Freeze,
    FreezeReply,
    Thaw,
    Usage,
    UsageReply,
)
from ._table import _REQUEST_OPCODE as _REQUEST_OPCODE  # the opcode of a request class, by class
from ._table import MESSAGES, Call, Message, Reply, Request, reply_kind
from ._update import (
    OPT_CENTERED,
    OPT_NESTEROV,
    ROUND_BIT,
    ROUND_CLOSE,
    ROUND_ELASTIC,
    ROUND_SUM,
    Encoding,
    Round,
    Update,
    UpdateOp,
    as_update,
    op_kind,
)
from ._verbs import Locate, LocateReply, RemoteWrite, VerbsConnect, VerbsConnectReply

__all__ = [
    "AUTH_PROOF_SIZE", "Admit", "Auth", "AuthChallenge", "BODY_SLACK", "Call", "Chain", "Checksum", "ChecksumReply",
    "ChunkEntry", "Clone", "DEFAULT_MAX_PAYLOAD", "EXTENT", "EXTENT_SIZE", "Encoding", "ErrorReply", "FLAG_CHAIN",
    "FLAG_CHALLENGE", "FLAG_CLEAN", "FLAG_EXISTING", "FLAG_HOLE", "FLAG_PART", "FLAG_REPLACE", "FLAG_REPLY",
    "FLAG_STAGED", "FLAG_STAGED_EXTENTS", "Frame", "FrameDecoder", "FrameTooLarge", "Free", "FreeFiles", "FreeReply",
    "Freeze",
    "FreezeReply", "GATHER_REPLY_FIXED", "Gather", "GatherReply", "HEADER", "HEADER_SIZE", "Hello", "HelloReply",
    "List", "ListReply", "Locate", "LocateReply", "MAGIC", "MAX_ADMIT", "MAX_LIST_ENTRIES", "MAX_SNAPSHOT_FILES",
    "MESSAGES", "MIN_PROTOCOL_VERSION", "Message", "OPT_CENTERED", "OPT_NESTEROV", "Opcode", "PART_MEMORY_S",
    "PROTOCOL_VERSION", "Part", "Parts", "Punch", "READ_REPLY_FIXED", "REFUSED_STATUSES", "Read", "ReadReply",
    "RemoteWrite", "Reply", "Request", "Resync", "SHARD_STATUSES", "SHORT_COPIES", "STATUS_ERRORS", "Scatter", "Stat",
    "StatReply", "Status", "SYNC_INTERVAL_S", "Sync", "Thaw", "UnexpectedReply", "UnknownOpcode", "Update", "UpdateOp", "Round", "ROUND_BIT",
    "ROUND_SUM", "ROUND_ELASTIC", "ROUND_CLOSE", "Usage", "UsageReply",
    "VerbsConnect", "VerbsConnectReply", "VersionReply", "WRITE_FIXED", "Write", "as_update", "decode_reply",
    "decode_request", "encode_reply", "encode_request", "error_reply", "expect_reply", "extents", "op_kind",
    "parse_header", "raise_for_error", "reply_kind",
]
