"""Update ops: what a WRITE, REMOTE_WRITE or SCATTER does to the bytes already in a chunk, and
how its op byte (and an optimizer's arguments) travel.

The update ops and their semantics (applied atomically per chunk by the shard, each bumps the
chunk's version by one) follow the parameter-server model of ps-lite (Li et al., OSDI 2014)
and the server-side accumulate of SoftMemoryBox II (Ahn et al., IEEE Access 2020). The op byte
is ``op | encoding << 4 | ROUND_BIT`` (protocol 8; the round bit, 0x80, protocol 11); an
optimizer op's arguments follow the message's fixed part as ``!4dI4x`` (40 bytes: four float64
and the u32 flags), then, with the round bit, the :class:`Round` as ``!QQIIB3x`` (32 bytes),
before any chain.

A push with a :class:`Round` is one worker's contribution to a synchronous (BSP) round: the
shard sums the contributions of the round's members to the same bytes and applies the update
op once, to their mean (or their sum), when the last one arrives (:mod:`irdma.server.rounds`;
Horovod's averaging allreduce, ps-lite's server-side merge as BytePS does it).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from dataclasses import dataclass

from ..._errors import LocalProtocolError, RemoteProtocolError
from ._core import _need


class UpdateOp(enum.IntEnum):
    """What a write does to the bytes already in a chunk.

    ``ASSIGN`` overwrites. ``ADD`` adds element-wise as little-endian float32: offset and
    length must be multiples of 4. ``SGD``, ``ADAM``, ``ADAGRAD``, ``RMSPROP`` (protocol 6) and
    ``FTRL`` (protocol 14) take the bytes as a float32 gradient and apply one optimizer step (:class:`Update` carries
    their arguments; :mod:`irdma.wire.optimizers` parses them, :mod:`irdma.server.optim` applies them).
    """

    ASSIGN = 0
    ADD = 1
    SGD = 2
    ADAM = 3
    ADAGRAD = 4
    RMSPROP = 5
    FTRL = 6

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
#: The op byte's bit that says a :class:`Round` follows the optimizer arguments (protocol 11).
ROUND_BIT = 0x80
#: Flag bits of a :class:`Round`: apply the sum of the contributions, not their mean (``hvd.Sum``).
ROUND_SUM = 0x1
#: An elastic job's round (protocol 12): ``members`` is what the member expects (its job's size);
#: contributions may disagree on it (the largest counts), and a round whose members did not all
#: push completes when a member closes it (:data:`ROUND_CLOSE`), its divisor those that pushed.
ROUND_ELASTIC = 0x2
#: Close (protocol 12): a WRITE without payload that applies, on the shard it is sent to, every
#: open round of its run up to ``round`` with the contributions it has (an elastic job's members
#: send it once the job's clock passed the round: every live member's contribution is in). Its
#: reply's version is the number of ranges applied with fewer members than expected.
ROUND_CLOSE = 0x4
_ROUND = struct.Struct("!QQIIB3x")  # series, round, member, members, flags


@dataclass(frozen=True)
class Round:
    """What makes a push one member's contribution to a synchronous round (protocol 11).

    Attributes:
        series: u64 naming the run the rounds belong to (a job run: every member of one run
            sends the same; a new run, the same job directory again, another).
        round: u64, the round (the job's clock: the rounds its members finished).
        member: u32, this contribution's member (the worker's rank), ``member < members``
            (any worker id in an elastic round).
        members: u32, how many contributions make the round (at least 1): the shard applies
            the update once the contributions of every member to the same bytes are in.
        flags: :data:`ROUND_SUM` (apply the sum; else the mean, the sum divided by ``members``),
            :data:`ROUND_ELASTIC`, :data:`ROUND_CLOSE` (protocol 12).
    """

    series: int
    round: int
    member: int
    members: int
    flags: int = 0

    def encode(self) -> bytes:
        return _ROUND.pack(self.series, self.round, self.member, self.members, self.flags)

    @property
    def total(self) -> bool:
        """Whether the round applies the sum of its contributions (:data:`ROUND_SUM`), not the mean."""
        return bool(self.flags & ROUND_SUM)

    @property
    def elastic(self) -> bool:
        """An elastic job's round (:data:`ROUND_ELASTIC`)."""
        return bool(self.flags & ROUND_ELASTIC)

    @property
    def close(self) -> bool:
        """A close of the run's rounds up to this one (:data:`ROUND_CLOSE`), not a contribution."""
        return bool(self.flags & ROUND_CLOSE)


