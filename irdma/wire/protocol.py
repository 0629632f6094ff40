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
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

import numpy as np

from .._errors import (
    BadRequest,
    DataLost,
    Dirty,
    Fenced,
    IrdmaError,
    LocalProtocolError,
    NoSpace,
    RemoteProtocolError,
    ReplicaFailed,
    ReplicaStale,
    ShardUnavailable,
)

PROTOCOL_VERSION = 10
#: Oldest protocol version this code speaks (3 added chain replication, 4 authentication, 5 GMAC
#: frame tags, 6 optimizer update ops, 7 GATHER and SCATTER of extents: sparse rows, 8 encoded
#: (compressed) gradients in WRITE and REMOTE_WRITE, 9 push parts (FLAG_PART) and ADMIT: a
#: snapshot keeps a push whole; FREE_FILES; 10 no new frame: CLONE ends the freeze on its shard,
#: and a frozen shard holds forwarded updates until its clone, so pushes wait one round trip
#: of the snapshot's creator, not three; a creator of protocol 9 still sends THAW, a no-op then).
MIN_PROTOCOL_VERSION = 9
MAGIC = b"IR"
HEADER = struct.Struct("!2sBBIHHI")
HEADER_SIZE = HEADER.size  # 16
#: Default largest payload (bytes) of one READ or WRITE; shards advertise theirs in HELLO.
DEFAULT_MAX_PAYLOAD = 16 << 20
#: Room for the fixed part of any body on top of the payload.
BODY_SLACK = 256

FLAG_REPLY = 0x1
FLAG_HOLE = 0x2
#: On a WRITE request: apply only to an existing chunk, else answer CHUNK_LOST.
FLAG_EXISTING = 0x4
#: On WRITE and REMOTE_WRITE: the body carries a replication :class:`Chain` after the fixed part.
FLAG_CHAIN = 0x8
#: On a forwarded WRITE: the payload is the whole chunk; set it and the chunk's version to
#: ``chain.expect`` (how a predecessor brings a stale replica up to date).
FLAG_REPLACE = 0x10
#: On READ: answer DIRTY rather than bytes some replica after this one may not have yet.
FLAG_CLEAN = 0x20
#: On the reply to HELLO: a challenge (the shard's nonce); prove the key with AUTH.
FLAG_CHALLENGE = 0x40
#: On SCATTER: the payload is not in the frame but in the connection's staging buffer at
#: ``staging_offset`` (verbs: it moved there by RDMA WRITE).
FLAG_STAGED = 0x80
#: On WRITE, REMOTE_WRITE and SCATTER with FLAG_CHAIN: a :class:`Part` follows the chain (the
#: update is one of several requests of one push; a snapshot's cut keeps a push whole).
FLAG_PART = 0x100
#: Most entries one LIST reply carries.
MAX_LIST_ENTRIES = 4096


class Opcode(enum.IntEnum):
    HELLO = 1
    READ = 2
    WRITE = 3
    STAT = 4
    FREE = 5
    PUNCH = 6
    VERBS_CONNECT = 7
    LOCATE = 8
    REMOTE_WRITE = 9
    LIST = 10
    SYNC = 11
    RESYNC = 12
    CHECKSUM = 13
    AUTH = 14
    GATHER = 15
    SCATTER = 16
    FREEZE = 17
    CLONE = 18
    THAW = 19
    USAGE = 20
    ADMIT = 21
    FREE_FILES = 22


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1
    NO_SPACE = 2
    UNKNOWN_OPCODE = 3
    TOO_LARGE = 4
    UNSUPPORTED_VERSION = 5
    AUTH_FAILED = 6
    INTERNAL = 7
    BAD_FRAME = 8
    CHUNK_LOST = 9
    STALE = 10  # a replica's chunk version does not follow the forwarded one (it missed updates)
    FENCED = 11  # the request's view of the shard map is older than one this shard has seen
    DIRTY = 12  # FLAG_CLEAN read of a chunk whose last update is not yet on every replica
    FORWARD_FAILED = 13  # applied here, but a successor failed or missed the forward deadline


#: Statuses whose error body starts with the u32 id of the shard concerned.
SHARD_STATUSES = (Status.STALE, Status.FORWARD_FAILED)

#: The one table of error statuses and the exceptions they stand for, read by both sides: a
#: shard answers an exception with the status of the first class here it is an instance of
#: (:func:`error_reply`), a client raises that class for the status (:func:`raise_for_error`).
#: (3FS's StatusCode, one table per direction being the bug this replaces.)
STATUS_ERRORS: tuple[tuple[Status, type[IrdmaError]], ...] = (
    (Status.NO_SPACE, NoSpace),
    (Status.BAD_REQUEST, BadRequest),
    (Status.CHUNK_LOST, DataLost),
    (Status.STALE, ReplicaStale),
    (Status.FORWARD_FAILED, ReplicaFailed),
    (Status.FENCED, Fenced),
    (Status.DIRTY, Dirty),
)
#: Statuses of a frame the shard refused before applying it: the client raises BadRequest.
REFUSED_STATUSES = (Status.BAD_REQUEST, Status.TOO_LARGE, Status.UNKNOWN_OPCODE)


class UpdateOp(enum.IntEnum):
    """What a write does to the bytes already in a chunk.

    ``ASSIGN`` overwrites. ``ADD`` adds element-wise as little-endian float32: offset and
    length must be multiples of 4. ``SGD``, ``ADAM``, ``ADAGRAD`` and ``RMSPROP`` (protocol 6)
    take the bytes as a float32 gradient and apply one optimizer step (:class:`Update` carries
    their arguments; :mod:`irdma.train.optimizers` parses them, :mod:`irdma.server.optim` applies them).
    """

    ASSIGN = 0
    ADD = 1
    SGD = 2
    ADAM = 3
    ADAGRAD = 4
    RMSPROP = 5

    @property
    def is_optimizer(self) -> bool:
        """Whether a write of this op is a gradient with state on the shard."""
        return self >= UpdateOp.SGD

    @property
    def is_float32(self) -> bool:
        """Whether writes must be float32-aligned (offset and length multiples of 4)."""
        return self != UpdateOp.ASSIGN

    @classmethod
    def parse(cls, name: str | bytes) -> UpdateOp:
        """Map ``"assign"``/``"add"`` to an op.

        Raises:
            ValueError: the name is not an update op.
        """
        if isinstance(name, bytes):
            name = name.decode("ascii", "replace")
        try:
            return cls[name.strip().upper()]
        except KeyError:
            valid = ", ".join(op.name.lower() for op in cls)
            raise ValueError(f"unknown update op {name!r}: use one of {valid}") from None


class Encoding(enum.IntEnum):
    """How the payload of a WRITE or REMOTE_WRITE is encoded (protocol 8): the high nibble of
    the op byte. ``TOPK`` and ``SIGN`` carry a compressed float32 gradient that the shard
    decodes before applying the op (layouts: :mod:`irdma.wire.compress`); never with ``assign``."""

    NONE = 0
    TOPK = 1
    SIGN = 2


#: Flag bits of an optimizer :class:`Update`.
OPT_NESTEROV = 0x1
OPT_CENTERED = 0x2


@dataclass(frozen=True)
class Update:
    """An update op with its arguments, as a WRITE or REMOTE_WRITE carries it.

    Attributes:
        op: the op (its byte in the fixed part).
        args: for an optimizer op, its four float64 arguments in the order of
            :data:`irdma.train.optimizers.ARGUMENTS` (unused ones 0.0); they follow the fixed part
            as ``!4dI4x`` (40 bytes) with ``flags``, before any chain.
        flags: OPT_NESTEROV, OPT_CENTERED.
        encoding: how the payload is encoded (:class:`Encoding`, protocol 8; the op byte's
            high nibble): the shard decodes it and applies ``op`` to the decoded gradient.
            Only with ``add`` and the optimizers.
    """

    op: UpdateOp
    args: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    flags: int = 0
    encoding: Encoding = Encoding.NONE

    @property
    def dense(self) -> UpdateOp | Update:
        """The same update with its payload decoded: what the shard applies."""
        if not self.encoding:
            return self
        return dataclasses.replace(self, encoding=Encoding.NONE) if self.op.is_optimizer else self.op


