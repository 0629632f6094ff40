"""Host-local aggregation: the workers of one host sum their gradients in shared memory, so that
the host pushes once instead of once per worker.

This is the node-local half of DASO (Coquelin et al., "Accelerating neural network training
with distributed asynchronous and selective optimization (DASO)", 2021): synchronise often
inside a node, where memory is shared and fast, and less often across nodes. A
:class:`HostGroup` is that node-local step; what is pushed, and how often, is decided above it.

How it works
------------
One group is ``size`` processes on one host, ranks ``0 .. size-1``; rank 0 is the leader.

* Joining. The leader takes an exclusive ``flock`` on ``RUN_DIR/NAME.lock``, creates the shared
  memory file ``/dev/shm/irdma-hier-UID-NAME`` (``O_EXCL``, mode 0600, space reserved with
  ``posix_fallocate`` so that a full /dev/shm is an error here rather than a SIGBUS later) and
  listens on the Unix socket ``RUN_DIR/NAME.sock`` (``SOCK_SEQPACKET``: one message per send).
  ``RUN_DIR`` is a directory of mode 0700 owned by the caller, so no other local user can
  connect. Each member connects, says HELLO (rank, size, nbytes, protocol version), and once
  all ``size - 1`` members are in, the leader sends each one WELCOME with the shared memory's
  file descriptor attached (``SCM_RIGHTS``). Then the leader unlinks the socket, the shared
  memory file and the lock file: from here on the group lives in open descriptors only, and a
  crash of any process leaves nothing behind in /dev/shm or the run directory.
* Leftovers. Names remain only if the leader is killed while the group forms. The next leader
  of the same name takes the lock (the kernel released the dead one's ``flock``), which proves
  no live leader uses the name, and removes the old socket and shared memory file before
  creating its own. A live leader holding the lock makes a second one fail at once.
* Layout of the shared memory. Slots of ``stride = nbytes`` rounded up to 64 bytes: member
  ``r`` (``1 <= r < size``) writes its array at byte ``(r - 1) * stride``; the result is at
  byte ``(size - 1) * stride``. Arrays are float32 in the host's native byte order, C order,
  starting at the slot's first byte. The leader needs no slot of its own: it reads its array
  where it is.
* A step (one call on every rank). Each member writes its slot (when the call has input for the
  leader) and sends REQ(op, step, shape); the leader waits for every member's REQ, checks that
  op, step and shape agree, computes, writes the result slot, and sends DONE(op, step, shape)
  to each member, which then copies the result out. The socket messages order every access to
  the shared memory: a member writes its slot only before its REQ, the leader writes the
  result slot only after every REQ of the step, and members read it only between DONE and
  their next REQ. Every wait blocks on a socket with a deadline; nothing spins.
* Failure. Any error inside a step breaks the group: the leader sends ERROR (its message names
  the rank at fault) to every member still connected and closes; a member that fails closes
  its socket, which the leader sees as end of file. A dead process's socket is closed by the
  kernel, so its death is noticed at once; a stuck one after ``timeout``.

The messages, as bytes, are in :mod:`irdma.train._hier_wire`.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import re
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType

import numpy as np
import numpy.typing as npt

from .._errors import IrdmaError
from . import _hier_wire as wire

__all__ = ["HostGroup", "HostGroupError", "local_rank_and_size"]

Float32Array = npt.NDArray[np.float32]

_ALIGN = 64
_MAX_SIZE = 4096
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_SUN_PATH_MAX = 107  # bytes of sockaddr_un.sun_path, less the terminating NUL
_SHM_DIR = "/dev/shm"


class HostGroupError(IrdmaError):
    """A host group could not form or a step failed: a rank did not arrive in time, left, or
    disagreed with the others (another call, another shape, another step). The group is closed
    after it: start a new one on every rank.

    Attributes:
        rank: the rank at fault (did not arrive, left, disagreed), or ``None`` when no single
            rank is.
        step: the step (0-based count of calls on this group) it happened at, or ``None``
            while the group was forming.
    """

    def __init__(self, message: str, hint: str = "", *, rank: int | None = None, step: int | None = None) -> None:
        super().__init__(message, hint)
        self.rank = rank
        self.step = step


_RESTART = "then start the group again on every rank (a HostGroup cannot take a rank back)"


def local_rank_and_size(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """This worker's rank and the number of workers on its host, from the environment.

    Reads ``IRDMA_LOCAL_RANK`` and ``IRDMA_LOCAL_SIZE`` (decimal integers, set by whatever
    starts the workers of a host). Neither set means one worker on this host: ``(0, 1)``.

    Args:
        environ: the variables to read; ``os.environ`` when ``None``.

    Returns:
        ``(rank, size)`` with ``0 <= rank < size``.

    Raises:
        ValueError: only one of the two is set, one is not a decimal integer, ``size < 1``,
            ``size`` is larger than 4096, or ``rank`` is outside ``0 .. size-1``.
    """
    env = os.environ if environ is None else environ
    raw_rank, raw_size = env.get("IRDMA_LOCAL_RANK"), env.get("IRDMA_LOCAL_SIZE")
    if raw_rank is None and raw_size is None:
        return 0, 1
    if raw_rank is None or raw_size is None:
        have, lack = ("RANK", "SIZE") if raw_size is None else ("SIZE", "RANK")
        raise ValueError(f"IRDMA_LOCAL_{have} is set but IRDMA_LOCAL_{lack} is not: set both "
                         "(e.g. IRDMA_LOCAL_RANK=0 IRDMA_LOCAL_SIZE=2) or neither")
    values = []
    for var, raw in (("IRDMA_LOCAL_RANK", raw_rank), ("IRDMA_LOCAL_SIZE", raw_size)):
        text = raw.strip()
        if not re.fullmatch(r"[0-9]{1,9}", text):
            raise ValueError(f"{var}={raw!r} is not a non-negative decimal integer")
        values.append(int(text))
    rank, size = values
    if not 1 <= size <= _MAX_SIZE:
        raise ValueError(f"IRDMA_LOCAL_SIZE={raw_size!r}: the number of workers on a host must be 1 .. {_MAX_SIZE}")
    if rank >= size:
        raise ValueError(f"IRDMA_LOCAL_RANK={raw_rank!r} is not below IRDMA_LOCAL_SIZE={raw_size!r} "
                         "(ranks are 0 .. size-1)")
    return rank, size


def default_run_dir() -> str:
    """Where groups put their socket and lock file: ``$XDG_RUNTIME_DIR/irdma-hier`` where that
    variable names an absolute path, else ``/tmp/irdma-hier-UID``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "irdma-hier")
    return f"/tmp/irdma-hier-{os.getuid()}"


