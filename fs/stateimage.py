"""``DIR/.irdma-state@NAME``: the optimizer state of file ``NAME`` as a file of the mount.

Reading one gives the state image of ``NAME`` (:meth:`irdma.Client.state_of`: its layout, its
size); writing it restores the image, and is refused for a file in a snapshot or past the image's
end. What a handle reads and writes is looked up at its first request and kept until it is
released (close-to-open, as a file's size): no metadata round trip per request.
"""

from __future__ import annotations

import dataclasses

from irdma._errors import InvalidArgument, ReadOnly
from irdma.client.native import ChunkMap, Client
from irdma.meta import Inode
from irdma.placement import Layout

from .handles import getattr_or_stale
from .openfile import OpenFiles


class StateImages:
    """The state image handles open on one mount (their numbers are :class:`irdma.fs.control.Control`'s).

    Args:
        client: the mount's open :class:`irdma.Client`.
        files: the files open on the mount (a file's size and chunk map as this mount sees them).
    """

    def __init__(self, client: Client, files: OpenFiles) -> None:
        self.client = client
        self.meta = client.meta
        self.files = files
        #: open handles: (layout, state chunk bytes, image bytes, inode, chunk map)
        self._handles: dict[int, tuple[Layout, int, int, Inode, ChunkMap]] = {}

    async def of(self, target_ino: int) -> tuple[Layout, int, int, Inode]:
        """``(layout, state chunk bytes, image bytes, inode)`` of a file's optimizer state,
        sized by the file as this mount sees it (its own writes included)."""
        target = await getattr_or_stale(self.meta, target_ino)
        st = self.files.files.get(target_ino)
        if st is not None and st.dirty:
            target = dataclasses.replace(target, size=st.size)
        layout, _, per, total = await self.client.state_of(target)
        return layout, per, total, target

    async def handle(self, fh: int, target_ino: int) -> tuple[Layout, int, int, Inode, ChunkMap]:
        """What a state image handle reads and writes, looked up at its first request and kept
        until it is released. The chunk map is this mount's own when it has the file open."""
        got = self._handles.get(fh)
        if got is None:
            layout, per, total, node = await self.of(target_ino)
            st = self.files.files.get(target_ino)
            chunks = st.chunks if st is not None else await self.meta.chunk_map(target_ino)
            got = self._handles[fh] = (layout, per, total, node, chunks)
        return got

    async def read(self, fh: int, target: int, off: int, size: int) -> bytearray:
        """Up to ``size`` bytes at ``off`` of the state image of inode ``target``."""
        layout, per, total, _, chunks = await self.handle(fh, target)
        buf = bytearray(max(0, min(size, total - off)))
        if buf:
            await self.client.read_state_into(layout, per, off, memoryview(buf), chunks)
        return buf

    async def write(self, fh: int, target: int, off: int, buf: bytes) -> int:
        """Restore bytes ``[off, off+len(buf))`` of the state image of inode ``target``.

        Raises:
            ReadOnly: the file is in a snapshot; InvalidArgument: the write does not fit the image.
        """
        layout, per, total, node, _ = await self.handle(fh, target)
        if node.snap:
            raise ReadOnly(f"inode {target} is in a snapshot: its optimizer state is read-only")
        if not total or off + len(buf) > total:
            raise InvalidArgument(
                f"optimizer state of inode {target}: the image is {total} bytes"
                f" ({node.update_op or 'assign'}, {node.size} bytes of weights); a write of"
                f" [{off}, {off + len(buf)}) does not fit: set the optimizer and write the weights first")
        await self.client.write_state_from(layout, per, off, buf)
        return len(buf)

    def release(self, fh: int) -> None:
        self._handles.pop(fh, None)