def as_update(op: UpdateOp | Update) -> Update:
    """An :class:`Update` for an op given either way."""
    return op if isinstance(op, Update) else Update(UpdateOp(op))


def op_kind(op: UpdateOp | Update) -> UpdateOp:
    """The op of an :class:`Update` or op."""
    return op.op if isinstance(op, Update) else UpdateOp(op)


# ---------------------------------------------------------------- messages
_HELLO = struct.Struct("!BBHH")  # min version, max version, name len, auth offer len
#: Bytes of a nonce and of a proof in the auth exchange (HMAC-SHA256).
AUTH_PROOF_SIZE = 32
_HELLO_R = struct.Struct("!B3xIQIQI")  # version, shard id, capacity, max payload, incarnation, extra len
_READ = struct.Struct("!QQII")  # file id, chunk index, offset, length
_VERSION = struct.Struct("!Q")
_WRITE = struct.Struct("!QQIIB3x")  # file id, chunk index, chunk size, offset, op
_STAT_R = struct.Struct("!IQQQ")  # shard id, capacity, used, chunks
_FREE = struct.Struct("!QQ")  # file id, first chunk index
_PUNCH = struct.Struct("!QQI")  # file id, chunk index, offset
# verbs: client QP number, PSN, GID; then the shard's QP, memory-region descriptors and limits
_VCONN = struct.Struct("!II16s")
_VCONN_R = struct.Struct("!II16sQQIQIQIIHI")
_LOCATE = struct.Struct("!QQI")  # file id, chunk index, chunk size to create with (0: do not)
_LOCATE_R = struct.Struct("!B3xQIQ")  # exists, region offset, chunk size, version slot index
_LIST = struct.Struct("!QQI")  # after file id, after chunk index, max entries
_LIST_R = struct.Struct("!I")  # entry count, then entries
_LIST_E = struct.Struct("!QQIQ")  # file id, chunk index, chunk size, version
_FREEZE = struct.Struct("!QII")  # token, lease in milliseconds, file count; then u64 file ids
_CLONE = struct.Struct("!QII")  # token, pair count, expected-version count; then pairs, then versions
_PAIR = struct.Struct("!QQ")  # source file id, clone's file id
_EXPECT = struct.Struct("!QQQ")  # file id, chunk index, version
_USAGE_E = struct.Struct("!QQQ")  # file id, bytes it holds alone, bytes it shares
_PART = struct.Struct("!QII")  # push id, part index, part count
_ADMIT = struct.Struct("!QII")  # token, wait in milliseconds, push id count; then u64 push ids
#: Most push ids one ADMIT names.
MAX_ADMIT = 4096
#: Most files one FREEZE or CLONE names (a bigger snapshot sends several).
MAX_SNAPSHOT_FILES = 65536
_RWRITE = struct.Struct("!QQIIBB2xIQQ")  # file, chunk, chunk size, offset, op, in place, length, staging off, region off
_CHAIN = struct.Struct("!QQQIB3x")  # request id, view, expect version, forward timeout (ms), successor count
_PEER = struct.Struct("!IH")  # shard id, address length; the UTF-8 address follows
_RESYNC = struct.Struct("!QQI")  # file id, chunk index, chunk size
_CHECKSUM = struct.Struct("!QQQ")  # file id, chunk index, view
_CHECKSUM_R = struct.Struct("!QI")  # version, CRC-32 of the chunk's bytes
_ERR_SHARD = struct.Struct("!I")
_OPTIM = struct.Struct("!4dI4x")  # an optimizer update's arguments and flags
_GATHER = struct.Struct("!QI4x")  # file id, extent count; extents follow
_GATHER_R = struct.Struct("!I4x")  # extent count; a u64 version per extent and the bytes follow
_SCATTER = struct.Struct("!QIIB3xQ")  # file id, chunk size, extent count, op, staging offset
#: One extent of GATHER and SCATTER: chunk index (u64), offset in the chunk, length (u32 each).
EXTENT = np.dtype([("chunk", ">u8"), ("offset", ">u4"), ("length", ">u4")])
#: Bytes of one extent on the wire.
EXTENT_SIZE = EXTENT.itemsize  # 16
_VERSIONS = np.dtype(">u8")


def extents(chunk: object, offset: object, length: object) -> np.ndarray:
    """An array of :data:`EXTENT` records from three equal-length integer sequences.

    Raises:
        LocalProtocolError: the sequences differ in length or a value does not fit its field.
    """
    c, o, n = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (chunk, offset, length))
    if not len(c) == len(o) == len(n):
        raise LocalProtocolError(f"extents of {len(c)} chunks, {len(o)} offsets and {len(n)} lengths")
    if len(c) and (c.min() < 0 or o.min() < 0 or n.min() < 0 or o.max() >= 1 << 32 or n.max() >= 1 << 32):
        raise LocalProtocolError("an extent's chunk, offset or length does not fit its field")
    out = np.empty(len(c), dtype=EXTENT)
    out["chunk"], out["offset"], out["length"] = c, o, n
    return out


def _decode_extents(body: memoryview, at: int, count: int, what: str) -> tuple[np.ndarray, int]:
    end = at + count * EXTENT_SIZE
    _need(body, end, what)
    ext = np.frombuffer(body[at:end], dtype=EXTENT)
    if count and int(ext["chunk"].max()) >= 1 << 63:
        raise RemoteProtocolError(f"{what} names a chunk index of 2^63 or more")
    return ext, end


def _encode_update(op: UpdateOp | Update, encodable: bool = True) -> tuple[int, bytes]:
    u = as_update(op)
    enc = Encoding(u.encoding)
    if enc and (not encodable or not u.op.is_float32):
        raise LocalProtocolError(f"an encoded ({enc.name.lower()}) payload goes only with add or an optimizer"
                                 " in WRITE or REMOTE_WRITE")
    return int(u.op) | int(enc) << 4, (_OPTIM.pack(*u.args, u.flags) if u.op.is_optimizer else b"")


def _decode_update(opv: int, body: memoryview, at: int, encodable: bool = True) -> tuple[UpdateOp | Update, int]:
    try:
        uop = UpdateOp(opv & 0xF)
    except ValueError:
        raise RemoteProtocolError(f"unknown update op {opv & 0xF}") from None
    try:
        enc = Encoding(opv >> 4)
    except ValueError:
        raise RemoteProtocolError(f"unknown payload encoding {opv >> 4}") from None
    if enc and (not encodable or not uop.is_float32):
        raise RemoteProtocolError(f"an encoded ({enc.name.lower()}) payload goes only with add or an optimizer"
                                  " in WRITE or REMOTE_WRITE")
    if not uop.is_optimizer:
        return (Update(uop, encoding=enc) if enc else uop), at
    _need(body, at + _OPTIM.size, "optimizer arguments")
    *args, flags = _OPTIM.unpack_from(body, at)
    return Update(uop, tuple(args), flags, enc), at + _OPTIM.size


@dataclass(frozen=True)
class Part:
    """The part a request is of a push that takes several (FLAG_PART; protocol 9): a client
    cuts a push into one update per chunk piece (or one SCATTER per shard), and tags each with
    the push's id, its own index and how many there are, so a snapshot's cut can take the
    whole push or none of it (:mod:`irdma.client.snapshots`).

    Attributes:
        push_id: u64, random, chosen by the client per push (never 0).
        index: u32, this request's place among the push's parts, ``0 <= index < count``.
        count: u32, how many requests the push was cut into (at least 2).
    """

    push_id: int
    index: int
    count: int


