"""The mount's control files: ``.irdma/``, SoftMemoryBox II's sync functions as files.

::

    .irdma/barrier/NAME@N     read: returns once N readers (any mount, any host) arrived
                              (the text is the barrier's generation)
    .irdma/barrier/NAME       read: "GENERATION ARRIVED N", the arrivals waiting now
    .irdma/lock/NAME@LEASE    read: returns once the reading process holds lock NAME, for
                              LEASE seconds at most (the text is the expiry, ns since the epoch);
                              the same process reads it again to renew it
    .irdma/lock/NAME          read: "HOLDER EXPIRY", or "free"; write 0: release it
    .irdma/counter/NAME       write DELTA (an integer): atomic add; a read of the same handle
                              gives the value before that add, of a fresh handle the current value

``.irdma/`` answers in every directory. The mount root's holds objects shared by the whole
namespace (and by native clients: :meth:`irdma.Client.barrier` and the rest use the same
names); ``DIR/.irdma/`` holds directory DIR's own objects (a job's barriers, locks and counters),
reached only through DIR, so the kernel's checks of DIR's path apply to them. Beside them, in any
directory: ``DIR/.irdma-clock@K`` (worker K's clock in job directory DIR:
:func:`irdma.train.coord.tick`) and ``DIR/.irdma-state@NAME`` (file NAME's optimizer state image,
:meth:`irdma.Client.state_of`; read to checkpoint, write to restore; its file's owner and mode).

Sync objects are files with owners. An object is created by its first use through a mount, with
the caller's uid and gid (a set-group-ID directory's gid in ``DIR/.irdma/``) and mode 0666 less
the caller's umask, and is checked like a file: read permission to read its state, read *and*
write permission to arrive at a barrier or take a lock (a read that changes the object), write
permission to add to a counter or release a lock; root may do everything. ``chmod`` and
``chown`` work as on files. The root's ``.irdma/KIND/`` directories are 1777 (anyone may create
a name there: first come, first served, as in ``/tmp``); ``DIR/.irdma/`` has DIR's owner and
mode, and a new object there needs write and search permission on DIR, so the objects of a 0700
job directory are the job's. Until it is created, a name shows the owner and mode it would get.

Locks. The holder is the process that read ``NAME@LEASE`` (``UID@HOST/SESSION/PID``). The
lease is cut to the directory's ``user.irdma.max_lease`` (the mount root's for the root's
``.irdma/``; seconds, default 600). A lock taken through a read-only handle (``cat``) outlives
the handle: ``echo 0 > .irdma/lock/NAME`` from any process of the holder's uid (or root)
releases it, else its lease ends. A lock taken through a read-write handle (``exec 3<>NAME@30``,
``open(..., "r+")``) is also released when that handle is closed, so its holder's death releases
it at once. Writing 0 to a free lock does nothing; to a lock another uid holds, EPERM.

Waits. Barrier, lock and clock waits are *reads* because the kernel serializes writes to one
file (its inode lock): a blocked write would hold back every other writer of the name, a release
included. A barrier or lock wait that reaches the mount's deadline (``irdma mount
--sync-timeout``, default 60 s) fails with ETIMEDOUT; a clock wait's deadline is its job's
``user.irdma.sync_timeout`` (:mod:`irdma.train.coord`). Every wait ends at once, with EINTR, when its
caller is signalled (Ctrl-C, SIGKILL, any signal it handles), and a barrier arrival that gave up
either way is withdrawn. pyfuse3 (3.5) neither passes FUSE_INTERRUPT on nor cancels the handler,
and the kernel keeps a caller whose request the daemon holds in uninterruptible sleep, even after
SIGKILL, until the reply: so while a wait runs, the mount reads the caller's
``/proc/PID/status`` every :data:`WATCH_S` and ends the wait when SIGKILL is pending (every
fatal signal becomes one) or a pending, unblocked signal has a handler (the thread that opened
the file, else its process; a caller in another PID namespace, pid 0, is not watched and only the
deadline ends its wait). Names of any file exist as soon as named (any name without '/'), reads
end with a newline, so ``cat .irdma/barrier/epoch1@4`` and ``echo 1 > .irdma/counter/steps``
work from a shell. The state lives in the metadata engine (:mod:`irdma.meta.sql_sync`), waits
poll it (:mod:`irdma.train.coord`). Inode numbers from :data:`BASE` on are virtual: never in the
metadata.

The mount's root directory also answers the xattr ``user.irdma.mount`` (:data:`XATTR_MOUNT`,
:meth:`Control.mount_xattr`): the namespace and directory the mount shows, which ``irdma info``
and ``irdma snapshot`` read to map a path under the mount, whichever user runs them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from irdma import xattrs
from irdma._concurrency import open_nursery
from irdma._errors import (
    InvalidArgument,
    IrdmaError,
    NoAttribute,
    NotFound,
    NotPermitted,
    SyncDenied,
    SyncInterrupted,
)
from irdma.client import coord
from irdma.meta import ROOT_INO
from irdma.meta.sql_sync import check_sync_name, sync_key

log = logging.getLogger("irdma.fs")
_T = TypeVar("_T")

CONTROL = b".irdma"
#: The xattr of the mount's root directory that says what the mount shows (:meth:`Control.mount_xattr`):
#: read by ``irdma info`` and ``irdma snapshot`` for a path under the mount (:func:`irdma.ops.mountpath.ask_mount`)
XATTR_MOUNT = b"user.irdma.mount"
#: ``JOB/.irdma-clock@K``: a read advances worker K's clock in job directory JOB and returns once
#: the job's consistency model lets it pull (:func:`irdma.train.coord.tick`); the text is the new clock
CLOCK_PREFIX = b".irdma-clock@"
#: ``DIR/.irdma-state@NAME``: file NAME's optimizer state image (:meth:`irdma.Client.state_of`):
#: read it to checkpoint the state, write it back to restore it (the file's mode and owner)
STATE_PREFIX = b".irdma-state@"
#: Virtual inode numbers start here (metadata inodes are counted from 1).
BASE = 1 << 60
#: The mount root's ``.irdma`` and its kind directories.
ROOT = BASE
KINDS = {b"barrier": BASE + 1, b"lock": BASE + 2, b"counter": BASE + 3}
#: How often (seconds) a waiting caller's process is checked for a signal (see the docstring).
WATCH_S = 0.05
_R, _W, _X = 4, 2, 1
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


@dataclass(frozen=True)
class _Node:
    """What a virtual inode is: ``control`` (a directory's ``.irdma``), ``kind``
    (``.irdma/KIND``), ``object`` (``.irdma/KIND/NAME``), ``clock`` (``JOB/.irdma-clock@K``:
    name K) or ``state`` (a state image: scope is the file's inode)."""

    what: str
    scope: int  # the directory whose .irdma it is (the job directory of a clock)
    kind: str = ""
    name: str = ""

    @property
    def key(self) -> str:
        """An object's key in the metadata (:func:`irdma.meta.sql_sync.sync_key`).

        Raises:
            InvalidArgument: a barrier or lock name with nothing before its ``@``.
        """
        base = self.name.rpartition("@")[0] if self.kind != "counter" and "@" in self.name else self.name
        return sync_key(None if self.scope == ROOT_INO else self.scope, base)

    @property
    def waits(self) -> bool:
        """A read of it arrives at a barrier or takes a lock (it changes the object)."""
        return self.kind in ("barrier", "lock") and "@" in self.name

    @property
    def shown(self) -> str:
        where = "" if self.scope == ROOT_INO else f"(directory inode {self.scope})/"
        return f"{where}.irdma/{self.kind}/{self.name}"


@dataclass(frozen=True)
class Caller:
    """Who made a request: the FUSE context's uid, gid and pid (a thread id) with what
    ``/proc/PID/status`` adds (supplementary groups, umask, the process's id) and the start
    times that tell a reused pid apart."""

    uid: int
    gid: int
    pid: int
    groups: frozenset[int] = frozenset()
    umask: int = 0o022
    tgid: int = 0
    start: str = ""
    tgid_start: str = ""

    def may(self, uid: int, gid: int, mode: int, want: int) -> bool:
        """Whether the caller has the ``want`` bits (r=4, w=2, x=1) of an object with owner
        ``uid``, group ``gid`` and permission bits ``mode`` (POSIX classes; root may all)."""
        if self.uid == 0:
            return True
        if self.uid == uid:
            bits = mode >> 6
        elif gid == self.gid or gid in self.groups:
            bits = mode >> 3
        else:
            bits = mode
        return bits & want == want


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _status(pid: int) -> dict[str, str]:
    text = _read(f"/proc/{pid}/status") if pid > 0 else None
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def _start(pid: int) -> str:
    """The start time of process or thread ``pid`` (field 22 of /proc/PID/stat), "" if gone."""
    text = _read(f"/proc/{pid}/stat") if pid > 0 else None
    fields = (text or "").rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else ""


def caller_of(ctx: Any) -> Caller:
    """The :class:`Caller` of a request context (a missing one, or pid 0: the mount's user,
    unwatched)."""
    if ctx is None:
        return Caller(os.getuid(), os.getgid(), 0)
    pid = int(ctx.pid)
    st = _status(pid)
    try:
        umask = int(st["Umask"], 8)
    except (KeyError, ValueError):
        umask = 0o022
    groups = frozenset(int(g) for g in st.get("Groups", "").split() if g.isdigit())
    tgid = int(st["Tgid"]) if st.get("Tgid", "").isdigit() else pid
    return Caller(int(ctx.uid), int(ctx.gid), pid, groups, umask, tgid, _start(pid), _start(tgid))


def signalled(who: Caller) -> bool | None:
    """Whether ``who``'s wait must end: SIGKILL pending (a fatal signal), or a pending,
    unblocked signal that it handles. Watches the thread that made the request, else its
    process; None when neither is there any more (or the pid is not visible here)."""
    for pid, start in ((who.pid, who.start), (who.tgid, who.tgid_start)):
        if pid <= 0 or not start or _start(pid) != start:
            continue
        st = _status(pid)
        try:
            pending = int(st["SigPnd"], 16) | int(st["ShdPnd"], 16)
            blocked, caught = int(st["SigBlk"], 16), int(st["SigCgt"], 16)
        except (KeyError, ValueError):
            continue
        return bool(pending & _SIGKILL_BIT or pending & ~blocked & caught)
    return None


@dataclass
class _Handle:
    node: _Node
    who: Caller
    holder: str  # a lock's holder: UID@HOST/SESSION/PID
    rw: bool  # opened read-write: closing it releases a lock it took
    fetched: int | None = None  # counter: the value before this handle's last add; waits: the reply
    took: bool = False  # a read of this handle took (or renewed) its lock


@dataclass
class Control:
    """The ``.irdma`` trees of one mount (``meta``: its :class:`irdma.meta.aio.AsyncMeta`).

    ``sync_timeout``: seconds a barrier or lock wait may take (``irdma mount --sync-timeout``).
    """

    meta: Any
    session: int
    #: ``tick(job inode, worker) -> clock``: the client's :meth:`irdma.Client.clock_at`
    tick: Any = None
    sync_timeout: float = xattrs.DEFAULT_SYNC_TIMEOUT
    #: What the mount shows, set by :func:`irdma.fs.mount.serve_mount`: its source as the mount
    #: table shows it (``irdma:URL``, no password) and the directory of the namespace that is its
    #: root (``--subdir``; ``/``); None: the root answers no :data:`XATTR_MOUNT`
    shows: tuple[str, str] | None = None
    _inos: dict[_Node, int] = field(default_factory=dict)
    _nodes: dict[int, _Node] = field(default_factory=dict)
    _handles: dict[int, _Handle] = field(default_factory=dict)
    _next: int = BASE + 1000

    def __post_init__(self) -> None:
        self._add(_Node("control", ROOT_INO), ROOT)
        for kind, ino in KINDS.items():
            self._add(_Node("kind", ROOT_INO, kind.decode()), ino)

    def _add(self, node: _Node, ino: int) -> None:
        self._inos[node] = ino
        self._nodes[ino] = node

    def _ino(self, node: _Node) -> int:
        ino = self._inos.get(node)
        if ino is None:
            ino, self._next = self._next, self._next + 1
            self._add(node, ino)
        return ino

    @staticmethod
    def owns(ino: int) -> bool:
        return ino >= BASE

    def mount_xattr(self) -> bytes | None:
        """The value of :data:`XATTR_MOUNT` on the mount's root (None when :attr:`shows` is
        unset): JSON of ``source`` (the mount table's ``irdma:URL``), ``subdir`` (the directory
        of the namespace the root is), and the mount's session in the metadata (``session``,
        ``host``, ``pid``: a command given another spelling of the URL tells by it whether that
        URL opens this namespace). Nothing secret: the URL is the one ``/proc/mounts`` shows, so
        every user who may read the root directory may read it (the kernel checks read permission
        on it). Computed at each read, not stored: not listed, never copied with the tree."""
        import json

        if self.shows is None:
            return None
        source, subdir = self.shows
        return json.dumps({"source": source, "subdir": subdir, "session": self.session,
                           "host": socket.gethostname(), "pid": os.getpid()}).encode()

    # ------------------------------------------------------------ names
    def scope_dir(self, directory: int) -> int:
        """The virtual inode of ``.irdma`` in directory inode ``directory``."""
        return self._ino(_Node("control", directory))

    def lookup(self, parent: int, name: bytes) -> int:
        """The virtual inode of ``name`` in control directory ``parent``.

        Raises:
            NotFound: no such control file.
        """
        node = self._nodes.get(parent)
        if node is None or node.what not in ("control", "kind"):
            raise NotFound("not a control directory")
        if name == b".":
            return parent
        if node.what == "control":
            if name in KINDS:
                return self._ino(_Node("kind", node.scope, name.decode()))
            raise NotFound(f".irdma/{name.decode(errors='replace')}: the control directories are barrier, lock, counter")
        if name == b"..":
            return self._ino(_Node("control", node.scope))
        text = name.decode("utf-8", "replace")
        try:
            check_sync_name(text)
        except InvalidArgument as exc:
            raise NotFound(str(exc)) from None
        return self._ino(_Node("object", node.scope, node.kind, text))

    def parent_of(self, ino: int) -> int:
        """The inode of control directory ``ino``'s ``..``: the directory whose ``.irdma`` it is
        (a metadata inode), or that ``.irdma`` for a kind directory.

        Raises:
            NotFound: not a control directory.
        """
        node = self._nodes.get(ino)
        if node is None or node.what not in ("control", "kind"):
            raise NotFound("not a control directory")
        return node.scope if node.what == "control" else self._ino(_Node("control", node.scope))

    def clock_file(self, job: int, name: bytes) -> int:
        """The virtual inode of ``JOB/.irdma-clock@K`` (``name``) in directory ``job``.

        Raises:
            NotFound: K is not a worker id.
        """
        worker = name[len(CLOCK_PREFIX):].decode("ascii", "replace")
        if not (worker.isdigit() and worker.isascii()):
            raise NotFound(f"{name.decode(errors='replace')}: name a worker, e.g. .irdma-clock@0")
        return self._ino(_Node("clock", job, name=str(int(worker))))

    def state_file(self, target: int) -> int:
        """The virtual inode of ``DIR/.irdma-state@NAME`` for file inode ``target``."""
        return self._ino(_Node("state", target))

    def target_of(self, ino: int) -> int | None:
        """The file inode whose state image ``ino`` is, or None for the other control files."""
        node = self._nodes.get(ino)
        return node.scope if node is not None and node.what == "state" else None

    def handle_target(self, fh: int) -> int | None:
        """The file inode whose state image handle ``fh`` reads or writes, else None."""
        h = self._handles.get(fh)
        return h.node.scope if h is not None and h.node.what == "state" else None

    def entries(self, ino: int) -> list[tuple[bytes, int]]:
        """A control directory's entries (kinds, or the names this mount used so far)."""
        node = self._nodes.get(ino)
        if node is None or node.what not in ("control", "kind"):
            raise NotFound("not a control directory")
        if node.what == "control":
            return sorted((k, self._ino(_Node("kind", node.scope, k.decode()))) for k in KINDS)
        return sorted((n.name.encode(), i) for n, i in self._inos.items()
                      if n.what == "object" and n.scope == node.scope and n.kind == node.kind)

    # ------------------------------------------------------------ owners
    async def _dir_bits(self, node: _Node) -> tuple[int, int, int]:
        """``(uid, gid, mode)`` of the directory a node belongs to (the root's ``.irdma``: the
        mount's user, 1777)."""
        if node.scope == ROOT_INO and node.what != "clock":
            return os.getuid(), os.getgid(), stat.S_ISVTX | 0o777
        d = await self.meta.getattr(node.scope)
        return int(d.uid), int(d.gid), int(d.mode) & 0o7777

    async def _new_owner(self, node: _Node, who: Caller) -> tuple[int, int, int]:
        """The owner an object gets from ``who``: its uid, its gid (a set-group-ID directory's),
        mode 0666 less its umask."""
        gid = who.gid
        if node.scope != ROOT_INO:
            _, dgid, dmode = await self._dir_bits(node)
            gid = dgid if dmode & stat.S_ISGID else gid
        return who.uid, gid, 0o666 & ~who.umask

    async def _owner(self, node: _Node, who: Caller | Any, claim: bool) -> tuple[int, int, int]:
        """An object's ``(uid, gid, mode)``; one never used gets the caller's (recorded if
        ``claim``, which needs write and search permission on a ``DIR/.irdma/`` directory).
        ``who``: the :class:`Caller`, or the request context to make it from if needed.

        Raises:
            InvalidArgument: a bad name (``claim`` only); SyncDenied: no permission to create it.
        """
        try:
            key = node.key
        except InvalidArgument:
            if claim:
                raise
            key = None
        got = await self.meta.sync_owner(node.kind, key) if key is not None else None
        if got is not None:
            return got  # type: ignore[no-any-return]
        who = who if isinstance(who, Caller) else caller_of(who)  # /proc only for a name not yet used
        new = await self._new_owner(node, who)
        if not claim:
            return new
        if node.scope != ROOT_INO and not who.may(*await self._dir_bits(node), _W | _X):
            raise SyncDenied(f"{node.shown}: creating a {node.kind} there needs write permission on the directory",
                                   "ask its owner, or use one of your own directory's .irdma/")
        return await self.meta.sync_claim(node.kind, key, *new)  # type: ignore[no-any-return]

    async def attr(self, ino: int, ctx: Any = None) -> dict[str, int]:
        """``st_*`` fields of a virtual inode, as caller ``ctx`` sees them (None: readdir)."""
        node = self._nodes.get(ino)
        if node is None or node.what == "state":
            raise NotFound(f"no control inode {ino}")
        if node.what in ("control", "kind"):
            uid, gid, perm = await self._dir_bits(node)
            mode, nlink = stat.S_IFDIR | perm, 2
        elif node.what == "clock":
            uid, gid, perm = await self._dir_bits(node)
            mode, nlink = stat.S_IFREG | (perm & 0o666), 1
        else:
            uid, gid, perm = await self._owner(node, ctx, claim=False)
            mode, nlink = stat.S_IFREG | perm, 1
        t = time.time_ns()
        return {"st_ino": ino, "st_mode": mode, "st_nlink": nlink, "st_uid": uid, "st_gid": gid, "st_size": 0,
                "st_atime_ns": t, "st_mtime_ns": t, "st_ctime_ns": t}

    async def setattr(self, ino: int, attr: Any, fields: Any, ctx: Any) -> None:
        """chmod and chown of a sync object (the kernel checked that the caller may); sizes and
        times are ignored (``echo 1 > counter`` truncates first)."""
        node = self._nodes.get(ino)
        if node is None or node.what != "object" or not (fields.update_mode or fields.update_uid or fields.update_gid):
            return
        uid, gid, mode = await self._owner(node, ctx, claim=True)
        uid = attr.st_uid if fields.update_uid else uid
        gid = attr.st_gid if fields.update_gid else gid
        mode = attr.st_mode & 0o7777 if fields.update_mode else mode
        await self.meta.sync_chown(node.kind, node.key, uid, gid, mode)

    # ------------------------------------------------------------ handles
    async def open(self, ino: int, fh: int, flags: int, ctx: Any) -> None:
        """Open a control file as handle ``fh``, checking the caller's permissions (see the
        module docstring); the first open of an object creates it.

        Raises:
            NotFound: not a control file; SyncDenied: no permission; InvalidArgument: a bad name.
        """
        node = self._nodes.get(ino)
        if node is None or node.what in ("control", "kind"):
            raise NotFound(f"no control file {ino}")
        who = caller_of(ctx)
        acc = flags & os.O_ACCMODE
        want = (_R if acc != os.O_WRONLY else 0) | (_W if acc != os.O_RDONLY else 0)
        if node.what == "clock":
            uid, gid, perm = await self._dir_bits(node)
            if not who.may(uid, gid, perm & 0o666, want | _R | _W):
                raise SyncDenied(f"clock {node.name} of directory inode {node.scope}: ticking needs read and write"
                                       " permission on the job directory", "ask the job's owner")
        elif node.what == "object":
            uid, gid, perm = await self._owner(node, who, claim=True)
            if node.waits:
                want |= _R | _W
            if not who.may(uid, gid, perm, want):
                does = "waiting at it or taking it" if node.waits else "this open"
                raise SyncDenied(f"{node.shown} is uid {uid}'s, mode {perm:04o}: {does} needs"
                                       f" {'read and write' if want == _R | _W else 'read' if want == _R else 'write'}"
                                       " permission", "use your own name, or ask its owner to chmod it")
        holder = f"{who.uid}@{socket.gethostname()}/{self.session}/{who.pid}"
        self._handles[fh] = _Handle(node, who, holder, acc == os.O_RDWR)

    async def release(self, fh: int) -> None:
        """Forget handle ``fh``; a lock it took through a read-write open is released."""
        h = self._handles.pop(fh, None)
        if h is None or not (h.took and h.rw):
            return
        try:
            await self.meta.lock_release(h.node.key, h.holder)
        except IrdmaError as exc:
            log.warning("%s: releasing the lock at close failed (its lease ends it): %s", h.node.shown, exc)

    async def write(self, fh: int, data: bytes) -> int:
        """Run the function the file names with the number written (see the module docstring).

        Raises:
            InvalidArgument: not a number, or not a file to write; NotPermitted: a lock another
            uid holds.
        """
        h = self._handles[fh]
        node = h.node
        text = data.decode("ascii", "replace").strip()
        if node.what != "object" or node.kind == "barrier" or node.waits:
            raise InvalidArgument(f"{node.shown}: read it to wait (see the mount's .irdma documentation)")
        try:
            number = int(text)
        except ValueError:
            raise InvalidArgument(f"{node.shown}: write an integer, not {text[:40]!r}") from None
        if node.kind == "lock":
            if number != 0:
                raise InvalidArgument(f"{node.shown}: write 0 to release it")
            released, holder = await self.meta.lock_release_uid(node.key, h.who.uid)
            if not released and holder is not None:
                raise NotPermitted(f"{node.shown} is held by {holder}: only a process of its uid (or root) releases it",
                                   "wait for its lease to end")
        else:
            h.fetched = await self.meta.counter_add(node.key, number)
        return len(data)

    @staticmethod
    def _split(node: _Node) -> tuple[str, float]:
        name, _, arg = node.name.rpartition("@")
        try:
            value = float(arg)
        except ValueError:
            value = 0.0
        if not name or not value > 0 or value == float("inf"):
            raise InvalidArgument(f"{node.shown}: name it NAME@N (a count, or a lease in seconds)")
        return name, value

    async def _max_lease(self, scope: int) -> float:
        try:
            return xattrs.parse_timeout(await self.meta.getxattr(scope, xattrs.XATTR_MAX_LEASE))
        except NoAttribute:
            return xattrs.DEFAULT_MAX_LEASE
        except InvalidArgument as exc:  # stored before it was checked
            log.warning("directory inode %d: %s; the default %g s applies", scope, exc, xattrs.DEFAULT_MAX_LEASE)
            return xattrs.DEFAULT_MAX_LEASE

    async def _wait(self, h: _Handle, wait: Callable[[], Awaitable[_T]]) -> _T:
        """``await wait()``, cancelled (SyncInterrupted) once the caller is signalled."""
        done: list[_T] = []
        with trio.CancelScope() as interrupted:
            async with open_nursery() as nursery:
                nursery.start_soon(self._watch, h.who, interrupted)
                done.append(await wait())
                nursery.cancel_scope.cancel()
        if done:  # it finished as the signal came: the caller gets the answer
            return done[0]
        raise SyncInterrupted(f"{h.node.shown}: the wait of pid {h.who.pid} was interrupted by a signal")

    @staticmethod
    async def _watch(who: Caller, scope: trio.CancelScope) -> None:
        while True:
            await trio.sleep(WATCH_S)
            state = signalled(who)
            if state is None:
                return  # not watchable: the deadline ends the wait
            if state:
                scope.cancel()
                return

    async def read(self, fh: int) -> bytes:
        """The wait or the value the file names (see the module docstring).

        Raises:
            InvalidArgument: a barrier or lease name without ``@N``; SyncTimeout; SyncInterrupted.
        """
        h = self._handles[fh]
        node = h.node
        if node.what == "clock":
            if h.fetched is None:  # one tick per open
                h.fetched = await self._wait(h, lambda: self.tick(node.scope, int(node.name)))
            return f"{h.fetched}\n".encode()
        if node.what != "object":
            raise InvalidArgument(f"{node.shown}: not a control file to read")
        if node.kind == "barrier" and node.waits:
            if h.fetched is None:  # once per open: the rest of a `cat` reads the same text
                _, n = self._split(node)
                key = node.key
                await self._wait(h, lambda: coord.barrier(self.meta, key, int(n), self.sync_timeout))
                h.fetched = await self.meta.barrier_generation(key)
            return f"{h.fetched}\n".encode()
        if node.kind == "barrier":
            gen, arrived, want = await self.meta.barrier_state(node.key)
            return f"{gen} {arrived} {want}\n".encode()
        if node.kind == "lock" and node.waits:
            if h.fetched is None:
                _, lease = self._split(node)
                key = node.key
                lease = min(lease, await self._max_lease(node.scope))
                h.fetched = await self._wait(h, lambda: coord.lock(self.meta, key, h.holder, lease, self.sync_timeout))
                h.took = True
            return f"{h.fetched}\n".encode()
        if node.kind == "counter":
            value = h.fetched if h.fetched is not None else await self.meta.counter_add(node.key, 0)
            return f"{value}\n".encode()
        who, expires = await self.meta.lock_state(node.key)
        return (f"{who} {expires}\n" if who is not None else "free\n").encode()
