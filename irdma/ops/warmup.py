"""``irdma warmup``: fill a local read cache ahead of the reads (as ``juicefs warmup``).

Two ways, by what the paths are (https://juicefs.com/docs/community/command_reference#warmup):

* paths on an irdma mount: every regular file under them is read through the mount, whole,
  by ``threads`` threads, with ``O_DIRECT`` so the kernel's page cache does not answer instead
  of the mount; the mount keeps what it reads in its cache (``irdma mount --cache-dir`` or
  ``--cache-memory``; a mount without one only reads).
* namespace paths with ``--meta URL --cache-dir DIR``: a native client with a disk cache in
  ``DIR`` reads every chunk of the files from the shards into ``DIR``, where a mount or client
  of the same namespace with the same ``--cache-dir`` finds them (validated by chunk version at
  its opens, as any kept chunk).

Progress (:func:`irdma.ops.progress.transfer_progress`) is shown in bytes and files, with the
rate and the time left.
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import trio

from .._errors import InvalidArgument
from ..meta import Inode

#: Bytes per read through a mount (FUSE cuts it into max_read requests).
READ_BLOCK = 4 << 20


@dataclass
class WarmupResult:
    files: int
    bytes: int  # bytes read (the files' sizes)
    seconds: float


def _walk(path: str) -> Iterator[tuple[str, int]]:
    """``(path, size)`` of every regular file at or under ``path`` (symlinks not followed)."""
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        yield path, st.st_size
    elif stat.S_ISDIR(st.st_mode):
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not (root == path and d == ".irdma"))
            for name in sorted(files):
                full = os.path.join(root, name)
                with_st = os.lstat(full)
                if stat.S_ISREG(with_st.st_mode):
                    yield full, with_st.st_size


def mount_files(paths: tuple[str, ...]) -> list[tuple[str, int]]:
    """The files ``irdma warmup`` reads through a mount: every regular file under ``paths``.

    Raises:
        InvalidArgument: a path is missing or not on an irdma mount.
    """
    from irdma.fs.mount import find_mount

    out: list[tuple[str, int]] = []
    for p in paths:
        real = os.path.realpath(p)
        if not os.path.exists(real):
            raise InvalidArgument(f"{p} does not exist", "name files or directories on an irdma mount")
        at = real
        while not os.path.ismount(at) and at != "/":
            at = os.path.dirname(at)
        entry = find_mount(at)
        if entry is None or not entry.is_irdma:
            raise InvalidArgument(f"{p} is not on an irdma mount",
                                  "name paths on a mount, or namespace paths with --meta URL --cache-dir DIR")
        out += list(_walk(real))
    return out


def _read_file(path: str, size: int, progress: Callable[..., None]) -> int:
    """Read a file whole with O_DIRECT (plain reads where the filesystem refuses O_DIRECT)."""
    buf = mmap.mmap(-1, READ_BLOCK)  # page aligned, as O_DIRECT wants
    try:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            fd = os.open(path, os.O_RDONLY)
        got = 0
        try:
            while True:
                n = os.preadv(fd, [buf], got)
                if n <= 0:
                    break
                got += n
                progress(n)
        finally:
            os.close(fd)
        progress(0, 1)
        return got
    finally:
        buf.close()


def warm_mount(files: list[tuple[str, int]], threads: int, progress: Callable[[int, int], None]) -> WarmupResult:
    """Read ``files`` through their mount with ``threads`` threads (see the module docstring).
    ``progress(bytes, files)`` is told what got done, from one thread at a time.

    Raises:
        OSError: a read failed (the file's name is in the error).
    """
    import time

    t0 = time.perf_counter()
    lock = threading.Lock()

    def tick(n: int, files: int = 0) -> None:
        with lock:
            progress(n, files)

    total = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for got in pool.map(lambda f: _read_file(f[0], f[1], tick), files):
            total += got
    return WarmupResult(len(files), total, time.perf_counter() - t0)


async def warm_namespace(meta_url: str, paths: tuple[str, ...], cache_dir: str, cache_size: str | None,
                         threads: int, transport: str, progress: Callable[[int, int], None],
                         sized: Callable[[int, int], None]) -> WarmupResult:
    """Read every chunk of the files under namespace ``paths`` into the disk cache ``cache_dir``
    with a native client, ``threads`` files at a time. ``sized(bytes, files)`` is told the
    totals first, ``progress(bytes, files)`` what got done.

    Raises:
        NotFound: a path is not in the namespace. InvalidArgument: the cache directory cannot
        be written. ShardUnavailable, DataLost: a read failed.
    """
    import time

    from ..client.cache import ChunkCache
    from ..client.native import Client

    cache = ChunkCache(0, cache_dir, cache_size)
    if not cache.disk_limit:
        raise InvalidArgument("--cache-size 0 keeps nothing", "give --cache-size above 0, such as 10G")
    t0 = time.perf_counter()
    async with Client.open(meta_url, transport=transport, cache=cache) as client:
        assert client.cached is not None
        files = []
        todo = [p if p.startswith("/") else "/" + p for p in paths]
        while todo:
            p = todo.pop()
            inode = await client.meta.resolve(p)
            if inode.is_dir:
                todo += [p.rstrip("/") + "/" + n for n in sorted(await client.listdir(p), reverse=True)]
            elif stat.S_ISREG(inode.mode):
                files.append(inode)
        sized(sum(i.size for i in files), len(files))
        limit = trio.Semaphore(max(1, threads))
        total = 0

        async def one(inode: Inode) -> None:
            nonlocal total
            async with limit:
                assert client.cached is not None
                await client.cached.warm(inode, await client.meta.chunk_map(inode.ino), lambda n: progress(n, 0))
                total += inode.size
                progress(0, 1)

        async with trio.open_nursery() as nursery:
            for inode in files:
                nursery.start_soon(one, inode)
    return WarmupResult(len(files), total, time.perf_counter() - t0)


__all__ = ["WarmupResult", "mount_files", "warm_mount", "warm_namespace", "READ_BLOCK"]