@dataclass
class Chain:
    """Chain replication of one update (CRAQ: Terrace & Freedman, USENIX ATC 2009; chain
    replication: van Renesse & Schneider, OSDI 2004).

    The client sends an update to the chunk's head replica with the rest of the chain as
    ``successors``; each replica applies it, then forwards it to the next with ``expect`` set to
    the version it reached, and answers once the rest of the chain answered. ``request_id``
    (client-chosen, unique, never 0) makes a retried request apply once: a replica that already
    applied it answers the version it reached and still forwards it along the (possibly new)
    chain. ``view`` is the shard map epoch the sender acts on: a replica refuses (FENCED) a view
    older than one it has seen, so a demoted head cannot overwrite the new chain.

    Attributes:
        request_id: u64, unique per update (0: no deduplication, a REPLACE).
        view: u64 shard-map epoch.
        expect: u64, 0 from a client; on a forward, the chunk version the sender reached.
        timeout_ms: u32 deadline of the forward to the next replica, milliseconds.
        successors: ``(shard id, "HOST:PORT")`` of the replicas after the receiver, in order.
    """

    request_id: int
    view: int = 0
    expect: int = 0
    timeout_ms: int = 5000
    successors: tuple[tuple[int, str], ...] = ()
    #: The push this update is a part of, when it is one of several (FLAG_PART, after the
    #: chain on the wire; a client's update only: forwards leave it out).
    part: Part | None = None

    def encode(self) -> bytes:
        out = [_CHAIN.pack(self.request_id, self.view, self.expect, self.timeout_ms, len(self.successors))]
        for sid, addr in self.successors:
            a = addr.encode()
            out.append(_PEER.pack(sid, len(a)) + a)
        return b"".join(out)

    @classmethod
    def decode(cls, body: memoryview, at: int) -> tuple[Chain, int]:
        """Parse a chain at ``body[at:]``; returns it and the offset after it."""
        _need(body[at:], _CHAIN.size, "chain")
        rid, view, expect, tmo, n = _CHAIN.unpack_from(body, at)
        at += _CHAIN.size
        succ = []
        for _ in range(n):
            _need(body[at:], _PEER.size, "chain successor")
            sid, alen = _PEER.unpack_from(body, at)
            at += _PEER.size
            _need(body[at:], alen, "chain successor address")
            succ.append((sid, bytes(body[at : at + alen]).decode("utf-8", "replace")))
            at += alen
        return cls(rid, view, expect, tmo, tuple(succ)), at


@dataclass
class Hello:
    min_version: int = MIN_PROTOCOL_VERSION
    max_version: int = PROTOCOL_VERSION
    client_name: str = ""
    auth: bytes = b""  # the auth offer: cluster id (16 bytes) and client nonce (32); empty for none


@dataclass
class HelloReply:
    version: int
    shard_id: int
    capacity: int
    max_payload: int
    incarnation: int = 0  # random, made with the shard's memory; 0 only in old replies
    extra: bytes = b""  # transport-specific (verbs: region descriptors, QP info)
    proof: bytes = b""  # the reply to AUTH: the shard's proof of the key (32 bytes)


@dataclass
class AuthChallenge:
    """The reply to HELLO of a shard with a key: its nonce (32 bytes)."""

    nonce: bytes


@dataclass
class Auth:
    """The client's proof of the cluster key (32 bytes), after an :class:`AuthChallenge`."""

    proof: bytes


@dataclass
class Read:
    file_id: int
    chunk_index: int
    offset: int
    length: int
    clean: bool = False  # FLAG_CLEAN: answer DIRTY rather than a version not on every replica


@dataclass
class ReadReply:
    version: int
    data: memoryview | bytes = b""
    hole: bool = False


@dataclass
class Write:
    file_id: int
    chunk_index: int
    chunk_size: int
    offset: int
    op: UpdateOp | Update
    data: memoryview | bytes = b""  # with an encoded op (protocol 8): the encoded gradient
    existing: bool = False  # FLAG_EXISTING: never create the chunk
    chain: Chain | None = None  # FLAG_CHAIN: replicate along this chain
    replace: bool = False  # FLAG_REPLACE (forwards only): data is the whole chunk


@dataclass
class Gather:
    """Pull ``extents`` (:data:`EXTENT` records) of one file in one request (sparse rows).
    ``clean``: FLAG_CLEAN, answer DIRTY if any extent's chunk has an update in flight (CRAQ)."""

    file_id: int
    extents: np.ndarray
    clean: bool = False


@dataclass
class GatherReply:
    """Reply to GATHER: ``versions`` (u64 per extent, 0 for a hole, which reads as zeros) and
    ``data``, the extents' bytes one after the other in request order."""

    versions: np.ndarray
    data: memoryview | bytes = b""


@dataclass
class Scatter:
    """Push ``data`` into ``extents`` of one file with update op ``op`` (sparse rows).

    ``data`` is the extents' bytes one after the other in request order; with ``staged`` (FLAG_STAGED,
    verbs) it is not in the frame but at ``staging_offset`` of the connection's staging buffer.
    The extents of one chunk are applied atomically, one version bump per chunk; a chained
    SCATTER is applied once per (request id, chunk) and forwarded chunk by chunk. Answered with a
    :class:`VersionReply` of the highest chunk version reached.
    """

    file_id: int
    chunk_size: int
    extents: np.ndarray
    op: UpdateOp | Update
    data: memoryview | bytes = b""
    existing: bool = False  # FLAG_EXISTING: never create a chunk
    chain: Chain | None = None  # FLAG_CHAIN
    staged: bool = False  # FLAG_STAGED
    staging_offset: int = 0

    @property
    def length(self) -> int:
        """Bytes of payload the extents name."""
        return int(self.extents["length"].sum(dtype=np.int64))


@dataclass
class Resync:
    """Bring the replicas after the receiver up to date on one chunk: the receiver sends its
    whole chunk down ``chain`` (a REPLACE ordered after every update it applied before)."""

    file_id: int
    chunk_index: int
    chunk_size: int
    chain: Chain


@dataclass
class Checksum:
    """The version and CRC-32 of a chunk's bytes (to compare replicas). ``view``: the shard-map
    epoch the resync acts on; the receiver refuses an older one than it has seen (FENCED) and
    fences updates older than it from then on, so none can slip past the comparison."""

    file_id: int
    chunk_index: int
    view: int = 0


@dataclass
class ChecksumReply:
    version: int  # 0: no such chunk
    crc: int  # zlib CRC-32 of the whole chunk; 0 when missing


@dataclass
class VersionReply:
    """Reply to WRITE and PUNCH: the chunk's version after the update."""

    version: int


@dataclass
class Stat:
    pass


@dataclass
class StatReply:
    """Reply to STAT. ``metrics``: the shard's Prometheus exporter, ``HOST:PORT`` as UTF-8 after
    the fixed part (at most 255 bytes; empty: none), so ``irdma stats --meta`` finds it."""

    shard_id: int
    capacity: int
    used: int
    chunks: int
    metrics: str = ""


@dataclass
class Free:
    file_id: int
    first_chunk: int


@dataclass
class FreeReply:
    freed: int


@dataclass
class Sync:
    """Make every update applied so far durable; answered with a VersionReply of 0."""


@dataclass
class List:
    """Chunks of the shard after ``(after_file, after_chunk)`` in (file, chunk) order."""

    after_file: int = 0
    after_chunk: int = 0
    max_entries: int = MAX_LIST_ENTRIES


@dataclass
class ChunkEntry:
    file_id: int
    chunk_index: int
    chunk_size: int  # bytes
    version: int


@dataclass
class ListReply:
    entries: list[ChunkEntry] = field(default_factory=list)


@dataclass
class FreezeReply(ListReply):
    """Reply to FREEZE and ADMIT: ``entries``, the frozen files' chunks here (file id, chunk
    index, chunk size, version), and ``parts``, the push parts (:class:`Part`) this shard
    applied of those files: for FREEZE, those of the last :data:`PART_MEMORY_S` seconds; for
    ADMIT, those of the pushes it names."""

    parts: list[Part] = field(default_factory=list)


#: Seconds a shard remembers the push parts it applied (a push's parts land within a few
#: milliseconds of one another; a FREEZE reports those of the last half of this).
PART_MEMORY_S = 10.0


@dataclass
class Admit:
    """Between FREEZE and CLONE: the pushes ``push_ids`` were split by the freeze (some of their
    parts were applied before it on some shard, some not): apply their parts this shard holds
    now, and those that come later at once, so the cut takes them whole. Waits up to ``wait_ms``
    for one to come when none is held. Answered with a :class:`FreezeReply` of the chunks of
    the files those parts touched and every part of those pushes this shard applied."""

    token: int
    wait_ms: int = 0
    push_ids: tuple[int, ...] = ()


@dataclass
class FreeFiles:
    """FREE of every chunk of each file (a snapshot's delete: all its files on this shard in one
    request, one chunk-index transaction). Answered with a FREE reply of the chunks freed."""

    file_ids: tuple[int, ...] = ()


