"""Rank 0 of a :mod:`irdma.train.hier` host group: the host's aggregation point.

It forms the group (the lock, the shared memory file, the listening socket, every member's
HELLO checked and answered with WELCOME and the shared memory's descriptor, then every name
unlinked), and at each step gathers the members' REQ, checks that they agree, and releases them
with DONE once the result is written. When the group fails it tells every member still
connected why (ERROR). The sums themselves are computed by :class:`irdma.train.hier.HostGroup`.
"""

from __future__ import annotations

import fcntl
import math
import os
import selectors
import socket
import struct
import time

from . import _hier_wire as wire
from ._hier_config import RESTART, SHM_DIR, GroupSpec, HostGroupError, ensure_run_dir, peer_uid
from ._hier_slots import Slots


class Leader:
    """The leader's side of one group: its connections to members ``1 .. size-1``.

    Args:
        spec: the group, as this rank (0) was asked to form it.
    """

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.members: dict[int, socket.socket] = {}  # rank -> connection
        self._sel: selectors.BaseSelector | None = None

    @property
    def formed(self) -> bool:
        """Whether every member joined (steps may begin)."""
        return self._sel is not None

    # ---- forming the group ----

    def form(self, slots: Slots) -> None:
        """Create the group's shared memory (mapped into ``slots``), wait for every member and
        hand each the memory; leave no name behind in /dev/shm or the run directory.

        Raises:
            HostGroupError: as :class:`irdma.train.hier.HostGroup` lists for forming.
        """
        s = self.spec
        ensure_run_dir(s.run_dir, create=True)
        lock_path = os.path.join(s.run_dir, f"{s.name}.lock")
        shm_path = os.path.join(SHM_DIR, f"irdma-hier-{os.getuid()}-{s.name}")
        lock_fd = self._take_lock(lock_path)
        listener: socket.socket | None = None
        shm_fd = -1
        try:
            # Holding the lock proves that no live leader uses this name: whatever is still
            # there was left by a leader killed while its group was forming.
            for path in (s.sock_path, shm_path):
                _unlink_quietly(path)
            try:
                shm_fd = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                os.posix_fallocate(shm_fd, 0, slots.length)
            except OSError as exc:
                raise HostGroupError(
                    f"host group {s.name!r}: cannot create {slots.length} bytes of shared memory at {shm_path}: "
                    f"{exc.strerror}", f"free space in {SHM_DIR} (df -h {SHM_DIR}) or lower nbytes") from exc
            slots.map(shm_fd)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            listener.bind(s.sock_path)
            listener.listen(s.size)
            self._accept_members(listener)
            welcome = wire.pack_greeting(wire.Kind.WELCOME, s.rank, s.size, s.pid, s.nbytes)
            for conn in self.members.values():
                socket.send_fds(conn, [welcome], [shm_fd])
            self._sel = selectors.DefaultSelector()
            for r, conn in self.members.items():
                self._sel.register(conn, selectors.EVENT_READ, r)
        finally:
            if listener is not None:
                listener.close()
            for path in (s.sock_path, shm_path, lock_path):
                _unlink_quietly(path)
            if shm_fd >= 0:
                os.close(shm_fd)
            os.close(lock_fd)

    def _take_lock(self, lock_path: str) -> int:
        s = self.spec
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise HostGroupError(
                    f"host group {s.name!r}: another leader (pid {holder}) is forming a group of this name in "
                    f"{s.run_dir}", "give each group of a host its own name, and rank 0 to one process only",
                ) from None
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{s.pid}\n".encode())
                return fd
            os.close(fd)  # the previous leader unlinked the file we locked: lock the new one

    def _accept_members(self, listener: socket.socket) -> None:
        s = self.spec
        deadline = time.monotonic() + s.timeout
        while len(self.members) < s.size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, s.size)) - set(self.members))
                raise HostGroupError(
                    f"host group {s.name!r}: rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} of {s.size} did not join within {s.timeout:g} s "
                    f"(socket {s.sock_path})",
                    "start every rank 1 .. size-1 with the same name, size, nbytes and run_dir, or raise timeout",
                    rank=missing[0])
            listener.settimeout(remaining)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            if peer_uid(conn) != os.getuid():
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
            self.members[rank] = conn

    def _check_hello(self, msg: bytes) -> int:
        s = self.spec
        try:
            kind, _, rank, _, _, nbytes, payload = wire.unpack(msg)
            size, pid = wire.HELLO.unpack(payload)
        except (ValueError, struct.error) as exc:
            raise HostGroupError(f"host group {s.name!r}: a process joined with a malformed greeting ({exc})",
                                 "run the same irdma version on every rank") from None
        what = f"host group {s.name!r}: rank {rank} (pid {pid})"
        if kind != wire.Kind.HELLO:
            raise HostGroupError(f"{what} sent {kind.name} instead of HELLO", rank=rank)
        if not 1 <= rank < s.size:
            raise HostGroupError(f"{what} is outside ranks 1 .. {s.size - 1}",
                                 "give each process of a host a distinct rank 0 .. size-1", rank=rank)
        if rank in self.members:
            raise HostGroupError(f"{what} joined twice (two processes with rank {rank})",
                                 "give each process of a host a distinct rank 0 .. size-1", rank=rank)
        if size != s.size or nbytes != s.nbytes:
            raise HostGroupError(
                f"{what} has size={size} nbytes={nbytes}, the leader size={s.size} nbytes={s.nbytes}",
                "every rank must pass the same size and nbytes", rank=rank)
        return rank

    # ---- one step ----

    def gather(self, op: wire.Op, shape: tuple[int, ...] | None, step: int) -> None:
        """Wait for every member's REQ of ``step`` and check that all agree with the leader's
        ``op`` and ``shape`` (``None``: no array).

        Raises:
            HostGroupError: a member did not arrive within the timeout, left, sent something
                malformed or out of turn, is at another step, made another call, or passed
                another shape (for a broadcast, a member may pass no array).
        """
        s = self.spec
        assert self._sel is not None
        got: dict[int, tuple[int, tuple[int, ...] | None]] = {}
        deadline = time.monotonic() + s.timeout
        while len(got) < s.size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, s.size)) - set(got))
                ranks = ", ".join(map(str, missing))
                raise HostGroupError(
                    f"host group {s.name!r}: rank{'s' if len(missing) > 1 else ''} {ranks} did not arrive at step "
                    f"{step} ({op.call}) within {s.timeout:g} s",
                    f"rank {missing[0]} is stuck or slower than the timeout: look at that process (its log, "
                    f"py-spy dump); every rank must make the same calls in the same order; raise timeout if it is "
                    f"only slow; {RESTART}", rank=missing[0])
            for key, _ in self._sel.select(remaining):
                r: int = key.data
                conn = self.members[r]
                try:
                    msg = conn.recv(wire.MAX_MSG)
                except OSError:
                    msg = b""
                if not msg:
                    raise HostGroupError(
                        f"host group {s.name!r}: rank {r} left the group at step {step} ({op.call}): its "
                        f"process exited or it closed the group", f"look at rank {r}'s log for why; {RESTART}", rank=r)
                try:
                    kind, got_op, rank, dims, got_step, _, _ = wire.unpack(msg)
                except ValueError as exc:
                    raise HostGroupError(f"host group {s.name!r}: rank {r} sent a malformed message ({exc})",
                                         rank=r) from None
                if kind != wire.Kind.REQ or rank != r or r in got:
                    raise HostGroupError(f"host group {s.name!r}: rank {r} sent {kind.name} (rank {rank}) out of "
                                         f"turn at step {step}", rank=r)
                if got_step != step:
                    raise HostGroupError(
                        f"host group {s.name!r}: rank {r} is at step {got_step}, the leader at step {step} "
                        f"({op.call})", f"every rank must make the same calls in the same order; {RESTART}", rank=r)
                if got_op != op:
                    raise HostGroupError(
                        f"host group {s.name!r}: at step {step} rank {r} called {wire.op_name(got_op)}, the "
                        f"leader {op.call}", f"every rank must make the same calls in the same order; {RESTART}",
                        rank=r)
                got[r] = (got_op, dims)
        shapes = {0: shape, **{r: dims for r, (_, dims) in got.items()}}
        if op == wire.Op.BROADCAST:
            bad = [r for r, sh in shapes.items() if sh is not None and sh != shape]
        else:
            bad = [r for r, sh in shapes.items() if sh != shape]
        if bad:
            listing = "; ".join(f"rank {r} {_shape_text(sh)}" for r, sh in sorted(shapes.items()))
            raise HostGroupError(
                f"host group {s.name!r}: ranks disagree on the shape at step {step} ({op.call}): {listing}",
                f"every rank must pass an array of the same shape to the same call; {RESTART}", rank=bad[0])

    def release(self, op: wire.Op, shape: tuple[int, ...] | None, step: int) -> None:
        """Tell every member that ``step`` is done (and the result's shape, ``None``: no result).

        Raises:
            HostGroupError: a member's connection is gone.
        """
        msg = wire.pack(wire.Kind.DONE, op, 0, shape, step)
        for r, conn in self.members.items():
            try:
                conn.sendall(msg)
            except OSError as exc:
                raise HostGroupError(
                    f"host group {self.spec.name!r}: rank {r} left the group at step {step} ({op.call}): "
                    f"{exc.strerror}", f"look at rank {r}'s log for why; {RESTART}", rank=r) from None

    # ---- failure and closing ----

    def tell(self, exc: HostGroupError, step: int | None) -> None:
        """Send ``exc`` as ERROR to every member still connected, without waiting for any
        (``step``: ``None`` while the group forms)."""
        msg = _pack_error(exc, step)
        for conn in self.members.values():
            _send_quietly(conn, msg)

    def close(self) -> None:
        """Close every member's connection. Safe to call twice."""
        for conn in self.members.values():
            conn.close()
        self.members.clear()
        if self._sel is not None:
            self._sel.close()
            self._sel = None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _send_quietly(conn: socket.socket, msg: bytes) -> None:
    try:
        conn.send(msg, socket.MSG_DONTWAIT)
    except OSError:
        pass  # that member is gone or not reading: it learns from end of file instead


def _pack_error(exc: HostGroupError, step: int | None) -> bytes:
    return wire.pack_error(str(exc.args[0]) if exc.args else "", exc.hint, exc.rank, step)


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "no array" if shape is None else f"shape {shape} ({4 * math.prod(shape)} bytes)"
