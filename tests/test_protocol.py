"""The pure codec: round trips, truncated and oversized frames, unknown opcodes, byte feeds."""

from __future__ import annotations

import struct

import pytest

from irdma._errors import LocalProtocolError, RemoteProtocolError
from irdma.wire import protocol as P

REQUESTS = [
    P.Hello(1, 1, "worker-0", b"secret-token"),
    P.Read(7, 3, 4096, 65536),
    P.Write(7, 3, 4 << 20, 12, P.UpdateOp.ADD, b"\x00\x00\x80\x3f" * 5),
    P.Write(2**64 - 1, 0, 4096, 0, P.UpdateOp.ASSIGN, b""),
    P.Stat(),
    P.Free(9, 2),
    P.Punch(9, 1, 100),
    P.VerbsConnect(0x1234, 0xABCDE, bytes(range(16))),
    P.Locate(9, 4, 1 << 20),
    P.RemoteWrite(9, 4, 1 << 20, 8, P.UpdateOp.ADD, False, 4096, 65536, 0),
    P.RemoteWrite(9, 4, 1 << 20, 8, P.UpdateOp.ASSIGN, True, 4096, 0, 3 << 20),
    P.RemoteWrite(9, 4, 1 << 20, 8, P.UpdateOp.ADD, False, 4096, 65536, 0, existing=True),
    P.Write(7, 3, 4 << 20, 12, P.UpdateOp.ASSIGN, b"abcd", existing=True),
    P.List(7, 3, 100),
    # replication: a client's update with its chain, a forward, a whole-chunk copy, RESYNC, CHECKSUM
    P.Write(7, 3, 4 << 20, 12, P.UpdateOp.ADD, b"abcd", chain=P.Chain(2**64 - 1, 9, 0, 5000, ((2, "10.0.0.2:7700"),
                                                                                          (3, "[::1]:7701")))),
    P.Write(7, 3, 4 << 20, 12, P.UpdateOp.ADD, b"abcd", chain=P.Chain(5, 9, 42, 2500)),
    P.Write(7, 3, 8, 0, P.UpdateOp.ASSIGN, b"12345678", chain=P.Chain(0, 9, 43, 2500), replace=True),
    P.RemoteWrite(9, 4, 1 << 20, 8, P.UpdateOp.ADD, False, 4096, 65536, 0, chain=P.Chain(6, 1, 0, 10, ((4, "h:1"),))),
    P.Resync(7, 3, 4 << 20, P.Chain(0, 3, 0, 5000, ((2, "127.0.0.1:9"),))),
    P.Checksum(7, 3, 12),
    P.Read(7, 3, 0, 4096, clean=True),
    # compressed gradients (protocol 8): the encoding in the op byte's high nibble
    P.Write(7, 3, 4 << 20, 12, P.Update(P.UpdateOp.ADD, encoding=P.Encoding.TOPK), b"\x01" * 16),
    P.Write(7, 3, 4 << 20, 12, P.Update(P.UpdateOp.SGD, (0.1, 0.0, 0.0, 0.0), encoding=P.Encoding.SIGN), b"\x02" * 13,
            chain=P.Chain(5, 9, 42, 2500)),
    P.RemoteWrite(9, 4, 1 << 20, 8, P.Update(P.UpdateOp.ADD, encoding=P.Encoding.SIGN), False, 4096, 65536, 0,
                  chain=P.Chain(6, 1, 0, 10, ((4, "h:1"),))),
    # rounds (protocol 11): a push that is one member's contribution to a synchronous round
    P.Write(7, 3, 4 << 20, 12, P.Update(P.UpdateOp.ADAM, (0.01, 0.9, 0.999, 1e-7), round=P.Round(2**64 - 1, 41, 2, 3)),
            b"\x03" * 16, chain=P.Chain(5, 9, 0, 2500, part=P.Part(7, 0, 2))),
    P.Write(7, 3, 4 << 20, 12, P.Update(P.UpdateOp.ADD, encoding=P.Encoding.TOPK, round=P.Round(1, 0, 0, 1, P.ROUND_SUM)),
            b"\x01" * 16),
    P.RemoteWrite(9, 4, 1 << 20, 8, P.Update(P.UpdateOp.SGD, (0.1, 0.0, 0.0, 0.0), round=P.Round(3, 5, 1, 2)), False,
                  4096, 65536, 0),
    # push parts (protocol 9): a snapshot's cut takes a push of several requests whole
    P.Write(7, 3, 8192, 0, P.UpdateOp.ADD, b"abcd", chain=P.Chain(5, 9, 0, 2500, part=P.Part(2**64 - 1, 1, 2))),
    P.RemoteWrite(9, 4, 1 << 20, 8, P.UpdateOp.ADD, False, 4096, 65536, 0,
                  chain=P.Chain(6, 1, 0, 10, ((4, "h:1"),), P.Part(12, 0, 3))),
    P.Scatter(7, 4096, P.extents([0, 1], [0, 8], [4, 4]), P.UpdateOp.ADD, b"abcdefgh",
              chain=P.Chain(8, 1, 0, 10, (), P.Part(13, 2, 3))),
    P.Admit(99, 50, (12, 13, 2**64 - 1)),
    P.FreeFiles((7, 9, 2**64 - 1)),
    P.Usage((7, 9)),
    P.Freeze(99, 5000, (7, 9)),
    # authentication: an offer (cluster id and nonce) and a proof
    P.Hello(4, 4, "worker-1", bytes(range(48))),
    P.Auth(bytes(range(32))),
]

