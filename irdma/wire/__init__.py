"""The wire: what a client and a shard say to each other, as bytes. Pure (no sockets, no
event loop) but for :mod:`.framing`, which reads and writes frames on a socket for both sides.

* :mod:`.protocol`: the frames (header, request and reply layouts, opcodes, the one
  status<->exception table), in the manner of h11: bytes in, events out.
* :mod:`.auth`: the cluster key, the mutual challenge-response and the frame tags (security
  levels ``integrity`` and ``auth``, SECURITY.md).
* :mod:`.compress`: the encodings of compressed gradients (top-k, scaled sign).
* :mod:`.extents`: extent records (chunk, offset, length) and their vectorized packing.
* :mod:`.framing`: socket set-up, exact reads, frame sends and the handshake.

Knows nothing of files, the shard map or the metadata engine. Names are re-exported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from irdma._lazy import exports

if TYPE_CHECKING:
    from .auth import KeySource, Macs
    from .compress import Compression
    from .protocol import Chain, Encoding, Update, UpdateOp

__getattr__, __dir__ = exports(__name__, {
    "UpdateOp": ".protocol", "Update": ".protocol", "Encoding": ".protocol", "Chain": ".protocol",
    "KeySource": ".auth", "Macs": ".auth",
    "Compression": ".compress",
})
__all__ = ["Chain", "Compression", "Encoding", "KeySource", "Macs", "Update", "UpdateOp"]
