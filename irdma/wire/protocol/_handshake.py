"""Opening a connection: HELLO and the AUTH exchange (protocol 4).

A connection opens with HELLO (protocol versions the client speaks, its name and its *auth
offer*: the cluster id and a fresh nonce) and the shard answers with its id, capacity, largest
payload and *incarnation*: a random non-zero u64 made with the shard's memory, so a client tells a
shard that lost its chunks (a restart) from one that kept them. A shard with a cluster key
first answers HELLO with a challenge (FLAG_CHALLENGE: its own nonce), the client proves the key
with AUTH, and the shard's HELLO-style reply to AUTH carries its proof back (see
:mod:`irdma.wire.auth`). On verbs, VERBS_CONNECT follows (:mod:`._verbs`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from ..._errors import RemoteProtocolError
from ._core import FLAG_CHALLENGE, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, Opcode, _exact, _need, _Parts

#: Bytes of a nonce and of a proof in the auth exchange (HMAC-SHA256).
AUTH_PROOF_SIZE = 32


@dataclass
class Hello:
    """Body ``!BBHH`` (min version, max version, name length, auth offer length), the UTF-8
    name, then the auth offer. Answered with a :class:`HelloReply` or an :class:`AuthChallenge`."""

    OPCODE: ClassVar[Opcode] = Opcode.HELLO
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!BBHH")

    min_version: int = MIN_PROTOCOL_VERSION
    max_version: int = PROTOCOL_VERSION
    client_name: str = ""
    auth: bytes = b""  # the auth offer: cluster id (16 bytes) and client nonce (32); empty for none

    def encode(self) -> tuple[_Parts, int]:
        name = self.client_name.encode()
        return [self.LAYOUT.pack(self.min_version, self.max_version, len(name), len(self.auth)) + name + self.auth], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Hello:
        fixed = cls.LAYOUT.size
        _need(body, fixed, "HELLO")
        lo, hi, nlen, clen = cls.LAYOUT.unpack_from(body)
        if len(body) != fixed + nlen + clen:
            raise RemoteProtocolError("HELLO body length does not match its name and auth offer")
        name = bytes(body[fixed : fixed + nlen]).decode("utf-8", "replace")
        return cls(lo, hi, name, bytes(body[fixed + nlen :]))

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> HelloReply | AuthChallenge:
        if flags & FLAG_CHALLENGE:
            return AuthChallenge.decode(body, flags)
        return HelloReply.decode(body, flags)


@dataclass
class HelloReply:
    """Body ``!B3xIQIQI`` (version, shard id, capacity, max payload, incarnation, extra length),
    the extra bytes, then the proof (replies to AUTH only)."""

    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!B3xIQIQI")

    version: int
    shard_id: int
    capacity: int
    max_payload: int
    incarnation: int = 0  # random, made with the shard's memory; 0 only in old replies
    extra: bytes = b""  # transport-specific (verbs: region descriptors, QP info)
    proof: bytes = b""  # the reply to AUTH: the shard's proof of the key (32 bytes)

    def encode(self) -> tuple[_Parts, int]:
        return [self.LAYOUT.pack(self.version, self.shard_id, self.capacity, self.max_payload, self.incarnation,
                                 len(self.extra)) + self.extra + self.proof], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> HelloReply:
        fixed = cls.LAYOUT.size
        _need(body, fixed, "HELLO reply")
        version, sid, cap, maxp, incarnation, elen = cls.LAYOUT.unpack_from(body)
        _need(body, fixed + elen, "HELLO reply")
        proof = bytes(body[fixed + elen :])
        if len(proof) not in (0, AUTH_PROOF_SIZE):
            raise RemoteProtocolError(f"HELLO reply carries a {len(proof)}-byte proof")
        return cls(version, sid, cap, maxp, incarnation, bytes(body[fixed : fixed + elen]), proof)


@dataclass
class AuthChallenge:
    """The reply to HELLO of a shard with a key: its nonce (32 bytes), with FLAG_CHALLENGE."""

    nonce: bytes

    def encode(self) -> tuple[_Parts, int]:
        return [self.nonce], FLAG_CHALLENGE

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> AuthChallenge:
        _exact(body, AUTH_PROOF_SIZE, "HELLO challenge")
        return cls(bytes(body))


@dataclass
class Auth:
    """The client's proof of the cluster key (32 bytes), after an :class:`AuthChallenge`.
    Answered as HELLO is (a challenge flag there is ignored)."""

    OPCODE: ClassVar[Opcode] = Opcode.AUTH

    proof: bytes

    def encode(self) -> tuple[_Parts, int]:
        return [self.proof], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Auth:
        _exact(body, AUTH_PROOF_SIZE, "AUTH")
        return cls(bytes(body))

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> HelloReply | AuthChallenge:
        return Hello.decode_reply(body, flags & ~FLAG_CHALLENGE)
