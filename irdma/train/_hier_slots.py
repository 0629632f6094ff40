"""The shared memory of a :mod:`irdma.train.hier` host group, and where each array lies in it.

Slots of ``stride = nbytes`` rounded up to 64 bytes: member ``r`` (``1 <= r < size``) writes its
array at byte ``(r - 1) * stride``; the result is at byte ``(size - 1) * stride``. Arrays are
float32 in the host's native byte order, C order, starting at the slot's first byte. The leader
needs no slot of its own. The mapping is at least a page long. Who may touch which slot when is
ordered by the group's messages (see :mod:`irdma.train.hier`), not here.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import numpy.typing as npt

from ._hier_config import ALIGN

Float32Array = npt.NDArray[np.float32]


class Slots:
    """The mapping of one group's shared memory file, ``size`` slots of ``nbytes`` each.

    Args:
        size: ranks in the group (slots ``1 .. size-1`` for members, ``size`` for the result).
        nbytes: the most bytes an array may have.
    """

    def __init__(self, size: int, nbytes: int) -> None:
        self.stride = -(-nbytes // ALIGN) * ALIGN
        self.length = max(size * self.stride, mmap.PAGESIZE)  # bytes of the file and of the mapping
        self._mm: mmap.mmap | None = None
        self._buf: npt.NDArray[np.uint8] | None = None

    def map(self, fd: int) -> None:
        """Map ``length`` bytes of the shared memory file ``fd`` (read and write, shared)."""
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(fd, self.length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)

    def view(self, slot: int, shape: tuple[int, ...]) -> Float32Array:
        """Slot ``1 .. size-1`` (a member's input) or ``size`` (the result) as float32 of ``shape``."""
        assert self._buf is not None
        start = (slot - 1) * self.stride
        n = 4 * math.prod(shape)
        return self._buf[start:start + n].view(np.float32).reshape(shape)

    def close(self) -> None:
        """Unmap (at once, or when the last view still alive is collected). Safe to call twice."""
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive (in a traceback): unmapped when it is collected
            self._mm = None