class HostGroup:
    """The workers (processes) of one host, summing float32 arrays through shared memory.

    Every rank of a host creates one with the same ``name``, ``size`` and ``nbytes`` and its own
    ``rank``; the constructor returns once all ``size`` ranks have joined. Then every rank makes
    the same calls in the same order (each call is one step; a step counter is checked on both
    sides). See the module docstring for the mechanism and the layout of the shared memory.

    Data: arrays are ``numpy.float32`` in the host's native byte order, any shape (0-d
    included) and any memory layout (copied in C order), of at most ``nbytes`` bytes. Every
    rank must pass the same shape to a step. Results are new C-contiguous float32 arrays owned
    by the caller.

    Deadlines: every wait ends within ``timeout`` seconds (members wait a small margin longer for
    the leader, so that the leader's report, which names the rank at fault, reaches them first).
    A rank whose process exits is noticed at once. After any :class:`HostGroupError` the group
    is closed on that rank, and the leader tells the others.

    Thread safety: one call at a time per object; a second thread calling while a call runs
    gets :class:`HostGroupError`. Not usable across ``fork`` (a child must make its own group).
    ``close`` is not collective: ranks close independently.

    Args:
        name: the group's name, shared by its ranks: 1 to 64 characters of ``A-Z a-z 0-9 _ . -``,
            not starting with ``.``, ``_`` or ``-``.
        rank: this process's rank, ``0 .. size-1``; rank 0 is the leader (it sums and, for the
            caller above, is the one that pushes).
        size: number of processes in the group, 1 .. 4096.
        nbytes: the most bytes an array may have (the shared memory holds ``size`` slots of it).
        timeout: seconds any wait may last, > 0: joining, and each step (members wait
            ``min(5, max(0.5, timeout / 4))`` s more for the leader).
        run_dir: directory of the socket and lock file (created with mode 0700 if missing; refused
            if it is a symlink, owned by another user, or open to group or others). Default:
            :func:`default_run_dir`.

    Raises:
        ValueError: a bad argument (before anything is created or connected).
        HostGroupError: the group did not form: not every rank joined within ``timeout`` (the
            message names the ranks missing), another live leader uses ``name``, ranks disagree
            on ``size``/``nbytes``, a member found no leader, the run directory is unsafe, or
            /dev/shm has no room for ``size * nbytes`` bytes.
    """

    def __init__(self, name: str, rank: int, size: int, nbytes: int, *, timeout: float = 60.0,
                 run_dir: str | None = None) -> None:
        _check_args(name, rank, size, nbytes, timeout)
        run_dir = default_run_dir() if run_dir is None else os.path.abspath(run_dir)
        sock_path = os.path.join(run_dir, f"{name}.sock")
        if len(os.fsencode(sock_path)) > _SUN_PATH_MAX:
            raise ValueError(f"socket path {sock_path!r} is longer than {_SUN_PATH_MAX} bytes: "
                             "choose a shorter run_dir or name")
        self.name = name
        self.rank = int(rank)
        self.size = int(size)
        self.nbytes = int(nbytes)
        self.timeout = float(timeout)
        self.run_dir = run_dir
        self._sock_path = sock_path
        self._stride = -(-nbytes // _ALIGN) * _ALIGN
        self._shm_len = max(size * self._stride, mmap.PAGESIZE)
        self._margin = min(5.0, max(0.5, 0.25 * self.timeout))
        self._step = 0
        self._closed = False
        self._broken: HostGroupError | None = None
        self._busy = threading.Lock()
        self._pid = os.getpid()
        self._mm: mmap.mmap | None = None
        self._buf: npt.NDArray[np.uint8] | None = None
        self._members: dict[int, socket.socket] = {}  # leader: rank -> connection
        self._sel: selectors.BaseSelector | None = None
        self._leader: socket.socket | None = None  # member: connection to the leader
        try:
            if rank == 0:
                self._form_as_leader()
            else:
                self._join_as_member()
        except HostGroupError as exc:
            self._abort(exc)
            raise
        except BaseException:
            self._abort(None)
            raise

    # ---- public calls ----

    @property
    def is_leader(self) -> bool:
        """Whether this is rank 0, the one that gets the sum of :meth:`reduce_to_leader`."""
        return self.rank == 0

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran here or an error closed the group."""
        return self._closed

    @property
    def step(self) -> int:
        """How many calls this rank has completed on the group."""
        return self._step

    def allreduce(self, x: Float32Array) -> Float32Array:
        """The sum of every rank's ``x``, on every rank.

        The leader adds in rank order, ``((x_0 + x_1) + x_2) + ...``, element by element in
        float32, and every rank gets the same bytes: the result equals
        ``functools.reduce(np.add, [x_0, x_1, ...])`` exactly, on every rank.

        Args:
            x: float32 in native byte order, any shape, at most ``nbytes`` bytes; every rank
                passes the same shape at this step.

        Returns:
            A new float32 array of ``x``'s shape.

        Raises:
            TypeError: ``x`` is not a native float32 ndarray (nothing happened; the group is
                still usable).
            ValueError: ``x`` is larger than ``nbytes`` (likewise).
            HostGroupError: the group is closed; a rank did not arrive within ``timeout`` or
                left; ranks passed different shapes or made a different call; a rank is out of
                step. The group is closed after it.
        """
        arr = self._check_array(x, "allreduce")
        with self._call(wire.Op.ALLREDUCE):
            if self.rank == 0:
                self._gather(wire.Op.ALLREDUCE, arr.shape)
                if self.size == 1:
                    return np.array(arr, dtype=np.float32, order="C", copy=True)
                res = self._view(self.size, arr.shape)
                np.add(arr, self._view(1, arr.shape), out=res)
                for r in range(2, self.size):
                    np.add(res, self._view(r, arr.shape), out=res)
                self._release(wire.Op.ALLREDUCE, arr.shape)
                return res.copy()
            np.copyto(self._view(self.rank, arr.shape), arr)
            shape = self._request(wire.Op.ALLREDUCE, arr.shape)
            return self._view(self.size, shape).copy()

    def reduce_to_leader(self, x: Float32Array) -> Float32Array | None:
        """The sum of every rank's ``x``, on the leader only (members copy no result back).

        Same order and bytes as :meth:`allreduce`. Members return once the leader has read
        their arrays, so they may reuse ``x`` and call again at once.

        Args:
            x: as for :meth:`allreduce`.

        Returns:
            On the leader, a new float32 array of ``x``'s shape; on members, ``None``.

        Raises:
            TypeError, ValueError, HostGroupError: as for :meth:`allreduce`.
        """
        arr = self._check_array(x, "reduce_to_leader")
        with self._call(wire.Op.REDUCE_TO_LEADER):
            if self.rank == 0:
                self._gather(wire.Op.REDUCE_TO_LEADER, arr.shape)
                out = np.array(arr, dtype=np.float32, order="C", copy=True)
                for r in range(1, self.size):
                    np.add(out, self._view(r, arr.shape), out=out)
                self._release(wire.Op.REDUCE_TO_LEADER, None)
                return out
            np.copyto(self._view(self.rank, arr.shape), arr)
            self._request(wire.Op.REDUCE_TO_LEADER, arr.shape)
            return None

    def broadcast(self, x: Float32Array | None = None) -> Float32Array:
        """The leader's ``x``, on every rank (e.g. weights the leader pulled for the host).

        Args:
            x: on the leader, the array to send (float32, native byte order, at most
                ``nbytes``); on members ``None``, or an array of the shape the leader sends,
                which is checked and not read (so that ``w = group.broadcast(w)`` works on every
                rank).

        Returns:
            A new float32 array equal to the leader's ``x``, same shape.

        Raises:
            TypeError: the leader passed ``None`` or a non-float32 array; a member passed an
                array that is not float32 (nothing happened; the group is still usable).
            ValueError: ``x`` is larger than ``nbytes`` (likewise).
            HostGroupError: as for :meth:`allreduce` (a member's array of another shape than
                the leader's is a disagreement).
        """
        if self.rank == 0 and x is None:
            raise TypeError("broadcast: the leader (rank 0) must pass the array to send")
        arr = None if x is None else self._check_array(x, "broadcast")
        shape = None if arr is None else arr.shape
        with self._call(wire.Op.BROADCAST):
            if self.rank == 0:
                assert arr is not None
                self._gather(wire.Op.BROADCAST, arr.shape)
                if self.size > 1:
                    np.copyto(self._view(self.size, arr.shape), arr)
                    self._release(wire.Op.BROADCAST, arr.shape)
                return np.array(arr, dtype=np.float32, order="C", copy=True)
            got = self._request(wire.Op.BROADCAST, shape)
            return self._view(self.size, got).copy()

    def barrier(self) -> None:
        """Return once every rank has called :meth:`barrier` for this step.

        Raises:
            HostGroupError: as for :meth:`allreduce`.
        """
        with self._call(wire.Op.BARRIER):
            if self.rank == 0:
                self._gather(wire.Op.BARRIER, None)
                self._release(wire.Op.BARRIER, None)
            else:
                self._request(wire.Op.BARRIER, None)

    def close(self) -> None:
        """Leave the group and release its memory and sockets. Safe to call twice.

        Not collective: the others notice at their next call (the leader's departure makes every
        member's next call raise; a member's makes the leader's next call raise).
        """
        if self._closed:
            return
        self._closed = True
        for conn in self._members.values():
            conn.close()
        self._members.clear()
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        if self._leader is not None:
            self._leader.close()
            self._leader = None
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive (in a traceback): unmapped when it is collected
            self._mm = None

    def __enter__(self) -> HostGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step {self._step}"
        return f"<HostGroup {self.name!r} rank {self.rank}/{self.size} nbytes={self.nbytes} {state}>"

    # ---- forming the group ----

    def _form_as_leader(self) -> None:
        _ensure_run_dir(self.run_dir, create=True)
        lock_path = os.path.join(self.run_dir, f"{self.name}.lock")
        shm_path = os.path.join(_SHM_DIR, f"irdma-hier-{os.getuid()}-{self.name}")
        lock_fd = self._take_lock(lock_path)
        listener: socket.socket | None = None
        shm_fd = -1
        try:
            # Holding the lock proves that no live leader uses this name: whatever is still
            # there was left by a leader killed while its group was forming.
            for path in (self._sock_path, shm_path):
                _unlink_quietly(path)
            try:
                shm_fd = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                os.posix_fallocate(shm_fd, 0, self._shm_len)
            except OSError as exc:
                raise HostGroupError(
                    f"host group {self.name!r}: cannot create {self._shm_len} bytes of shared memory at {shm_path}: "
                    f"{exc.strerror}", f"free space in {_SHM_DIR} (df -h {_SHM_DIR}) or lower nbytes") from exc
            self._map(shm_fd)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            listener.bind(self._sock_path)
            listener.listen(self.size)
            self._accept_members(listener)
            for conn in self._members.values():
                socket.send_fds(conn, [self._greeting(wire.Kind.WELCOME)], [shm_fd])
            self._sel = selectors.DefaultSelector()
            for r, conn in self._members.items():
                self._sel.register(conn, selectors.EVENT_READ, r)
        finally:
            if listener is not None:
                listener.close()
            for path in (self._sock_path, shm_path, lock_path):
                _unlink_quietly(path)
            if shm_fd >= 0:
                os.close(shm_fd)
            os.close(lock_fd)

    def _take_lock(self, lock_path: str) -> int:
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise HostGroupError(
                    f"host group {self.name!r}: another leader (pid {holder}) is forming a group of this name in "
                    f"{self.run_dir}", "give each group of a host its own name, and rank 0 to one process only",
                ) from None
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{self._pid}\n".encode())
                return fd
            os.close(fd)  # the previous leader unlinked the file we locked: lock the new one

    def _accept_members(self, listener: socket.socket) -> None:
        deadline = time.monotonic() + self.timeout
        while len(self._members) < self.size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, self.size)) - set(self._members))
                raise HostGroupError(
                    f"host group {self.name!r}: rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} of {self.size} did not join within {self.timeout:g} s "
                    f"(socket {self._sock_path})",
                    "start every rank 1 .. size-1 with the same name, size, nbytes and run_dir, or raise timeout",
                    rank=missing[0])
            listener.settimeout(remaining)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            if _peer_uid(conn) != os.getuid():
                conn.close()  # not one of ours (only root can get past the 0700 directory)
                continue
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                msg = conn.recv(wire.MAX_MSG)
            except (TimeoutError, OSError):
                conn.close()
                continue
            try:
                rank = self._check_hello(msg)
            except HostGroupError as exc:
                _send_quietly(conn, _pack_error(exc, None))
                conn.close()
                raise
            self._members[rank] = conn

    def _check_hello(self, msg: bytes) -> int:
        try:
            kind, _, rank, _, _, nbytes, payload = wire.unpack(msg)
            size, pid = wire.HELLO.unpack(payload)
        except (ValueError, struct.error) as exc:
            raise HostGroupError(f"host group {self.name!r}: a process joined with a malformed greeting ({exc})",
                                 "run the same irdma version on every rank") from None
        what = f"host group {self.name!r}: rank {rank} (pid {pid})"
        if kind != wire.Kind.HELLO:
            raise HostGroupError(f"{what} sent {kind.name} instead of HELLO", rank=rank)
        if not 1 <= rank < self.size:
            raise HostGroupError(f"{what} is outside ranks 1 .. {self.size - 1}",
                                 "give each process of a host a distinct rank 0 .. size-1", rank=rank)
        if rank in self._members:
            raise HostGroupError(f"{what} joined twice (two processes with rank {rank})",
                                 "give each process of a host a distinct rank 0 .. size-1", rank=rank)
        if size != self.size or nbytes != self.nbytes:
            raise HostGroupError(
                f"{what} has size={size} nbytes={nbytes}, the leader size={self.size} nbytes={self.nbytes}",
                "every rank must pass the same size and nbytes", rank=rank)
        return rank

    def _join_as_member(self) -> None:
        deadline = time.monotonic() + self.timeout + self._margin
        conn = self._connect(deadline)
        self._leader = conn
        conn.sendall(self._greeting(wire.Kind.HELLO))
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            msg, fds, _, _ = socket.recv_fds(conn, wire.MAX_MSG, 1)
        except TimeoutError:
            raise HostGroupError(
                f"host group {self.name!r} rank {self.rank}: the leader (rank 0) did not complete the group within "
                f"{self.timeout + self._margin:g} s", "start every rank 0 .. size-1 with the same name, size and "
                "nbytes; the leader waits for all of them", rank=0) from None
        except OSError:
            msg, fds = _after_reset(conn), []
        try:
            if not msg:
                raise HostGroupError(f"host group {self.name!r} rank {self.rank}: the leader closed the connection "
                                     "while the group formed", "look at rank 0's log", rank=0)
            try:
                kind, _, _, _, _, nbytes, payload = wire.unpack(msg)
                if kind == wire.Kind.ERROR:
                    raise self._leader_error(msg)
                size, _ = wire.HELLO.unpack(payload)
            except (ValueError, struct.error) as exc:
                raise HostGroupError(f"host group {self.name!r} rank {self.rank}: the leader sent a malformed "
                                     f"greeting ({exc})", "run the same irdma version on every rank", rank=0) from None
            if kind != wire.Kind.WELCOME or len(fds) != 1 or size != self.size or nbytes != self.nbytes:
                raise HostGroupError(f"host group {self.name!r} rank {self.rank}: the leader answered "
                                     f"{kind.name} size={size} nbytes={nbytes} fds={len(fds)}",
                                     "run the same irdma version on every rank", rank=0)
            if os.fstat(fds[0]).st_size != self._shm_len:
                raise HostGroupError(f"host group {self.name!r} rank {self.rank}: the shared memory has "
                                     f"{os.fstat(fds[0]).st_size} bytes, expected {self._shm_len}", rank=0)
            self._map(fds[0])
        finally:
            for fd in fds:
                os.close(fd)

    def _greeting(self, kind: wire.Kind) -> bytes:
        payload = wire.HELLO.pack(self.size, self._pid)
        return wire.pack(kind, wire.Op.JOIN, self.rank, None, 0, payload, extra=self.nbytes)

    def _connect(self, deadline: float) -> socket.socket:
        # No stdlib way to be woken when a socket file appears: retry with a short backoff.
        delay = 0.001
        dir_checked = False
        while True:
            if not dir_checked:
                dir_checked = _ensure_run_dir(self.run_dir, create=False)
            remaining = deadline - time.monotonic()
            if dir_checked:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
                conn.settimeout(max(remaining, 0.001))
                try:
                    conn.connect(self._sock_path)
                except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
                    conn.close()  # no leader yet, or a leftover socket of a dead one
                except BaseException:
                    conn.close()
                    raise
                else:
                    if _peer_uid(conn) == os.getuid():
                        return conn
                    conn.close()
                remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HostGroupError(
                    f"host group {self.name!r} rank {self.rank}: no leader (rank 0) at {self._sock_path} within "
                    f"{self.timeout + self._margin:g} s", "start rank 0 with the same name and run_dir", rank=0)
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, 0.05)

    def _map(self, fd: int) -> None:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(fd, self._shm_len, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)

    # ---- one step ----

    @contextmanager
    def _call(self, op: wire.Op) -> Iterator[None]:
        if self._closed:
            if self._broken is not None:
                raise HostGroupError(f"host group {self.name!r} rank {self.rank} is closed after an earlier error: "
                                     f"{self._broken}", "start the group again on every rank") from self._broken
            raise HostGroupError(f"host group {self.name!r} rank {self.rank} is closed", "create a new HostGroup")
        if os.getpid() != self._pid:
            raise HostGroupError(f"host group {self.name!r} was created by pid {self._pid}, not this process",
                                 "create the group in the process that uses it (after fork)")
        if not self._busy.acquire(blocking=False):
            raise HostGroupError(f"host group {self.name!r} rank {self.rank}: {op.call} called while another call "
                                 "runs", "make one call at a time per HostGroup (see its thread safety note)")
        try:
            try:
                yield
            except HostGroupError as exc:
                if exc.step is None:
                    exc.step = self._step
                self._abort(exc)
                raise
            except BaseException:
                self._abort(None)
                raise
            self._step += 1
        finally:
            self._busy.release()

    def _check_array(self, x: object, call: str) -> Float32Array:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{call}: x must be a numpy.ndarray of float32, not {type(x).__name__}")
        if x.dtype != np.dtype(np.float32):
            raise TypeError(f"{call}: x has dtype {x.dtype.str}, the group sums float32 in native byte order "
                            f"({np.dtype(np.float32).str}): pass x.astype(np.float32)")
        if x.nbytes > self.nbytes:
            raise ValueError(f"{call}: x has shape {x.shape} ({x.nbytes} bytes), more than the group's "
                             f"nbytes={self.nbytes}")
        return x

    def _view(self, slot: int, shape: tuple[int, ...]) -> Float32Array:
        """Slot ``1 .. size-1`` (a member's input) or ``size`` (the result) as float32 of ``shape``."""
        assert self._buf is not None
        start = (slot - 1) * self._stride
        n = 4 * math.prod(shape)
        return self._buf[start:start + n].view(np.float32).reshape(shape)

    def _gather(self, op: wire.Op, shape: tuple[int, ...] | None) -> None:
        """Leader: wait for every member's REQ of this step and check that all agree."""
        assert self._sel is not None
        got: dict[int, tuple[int, tuple[int, ...] | None]] = {}
        deadline = time.monotonic() + self.timeout
        while len(got) < self.size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, self.size)) - set(got))
                ranks = ", ".join(map(str, missing))
                raise HostGroupError(
                    f"host group {self.name!r}: rank{'s' if len(missing) > 1 else ''} {ranks} did not arrive at step "
                    f"{self._step} ({op.call}) within {self.timeout:g} s",
                    f"rank {missing[0]} is stuck or slower than the timeout: look at that process (its log, "
                    f"py-spy dump); every rank must make the same calls in the same order; raise timeout if it is "
                    f"only slow; {_RESTART}", rank=missing[0])
            for key, _ in self._sel.select(remaining):
                r: int = key.data
                conn = self._members[r]
                try:
                    msg = conn.recv(wire.MAX_MSG)
                except OSError:
                    msg = b""
                if not msg:
                    raise HostGroupError(
                        f"host group {self.name!r}: rank {r} left the group at step {self._step} ({op.call}): its "
                        f"process exited or it closed the group", f"look at rank {r}'s log for why; {_RESTART}", rank=r)
                try:
                    kind, got_op, rank, dims, step, _, _ = wire.unpack(msg)
                except ValueError as exc:
                    raise HostGroupError(f"host group {self.name!r}: rank {r} sent a malformed message ({exc})",
                                         rank=r) from None
                if kind != wire.Kind.REQ or rank != r or r in got:
                    raise HostGroupError(f"host group {self.name!r}: rank {r} sent {kind.name} (rank {rank}) out of "
                                         f"turn at step {self._step}", rank=r)
                if step != self._step:
                    raise HostGroupError(
                        f"host group {self.name!r}: rank {r} is at step {step}, the leader at step {self._step} "
                        f"({op.call})", f"every rank must make the same calls in the same order; {_RESTART}", rank=r)
                if got_op != op:
                    raise HostGroupError(
                        f"host group {self.name!r}: at step {self._step} rank {r} called {wire.op_name(got_op)}, the "
                        f"leader {op.call}", f"every rank must make the same calls in the same order; {_RESTART}",
                        rank=r)
                got[r] = (got_op, dims)
        shapes = {0: shape, **{r: dims for r, (_, dims) in got.items()}}
        if op == wire.Op.BROADCAST:
            bad = [r for r, s in shapes.items() if s is not None and s != shape]
        else:
            bad = [r for r, s in shapes.items() if s != shape]
        if bad:
            listing = "; ".join(f"rank {r} {_shape_text(s)}" for r, s in sorted(shapes.items()))
            raise HostGroupError(
                f"host group {self.name!r}: ranks disagree on the shape at step {self._step} ({op.call}): {listing}",
                f"every rank must pass an array of the same shape to the same call; {_RESTART}", rank=bad[0])

    def _release(self, op: wire.Op, shape: tuple[int, ...] | None) -> None:
        """Leader: tell every member that the step is done (and the result's shape)."""
        msg = wire.pack(wire.Kind.DONE, op, 0, shape, self._step)
        for r, conn in self._members.items():
            try:
                conn.sendall(msg)
            except OSError as exc:
                raise HostGroupError(
                    f"host group {self.name!r}: rank {r} left the group at step {self._step} ({op.call}): "
                    f"{exc.strerror}", f"look at rank {r}'s log for why; {_RESTART}", rank=r) from None

    def _request(self, op: wire.Op, shape: tuple[int, ...] | None) -> tuple[int, ...]:
        """Member: send this step's REQ and wait for the leader's DONE; return the result's shape."""
        conn = self._leader
        assert conn is not None
        deadline = time.monotonic() + self.timeout + self._margin
        try:
            conn.sendall(wire.pack(wire.Kind.REQ, op, self.rank, shape, self._step))
        except OSError:
            pass  # the leader is gone; what it said last, if anything, is still to be read below
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            msg = conn.recv(wire.MAX_MSG)
        except TimeoutError:
            raise HostGroupError(
                f"host group {self.name!r} rank {self.rank}: the leader (rank 0) did not answer at step {self._step} "
                f"({op.call}) within {self.timeout + self._margin:g} s",
                f"rank 0 is stuck, slower than the timeout, or waits for another rank: look at rank 0's log; "
                f"{_RESTART}", rank=0) from None
        except OSError:
            msg = _after_reset(conn)
        if not msg:
            raise HostGroupError(
                f"host group {self.name!r} rank {self.rank}: the leader (rank 0) left the group at step {self._step} "
                f"({op.call}): its process exited or it closed the group", f"look at rank 0's log; {_RESTART}", rank=0)
        try:
            kind, got_op, _, dims, step, _, _ = wire.unpack(msg)
        except ValueError as exc:
            raise HostGroupError(f"host group {self.name!r} rank {self.rank}: the leader sent a malformed message "
                                 f"({exc})", "run the same irdma version on every rank", rank=0) from None
        if kind == wire.Kind.ERROR:
            raise self._leader_error(msg)
        if kind != wire.Kind.DONE or got_op != op or step != self._step:
            raise HostGroupError(
                f"host group {self.name!r} rank {self.rank}: the leader answered {kind.name} {wire.op_name(got_op)} "
                f"step {step} to {op.call} step {self._step}", f"every rank must make the same calls; {_RESTART}",
                rank=0)
        return () if dims is None else dims

    def _leader_error(self, msg: bytes) -> HostGroupError:
        _, _, rank, _, step, _, payload = wire.unpack(msg)
        text, _, hint = payload.decode(errors="replace").partition("\0")
        return HostGroupError(f"{text} [reported by the leader to rank {self.rank}]", hint,
                              rank=None if rank == wire.NONE else rank, step=None if step == wire.NO_STEP else step)

    def _abort(self, exc: HostGroupError | None) -> None:
        """Close after a failure; the leader first tells every member still connected why."""
        if exc is None:  # another exception (KeyboardInterrupt, a bug) stopped this rank mid-call
            exc = HostGroupError(f"host group {self.name!r}: rank {self.rank} was interrupted in a call",
                                 f"look at rank {self.rank}'s log; {_RESTART}", rank=self.rank)
        if self.rank == 0:
            msg = _pack_error(exc, self._step if self._sel is not None else None)
            for conn in self._members.values():
                _send_quietly(conn, msg)
        self._broken = exc
        self.close()


# ---- helpers ----

def _check_args(name: object, rank: object, size: object, nbytes: object, timeout: object) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name={name!r}: 1 to 64 characters of A-Z a-z 0-9 _ . -, starting with a letter or digit")
    for arg, value in (("rank", rank), ("size", size), ("nbytes", nbytes)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise ValueError(f"{arg}={value!r} is not an integer")
    assert isinstance(rank, int | np.integer) and isinstance(size, int | np.integer)
    assert isinstance(nbytes, int | np.integer)
    if not 1 <= size <= _MAX_SIZE:
        raise ValueError(f"size={size}: a group has 1 .. {_MAX_SIZE} ranks")
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} is outside 0 .. size-1 (size={size})")
    if not 0 <= nbytes <= 2**62 // size:
        raise ValueError(f"nbytes={nbytes}: must be >= 0 (and size * nbytes must fit in memory)")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout={timeout!r}: seconds, > 0 and finite")


def _ensure_run_dir(path: str, *, create: bool) -> bool:
    """Check that ``path`` is a directory of ours that no other user can enter (creating it, mode
    0700, when ``create``). Returns whether it exists."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.lstat(path)
        except OSError as exc:
            raise HostGroupError(f"cannot create the run directory {path}: {exc.strerror}",
                                 "pass run_dir= a directory you can write") from exc
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise HostGroupError(f"run directory {path} is not a directory (or is a symlink)",
                             "remove it or pass another run_dir=")
    if st.st_uid != os.getuid():
        raise HostGroupError(f"run directory {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})",
                             "pass run_dir= a directory of your own")
    if st.st_mode & 0o077:
        raise HostGroupError(f"run directory {path} has mode {stat.S_IMODE(st.st_mode):o}: other local users could "
                             "join the group", f"chmod 700 {path}")
    return True


def _peer_uid(conn: socket.socket) -> int:
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _after_reset(conn: socket.socket) -> bytes:
    """The message still queued after a failed receive, or ``b""``. A peer that closes with
    messages of ours unread resets the connection (ECONNRESET): Linux reports that error once,
    before the messages the peer sent us first (such as the leader's ERROR), which a second
    receive returns."""
    try:
        return conn.recv(wire.MAX_MSG, socket.MSG_DONTWAIT)
    except OSError:
        return b""


def _send_quietly(conn: socket.socket, msg: bytes) -> None:
    try:
        conn.send(msg, socket.MSG_DONTWAIT)
    except OSError:
        pass  # that member is gone or not reading: it learns from end of file instead


def _pack_error(exc: HostGroupError, step: int | None) -> bytes:
    return wire.pack_error(str(exc.args[0]) if exc.args else "", exc.hint, exc.rank, step)


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "no array" if shape is None else f"shape {shape} ({4 * math.prod(shape)} bytes)"