REPLIES = [
    (P.Opcode.HELLO, P.HelloReply(2, 3, 2 << 30, 16 << 20, 0xFEEDFACE12345678, b"verbs-descriptors")),
    (P.Opcode.READ, P.ReadReply(42, b"abcdefgh")),
    (P.Opcode.READ, P.ReadReply(0, b"", hole=True)),
    (P.Opcode.WRITE, P.VersionReply(43)),
    (P.Opcode.STAT, P.StatReply(1, 1 << 30, 4 << 20, 1)),
    (P.Opcode.FREE, P.FreeReply(5)),
    (P.Opcode.PUNCH, P.VersionReply(2)),
    (P.Opcode.WRITE, P.ErrorReply(P.Status.NO_SPACE, "shard 1 is full")),
    (P.Opcode.VERBS_CONNECT, P.VerbsConnectReply(1, 2, b"g" * 16, 1 << 40, 1 << 30, 7, 1 << 41, 8, 1 << 42, 1 << 24,
                                                 9, 64, 4096)),
    (P.Opcode.LOCATE, P.LocateReply(True, 4 << 20, 1 << 20, 1024)),
    (P.Opcode.REMOTE_WRITE, P.VersionReply(3)),
    (P.Opcode.LIST, P.ListReply([P.ChunkEntry(7, 0, 4 << 20, 3), P.ChunkEntry(2**64 - 1, 9, 4096, 0)])),
    (P.Opcode.LIST, P.ListReply([])),
    (P.Opcode.WRITE, P.ErrorReply(P.Status.CHUNK_LOST, "chunk (7, 3) is not on shard 1")),
    (P.Opcode.WRITE, P.ErrorReply(P.Status.FORWARD_FAILED, "replica 3 did not answer", 3)),
    (P.Opcode.WRITE, P.ErrorReply(P.Status.STALE, "replica 4 is behind", 4)),
    (P.Opcode.WRITE, P.ErrorReply(P.Status.FENCED, "epoch 9 seen")),
    (P.Opcode.CHECKSUM, P.ChecksumReply(12, 0xDEADBEEF)),
    (P.Opcode.RESYNC, P.VersionReply(12)),
    (P.Opcode.HELLO, P.AuthChallenge(bytes(range(32, 64)))),
    (P.Opcode.AUTH, P.HelloReply(4, 3, 2 << 30, 16 << 20, 7, b"", bytes(range(32)))),
    (P.Opcode.AUTH, P.HelloReply(4, 3, 2 << 30, 16 << 20, 7, b"verbs", bytes(range(32)))),
    (P.Opcode.AUTH, P.ErrorReply(P.Status.AUTH_FAILED, "wrong cluster key")),
    (P.Opcode.FREEZE, P.FreezeReply([P.ChunkEntry(7, 0, 4096, 3)], [P.Part(12, 0, 3), P.Part(12, 2, 3)])),
    (P.Opcode.ADMIT, P.FreezeReply([], [])),
]


