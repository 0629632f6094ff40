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

Where the code is
-----------------
This module is the group as its caller sees it (:class:`HostGroup`: the calls, the sums, the
step counter, closing). Beneath it, each with one job: :mod:`._hier_config` (the arguments, the
environment, the run directory, :class:`HostGroupError`), :mod:`._hier_slots` (the shared
memory's layout and mapping), :mod:`._hier_leader` (rank 0: forming the group, gathering and
releasing each step, reporting a failure), :mod:`._hier_member` (the other ranks: joining, each
step's request), and :mod:`._hier_wire` (the messages as bytes, no I/O).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

import numpy as np

from . import _hier_wire as wire
from ._hier_config import RESTART, GroupSpec
from ._hier_config import HostGroupError as HostGroupError
from ._hier_config import default_run_dir as default_run_dir
from ._hier_config import local_rank_and_size as local_rank_and_size
from ._hier_leader import Leader
from ._hier_member import Member
from ._hier_slots import Float32Array, Slots

__all__ = ["HostGroup", "HostGroupError", "local_rank_and_size"]


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
        spec = GroupSpec.make(name, rank, size, nbytes, timeout, run_dir)
        self.name = spec.name
        self.rank = spec.rank
        self.size = spec.size
        self.nbytes = spec.nbytes
        self.timeout = spec.timeout
        self.run_dir = spec.run_dir
        self._pid = spec.pid
        self._slots = Slots(spec.size, spec.nbytes)
        self._step = 0
        self._closed = False
        self._broken: HostGroupError | None = None
        self._busy = threading.Lock()
        self._leader: Leader | None = Leader(spec) if spec.rank == 0 else None
        self._member: Member | None = None if spec.rank == 0 else Member(spec)
        try:
            if self._leader is not None:
                self._leader.form(self._slots)
            else:
                assert self._member is not None
                self._member.join(self._slots)
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
        with self._call(wire.Op.ALLREDUCE) as side:
            if isinstance(side, Leader):
                side.gather(wire.Op.ALLREDUCE, arr.shape, self._step)
                if self.size == 1:
                    return np.array(arr, dtype=np.float32, order="C", copy=True)
                res = self._slots.view(self.size, arr.shape)
                np.add(arr, self._slots.view(1, arr.shape), out=res)
                for r in range(2, self.size):
                    np.add(res, self._slots.view(r, arr.shape), out=res)
                side.release(wire.Op.ALLREDUCE, arr.shape, self._step)
                return res.copy()
            np.copyto(self._slots.view(self.rank, arr.shape), arr)
            shape = side.request(wire.Op.ALLREDUCE, arr.shape, self._step)
            return self._slots.view(self.size, shape).copy()

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
        with self._call(wire.Op.REDUCE_TO_LEADER) as side:
            if isinstance(side, Leader):
                side.gather(wire.Op.REDUCE_TO_LEADER, arr.shape, self._step)
                out = np.array(arr, dtype=np.float32, order="C", copy=True)
                for r in range(1, self.size):
                    np.add(out, self._slots.view(r, arr.shape), out=out)
                side.release(wire.Op.REDUCE_TO_LEADER, None, self._step)
                return out
            np.copyto(self._slots.view(self.rank, arr.shape), arr)
            side.request(wire.Op.REDUCE_TO_LEADER, arr.shape, self._step)
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
        with self._call(wire.Op.BROADCAST) as side:
            if isinstance(side, Leader):
                assert arr is not None
                side.gather(wire.Op.BROADCAST, arr.shape, self._step)
                if self.size > 1:
                    np.copyto(self._slots.view(self.size, arr.shape), arr)
                    side.release(wire.Op.BROADCAST, arr.shape, self._step)
                return np.array(arr, dtype=np.float32, order="C", copy=True)
            got = side.request(wire.Op.BROADCAST, shape, self._step)
            return self._slots.view(self.size, got).copy()

    def barrier(self) -> None:
        """Return once every rank has called :meth:`barrier` for this step.

        Raises:
            HostGroupError: as for :meth:`allreduce`.
        """
        with self._call(wire.Op.BARRIER) as side:
            if isinstance(side, Leader):
                side.gather(wire.Op.BARRIER, None, self._step)
                side.release(wire.Op.BARRIER, None, self._step)
            else:
                side.request(wire.Op.BARRIER, None, self._step)

    def close(self) -> None:
        """Leave the group and release its memory and sockets. Safe to call twice.

        Not collective: the others notice at their next call (the leader's departure makes every
        member's next call raise; a member's makes the leader's next call raise).
        """
        if self._closed:
            return
        self._closed = True
        if self._leader is not None:
            self._leader.close()
        if self._member is not None:
            self._member.close()
        self._slots.close()

    def __enter__(self) -> HostGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step {self._step}"
        return f"<HostGroup {self.name!r} rank {self.rank}/{self.size} nbytes={self.nbytes} {state}>"

    # ---- one step ----

    @contextmanager
    def _call(self, op: wire.Op) -> Iterator[Leader | Member]:
        """One step: refuse a closed group, another process, a second call at once; yield this
        rank's side; count the step when it completes, close the group when it fails."""
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
        side = self._leader if self._leader is not None else self._member
        assert side is not None
        try:
            try:
                yield side
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

    def _abort(self, exc: HostGroupError | None) -> None:
        """Close after a failure; the leader first tells every member still connected why."""
        if exc is None:  # another exception (KeyboardInterrupt, a bug) stopped this rank mid-call
            exc = HostGroupError(f"host group {self.name!r}: rank {self.rank} was interrupted in a call",
                                 f"look at rank {self.rank}'s log; {RESTART}", rank=self.rank)
        if self._leader is not None:
            self._leader.tell(exc, self._step if self._leader.formed else None)
        self._broken = exc
        self.close()