@dataclass
class Freeze:
    """Hold the updates to these files until CLONE or THAW with ``token``, or until
    ``lease_ms`` passed (the snapshot that asked is then void): the first phase of a snapshot's
    cut (:mod:`irdma.client.snapshots`). Clients' updates are held, and so are the updates a
    replica forwards down a chain (protocol 10), until this shard's CLONE: those the cut has
    (their version not past it) are applied before the clone, the rest after; a shard not
    cloned within a second (less when the held forwards' deadlines are shorter) lets forwards go on,
    and refuses the clone if one reached a chunk past the cut.
    Answered with a LIST reply of every chunk of those files here (optimizer state left out:
    it follows its chunk)."""

    token: int  # u64, non-zero, chosen by the snapshot's creator
    lease_ms: int
    file_ids: tuple[int, ...] = ()


@dataclass
class Clone:
    """Second phase of a snapshot's cut: once every chunk named in ``expect`` is at that
    version here (a replica catching up on forwarded updates, held or on their way; waited
    for up to the freeze's lease), make each pair's clone file share the source's chunks (no
    byte copied: :meth:`irdma.server.shard.Shard.clone`), then end the freeze here: the held
    updates are applied in the order they came (protocol 10; before, the freeze stayed until
    THAW, sent once every shard had cloned). Token 0: no
    freeze, no versions (the sources are read-only: a snapshot's files, cloned back into the
    live namespace). Answered with a FREE reply giving how many chunk keys were made."""

    token: int
    pairs: tuple[tuple[int, int], ...] = ()  # (source file id, clone's file id)
    expect: tuple[tuple[int, int, int], ...] = ()  # (file id, chunk index, version)


@dataclass
class Usage:
    """How many bytes each file holds on this shard alone and how many it shares with other
    files (a snapshot and its live file: copy-on-write). Answered with a USAGE reply."""

    file_ids: tuple[int, ...] = ()


@dataclass
class UsageReply:
    entries: list[tuple[int, int, int]] = field(default_factory=list)  # (file id, alone, shared) bytes


@dataclass
class Thaw:
    """Release freeze ``token``: the held updates are applied (when a snapshot is given up
    before this shard's CLONE, which ends a freeze itself; a no-op for a freeze that is over).
    Answered with a VERSION reply of 0."""

    token: int


@dataclass
class Punch:
    file_id: int
    chunk_index: int
    offset: int


@dataclass
class VerbsConnect:
    """Verbs transport: the client's RC queue pair, to be connected to a new one on the shard."""

    qp_num: int
    psn: int
    gid: bytes  # 16 bytes, network order


@dataclass
class VerbsConnectReply:
    """The shard's queue pair and the remote memory it lets this client touch.

    ``region_*``: the memory region of chunks (RDMA READ and WRITE). ``versions_*``: the table
    of chunk versions, little-endian u64, slot ``chunk_offset // 4096`` (RDMA READ).
    ``staging_*``: this connection's staging buffer (RDMA WRITE, then REMOTE_WRITE).
    """

    qp_num: int
    psn: int
    gid: bytes
    region_addr: int
    region_len: int
    region_rkey: int
    versions_addr: int
    versions_rkey: int
    staging_addr: int
    staging_len: int
    staging_rkey: int
    recv_slots: int  # requests the shard can take at once on this QP
    slot_size: int  # largest request frame it takes over SEND, bytes


@dataclass
class Locate:
    """Where a chunk lives in the region; ``create_size`` > 0 allocates it if missing."""

    file_id: int
    chunk_index: int
    create_size: int = 0


@dataclass
class LocateReply:
    """``shared``: the chunk shares its extent with another key (a snapshot's): its place may
    change at the next update (copy-on-write), so a client must not cache it (sent as
    ``exists`` = 2)."""

    exists: bool
    region_offset: int = 0
    chunk_size: int = 0
    version_slot: int = 0
    shared: bool = False


@dataclass
class RemoteWrite:
    """A write whose payload already moved by RDMA WRITE.

    ``in_place``: the bytes were written straight into the chunk at ``region_offset`` (assign);
    the shard checks the chunk is still there and bumps its version. Otherwise the payload
    sits in the connection's staging buffer at ``staging_offset`` and the shard applies ``op``.
    """

    file_id: int
    chunk_index: int
    chunk_size: int
    offset: int
    op: UpdateOp | Update
    in_place: bool
    length: int
    staging_offset: int = 0
    region_offset: int = 0
    existing: bool = False  # FLAG_EXISTING: never create the chunk
    chain: Chain | None = None  # FLAG_CHAIN: replicate along this chain


@dataclass
class ErrorReply:
    status: Status
    message: str = ""
    shard_id: int = 0  # STALE, FORWARD_FAILED: the replica concerned


def error_reply(exc: Exception, shard_id: int) -> ErrorReply | None:
    """The error reply a shard (``shard_id``) sends for a request that raised ``exc``
    (:data:`STATUS_ERRORS`; ShardUnavailable met while serving is INTERNAL); None for any other
    exception: a bug, which the caller logs and answers INTERNAL."""
    for status, cls in STATUS_ERRORS:
        if isinstance(exc, cls):
            # the class's own hint is not sent: the client's exception of the same class says it once
            said = exc.args[0] if exc.args and isinstance(exc.args[0], str) and getattr(exc, "hint", "") == getattr(type(exc), "hint", "") else str(exc)
            return ErrorReply(status, said, getattr(exc, "shard_id", 0) if status in SHARD_STATUSES else 0)
    if isinstance(exc, ShardUnavailable):
        return ErrorReply(Status.INTERNAL, f"shard {shard_id}: {exc}")
    return None


def raise_for_error(reply: Reply, address: str) -> None:
    """Raise the exception an error reply from the shard at ``address`` stands for
    (:data:`STATUS_ERRORS`); any other status is ShardUnavailable. Other replies pass.

    Raises:
        BadRequest: the shard refused the request (:data:`REFUSED_STATUSES`).
        NoSpace, DataLost, ReplicaStale, ReplicaFailed, Fenced, Dirty: as the table says.
        ShardUnavailable: INTERNAL, AUTH_FAILED and any status this side does not know.
    """
    if not isinstance(reply, ErrorReply):
        return
    where = f"shard at {address}"
    if reply.status in REFUSED_STATUSES:
        raise BadRequest(f"{where} refused the request: {reply.message}")
    for status, cls in STATUS_ERRORS:
        if reply.status == status:
            if status in SHARD_STATUSES:
                raise cls(f"{where}: {reply.message}", reply.shard_id)  # type: ignore[arg-type]
            raise cls(f"{where}: {reply.message}")
    name = reply.status.name if isinstance(reply.status, Status) else str(reply.status)
    raise ShardUnavailable(f"{where} answered {name}: {reply.message}")


Request = Union[Hello, Read, Write, Stat, Free, Punch, VerbsConnect, Locate, RemoteWrite, List, Sync, Resync, Checksum,
                Auth, Gather, Scatter, Freeze, Clone, Thaw, Usage, Admit, FreeFiles]
Reply = Union[
    HelloReply, ReadReply, VersionReply, StatReply, FreeReply, ErrorReply, VerbsConnectReply, LocateReply, ListReply,
    ChecksumReply, AuthChallenge, GatherReply, UsageReply, FreezeReply,
]

# ---------------------------------------------------------------- the message table
_M = TypeVar("_M")
# Each request kind is one row of MESSAGES: its opcode, its class, how it is encoded (the
# parts after the header, and the header's flags), how its body is decoded, and how the body of
# its OK reply is decoded. encode_request, decode_request and decode_reply only look rows up;
# a new request is one row here (and its handling in irdma.server.dispatch).
_Parts = list[bytes | memoryview]


def _chain_of(body: memoryview, at: int, flags: int) -> tuple[Chain | None, int]:
    if not flags & FLAG_CHAIN:
        if flags & FLAG_PART:
            raise RemoteProtocolError("FLAG_PART without FLAG_CHAIN")
        return None, at
    chain, at = Chain.decode(body, at)
    if flags & FLAG_PART:
        _need(body[at:], _PART.size, "push part")
        part = Part(*_PART.unpack_from(body, at))
        if not part.push_id or part.count < 2 or part.index >= part.count:
            raise RemoteProtocolError(f"push part {part.index} of {part.count} (push {part.push_id}) is not valid")
        chain = dataclasses.replace(chain, part=part)
        at += _PART.size
    return chain, at


