"""Ranks ``1 .. size-1`` of a :mod:`irdma.train.hier` host group: a worker's side.

A member connects to the leader's socket (retrying until the leader listens), says HELLO,
receives WELCOME with the shared memory's descriptor and maps it; at each step it sends REQ
(its slot already written) and waits for the leader's DONE, or its ERROR, which becomes this
rank's :class:`~irdma.train._hier_config.HostGroupError`. The copies in and out of the slots
are made by :class:`irdma.train.hier.HostGroup`.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from . import _hier_wire as wire
from ._hier_config import RESTART, GroupSpec, HostGroupError, ensure_run_dir, peer_uid
from ._hier_slots import Slots


class Member:
    """A member's side of one group: its connection to the leader.

    Every wait lasts at most the group's ``timeout`` plus ``margin`` seconds, so that the
    leader's report, which names the rank at fault, reaches the member before its own deadline.

    Args:
        spec: the group, as this rank (1 .. size-1) was asked to join it.
    """

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.conn: socket.socket | None = None  # to the leader

    # ---- joining ----

    def join(self, slots: Slots) -> None:
        """Join the leader's group and map its shared memory into ``slots``.

        Raises:
            HostGroupError: as :class:`irdma.train.hier.HostGroup` lists for forming.
        """
        s = self.spec
        deadline = time.monotonic() + s.timeout + s.margin
        conn = self._connect(deadline)
        self.conn = conn
        conn.sendall(wire.pack_greeting(wire.Kind.HELLO, s.rank, s.size, s.pid, s.nbytes))
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            msg, fds, _, _ = socket.recv_fds(conn, wire.MAX_MSG, 1)
        except TimeoutError:
            raise HostGroupError(
                f"host group {s.name!r} rank {s.rank}: the leader (rank 0) did not complete the group within "
                f"{s.timeout + s.margin:g} s", "start every rank 0 .. size-1 with the same name, size and "
                "nbytes; the leader waits for all of them", rank=0) from None
        except OSError:
            msg, fds = _after_reset(conn), []
        try:
            if not msg:
                raise HostGroupError(f"host group {s.name!r} rank {s.rank}: the leader closed the connection "
                                     "while the group formed", "look at rank 0's log", rank=0)
            try:
                kind, _, _, _, _, nbytes, payload = wire.unpack(msg)
                if kind == wire.Kind.ERROR:
                    raise self._leader_error(msg)
                size, _ = wire.HELLO.unpack(payload)
            except (ValueError, struct.error) as exc:
                raise HostGroupError(f"host group {s.name!r} rank {s.rank}: the leader sent a malformed "
                                     f"greeting ({exc})", "run the same irdma version on every rank", rank=0) from None
            if kind != wire.Kind.WELCOME or len(fds) != 1 or size != s.size or nbytes != s.nbytes:
                raise HostGroupError(f"host group {s.name!r} rank {s.rank}: the leader answered "
                                     f"{kind.name} size={size} nbytes={nbytes} fds={len(fds)}",
                                     "run the same irdma version on every rank", rank=0)
            if os.fstat(fds[0]).st_size != slots.length:
                raise HostGroupError(f"host group {s.name!r} rank {s.rank}: the shared memory has "
                                     f"{os.fstat(fds[0]).st_size} bytes, expected {slots.length}", rank=0)
            slots.map(fds[0])
        finally:
            for fd in fds:
                os.close(fd)

    def _connect(self, deadline: float) -> socket.socket:
        s = self.spec
        # No stdlib way to be woken when a socket file appears: retry with a short backoff.
        delay = 0.001
        dir_checked = False
        while True:
            if not dir_checked:
                dir_checked = ensure_run_dir(s.run_dir, create=False)
            remaining = deadline - time.monotonic()
            if dir_checked:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
                conn.settimeout(max(remaining, 0.001))
                try:
                    conn.connect(s.sock_path)
                except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
                    conn.close()  # no leader yet, or a leftover socket of a dead one
                except BaseException:
                    conn.close()
                    raise
                else:
                    if peer_uid(conn) == os.getuid():
                        return conn
                    conn.close()
                remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HostGroupError(
                    f"host group {s.name!r} rank {s.rank}: no leader (rank 0) at {s.sock_path} within "
                    f"{s.timeout + s.margin:g} s", "start rank 0 with the same name and run_dir", rank=0)
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, 0.05)

    # ---- one step ----

    def request(self, op: wire.Op, shape: tuple[int, ...] | None, step: int) -> tuple[int, ...]:
        """Send this step's REQ (``shape`` of this rank's array, ``None``: none) and wait for the
        leader's DONE; return the result's shape (``()`` when the leader sent none).

        Raises:
            HostGroupError: the leader did not answer in time, left, sent something malformed or
                out of step, or reported the group's failure (its message, naming the rank at
                fault).
        """
        s = self.spec
        conn = self.conn
        assert conn is not None
        deadline = time.monotonic() + s.timeout + s.margin
        try:
            conn.sendall(wire.pack(wire.Kind.REQ, op, s.rank, shape, step))
        except OSError:
            pass  # the leader is gone; what it said last, if anything, is still to be read below
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            msg = conn.recv(wire.MAX_MSG)
        except TimeoutError:
            raise HostGroupError(
                f"host group {s.name!r} rank {s.rank}: the leader (rank 0) did not answer at step {step} "
                f"({op.call}) within {s.timeout + s.margin:g} s",
                f"rank 0 is stuck, slower than the timeout, or waits for another rank: look at rank 0's log; "
                f"{RESTART}", rank=0) from None
        except OSError:
            msg = _after_reset(conn)
        if not msg:
            raise HostGroupError(
                f"host group {s.name!r} rank {s.rank}: the leader (rank 0) left the group at step {step} "
                f"({op.call}): its process exited or it closed the group", f"look at rank 0's log; {RESTART}", rank=0)
        try:
            kind, got_op, _, dims, got_step, _, _ = wire.unpack(msg)
        except ValueError as exc:
            raise HostGroupError(f"host group {s.name!r} rank {s.rank}: the leader sent a malformed message "
                                 f"({exc})", "run the same irdma version on every rank", rank=0) from None
        if kind == wire.Kind.ERROR:
            raise self._leader_error(msg)
        if kind != wire.Kind.DONE or got_op != op or got_step != step:
            raise HostGroupError(
                f"host group {s.name!r} rank {s.rank}: the leader answered {kind.name} {wire.op_name(got_op)} "
                f"step {got_step} to {op.call} step {step}", f"every rank must make the same calls; {RESTART}",
                rank=0)
        return () if dims is None else dims

    def _leader_error(self, msg: bytes) -> HostGroupError:
        _, _, rank, _, step, _, payload = wire.unpack(msg)
        text, _, hint = payload.decode(errors="replace").partition("\0")
        return HostGroupError(f"{text} [reported by the leader to rank {self.spec.rank}]", hint,
                              rank=None if rank == wire.NONE else rank, step=None if step == wire.NO_STEP else step)

    def close(self) -> None:
        """Close the connection to the leader. Safe to call twice."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _after_reset(conn: socket.socket) -> bytes:
    """The message still queued after a failed receive, or ``b""``. A peer that closes with
    messages of ours unread resets the connection (ECONNRESET): Linux reports that error once,
    before the messages the peer sent us first (such as the leader's ERROR), which a second
    receive returns."""
    try:
        return conn.recv(wire.MAX_MSG, socket.MSG_DONTWAIT)
    except OSError:
        return b""