def _frames(data: bytes, max_body: int = 1 << 20) -> list[P.Frame]:
    dec = P.FrameDecoder(max_body)
    dec.feed(data)
    out = []
    while (f := dec.next_frame()) is not None:
        out.append(f)
    return out


def _norm(msg: object) -> object:
    # payload views compare as bytes
    d = dict(vars(msg))
    for k, v in d.items():
        if isinstance(v, memoryview):
            d[k] = bytes(v)
        elif hasattr(v, "tolist"):  # extents
            d[k] = v.tolist()
    return type(msg), d


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg: P.Request) -> None:
    wire = b"".join(P.encode_request(msg, 77))
    [frame] = _frames(wire)
    assert frame.request_id == 77 and not frame.is_reply
    assert _norm(P.decode_request(frame)) == _norm(msg)


@pytest.mark.parametrize("opcode,msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(opcode: int, msg: P.Reply) -> None:
    wire = b"".join(P.encode_reply(opcode, 5, msg))
    [frame] = _frames(wire)
    assert frame.is_reply and frame.request_id == 5
    got = P.decode_reply(frame)
    if isinstance(msg, P.ReadReply) and msg.hole:
        assert isinstance(got, P.ReadReply) and got.hole and got.version == 0
    else:
        assert _norm(got) == _norm(msg)


def test_byte_by_byte_feed_gives_the_same_frames() -> None:
    wire = b"".join(b"".join(P.encode_request(m, i)) for i, m in enumerate(REQUESTS))
    dec = P.FrameDecoder()
    frames = []
    for i in range(len(wire)):
        dec.feed(wire[i : i + 1])
        while (f := dec.next_frame()) is not None:
            frames.append(f)
    assert [_norm(P.decode_request(f)) for f in frames] == [_norm(m) for m in REQUESTS]
    assert dec.buffered == 0


def test_truncated_frame_waits_for_more_and_never_yields_a_partial_frame() -> None:
    wire = b"".join(P.encode_request(P.Write(1, 0, 4096, 0, P.UpdateOp.ASSIGN, b"x" * 100), 1))
    for cut in (1, P.HEADER_SIZE - 1, P.HEADER_SIZE, len(wire) - 1):
        assert _frames(wire[:cut]) == []


def test_trailing_garbage_after_a_frame_is_not_mistaken_for_a_frame() -> None:
    wire = b"".join(P.encode_request(P.Stat(), 1)) + b"IR"
    dec = P.FrameDecoder()
    dec.feed(wire)
    assert isinstance(P.decode_request(dec.next_frame()), P.Stat)  # type: ignore[arg-type]
    assert dec.next_frame() is None and dec.buffered == 2


def test_oversized_frame_is_refused_from_its_header() -> None:
    header = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.Opcode.WRITE, 1, 0, 0, 10_000)
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        _frames(header, max_body=9_999)


def test_bad_magic_and_wrong_version_are_remote_errors() -> None:
    with pytest.raises(RemoteProtocolError, match="magic"):
        _frames(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(RemoteProtocolError, match="version"):
        _frames(P.HEADER.pack(P.MAGIC, 99, P.Opcode.STAT, 1, 0, 0, 0))


def test_unknown_opcode_is_reported_with_framing_intact() -> None:
    wire = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, 200, 9, 0, 0, 3) + b"abc"
    wire += b"".join(P.encode_request(P.Stat(), 10))
    f1, f2 = _frames(wire)
    with pytest.raises(P.UnknownOpcode):
        P.decode_request(f1)
    assert isinstance(P.decode_request(f2), P.Stat)


@pytest.mark.parametrize(
    "opcode,body",
    [
        (P.Opcode.READ, b"\x00" * 10),
        (P.Opcode.READ, b"\x00" * 25),
        (P.Opcode.WRITE, b"\x00" * 8),
        (P.Opcode.STAT, b"x"),
        (P.Opcode.FREE, b""),
        (P.Opcode.HELLO, struct.pack("!BBHH", 1, 1, 50, 0) + b"short"),
    ],
)
def test_bodies_of_the_wrong_length_are_remote_errors(opcode: int, body: bytes) -> None:
    frame = P.Frame(opcode, 1, 0, 0, memoryview(body))
    with pytest.raises(RemoteProtocolError):
        P.decode_request(frame)


