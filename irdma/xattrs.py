"""The ``user.irdma.*`` xattrs of training jobs and communication: their names, defaults and
parsers, in one place at the bottom of the layers (pure, no I/O), so the metadata engine that
validates a value, the mount and the client that read it, and the training code agree.

Job directories (:mod:`irdma.client.coord`): ``user.irdma.consistency`` (``asp``, ``bsp``,
``ssp:S``; Ho et al., NIPS 2013), ``user.irdma.workers`` (N), ``user.irdma.sync_timeout``
(seconds), ``user.irdma.elastic`` (``MIN:MAX``), ``user.irdma.max_lease`` (seconds), and the
read-only ``user.irdma.clocks``. Files and directories (:mod:`irdma.client.comm`; P3, SysML
2019; layer dropping, Applied Sciences 2020): ``user.irdma.slice`` (float32 elements),
``user.irdma.priority`` (0 = most urgent), ``user.irdma.drop`` (a relative L1 threshold).
The metadata engine's own (``user.irdma.update``, ``chunk_size``, ``io``, ``cache``, ``shape``,
``max_snapshots``) are in :mod:`irdma.meta.base`; ``user.irdma.compress`` in
:mod:`irdma.wire.compress`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ._errors import InvalidArgument

XATTR_CONSISTENCY = b"user.irdma.consistency"
XATTR_WORKERS = b"user.irdma.workers"
XATTR_SYNC_TIMEOUT = b"user.irdma.sync_timeout"
#: On a job directory: ``MIN:MAX`` live workers of an elastic job (see the module docstring).
XATTR_ELASTIC = b"user.irdma.elastic"
#: On a directory (the mount's root for its ``.irdma/``): the longest lease (seconds) a lock of
#: that directory's ``.irdma/lock/`` may be taken for through a mount; longer ones are cut to it.
XATTR_MAX_LEASE = b"user.irdma.max_lease"
#: Default of :data:`XATTR_MAX_LEASE` (seconds).
DEFAULT_MAX_LEASE = 600.0
#: Read (not stored) on a job directory: every worker's clock, ``"K:C K:C ..."``.
XATTR_CLOCKS = b"user.irdma.clocks"
#: Default deadline of a wait (seconds).
DEFAULT_SYNC_TIMEOUT = 60.0

#: P3's slice: 40,000 float32 (160,000 bytes) per request.
DEFAULT_SLICE_ELEMS = 40_000
XATTR_SLICE = b"user.irdma.slice"
XATTR_PRIORITY = b"user.irdma.priority"
XATTR_DROP = b"user.irdma.drop"
#: Priorities are integers in [0, MAX_PRIORITY]; 0 is the most urgent (the first layer).
MAX_PRIORITY = 1 << 20


@dataclass(frozen=True)
class Consistency:
    """A job's consistency model: ``staleness`` None for ASP, 0 for BSP, S for SSP:S."""

    staleness: int | None

    @property
    def name(self) -> str:
        return "asp" if self.staleness is None else "bsp" if self.staleness == 0 else f"ssp:{self.staleness}"


def parse_consistency(value: bytes | str) -> Consistency:
    """``asp``, ``bsp`` or ``ssp:S`` (S >= 0; ``ssp:0`` is BSP).

    Raises:
        InvalidArgument: anything else.
    """
    text = (value.decode("ascii", "replace") if isinstance(value, bytes) else value).strip().lower()
    if text == "asp":
        return Consistency(None)
    if text == "bsp":
        return Consistency(0)
    if text.startswith("ssp:"):
        try:
            s = int(text[4:])
        except ValueError:
            s = -1
        if 0 <= s <= 1 << 20:
            return Consistency(s)
    raise InvalidArgument(f"bad consistency {text!r}: use asp, bsp or ssp:S with S >= 0")


def parse_workers(value: bytes | str) -> int:
    """A worker count, 1 to 2^20. Raises InvalidArgument."""
    try:
        n = int(value.decode("ascii", "replace") if isinstance(value, bytes) else value)
    except ValueError:
        n = 0
    if not 1 <= n <= 1 << 20:
        raise InvalidArgument(f"bad worker count {value!r}: use 1 to {1 << 20}")
    return n


def parse_timeout(value: bytes | str) -> float:
    """A sync deadline in seconds, more than 0 and at most a day. Raises InvalidArgument."""
    try:
        t = float(value.decode("ascii", "replace") if isinstance(value, bytes) else value)
    except ValueError:
        t = -1.0
    if not 0 < t <= 86400 or not math.isfinite(t):
        raise InvalidArgument(f"bad sync timeout {value!r}: seconds, more than 0 and at most 86400")
    return t


def parse_elastic(value: bytes | str) -> tuple[int, int]:
    """``MIN:MAX`` live workers, 1 <= MIN <= MAX <= 2^20. Raises InvalidArgument."""
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    low, colon, high = text.strip().partition(":")
    try:
        lo, hi = int(low), int(high) if colon else -1
    except ValueError:
        lo = hi = -1
    if not 1 <= lo <= hi <= 1 << 20:
        raise InvalidArgument(f"bad elastic range {text!r}: use MIN:MAX with 1 <= MIN <= MAX, e.g. 1:4")
    return lo, hi


def _text(value: bytes | str) -> str:
    return (value.decode("ascii", "replace") if isinstance(value, bytes) else value).strip()


def parse_slice(value: bytes | str) -> int:
    """``user.irdma.slice``: float32 elements per slice (``40000``), ``0`` for none -> elements.

    Raises:
        ValueError: not a non-negative integer below 2^28.
    """
    text = _text(value)
    if not text.isdigit() or int(text) >= 1 << 28:
        raise ValueError(f"bad {XATTR_SLICE.decode()} {text!r}: use float32 elements per slice such as"
                         f" {DEFAULT_SLICE_ELEMS} (P3's), or 0 for no slicing")
    return int(text)


def parse_priority(value: bytes | str) -> int:
    """``user.irdma.priority``: an integer 0 .. MAX_PRIORITY (0 = most urgent).

    Raises:
        ValueError: anything else.
    """
    text = _text(value)
    if not text.isdigit() or int(text) > MAX_PRIORITY:
        raise ValueError(f"bad {XATTR_PRIORITY.decode()} {text!r}: use an integer 0..{MAX_PRIORITY}"
                         " (0 is the most urgent: the first layer of the forward pass)")
    return int(text)


def parse_drop(value: bytes | str) -> float:
    """``user.irdma.drop``: the relative L1 threshold of layer dropping (``0.001``), ``0`` for never.

    Raises:
        ValueError: not a finite number in [0, 1].
    """
    text = _text(value)
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"bad {XATTR_DROP.decode()} {text!r}: use a threshold in [0, 1] relative to the layer's"
                         " weights (L1), such as 0.001; 0 never drops")
    return x


#: The communication xattrs and their normalizers (the metadata engine stores the normalized text).
XATTRS: dict[bytes, Callable[[bytes | str], str]] = {
    XATTR_SLICE: lambda v: str(parse_slice(v)),
    XATTR_PRIORITY: lambda v: str(parse_priority(v)),
    XATTR_DROP: lambda v: repr(parse_drop(v)),
}
