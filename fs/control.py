"""The mount's control files: ``.irdma/`` at the root, SoftMemoryBox II's sync functions as files.

::

    .irdma/barrier/NAME@N     read: returns once N readers (any mount, any host) arrived
                              (the text is the barrier's generation)
    .irdma/lock/NAME@LEASE    read: returns once the reading process holds lock NAME, for
                              LEASE seconds (open and read again to renew); the text is the
                              expiry (ns since the epoch)
    .irdma/lock/NAME          read: the holder and expiry, or "free"; write 0: release it (the
                              holder is the process: host, mount session, pid); a holder that
                              dies frees it when its lease runs out
    .irdma/counter/NAME       write DELTA (an integer): atomic add; a read of the same handle
                              gives the value before that add, of a fresh handle the current value

Beside them, in any directory: ``DIR/.irdma-clock@K`` (worker K's clock in job directory DIR:
:func:`irdma.coord.tick`) and ``DIR/.irdma-state@NAME`` (file NAME's optimizer state image,
:meth:`irdma.Client.state_of`; read to checkpoint, write to restore; its file's owner and mode).

The waits are *reads* because the kernel serializes writes to one file (its inode lock): a
blocked write would hold back every other writer of the name, a release included. Each file
exists as soon as it is named (any name without '/'), reads end with a newline, so ``cat
.irdma/barrier/epoch1@4`` and ``echo 1 > .irdma/counter/steps`` work from a shell. A wait that reaches the mount's sync deadline
(``irdma mount --sync-timeout``, 60 s) fails with ETIMEDOUT; a barrier arrival that gave up is
withdrawn. The state lives in the metadata engine (:mod:`irdma.meta.sql_sync`), waits poll it
(:mod:`irdma.coord`). Inode numbers from :data:`BASE` on are virtual: never in the metadata.
"""

from __future__ import annotations

import socket
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from irdma import coord
from irdma._errors import InvalidArgument, NotFound
from irdma.meta.sql_sync import check_sync_name

CONTROL = b".irdma"
#: ``JOB/.irdma-clock@K``: a read advances worker K's clock in job directory JOB and returns once
#: the job's consistency model lets it pull (:func:`irdma.coord.tick`); the text is the new clock
CLOCK_PREFIX = b".irdma-clock@"
#: ``DIR/.irdma-state@NAME``: file NAME's optimizer state image (:meth:`irdma.Client.state_of`):
#: read it to checkpoint the state, write it back to restore it (the file's mode and owner)
STATE_PREFIX = b".irdma-state@"
#: Virtual inode numbers start here (metadata inodes are counted from 1).
BASE = 1 << 60
ROOT = BASE
KINDS = {b"barrier": BASE + 1, b"lock": BASE + 2, b"counter": BASE + 3}
_KIND_OF = {v: k for k, v in KINDS.items()}


@dataclass
class _Handle:
    kind: bytes
    name: str
    holder: str
    fetched: int | None = None  # counter: the value before this handle's last add