def test_unknown_update_op_is_a_remote_error() -> None:
    body = struct.pack("!QQIIB3x", 1, 0, 4096, 0, 9)
    with pytest.raises(RemoteProtocolError, match="update op"):
        P.decode_request(P.Frame(P.Opcode.WRITE, 1, 0, 0, memoryview(body)))


def test_a_reply_is_not_accepted_as_a_request_nor_the_reverse() -> None:
    [req] = _frames(b"".join(P.encode_request(P.Stat(), 1)))
    [rep] = _frames(b"".join(P.encode_reply(P.Opcode.STAT, 1, P.StatReply(1, 2, 3, 4))))
    with pytest.raises(RemoteProtocolError):
        P.decode_request(rep)
    with pytest.raises(RemoteProtocolError):
        P.decode_reply(req)


def test_fields_that_do_not_fit_are_local_errors() -> None:
    with pytest.raises(LocalProtocolError):
        P.encode_request(P.Read(-1, 0, 0, 0), 1)
    with pytest.raises(LocalProtocolError):
        P.encode_request(P.Stat(), 1 << 32)


def test_update_op_names() -> None:
    assert P.UpdateOp.parse("add") is P.UpdateOp.ADD
    assert P.UpdateOp.parse(b"assign\n") is P.UpdateOp.ASSIGN
    with pytest.raises(ValueError, match="assign, add"):
        P.UpdateOp.parse("multiply")


def test_oversized_frame_raises_its_own_class() -> None:
    header = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.Opcode.WRITE, 1, 0, 0, 10_000)
    with pytest.raises(P.FrameTooLarge):
        P.parse_header(header, 9_999)
    # a wrong magic is not "too large", whatever its message says
    with pytest.raises(RemoteProtocolError) as info:
        P.parse_header(b"XX" + header[2:], 9_999)
    assert not isinstance(info.value, P.FrameTooLarge)


def test_a_hello_header_of_any_version_parses_so_the_body_can_negotiate() -> None:
    """Version negotiation happens in HELLO's body: its header version must not be refused."""
    for version in (1, P.PROTOCOL_VERSION + 1, 255):
        wire = b"".join(P.encode_request(P.Hello(1, 9, "future-client"), 0))
        wire = wire[:2] + bytes([version]) + wire[3:]
        frame = P.parse_header(wire, 1 << 16, any_version=True)
        frame.body = memoryview(wire[P.HEADER_SIZE:])
        hello = P.decode_request(frame)
        assert isinstance(hello, P.Hello) and (hello.min_version, hello.max_version) == (1, 9)
        with pytest.raises(RemoteProtocolError, match="version"):
            P.parse_header(wire, 1 << 16)


def _write_with_op_byte(opv: int) -> P.Frame:
    wire = b"".join(P.encode_request(P.Write(7, 3, 4096, 0, P.UpdateOp.ADD, b"\x00" * 16), 1))
    at = P.HEADER_SIZE + 24  # the op byte of the fixed part (!QQII then the op)
    wire = wire[:at] + bytes([opv]) + wire[at + 1 :]
    [frame] = _frames(wire)
    return frame


def test_the_op_byte_carries_the_encoding_in_its_high_nibble() -> None:
    msg = P.Write(7, 3, 4096, 0, P.Update(P.UpdateOp.ADD, encoding=P.Encoding.SIGN), b"\x00" * 16)
    wire = b"".join(P.encode_request(msg, 1))
    assert wire[P.HEADER_SIZE + 24] == P.UpdateOp.ADD | P.Encoding.SIGN << 4
    got = P.decode_request(_write_with_op_byte(P.UpdateOp.ADD | P.Encoding.TOPK << 4))
    assert isinstance(got, P.Write) and got.op == P.Update(P.UpdateOp.ADD, encoding=P.Encoding.TOPK)
    assert P.as_update(got.op).dense is P.UpdateOp.ADD
    # no encoding: the op as before (a bare UpdateOp)
    assert P.decode_request(_write_with_op_byte(P.UpdateOp.ADD)).op is P.UpdateOp.ADD  # type: ignore[union-attr]