def _chain_bytes(chain: Chain | None) -> tuple[bytes, int]:
    """The wire bytes of an update's chain and its part, and the flags they set."""
    if chain is None:
        return b"", 0
    if chain.part is None:
        return chain.encode(), FLAG_CHAIN
    part = chain.part
    return chain.encode() + _PART.pack(part.push_id, part.index, part.count), FLAG_CHAIN | FLAG_PART


def _enc_hello(msg: Hello) -> tuple[_Parts, int]:
    name = msg.client_name.encode()
    return [_HELLO.pack(msg.min_version, msg.max_version, len(name), len(msg.auth)) + name + msg.auth], 0


def _dec_hello(body: memoryview, flags: int) -> Hello:
    _need(body, _HELLO.size, "HELLO")
    lo, hi, nlen, clen = _HELLO.unpack_from(body)
    if len(body) != _HELLO.size + nlen + clen:
        raise RemoteProtocolError("HELLO body length does not match its name and auth offer")
    name = bytes(body[_HELLO.size : _HELLO.size + nlen]).decode("utf-8", "replace")
    return Hello(lo, hi, name, bytes(body[_HELLO.size + nlen :]))


def _rep_hello(body: memoryview, flags: int) -> HelloReply | AuthChallenge:
    if flags & FLAG_CHALLENGE:
        _exact(body, AUTH_PROOF_SIZE, "HELLO challenge")
        return AuthChallenge(bytes(body))
    _need(body, _HELLO_R.size, "HELLO reply")
    version, sid, cap, maxp, incarnation, elen = _HELLO_R.unpack_from(body)
    _need(body, _HELLO_R.size + elen, "HELLO reply")
    proof = bytes(body[_HELLO_R.size + elen :])
    if len(proof) not in (0, AUTH_PROOF_SIZE):
        raise RemoteProtocolError(f"HELLO reply carries a {len(proof)}-byte proof")
    return HelloReply(version, sid, cap, maxp, incarnation, bytes(body[_HELLO_R.size : _HELLO_R.size + elen]), proof)


def _enc_auth(msg: Auth) -> tuple[_Parts, int]:
    return [msg.proof], 0


def _dec_auth(body: memoryview, flags: int) -> Auth:
    _exact(body, AUTH_PROOF_SIZE, "AUTH")
    return Auth(bytes(body))


def _rep_auth(body: memoryview, flags: int) -> HelloReply | AuthChallenge:
    return _rep_hello(body, flags & ~FLAG_CHALLENGE)


def _enc_read(msg: Read) -> tuple[_Parts, int]:
    return [_READ.pack(msg.file_id, msg.chunk_index, msg.offset, msg.length)], FLAG_CLEAN if msg.clean else 0


def _dec_read(body: memoryview, flags: int) -> Read:
    _exact(body, _READ.size, "READ")
    fid, idx, off, n = _READ.unpack_from(body)
    return Read(fid, idx, off, n, bool(flags & FLAG_CLEAN))


def _rep_read(body: memoryview, flags: int) -> ReadReply:
    _need(body, _VERSION.size, "READ reply")
    (version,) = _VERSION.unpack_from(body)
    return ReadReply(version, body[_VERSION.size :], bool(flags & FLAG_HOLE))


def _enc_write(msg: Write) -> tuple[_Parts, int]:
    flags = 0
    opv, optim = _encode_update(msg.op)
    chain, flags = _chain_bytes(msg.chain)
    fixed = _WRITE.pack(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, opv) + optim + chain
    flags |= (FLAG_EXISTING if msg.existing else 0) | (FLAG_REPLACE if msg.replace else 0)
    return ([fixed, msg.data] if len(msg.data) else [fixed]), flags


def _dec_write(body: memoryview, flags: int) -> Write:
    _need(body, _WRITE.size, "WRITE")
    fid, idx, csize, off, opv = _WRITE.unpack_from(body)
    uop, at = _decode_update(opv, body, _WRITE.size)
    chain, at = _chain_of(body, at, flags)
    return Write(fid, idx, csize, off, uop, body[at:], bool(flags & FLAG_EXISTING), chain, bool(flags & FLAG_REPLACE))


def _version_reply(what: str) -> Callable[[memoryview, int], VersionReply]:
    def decode(body: memoryview, flags: int) -> VersionReply:
        _exact(body, _VERSION.size, what)
        return VersionReply(_VERSION.unpack_from(body)[0])

    return decode


def _enc_resync(msg: Resync) -> tuple[_Parts, int]:
    return [_RESYNC.pack(msg.file_id, msg.chunk_index, msg.chunk_size) + msg.chain.encode()], 0


def _dec_resync(body: memoryview, flags: int) -> Resync:
    _need(body, _RESYNC.size, "RESYNC")
    chain, at = Chain.decode(body, _RESYNC.size)
    _exact(body, at, "RESYNC")
    fid, idx, csize = _RESYNC.unpack_from(body)
    return Resync(fid, idx, csize, chain)


