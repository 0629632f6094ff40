"""Gradient compression with error feedback: top-k and scaled sign (pure numpy, no I/O).

A worker that pushes a gradient to a file whose update op is ``add`` or an optimizer may send it
compressed (xattr ``user.irdma.compress`` of the file, else of its directory; or
``Client.push(..., compress=...)``). The shard decodes the payload and applies the op to the
decoded gradient exactly as to a dense write of it (protocol 8, :class:`irdma.wire.protocol.Encoding`).
What the compression drops is kept on the worker and added to the next gradient (*error
feedback*), so nothing is lost, only delayed: for each push of gradient ``g`` with residual ``r``
(float32, same shape, zeros at first)::

    corrected = g + r
    payload, decoded = encode(corrected, c)      # the shard applies `decoded`
    r = corrected - decoded

The methods: top-k sparsification by magnitude with error accumulation (Stich, Cordonnier &
Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; Lin et al., "Deep Gradient Compression",
ICLR 2018) and scaled sign, one scale per slice (Karimireddy, Rebjock, Stich & Jaggi, "Error
Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019).

Wire layouts
------------
The input is a vector of ``n`` little-endian IEEE-754 float32 elements (1 <= n < 2^32): the
bytes ``[offset, offset + 4n)`` of one chunk. Every integer and float of a payload is
little-endian (like the parameters themselves, unlike the frame headers of
:mod:`irdma.wire.protocol`); there is no padding between the parts.

``topk`` (:attr:`Encoding.TOPK`), ``8 + 8k`` bytes::

    n        u32     elements of the decoded vector
    k        u32     elements kept, 1 <= k <= n; k = max(1, ceil(fraction * n))
    indices  u32[k]  strictly ascending, each < n
    values   f32[k]  the elements at those indices, finite

    The kept elements are the k largest by magnitude (ties: the lowest index first); the
    decoded vector is zero elsewhere.

``sign`` (:attr:`Encoding.SIGN`), ``8 + 4 * ceil(n / slice) + ceil(n / 8)`` bytes::

    n        u32                     elements of the decoded vector
    slice    u32                     elements per scale, >= 1 (SIGN_SLICE unless chosen)
    scales   f32[ceil(n / slice)]    scale j = mean |x_i| over i in [j*slice, (j+1)*slice) ∩ [0, n),
                                     computed in float64 and rounded once to float32; finite, >= 0
    signs    u8[ceil(n / 8)]         bit i (numpy.packbits, bitorder="little": element i is bit
                                     i % 8 of byte i // 8) is 1 where x_i < 0; pad bits are 0

    The decoded element i is ``-scale`` where its bit is 1, else ``+scale``, for the scale of
    its slice.

:func:`decode` checks every one of these rules and raises ValueError on any payload that breaks
one, so the shard refuses it (BAD_REQUEST) and changes nothing. Decoding is deterministic: every
replica of a chunk decodes a forwarded payload to the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .._errors import InvalidArgument
from .protocol import Encoding

#: The xattr of a file (or of its directory, for the files in it) that selects compression.
XATTR_COMPRESS = b"user.irdma.compress"
#: Elements per scale of ``sign``. Small enough that a scale follows the magnitude of the
#: gradient where it changes (a tensor's layers and rows differ by orders of magnitude; one
#: scale per tensor, as in the paper, would flatten them), large enough that scales cost about
#: 3% on top of the one bit per element (4 bytes per 128 bytes of signs). 1024 divides every
#: chunk and piece size (multiples of 4 KiB), so slices never straddle a piece boundary.
SIGN_SLICE = 1024
_HEAD = np.dtype([("n", "<u4"), ("m", "<u4")])  # (n, k) of topk; (n, slice) of sign
_HEAD_SIZE = 8
_F32 = np.dtype("<f4")
_U32 = np.dtype("<u4")
#: Largest n of a payload (a u32 field).
MAX_ELEMENTS = (1 << 32) - 1


@dataclass(frozen=True)
class Compression:
    """How gradients are compressed: the parsed value of ``user.irdma.compress``.

    Attributes:
        kind: :class:`Encoding` (``NONE``, ``TOPK`` or ``SIGN``).
        fraction: for ``TOPK``, the share of elements kept, 0 < fraction <= 1 (1.0 otherwise).
        slice: for ``SIGN``, elements per scale (:data:`SIGN_SLICE` by default).
    """

    kind: Encoding = Encoding.NONE
    fraction: float = 1.0
    slice: int = SIGN_SLICE

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0 or not math.isfinite(self.fraction):
            raise ValueError(f"top-k fraction {self.fraction!r} must be in (0, 1]")
        if not 1 <= self.slice <= MAX_ELEMENTS:
            raise ValueError(f"sign slice {self.slice!r} must be 1 to {MAX_ELEMENTS} elements")

    def __bool__(self) -> bool:
        return self.kind != Encoding.NONE


#: No compression.
NONE = Compression()


def parse_compress(value: bytes | str) -> Compression:
    """Parse ``none``, ``topk:FRACTION`` (0 < FRACTION <= 1, e.g. ``topk:0.01``), ``sign`` or
    ``sign:SLICE`` (elements per scale, default :data:`SIGN_SLICE`); case and surrounding
    blanks are ignored.

    Raises:
        ValueError: anything else (the message says what to use).
    """
    text = (value.decode("ascii", "replace") if isinstance(value, bytes) else value).strip().lower()
    kind, _, arg = text.partition(":")
    hint = "use none, topk:FRACTION with 0 < FRACTION <= 1 (e.g. topk:0.01) or sign"
    try:
        if kind == "none" and not arg:
            return NONE
        if kind == "topk" and arg:
            return Compression(Encoding.TOPK, fraction=float(arg))
        if kind == "sign":
            return Compression(Encoding.SIGN, slice=int(arg) if arg else SIGN_SLICE)
    except ValueError as exc:
        raise ValueError(f"bad {XATTR_COMPRESS.decode()} {text!r}: {exc}; {hint}") from None
    raise ValueError(f"bad {XATTR_COMPRESS.decode()} {text!r}: {hint}")


def format_compress(c: Compression) -> str:
    """The normalized xattr value of ``c`` (``parse_compress(format_compress(c)) == c``)."""
    if c.kind == Encoding.TOPK:
        return f"topk:{c.fraction!r}"
    if c.kind == Encoding.SIGN:
        return "sign" if c.slice == SIGN_SLICE else f"sign:{c.slice}"
    return "none"


def xattr_value(value: bytes | str) -> str:
    """The normalized value to store for ``user.irdma.compress`` (the metadata engines' check).

    Raises:
        InvalidArgument: not a valid value (EINVAL; nothing is stored).
    """
    try:
        return format_compress(parse_compress(value))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def topk_count(n: int, fraction: float) -> int:
    """k of a top-k payload of ``n`` elements: ``max(1, ceil(fraction * n))``, at most n, with
    ``fraction`` taken as the decimal it prints as (``0.05 * 1020`` is 51, not 52)."""
    return min(n, max(1, math.ceil(Fraction(repr(fraction)) * n)))


def wire_bytes(n: int, c: Compression) -> int:
    """Bytes of the payload that carries ``n`` float32 elements compressed with ``c`` (``4n``
    for none; for the cost model and to size pieces)."""
    if c.kind == Encoding.TOPK:
        return _HEAD_SIZE + 8 * topk_count(n, c.fraction)
    if c.kind == Encoding.SIGN:
        return _HEAD_SIZE + 4 * -(-n // c.slice) + -(-n // 8)
    return 4 * n


def max_elements(limit: int, c: Compression) -> int:
    """The most elements whose payload fits in ``limit`` bytes (0 when not even one does)."""
    lo, hi = 0, MAX_ELEMENTS
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if wire_bytes(mid, c) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def encode(x: np.ndarray, c: Compression) -> tuple[bytes, np.ndarray]:
    """Compress a float32 gradient.

    Args:
        x: float32, any shape (C order; read as a flat vector of n elements, 1 <= n < 2^32).
        c: the compression (``TOPK`` or ``SIGN``).

    Returns:
        ``(payload, decoded)``: the payload (layout in the module docstring) and the flat
        float32 vector of n elements the shard will apply, ``decode(payload, c.kind)``.

    Raises:
        ValueError: ``x`` is empty, too long, not float32, has a NaN or an infinity, or ``c``
            is ``none``.
    """
    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.dtype != np.float32:
        raise ValueError(f"a gradient to compress must be float32, not {flat.dtype}")
    n = len(flat)
    if not 1 <= n <= MAX_ELEMENTS:
        raise ValueError(f"a gradient to compress has 1 to {MAX_ELEMENTS} elements, not {n}")
    if not np.isfinite(flat).all():
        raise ValueError("a gradient to compress must be finite (it has a NaN or an infinity)")
    flat = flat.astype(_F32, copy=False)
    if c.kind == Encoding.TOPK:
        return _encode_topk(flat, topk_count(n, c.fraction))
    if c.kind == Encoding.SIGN:
        return _encode_sign(flat, c.slice)
    raise ValueError("encode needs a compression: topk or sign, not none")


def _encode_topk(x: np.ndarray, k: int) -> tuple[bytes, np.ndarray]:
    n = len(x)
    mag = np.abs(x)
    if k == n:
        idx = np.arange(n, dtype=np.int64)
    else:
        t = np.partition(mag, n - k)[n - k]  # the k-th largest magnitude
        above = np.flatnonzero(mag > t)
        ties = np.flatnonzero(mag == t)[: k - len(above)]  # the lowest indices among equals
        idx = np.sort(np.concatenate([above, ties]))
    values = x[idx]
    decoded = np.zeros(n, dtype=_F32)
    decoded[idx] = values
    head = np.array([(n, k)], dtype=_HEAD)
    return head.tobytes() + idx.astype(_U32).tobytes() + values.tobytes(), decoded


def _slice_starts(n: int, slice_: int) -> np.ndarray:
    return np.arange(0, n, slice_, dtype=np.int64)


def _encode_sign(x: np.ndarray, slice_: int) -> tuple[bytes, np.ndarray]:
    n = len(x)
    starts = _slice_starts(n, slice_)
    sums = np.add.reduceat(np.abs(x).astype(np.float64), starts)
    counts = np.diff(np.append(starts, n))
    scales = (sums / counts).astype(_F32)
    neg = x < 0
    bits = np.packbits(neg, bitorder="little")
    decoded = np.repeat(scales, counts)
    np.negative(decoded, out=decoded, where=neg)
    head = np.array([(n, slice_)], dtype=_HEAD)
    return head.tobytes() + scales.tobytes() + bits.tobytes(), decoded


def payload_elements(payload: bytes | memoryview | np.ndarray) -> int:
    """The n a payload's header announces (for a range check before decoding).

    Raises:
        ValueError: the payload is shorter than its header.
    """
    buf = np.frombuffer(payload, dtype=np.uint8)
    if len(buf) < _HEAD_SIZE:
        raise ValueError(f"an encoded payload of {len(buf)} bytes is shorter than its {_HEAD_SIZE}-byte header")
    return int(buf[:_HEAD_SIZE].view(_HEAD)[0]["n"])


def decode(payload: bytes | memoryview | np.ndarray, encoding: Encoding | int,
           limit: int = MAX_ELEMENTS) -> np.ndarray:
    """Decode a payload into the float32 vector it carries, checking every rule of its layout.

    Args:
        payload: the bytes (layout in the module docstring).
        encoding: :attr:`Encoding.TOPK` or :attr:`Encoding.SIGN`.
        limit: the most elements accepted (a shard passes the room left in the chunk), checked
            before anything is allocated.

    Returns:
        A new flat float32 array (native little-endian) of the n elements.

    Raises:
        ValueError: an unknown encoding, or a malformed payload: wrong length for its header,
            n of 0 or over ``limit``, k of 0 or over n, indices not strictly ascending or not
            below n, a value or scale not finite, a negative scale, a slice of 0, non-zero pad bits.
    """
    buf = np.frombuffer(payload, dtype=np.uint8)
    n = payload_elements(buf)
    m = int(buf[:_HEAD_SIZE].view(_HEAD)[0]["m"])
    if n == 0:
        raise ValueError("an encoded payload of 0 elements")
    if n > limit:
        raise ValueError(f"an encoded payload of {n} elements, more than the {limit} that fit")
    body = buf[_HEAD_SIZE:]
    if encoding == Encoding.TOPK:
        k = m
        if not 1 <= k <= n:
            raise ValueError(f"a top-k payload keeps {k} of {n} elements: k must be 1 to n")
        if len(body) != 8 * k:
            raise ValueError(f"a top-k payload of k={k} needs {_HEAD_SIZE + 8 * k} bytes, got {len(buf)}")
        idx = body[: 4 * k].view(_U32)
        values = body[4 * k :].view(_F32)
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError("the indices of a top-k payload must be strictly ascending")
        if int(idx[-1]) >= n:
            raise ValueError(f"a top-k payload names index {int(idx[-1])} of a vector of {n}")
        if not bool(np.isfinite(values).all()):
            raise ValueError("a top-k payload carries a value that is not finite")
        out = np.zeros(n, dtype=_F32)
        out[idx] = values
        return out
    if encoding == Encoding.SIGN:
        slice_ = m
        if slice_ < 1:
            raise ValueError("a sign payload's slice must be at least 1 element")
        nscales, nbits = -(-n // slice_), -(-n // 8)
        if len(body) != 4 * nscales + nbits:
            raise ValueError(f"a sign payload of {n} elements in slices of {slice_} needs"
                             f" {_HEAD_SIZE + 4 * nscales + nbits} bytes, got {len(buf)}")
        scales = body[: 4 * nscales].view(_F32)
        if not bool(np.isfinite(scales).all()) or bool((scales < 0).any()):
            raise ValueError("a sign payload's scales must be finite and not negative")
        bits = body[4 * nscales :]
        if n % 8 and int(bits[-1]) >> (n % 8):
            raise ValueError("a sign payload's pad bits (after element n-1) must be 0")
        neg = np.unpackbits(bits, count=n, bitorder="little").view(bool)
        counts = np.full(nscales, slice_, dtype=np.int64)
        counts[-1] = n - slice_ * (nscales - 1)
        out = np.repeat(scales, counts).astype(_F32, copy=False)
        np.negative(out, out=out, where=neg)
        return out
    raise ValueError(f"unknown payload encoding {int(encoding)}")


class ErrorFeedback:
    """Residuals of error feedback, one per key (e.g. a file path or a layer), on the worker.

    The residual of a key is float32 of the gradient's shape, zeros at first; :meth:`step` adds
    it to the gradient, compresses the sum and keeps what the compression dropped (Karimireddy
    et al., ICML 2019: error-feedback SGD). Over any number of steps, the sum of the decoded
    gradients plus the residual equals the sum of the gradients (up to float32 rounding of the
    additions; exactly where they are exact, e.g. integers below 2^24).

    Args:
        c: the compression.
    """

    def __init__(self, c: Compression) -> None:
        self.compression = c
        self.residuals: dict[Hashable, np.ndarray] = {}

    def residual(self, key: Hashable, shape: tuple[int, ...] | int) -> np.ndarray:
        """The residual of ``key`` (made, zeros, on first use).

        Raises:
            ValueError: the key's residual has another shape.
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        r = self.residuals.get(key)
        if r is None:
            r = self.residuals[key] = np.zeros(shape, dtype=_F32)
        elif r.shape != shape:
            raise ValueError(f"the residual of {key!r} has shape {r.shape}, the gradient {shape}")
        return r

    def step(self, key: Hashable, g: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Compress ``g + residual``; the residual becomes what the compression dropped.

        Returns:
            ``(payload, decoded)`` as :func:`encode` (``decoded`` flat float32).

        Raises:
            ValueError: as :func:`encode` (the residual is then unchanged).
        """
        g = np.asarray(g, dtype=_F32)
        r = self.residual(key, g.shape)
        corrected = g + r
        payload, decoded = encode(corrected, self.compression)
        r[...] = corrected - decoded.reshape(g.shape)
        return payload, decoded

    def pop(self, key: Hashable) -> np.ndarray | None:
        """Drop the residual of ``key`` and return it (None if there is none)."""
        return self.residuals.pop(key, None)


__all__ = [
    "XATTR_COMPRESS", "SIGN_SLICE", "Compression", "NONE", "parse_compress", "format_compress", "xattr_value",
    "topk_count", "wire_bytes", "max_elements", "encode", "decode", "payload_elements", "ErrorFeedback", "Encoding",
]