@pytest.mark.parametrize("opv", [P.UpdateOp.ADD | 3 << 4, P.UpdateOp.ADD | 15 << 4,
                                 P.UpdateOp.ASSIGN | P.Encoding.TOPK << 4, P.UpdateOp.ASSIGN | P.Encoding.SIGN << 4])
def test_unknown_encodings_and_encoded_assign_are_refused(opv: int) -> None:
    with pytest.raises(RemoteProtocolError, match="encoding|encoded"):
        P.decode_request(_write_with_op_byte(opv))


def test_encoding_assign_or_a_scatter_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError, match="encoded"):
        P.encode_request(P.Write(7, 3, 4096, 0, P.Update(P.UpdateOp.ASSIGN, encoding=P.Encoding.TOPK), b"x"), 1)
    ext = P.extents([0], [0], [4])
    with pytest.raises(LocalProtocolError, match="encoded"):
        P.encode_request(P.Scatter(7, 4096, ext, P.Update(P.UpdateOp.ADD, encoding=P.Encoding.SIGN), b"abcd"), 1)
    wire = bytearray(b"".join(P.encode_request(P.Scatter(7, 4096, ext, P.UpdateOp.ADD, b"abcd"), 1)))
    wire[P.HEADER_SIZE + 16] |= P.Encoding.TOPK << 4  # !QIIB: the op byte
    [frame] = _frames(bytes(wire))
    with pytest.raises(RemoteProtocolError, match="encoded"):
        P.decode_request(frame)


def test_protocol_14_is_spoken_and_9_still_understood() -> None:
    """Protocol 10 changed no frame (a CLONE ends its freeze; THAW of one that is over is a
    no-op), 11 only added the round bit of the op byte, 12 two flags of a round and lets a
    whole-chunk copy between shards be shorter than its chunk (sent to a successor of 12 only),
    13 a flag of a staged SCATTER, and 14 an op value (FTRL), so a client of protocol 9 still
    works with these shards; 8 and older are refused."""
    assert (P.MIN_PROTOCOL_VERSION, P.PROTOCOL_VERSION) == (9, 14)
    wire = bytearray(b"".join(P.encode_request(P.Thaw(5), 1)))
    wire[2] = 9  # the header's version byte (!2sB...)
    [frame] = _frames(bytes(wire))
    assert P.decode_request(frame) == P.Thaw(5)
    wire[2] = 8
    with pytest.raises(RemoteProtocolError, match="protocol version 8"):
        _frames(bytes(wire))


def test_a_staged_scatters_extents_may_travel_in_the_staging_buffer() -> None:
    """FLAG_STAGED_EXTENTS (protocol 13, verbs): the frame carries only the extents' count; the
    shard reads them from the staging buffer, ahead of the rows, and finds the rows after them."""
    ext = P.extents([0, 0, 1], [0, 64, 8], [4, 8, 4])
    msg = P.Scatter(7, 4096, ext[:0], P.Update(P.UpdateOp.ADD, round=P.Round(1, 0, 0, 2)), staged=True,
                    staging_offset=32, staged_extents=3)
    wire = b"".join(P.encode_request(msg, 5))
    [frame] = _frames(wire)
    got = P.decode_request(frame)
    assert isinstance(got, P.Scatter) and _norm(got) == _norm(msg)
    staging = memoryview(bytes(32) + ext.tobytes() + b"r" * 16)
    rows = got.unstaged(staging)
    assert rows.extents.tolist() == ext.tolist() and (rows.staging_offset, rows.staged_extents, rows.length) == (80, 0, 16)
    assert P.Scatter(7, 4096, ext, P.UpdateOp.ADD, b"a" * 16).unstaged(None).length == 16  # extents in the frame
    with pytest.raises(RemoteProtocolError, match="leave the 0-byte staging buffer"):
        got.unstaged(None)  # a TCP connection has none
    with pytest.raises(RemoteProtocolError, match="leave the 60-byte staging buffer"):
        got.unstaged(staging[:60])
    with pytest.raises(LocalProtocolError, match="staged extents go with a staged payload"):
        P.encode_request(P.Scatter(7, 4096, ext[:0], P.UpdateOp.ADD, staged_extents=3), 1)
    with pytest.raises(LocalProtocolError, match="no extent in the frame"):
        P.encode_request(P.Scatter(7, 4096, ext, P.UpdateOp.ADD, staged=True, staged_extents=3), 1)
    bad = bytearray(wire)
    struct.pack_into("!H", bad, 10, P.FLAG_STAGED_EXTENTS)  # the header's flags: the payload not staged
    [frame] = _frames(bytes(bad))
    with pytest.raises(RemoteProtocolError, match="payload is not"):
        P.decode_request(frame)