def _fixed(cls: type[_M], layout: struct.Struct, what: str) -> tuple[Callable[[Any], tuple[_Parts, int]],
                                                                      Callable[[memoryview, int], _M]]:
    """The codec of a request that is one fixed struct of its fields, in order."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    def encode(msg: Any) -> tuple[_Parts, int]:
        return ([layout.pack(*(getattr(msg, n) for n in names))] if names else []), 0

    def decode(body: memoryview, flags: int) -> _M:
        _exact(body, layout.size, what)
        return cls(*layout.unpack_from(body))

    return encode, decode


def _rep_stat(body: memoryview, flags: int) -> StatReply:
    _need(body, _STAT_R.size, "STAT reply")
    if len(body) > _STAT_R.size + 255:
        raise RemoteProtocolError(f"STAT reply of {len(body)} bytes is longer than {_STAT_R.size + 255}")
    try:
        metrics = bytes(body[_STAT_R.size :]).decode()
    except UnicodeDecodeError:
        raise RemoteProtocolError("STAT reply names its metrics address in bytes that are not UTF-8") from None
    sid, cap, used, nchunks = _STAT_R.unpack_from(body)
    return StatReply(sid, cap, used, nchunks, metrics)


def _rep_free(body: memoryview, flags: int) -> FreeReply:
    _exact(body, _VERSION.size, "FREE reply")
    return FreeReply(_VERSION.unpack_from(body)[0])


def _rep_vconn(body: memoryview, flags: int) -> VerbsConnectReply:
    _exact(body, _VCONN_R.size, "VERBS_CONNECT reply")
    return VerbsConnectReply(*_VCONN_R.unpack_from(body))


def _rep_locate(body: memoryview, flags: int) -> LocateReply:
    _exact(body, _LOCATE_R.size, "LOCATE reply")
    exists, roff, csize, slot = _LOCATE_R.unpack_from(body)
    return LocateReply(bool(exists), roff, csize, slot, exists == 2)


def _rep_checksum(body: memoryview, flags: int) -> ChecksumReply:
    _exact(body, _CHECKSUM_R.size, "CHECKSUM reply")
    return ChecksumReply(*_CHECKSUM_R.unpack_from(body))


def _enc_rwrite(msg: RemoteWrite) -> tuple[_Parts, int]:
    opv, optim = _encode_update(msg.op)
    chain, flags = _chain_bytes(msg.chain)
    parts: _Parts = [_RWRITE.pack(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, opv, int(msg.in_place),
                                  msg.length, msg.staging_offset, msg.region_offset) + optim + chain]
    return parts, (FLAG_EXISTING if msg.existing else 0) | flags


def _dec_rwrite(body: memoryview, flags: int) -> RemoteWrite:
    _need(body, _RWRITE.size, "REMOTE_WRITE")
    fid, idx, csize, off, opv, in_place, n, soff, roff = _RWRITE.unpack_from(body)
    uop, at = _decode_update(opv, body, _RWRITE.size)
    chain, at = _chain_of(body, at, flags)
    _exact(body, at, "REMOTE_WRITE")
    return RemoteWrite(fid, idx, csize, off, uop, bool(in_place), n, soff, roff, bool(flags & FLAG_EXISTING), chain)


def _rep_list(body: memoryview, flags: int) -> ListReply:
    _need(body, _LIST_R.size, "LIST reply")
    (count,) = _LIST_R.unpack_from(body)
    _exact(body, _LIST_R.size + count * _LIST_E.size, "LIST reply")
    return ListReply([ChunkEntry(*_LIST_E.unpack_from(body, _LIST_R.size + i * _LIST_E.size)) for i in range(count)])


def _enc_gather(msg: Gather) -> tuple[_Parts, int]:
    ext = np.ascontiguousarray(msg.extents, dtype=EXTENT)
    return [_GATHER.pack(msg.file_id, len(ext)), ext.tobytes()], FLAG_CLEAN if msg.clean else 0


def _dec_gather(body: memoryview, flags: int) -> Gather:
    _need(body, _GATHER.size, "GATHER")
    fid, count = _GATHER.unpack_from(body)
    ext, at = _decode_extents(body, _GATHER.size, count, "GATHER")
    _exact(body, at, "GATHER")
    return Gather(fid, ext, bool(flags & FLAG_CLEAN))


def _rep_gather(body: memoryview, flags: int) -> GatherReply:
    _need(body, _GATHER_R.size, "GATHER reply")
    (count,) = _GATHER_R.unpack_from(body)
    end = _GATHER_R.size + 8 * count
    _need(body, end, "GATHER reply")
    return GatherReply(np.frombuffer(body[_GATHER_R.size : end], dtype=_VERSIONS), body[end:])


def _enc_scatter(msg: Scatter) -> tuple[_Parts, int]:
    flags = 0
    ext = np.ascontiguousarray(msg.extents, dtype=EXTENT)
    opv, optim = _encode_update(msg.op, encodable=False)
    chain, flags = _chain_bytes(msg.chain)
    fixed = _SCATTER.pack(msg.file_id, msg.chunk_size, len(ext), opv, msg.staging_offset) + optim + chain
    if not msg.staged and len(msg.data) != msg.length:
        raise LocalProtocolError(f"SCATTER of {len(msg.data)} bytes into extents of {msg.length}")
    parts: _Parts = [fixed, ext.tobytes()]
    if not msg.staged and len(msg.data):
        parts.append(msg.data)
    return parts, flags | (FLAG_EXISTING if msg.existing else 0) | (FLAG_STAGED if msg.staged else 0)


def _dec_scatter(body: memoryview, flags: int) -> Scatter:
    _need(body, _SCATTER.size, "SCATTER")
    fid, csize, count, opv, soff = _SCATTER.unpack_from(body)
    uop, at = _decode_update(opv, body, _SCATTER.size, encodable=False)
    chain, at = _chain_of(body, at, flags)
    ext, at = _decode_extents(body, at, count, "SCATTER")
    staged = bool(flags & FLAG_STAGED)
    msg = Scatter(fid, csize, ext, uop, b"" if staged else body[at:], bool(flags & FLAG_EXISTING), chain, staged, soff)
    if staged:
        _exact(body, at, "SCATTER (staged)")
    elif len(body) - at != msg.length:
        raise RemoteProtocolError(f"SCATTER carries {len(body) - at} bytes for extents of {msg.length}")
    return msg


def _enc_freeze(msg: Freeze) -> tuple[_Parts, int]:
    if len(msg.file_ids) > MAX_SNAPSHOT_FILES:
        raise LocalProtocolError(f"FREEZE of {len(msg.file_ids)} files: at most {MAX_SNAPSHOT_FILES}")
    return [_FREEZE.pack(msg.token, msg.lease_ms, len(msg.file_ids)),
            np.asarray(msg.file_ids, dtype=">u8").tobytes()], 0


def _dec_freeze(body: memoryview, flags: int) -> Freeze:
    _need(body, _FREEZE.size, "FREEZE")
    token, lease, n = _FREEZE.unpack_from(body)
    if n > MAX_SNAPSHOT_FILES:
        raise RemoteProtocolError(f"FREEZE of {n} files: at most {MAX_SNAPSHOT_FILES}")
    _exact(body, _FREEZE.size + 8 * n, "FREEZE")
    ids = np.frombuffer(body[_FREEZE.size :], dtype=">u8").tolist()
    return Freeze(token, lease, tuple(int(i) for i in ids))


def _rep_freeze(body: memoryview, flags: int) -> FreezeReply:
    _need(body, _LIST_R.size, "FREEZE reply")
    (count,) = _LIST_R.unpack_from(body)
    at = _LIST_R.size + count * _LIST_E.size
    _need(body, at + _LIST_R.size, "FREEZE reply")
    (nparts,) = _LIST_R.unpack_from(body, at)
    at += _LIST_R.size
    _exact(body, at + nparts * _PART.size, "FREEZE reply")
    return FreezeReply([ChunkEntry(*_LIST_E.unpack_from(body, _LIST_R.size + i * _LIST_E.size)) for i in range(count)],
                       [Part(*_PART.unpack_from(body, at + k * _PART.size)) for k in range(nparts)])


def _enc_admit(msg: Admit) -> tuple[_Parts, int]:
    if len(msg.push_ids) > MAX_ADMIT:
        raise LocalProtocolError(f"ADMIT of {len(msg.push_ids)} pushes: at most {MAX_ADMIT}")
    return [_ADMIT.pack(msg.token, msg.wait_ms, len(msg.push_ids)), np.asarray(msg.push_ids, dtype=">u8").tobytes()], 0


def _dec_admit(body: memoryview, flags: int) -> Admit:
    _need(body, _ADMIT.size, "ADMIT")
    token, wait, n = _ADMIT.unpack_from(body)
    if n > MAX_ADMIT:
        raise RemoteProtocolError(f"ADMIT of {n} pushes: at most {MAX_ADMIT}")
    _exact(body, _ADMIT.size + 8 * n, "ADMIT")
    return Admit(token, wait, tuple(int(i) for i in np.frombuffer(body[_ADMIT.size :], dtype=">u8").tolist()))


def _file_list(cls: type[_M], what: str) -> tuple[Callable[[Any], tuple[_Parts, int]], Callable[[memoryview, int], _M]]:
    """The codec of a request that is only a list of file ids (``file_ids``: u32 count, then
    u64 ids), at most :data:`MAX_SNAPSHOT_FILES`."""

    def encode(msg: Any) -> tuple[_Parts, int]:
        if len(msg.file_ids) > MAX_SNAPSHOT_FILES:
            raise LocalProtocolError(f"{what} of {len(msg.file_ids)} files: at most {MAX_SNAPSHOT_FILES}")
        return [_LIST_R.pack(len(msg.file_ids)), np.asarray(msg.file_ids, dtype=">u8").tobytes()], 0

    def decode(body: memoryview, flags: int) -> _M:
        _need(body, _LIST_R.size, what)
        (n,) = _LIST_R.unpack_from(body)
        if n > MAX_SNAPSHOT_FILES:
            raise RemoteProtocolError(f"{what} of {n} files: at most {MAX_SNAPSHOT_FILES}")
        _exact(body, _LIST_R.size + 8 * n, what)
        return cls(tuple(int(i) for i in np.frombuffer(body[_LIST_R.size :], dtype=">u8").tolist()))  # type: ignore[call-arg]

    return encode, decode


def _rep_usage(body: memoryview, flags: int) -> UsageReply:
    _need(body, _LIST_R.size, "USAGE reply")
    (n,) = _LIST_R.unpack_from(body)
    _exact(body, _LIST_R.size + n * _USAGE_E.size, "USAGE reply")
    return UsageReply([_USAGE_E.unpack_from(body, _LIST_R.size + k * _USAGE_E.size) for k in range(n)])


def _enc_clone(msg: Clone) -> tuple[_Parts, int]:
    if len(msg.pairs) > MAX_SNAPSHOT_FILES:
        raise LocalProtocolError(f"CLONE of {len(msg.pairs)} files: at most {MAX_SNAPSHOT_FILES}")
    return [_CLONE.pack(msg.token, len(msg.pairs), len(msg.expect)),
            b"".join(_PAIR.pack(*p) for p in msg.pairs), b"".join(_EXPECT.pack(*e) for e in msg.expect)], 0


def _dec_clone(body: memoryview, flags: int) -> Clone:
    _need(body, _CLONE.size, "CLONE")
    token, n, m = _CLONE.unpack_from(body)
    if n > MAX_SNAPSHOT_FILES or m > MAX_SNAPSHOT_FILES * 1024:
        raise RemoteProtocolError(f"CLONE of {n} files and {m} chunks is too large")
    _exact(body, _CLONE.size + n * _PAIR.size + m * _EXPECT.size, "CLONE")
    at = _CLONE.size
    pairs = tuple(_PAIR.unpack_from(body, at + k * _PAIR.size) for k in range(n))
    at += n * _PAIR.size
    expect = tuple(_EXPECT.unpack_from(body, at + k * _EXPECT.size) for k in range(m))
    return Clone(token, pairs, expect)


@dataclass(frozen=True)
class Message:
    """One request kind of the protocol: a row of :data:`MESSAGES`.

    ``encode(msg) -> (parts, flags)``: the body's buffers after the header (payloads as views)
    and the header's flags. ``decode(body, flags)``: the request from its body (views into
    it). ``reply(body, flags)``: the OK reply from its body. Both decoders raise
    RemoteProtocolError for a body that does not match (framing is intact: answer an error).
    """

    opcode: Opcode
    request: type
    encode: Callable[[Any], tuple[_Parts, int]]
    decode: Callable[[memoryview, int], Any]
    reply: Callable[[memoryview, int], Any]


_STAT_CODEC = _fixed(Stat, struct.Struct("!"), "STAT")
_SYNC_CODEC = _fixed(Sync, struct.Struct("!"), "SYNC")
_FREE_CODEC = _fixed(Free, _FREE, "FREE")
_PUNCH_CODEC = _fixed(Punch, _PUNCH, "PUNCH")
_VCONN_CODEC = _fixed(VerbsConnect, _VCONN, "VERBS_CONNECT")
_LOCATE_CODEC = _fixed(Locate, _LOCATE, "LOCATE")
_LIST_CODEC = _fixed(List, _LIST, "LIST")
_CHECKSUM_CODEC = _fixed(Checksum, _CHECKSUM, "CHECKSUM")
_THAW_CODEC = _fixed(Thaw, struct.Struct("!Q"), "THAW")

#: Every request kind, by opcode: the one registry of the protocol.
MESSAGES: dict[Opcode, Message] = {m.opcode: m for m in (
    Message(Opcode.HELLO, Hello, _enc_hello, _dec_hello, _rep_hello),
    Message(Opcode.AUTH, Auth, _enc_auth, _dec_auth, _rep_auth),
    Message(Opcode.READ, Read, _enc_read, _dec_read, _rep_read),
    Message(Opcode.WRITE, Write, _enc_write, _dec_write, _version_reply("WRITE reply")),
    Message(Opcode.STAT, Stat, *_STAT_CODEC, _rep_stat),
    Message(Opcode.FREE, Free, *_FREE_CODEC, _rep_free),
    Message(Opcode.PUNCH, Punch, *_PUNCH_CODEC, _version_reply("PUNCH reply")),
    Message(Opcode.VERBS_CONNECT, VerbsConnect, *_VCONN_CODEC, _rep_vconn),
    Message(Opcode.LOCATE, Locate, *_LOCATE_CODEC, _rep_locate),
    Message(Opcode.REMOTE_WRITE, RemoteWrite, _enc_rwrite, _dec_rwrite, _version_reply("REMOTE_WRITE reply")),
    Message(Opcode.LIST, List, *_LIST_CODEC, _rep_list),
    Message(Opcode.SYNC, Sync, *_SYNC_CODEC, _version_reply("SYNC reply")),
    Message(Opcode.RESYNC, Resync, _enc_resync, _dec_resync, _version_reply("RESYNC reply")),
    Message(Opcode.CHECKSUM, Checksum, *_CHECKSUM_CODEC, _rep_checksum),
    Message(Opcode.GATHER, Gather, _enc_gather, _dec_gather, _rep_gather),
    Message(Opcode.SCATTER, Scatter, _enc_scatter, _dec_scatter, _version_reply("SCATTER reply")),
    Message(Opcode.FREEZE, Freeze, _enc_freeze, _dec_freeze, _rep_freeze),
    Message(Opcode.CLONE, Clone, _enc_clone, _dec_clone, _rep_free),
    Message(Opcode.THAW, Thaw, *_THAW_CODEC, _version_reply("THAW reply")),
    Message(Opcode.USAGE, Usage, *_file_list(Usage, "USAGE"), _rep_usage),
    Message(Opcode.ADMIT, Admit, _enc_admit, _dec_admit, _rep_freeze),
    Message(Opcode.FREE_FILES, FreeFiles, *_file_list(FreeFiles, "FREE_FILES"), _rep_free),
)}
_BY_TYPE: dict[type, Message] = {m.request: m for m in MESSAGES.values()}
_REQUEST_OPCODE: dict[type, Opcode] = {m.request: m.opcode for m in MESSAGES.values()}


@dataclass
class Frame:
    """One decoded frame: header fields plus the body (a view into the decoder's buffer
    or the caller's buffer; copy it if it must outlive the next ``feed``)."""

    opcode: int
    request_id: int
    status: int
    flags: int
    body: memoryview = field(default_factory=lambda: memoryview(b""))
    version: int = PROTOCOL_VERSION
    body_len: int = 0  # as announced by the header

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & FLAG_REPLY)