@dataclass(frozen=True)
class Update:
    """An update op with its arguments, as a WRITE or REMOTE_WRITE carries it.

    Attributes:
        op: the op (its byte in the fixed part).
        args: for an optimizer op, its four float64 arguments in the order of
            :data:`irdma.wire.optimizers.ARGUMENTS` (unused ones 0.0); they follow the fixed part
            as ``!4dI4x`` (40 bytes) with ``flags``, before any chain.
        flags: OPT_NESTEROV, OPT_CENTERED.
        encoding: how the payload is encoded (:class:`Encoding`, protocol 8; the op byte's
            high nibble): the shard decodes it and applies ``op`` to the decoded gradient.
            Only with ``add`` and the optimizers.
        round: the synchronous round this push contributes to (:class:`Round`, protocol 11),
            or None: applied as it comes. Only with ``add`` and the optimizers.
    """

    op: UpdateOp
    args: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    flags: int = 0
    encoding: Encoding = Encoding.NONE
    round: Round | None = None

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


_OPTIM = struct.Struct("!4dI4x")  # an optimizer update's arguments and flags


def _encode_update(op: UpdateOp | Update, encodable: bool = True) -> tuple[int, bytes]:
    """The op byte of an update and the bytes of its optimizer arguments and round (empty for
    another op without a round)."""
    u = as_update(op)
    enc = Encoding(u.encoding)
    if enc and (not encodable or not u.op.is_float32):
        raise LocalProtocolError(f"an encoded ({enc.name.lower()}) payload goes only with add or an optimizer"
                                 " in WRITE or REMOTE_WRITE")
    after = _OPTIM.pack(*u.args, u.flags) if u.op.is_optimizer else b""
    if u.round is None:
        return int(u.op) | int(enc) << 4, after
    if not u.op.is_float32:
        raise LocalProtocolError("a round (a synchronous push) goes only with add or an optimizer")
    if not 0 <= u.round.member < u.round.members and not u.round.elastic:
        raise LocalProtocolError(f"round member {u.round.member} of {u.round.members}: use 0 <= member < members")
    return int(u.op) | int(enc) << 4 | ROUND_BIT, after + u.round.encode()


def _decode_update(opv: int, body: memoryview, at: int, encodable: bool = True) -> tuple[UpdateOp | Update, int]:
    """The update of op byte ``opv``, its arguments read at ``body[at:]``; and the offset after them."""
    try:
        uop = UpdateOp(opv & 0xF)
    except ValueError:
        raise RemoteProtocolError(f"unknown update op {opv & 0xF}") from None
    try:
        enc = Encoding((opv & ~ROUND_BIT) >> 4)
    except ValueError:
        raise RemoteProtocolError(f"unknown payload encoding {(opv & ~ROUND_BIT) >> 4}") from None
    if enc and (not encodable or not uop.is_float32):
        raise RemoteProtocolError(f"an encoded ({enc.name.lower()}) payload goes only with add or an optimizer"
                                  " in WRITE or REMOTE_WRITE")
    args: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    flags = 0
    if uop.is_optimizer:
        _need(body, at + _OPTIM.size, "optimizer arguments")
        *got, flags = _OPTIM.unpack_from(body, at)
        args = (got[0], got[1], got[2], got[3])
        at += _OPTIM.size
    rnd = None
    if opv & ROUND_BIT:
        if not uop.is_float32:
            raise RemoteProtocolError("a round (a synchronous push) goes only with add or an optimizer")
        _need(body, at + _ROUND.size, "round")
        rnd = Round(*_ROUND.unpack_from(body, at))
        at += _ROUND.size
        if not 0 <= rnd.member < rnd.members and not rnd.elastic:
            raise RemoteProtocolError(f"round member {rnd.member} of {rnd.members}: use 0 <= member < members")
    if not uop.is_optimizer and rnd is None:
        return (Update(uop, encoding=enc) if enc else uop), at
    return Update(uop, args, flags, enc, rnd), at