@pytest.mark.parametrize("part", [(0, 0, 2), (5, 2, 2), (5, 0, 1)], ids=["push id 0", "index past count", "one part"])
def test_a_push_part_that_cannot_be_is_a_remote_error(part: tuple[int, int, int]) -> None:
    wire = bytearray(b"".join(P.encode_request(P.Write(7, 3, 8192, 0, P.UpdateOp.ADD, b"",
                                                       chain=P.Chain(5, 9, 0, 2500, part=P.Part(1, 0, 2))), 1)))
    at = len(wire) - 16  # the part is the body's last 16 bytes (no payload)
    wire[at:] = struct.pack("!QII", *part)
    [frame] = _frames(bytes(wire))
    with pytest.raises(RemoteProtocolError, match="push part"):
        P.decode_request(frame)


@pytest.mark.parametrize("status,cls", P.STATUS_ERRORS, ids=[s.name for s, _ in P.STATUS_ERRORS])
def test_every_error_a_shard_sends_is_raised_as_the_same_class_by_the_client(status: P.Status, cls: type) -> None:
    """The one status table (issue 21): an exception met by a shard, encoded as its error
    reply and decoded by a client, is raised there as the same class (with the replica it
    names); the wire status is the table's."""
    import irdma._errors as E

    exc = cls("what went wrong", 7) if issubclass(cls, E.ReplicaError) else cls("what went wrong")
    reply = P.error_reply(exc, shard_id=3)
    assert reply is not None and reply.status == status
    frame = P.parse_header(b"".join(P.encode_reply(P.Opcode.WRITE, 9, reply))[: P.HEADER_SIZE], 1 << 20)
    frame.body = memoryview(b"".join(P.encode_reply(P.Opcode.WRITE, 9, reply))[P.HEADER_SIZE :])
    with pytest.raises(cls) as raised:
        P.raise_for_error(P.decode_reply(frame), "127.0.0.1:1")
    assert type(raised.value) is cls and "what went wrong" in str(raised.value)
    if issubclass(cls, E.ReplicaError):
        assert raised.value.shard_id == 7


def test_a_status_the_table_lacks_is_shard_unavailable_and_a_bug_is_no_table_entry() -> None:
    import irdma._errors as E

    for status in (P.Status.INTERNAL, P.Status.AUTH_FAILED):
        with pytest.raises(E.ShardUnavailable, match=status.name):
            P.raise_for_error(P.ErrorReply(status, "x"), "127.0.0.1:1")
    for status in P.REFUSED_STATUSES:
        with pytest.raises(E.BadRequest, match="refused the request"):
            P.raise_for_error(P.ErrorReply(status, "x"), "127.0.0.1:1")
    assert P.error_reply(ZeroDivisionError("bug"), 3) is None  # the caller logs it, answers INTERNAL
    internal = P.error_reply(E.ShardUnavailable("link down"), 3)
    assert internal is not None and internal.status == P.Status.INTERNAL and "shard 3" in internal.message


def test_every_opcode_has_one_row_in_the_message_table() -> None:
    """The table-driven protocol (issue 21): each request kind is one row of MESSAGES, found by
    opcode when decoding and by class when encoding; no opcode lacks one, no class has two."""
    import typing

    assert set(P.MESSAGES) == set(P.Opcode)
    assert len({m.request for m in P.MESSAGES.values()}) == len(P.MESSAGES)
    assert {m.request for m in P.MESSAGES.values()} == set(typing.get_args(P.Request))
    for opcode, row in P.MESSAGES.items():
        assert row.opcode is opcode and P._REQUEST_OPCODE[row.request] is opcode