# ---------------------------------------------------------------- encoding
class Parts(list):  # type: ignore[type-arg]
    """The buffers of one frame in the order they go on the wire (header first).

    ``payload``: how many of the frame's last bytes are tensor payload (the data of a WRITE or
    SCATTER, of a READ or GATHER reply): the bytes a connection under ``--security auth``
    leaves out of the frame's tag (:class:`irdma.wire.auth.Macs`). 0 for every other frame."""

    payload = 0


def _parts(items: list[bytes | memoryview], payload: int = 0) -> Parts:
    out = Parts(items)
    out.payload = payload
    return out


def _header(opcode: int, request_id: int, body_len: int, status: int = 0, flags: int = 0) -> bytes:
    if not 0 <= request_id < 1 << 32:
        raise LocalProtocolError(f"request id {request_id} does not fit in u32")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, opcode, request_id, status, flags, body_len)


def encode_request(msg: Request, request_id: int) -> Parts:
    """Encode a request as a list of buffers to send in order (the payload is not copied).

    Raises:
        LocalProtocolError: a field does not fit its wire type.
    """
    row = _BY_TYPE.get(type(msg))
    if row is None:
        raise LocalProtocolError(f"not a request: {msg!r}")
    try:
        parts, flags = row.encode(msg)
    except struct.error as exc:
        raise LocalProtocolError(f"cannot encode {msg!r}: {exc}") from None
    body_len = sum(len(p) for p in parts)
    if body_len >= 1 << 32:
        raise LocalProtocolError(f"body of {body_len} bytes does not fit in u32")
    payload = len(msg.data) if isinstance(msg, Write) or (isinstance(msg, Scatter) and not msg.staged) else 0
    return _parts([_header(row.opcode, request_id, body_len, 0, flags), *parts], payload)


def _enc_read_reply(m: ReadReply) -> tuple[_Parts, int]:
    return ([_VERSION.pack(m.version)], FLAG_HOLE) if m.hole else ([_VERSION.pack(m.version), m.data], 0)


