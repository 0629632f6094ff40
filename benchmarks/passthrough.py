"""The FUSE ceiling of this machine: a minimal pyfuse3 + trio passthrough of a directory.

    python benchmarks/passthrough.py SOURCE MOUNTPOINT

Every request is forwarded to the same call on SOURCE (a tmpfs directory in the benchmark), with
the same FUSE options as irdma's mount (default_permissions; 1 MiB requests; direct I/O when
the opener asks for O_DIRECT). No caching, no metadata engine, no network: what is left is the
kernel's FUSE round trip plus pyfuse3's and trio's cost per request, the floor under irdma's
mount (``benchmarks/fio.py`` measures both side by side). Enough of POSIX for fio: lookup,
getattr, setattr (size, mode, times), create, open, read, write, fsync, release, unlink, readdir,
statfs; mkdir, rmdir and rename, for TensorFlow's CheckpointManager (``make bench``'s checkpoint
section measures its restore here too). Not a general-purpose filesystem (no links, no xattrs).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Callable

import pyfuse3
import trio


class Passthrough(pyfuse3.Operations):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self._paths: dict[int, str] = {pyfuse3.ROOT_INODE: source}
        self._fds: dict[int, int] = {}

    def _path(self, inode: int) -> str:
        try:
            return self._paths[inode]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    def _attr(self, path: str) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        ino = pyfuse3.ROOT_INODE if path == self.source else st.st_ino
        self._paths.setdefault(ino, path)
        e = pyfuse3.EntryAttributes()
        for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size", "st_atime_ns", "st_mtime_ns",
                  "st_ctime_ns"):
            setattr(e, k, getattr(st, k))
        e.st_ino = ino
        e.st_blksize, e.st_blocks = 4096, (st.st_size + 511) // 512
        e.attr_timeout = e.entry_timeout = 1.0
        return e

    async def lookup(self, parent_inode: int, name: bytes, ctx: object = None) -> pyfuse3.EntryAttributes:
        return self._attr(os.path.join(self._path(parent_inode), os.fsdecode(name)))

    async def getattr(self, inode: int, ctx: object = None) -> pyfuse3.EntryAttributes:
        return self._attr(self._path(inode))

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: object) -> pyfuse3.EntryAttributes:
        path = self._path(inode)
        try:
            if fields.update_size:
                os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, stat.S_IMODE(attr.st_mode))
            if fields.update_atime or fields.update_mtime:
                st = os.lstat(path)
                os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                   attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        return self._attr(path)

    def _open_fd(self, path: str, flags: int, mode: int = 0o644) -> pyfuse3.FileInfo:
        try:
            fd = os.open(path, flags & ~os.O_DIRECT, mode)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        self._fds[fd] = fd
        return pyfuse3.FileInfo(fh=fd, direct_io=bool(flags & os.O_DIRECT))

    async def open(self, inode: int, flags: int, ctx: object) -> pyfuse3.FileInfo:
        return self._open_fd(self._path(inode), flags)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: object) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        fi = self._open_fd(path, flags | os.O_CREAT, stat.S_IMODE(mode))
        return fi, self._attr(path)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return os.pwrite(fh, buf, off)

    async def fsync(self, fh: int, datasync: bool) -> None:
        os.fsync(fh)

    async def flush(self, fh: int) -> None:
        pass

    async def release(self, fh: int) -> None:
        os.close(self._fds.pop(fh))

    async def unlink(self, parent_inode: int, name: bytes, ctx: object) -> None:
        self._remove(parent_inode, name, os.unlink)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: object) -> None:
        self._remove(parent_inode, name, os.rmdir)

    def _remove(self, parent_inode: int, name: bytes, remove: Callable[[str], None]) -> None:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        try:
            ino = os.lstat(path).st_ino
            remove(path)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        self._paths.pop(ino, None)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: object) -> pyfuse3.EntryAttributes:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        try:
            os.mkdir(path, stat.S_IMODE(mode))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        return self._attr(path)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: object) -> None:
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)  # no RENAME_NOREPLACE / RENAME_EXCHANGE here
        old = os.path.join(self._path(parent_inode_old), os.fsdecode(name_old))
        new = os.path.join(self._path(parent_inode_new), os.fsdecode(name_new))
        try:
            replaced: int | None = os.lstat(new).st_ino
        except FileNotFoundError:
            replaced = None
        try:
            os.rename(old, new)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        if replaced is not None:
            self._paths.pop(replaced, None)
        for ino, path in list(self._paths.items()):  # the entry itself and, for a directory, what is under it
            if path == old or path.startswith(old + os.sep):
                self._paths[ino] = new + path[len(old):]

    async def opendir(self, inode: int, ctx: object) -> int:
        self._path(inode)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        path = self._path(fh)
        names = sorted(os.listdir(path))
        for i, name in enumerate(names[start_id:], start_id):
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attr(os.path.join(path, name)), i + 1):
                break

    async def releasedir(self, fh: int) -> None:
        pass

    async def statfs(self, ctx: object) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.source)
        out = pyfuse3.StatvfsData()
        for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail"):
            setattr(out, k, getattr(st, k))
        out.f_namemax = st.f_namemax
        return out


def main() -> None:
    source, mountpoint = sys.argv[1:3]
    fs = Passthrough(os.path.abspath(source))
    options = set(pyfuse3.default_options)
    options.update({"default_permissions", "fsname=passthrough", "subtype=passthrough"})
    pyfuse3.init(fs, mountpoint, options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