@dataclass
class Control:
    """The ``.irdma`` tree of one mount (``meta``: its :class:`irdma.meta.aio.AsyncMeta`)."""

    meta: Any
    session: int
    #: ``tick(job inode, worker) -> clock``: the client's :meth:`irdma.Client.clock_at`
    tick: Any = None
    sync_timeout: float = coord.DEFAULT_SYNC_TIMEOUT
    _files: dict[tuple[bytes, str], int] = field(default_factory=dict)
    _names: dict[int, tuple[bytes, str]] = field(default_factory=dict)
    _handles: dict[int, _Handle] = field(default_factory=dict)

    @staticmethod
    def owns(ino: int) -> bool:
        return ino >= BASE

    def lookup(self, parent: int, name: bytes) -> int:
        """The virtual inode of ``name`` in ``parent`` (root's ``.irdma`` included).

        Raises:
            NotFound: no such control file.
        """
        if parent == ROOT:
            if name in KINDS:
                return KINDS[name]
            raise NotFound(f".irdma/{name.decode(errors='replace')}: the control directories are barrier, lock, counter")
        kind = _KIND_OF.get(parent)
        if kind is None:
            raise NotFound("not a control directory")
        if name == b".":
            return parent
        if name == b"..":
            return ROOT
        text = name.decode("utf-8", "replace")
        try:
            check_sync_name(text)
        except InvalidArgument as exc:
            raise NotFound(str(exc)) from None
        key = (kind, text)
        ino = self._files.get(key)
        if ino is None:
            ino = self._files[key] = BASE + 1000 + len(self._files)
            self._names[ino] = key
        return ino

    def clock_file(self, job: int, name: bytes) -> int:
        """The virtual inode of ``JOB/.irdma-clock@K`` (``name``) in directory ``job``.

        Raises:
            NotFound: K is not a worker id.
        """
        worker = name[len(CLOCK_PREFIX):].decode("ascii", "replace")
        if not worker.isdigit():
            raise NotFound(f"{name.decode(errors='replace')}: name a worker, e.g. .irdma-clock@0")
        key = (b"clock", f"{job}@{int(worker)}")
        ino = self._files.get(key)
        if ino is None:
            ino = self._files[key] = BASE + 1000 + len(self._files)
            self._names[ino] = key
        return ino

    def state_file(self, target: int) -> int:
        """The virtual inode of ``DIR/.irdma-state@NAME`` for file inode ``target``."""
        key = (b"state", str(target))
        ino = self._files.get(key)
        if ino is None:
            ino = self._files[key] = BASE + 1000 + len(self._files)
            self._names[ino] = key
        return ino

    def target_of(self, ino: int) -> int | None:
        """The file inode whose state image ``ino`` is, or None for the other control files."""
        kind, name = self._names.get(ino, (b"", ""))
        return int(name) if kind == b"state" else None

    def handle_target(self, fh: int) -> int | None:
        """The file inode whose state image handle ``fh`` reads or writes, else None."""
        h = self._handles.get(fh)
        return int(h.name) if h is not None and h.kind == b"state" else None

    def attr(self, ino: int, uid: int, gid: int) -> dict[str, int]:
        """``st_*`` fields of a virtual inode."""
        t = time.time_ns()
        if ino == ROOT or ino in _KIND_OF:
            mode, nlink = stat.S_IFDIR | 0o777 | stat.S_ISVTX, 2
        elif ino in self._names:
            mode, nlink = stat.S_IFREG | 0o666, 1
        else:
            raise NotFound(f"no control inode {ino}")
        return {"st_ino": ino, "st_mode": mode, "st_nlink": nlink, "st_uid": uid, "st_gid": gid, "st_size": 0,
                "st_atime_ns": t, "st_mtime_ns": t, "st_ctime_ns": t}

    def entries(self, ino: int) -> list[tuple[bytes, int]]:
        """A control directory's entries (kinds, or the names this mount used so far)."""
        if ino == ROOT:
            return sorted(KINDS.items())
        kind = _KIND_OF.get(ino)
        if kind is None:
            raise NotFound("not a control directory")
        return sorted((n.encode(), i) for (k, n), i in self._files.items() if k == kind)

    def open(self, ino: int, fh: int, pid: int) -> None:
        if ino not in self._names:
            raise NotFound(f"no control file {ino}")
        kind, name = self._names[ino]
        self._handles[fh] = _Handle(kind, name, f"{socket.gethostname()}/{self.session}/{pid}")

    def release(self, fh: int) -> None:
        self._handles.pop(fh, None)

    async def write(self, fh: int, data: bytes) -> int:
        """Run the function the file names with the number written (see the module docstring).

        Raises:
            InvalidArgument: not a number; SyncTimeout: the wait reached the deadline.
        """
        h = self._handles[fh]
        text = data.decode("ascii", "replace").strip()
        where = f".irdma/{h.kind.decode()}/{h.name}"
        if h.kind == b"barrier" or "@" in h.name:
            raise InvalidArgument(f"{where}: read it to wait (see the mount's .irdma documentation)")
        try:
            number = int(text)
        except ValueError:
            raise InvalidArgument(f"{where}: write an integer, not {text[:40]!r}") from None
        if h.kind == b"lock":
            if number != 0 or not await self.meta.lock_release(h.name, h.holder):
                raise InvalidArgument(f"{where}: write 0 to release it, as the process that holds it")
        else:
            h.fetched = await self.meta.counter_add(h.name, number)
        return len(data)

    @staticmethod
    def _split(h: _Handle) -> tuple[str, float]:
        name, _, arg = h.name.rpartition("@")
        try:
            value = float(arg)
        except ValueError:
            value = 0.0
        if not name or not value > 0:
            raise InvalidArgument(f".irdma/{h.kind.decode()}/{h.name}: name it NAME@N (a count, or a lease in seconds)")
        return name, value

    async def read(self, fh: int) -> bytes:
        """The wait or the value the file names (see the module docstring).

        Raises:
            InvalidArgument: a barrier or lease name without ``@N``; SyncTimeout.
        """
        h = self._handles[fh]
        if h.kind == b"clock":
            if h.fetched is None:  # one tick per open
                job, _, worker = h.name.partition("@")
                h.fetched = await self.tick(int(job), int(worker))
            return f"{h.fetched}\n".encode()
        if h.kind == b"barrier":
            if h.fetched is None:  # once per open: the rest of a `cat` reads the same text
                name, n = self._split(h)
                await coord.barrier(self.meta, name, int(n), self.sync_timeout)
                h.fetched = await self.meta.barrier_generation(name)
            return f"{h.fetched}\n".encode()
        if h.kind == b"lock" and "@" in h.name:
            if h.fetched is None:
                name, lease = self._split(h)
                h.fetched = await coord.lock(self.meta, name, h.holder, lease, self.sync_timeout)
            return f"{h.fetched}\n".encode()
        if h.kind == b"counter":
            value = h.fetched if h.fetched is not None else await self.meta.counter_add(h.name, 0)
            return f"{value}\n".encode()
        who, expires = await self.meta.lock_state(h.name)
        return (f"{who} {expires}\n" if who is not None else "free\n").encode()