#: How each kind of OK reply is encoded: its body's buffers and the header flags it adds.
_REPLY_ENCODERS: dict[type, Callable[[Any], tuple[_Parts, int]]] = {
    HelloReply: lambda m: ([_HELLO_R.pack(m.version, m.shard_id, m.capacity, m.max_payload, m.incarnation,
                                          len(m.extra)) + m.extra + m.proof], 0),
    AuthChallenge: lambda m: ([m.nonce], FLAG_CHALLENGE),
    GatherReply: lambda m: ([_GATHER_R.pack(len(m.versions))
                             + np.ascontiguousarray(m.versions, dtype=_VERSIONS).tobytes(), m.data], 0),
    ReadReply: _enc_read_reply,
    VersionReply: lambda m: ([_VERSION.pack(m.version)], 0),
    StatReply: lambda m: ([_STAT_R.pack(m.shard_id, m.capacity, m.used, m.chunks)]
                          + ([m.metrics.encode()[:255]] if m.metrics else []), 0),
    FreeReply: lambda m: ([_VERSION.pack(m.freed)], 0),
    UsageReply: lambda m: ([_LIST_R.pack(len(m.entries)), b"".join(_USAGE_E.pack(*e) for e in m.entries)], 0),
    VerbsConnectReply: lambda m: ([_VCONN_R.pack(m.qp_num, m.psn, m.gid, m.region_addr, m.region_len, m.region_rkey,
                                                 m.versions_addr, m.versions_rkey, m.staging_addr, m.staging_len,
                                                 m.staging_rkey, m.recv_slots, m.slot_size)], 0),
    LocateReply: lambda m: ([_LOCATE_R.pack(2 if m.exists and m.shared else int(m.exists), m.region_offset, m.chunk_size,
                                            m.version_slot)], 0),
    ChecksumReply: lambda m: ([_CHECKSUM_R.pack(m.version, m.crc)], 0),
    ListReply: lambda m: ([_LIST_R.pack(len(m.entries))
                           + b"".join(_LIST_E.pack(x.file_id, x.chunk_index, x.chunk_size, x.version)
                                      for x in m.entries)], 0),
    FreezeReply: lambda m: ([_LIST_R.pack(len(m.entries))
                             + b"".join(_LIST_E.pack(x.file_id, x.chunk_index, x.chunk_size, x.version)
                                        for x in m.entries)
                             + _LIST_R.pack(len(m.parts))
                             + b"".join(_PART.pack(p.push_id, p.index, p.count) for p in m.parts)], 0),
}


def encode_reply(opcode: int, request_id: int, msg: Reply) -> Parts:
    """Encode a reply to request ``opcode``; see :func:`encode_request`."""
    flags = FLAG_REPLY
    status = Status.OK
    if isinstance(msg, ErrorReply):
        status = msg.status
        parts: _Parts = [msg.message.encode()[:4096]]
        if status in SHARD_STATUSES:
            parts.insert(0, _ERR_SHARD.pack(msg.shard_id))
    else:
        encode = _REPLY_ENCODERS.get(type(msg))
        if encode is None:
            raise LocalProtocolError(f"not a reply: {msg!r}")
        parts, more = encode(msg)
        flags |= more
    body_len = sum(len(p) for p in parts)
    payload = len(msg.data) if isinstance(msg, GatherReply) or (isinstance(msg, ReadReply) and not msg.hole) else 0
    return _parts([_header(opcode, request_id, body_len, int(status), flags), *parts], payload)


# ---------------------------------------------------------------- decoding
class FrameTooLarge(RemoteProtocolError):
    """A header announced a body longer than the receiver accepts (answer TOO_LARGE, close)."""


def parse_header(buf: bytes | bytearray | memoryview, max_body: int, *, any_version: bool = False) -> Frame:
    """Parse one 16-byte header (the body is left empty).

    ``any_version`` skips the version check: for the HELLO that opens a connection, whose body
    says which versions the peer speaks (negotiation happens there, not in the header).

    Raises:
        FrameTooLarge: a body longer than ``max_body``.
        RemoteProtocolError: bad magic or a protocol version this code does not speak.
            Framing is lost: close the connection.
    """
    magic, version, opcode, request_id, status, flags, body_len = HEADER.unpack(buf[:HEADER_SIZE])
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad magic {bytes(magic)!r}: not an irdma peer")
    if not any_version and not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"frame of protocol version {version}; this side speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
        )
    if body_len > max_body:
        raise FrameTooLarge(f"frame body of {body_len} bytes exceeds the limit of {max_body}")
    return Frame(opcode, request_id, status, flags, version=version, body_len=body_len)


class FrameDecoder:
    """Incremental splitter of a byte stream into frames.

    Feed bytes in pieces of any size with :meth:`feed`; take frames with :meth:`next_frame`
    until it returns ``None``. A frame's body is a fresh ``bytes`` object.

    Args:
        max_body: largest body accepted, in bytes.
    """

    def __init__(self, max_body: int = DEFAULT_MAX_PAYLOAD + BODY_SLACK) -> None:
        self.max_body = max_body
        self._buf = bytearray()
        self._pending: Frame | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned in a frame."""
        return len(self._buf)

    def next_frame(self) -> Frame | None:
        """Return the next complete frame, or None when more bytes are needed.

        Raises:
            RemoteProtocolError: see :func:`parse_header`.
        """
        if self._pending is None:
            if len(self._buf) < HEADER_SIZE:
                return None
            self._pending = parse_header(self._buf, self.max_body)
            del self._buf[:HEADER_SIZE]
        n = self._pending.body_len
        if len(self._buf) < n:
            return None
        frame, self._pending = self._pending, None
        frame.body = memoryview(bytes(self._buf[:n]))
        del self._buf[:n]
        return frame


def _need(body: memoryview, n: int, what: str) -> None:
    if len(body) < n:
        raise RemoteProtocolError(f"{what} body of {len(body)} bytes is shorter than its {n}-byte fixed part")


def decode_request(frame: Frame) -> Request:
    """Turn a request frame into a message. Payloads are views into ``frame.body``.

    Raises:
        RemoteProtocolError: unknown opcode, a reply where a request was due, or a body
            whose length does not match its opcode. Framing is intact: answer with an error.
    """
    if frame.is_reply:
        raise RemoteProtocolError("got a reply frame where a request was expected")
    row = MESSAGES.get(frame.opcode)  # type: ignore[call-overload]
    if row is None:
        raise UnknownOpcode(f"unknown opcode {frame.opcode}")
    return row.decode(frame.body, frame.flags)  # type: ignore[no-any-return]


class UnknownOpcode(RemoteProtocolError):
    """The frame is intact but its opcode is not one this side knows."""


def _exact(body: memoryview, n: int, what: str) -> None:
    if len(body) != n:
        raise RemoteProtocolError(f"{what} body must be {n} bytes, got {len(body)}")


def decode_reply(frame: Frame) -> Reply:
    """Turn a reply frame into a message.

    Raises:
        RemoteProtocolError: a request where a reply was due, an unknown opcode, or a body
            that does not match.
    """
    if not frame.is_reply:
        raise RemoteProtocolError("got a request frame where a reply was expected")
    body = frame.body
    if frame.status != Status.OK:
        try:
            status = Status(frame.status)
        except ValueError:
            status = Status.INTERNAL
        sid = 0
        if status in SHARD_STATUSES and len(body) >= _ERR_SHARD.size:
            (sid,) = _ERR_SHARD.unpack_from(body)
            body = body[_ERR_SHARD.size :]
        return ErrorReply(status, bytes(body).decode("utf-8", "replace"), sid)
    row = MESSAGES.get(frame.opcode)  # type: ignore[call-overload]
    if row is None:
        raise UnknownOpcode(f"unknown opcode {frame.opcode} in a reply")
    return row.reply(body, frame.flags)  # type: ignore[no-any-return]


class UnexpectedReply(RemoteProtocolError, ShardUnavailable):
    """The peer answered a request with a reply of another kind (a READ answered as a STAT,
    say): the peer is at fault (a :class:`RemoteProtocolError`), and a transport that meets
    one declares the connection broken, so its callers treat it as a lost shard
    (:class:`ShardUnavailable`: reconnect, fail over)."""


_R = TypeVar("_R")


def expect_reply(reply: Reply, kind: type[_R], request: str, peer: str) -> _R:
    """``reply`` when it is a ``kind``: the check of what a peer sent back, so never an
    ``assert`` (``python -O`` strips those).

    Args:
        reply: the decoded reply (an error reply was turned into an exception before).
        kind: the reply class ``request`` is answered with.
        request: the request's name, for the message (``"WRITE"``).
        peer: who answered, for the message (``"shard at HOST:PORT"``).

    Raises:
        UnexpectedReply: ``reply`` is of another kind.
    """
    if not isinstance(reply, kind):
        raise UnexpectedReply(f"{peer} answered a {request} request with a {type(reply).__name__},"
                              f" not a {kind.__name__}: connection closed")
    return reply


#: Sizes of the fixed parts, for transports that receive payloads in place.
READ_REPLY_FIXED = _VERSION.size
GATHER_REPLY_FIXED = _GATHER_R.size
WRITE_FIXED = _WRITE.size
