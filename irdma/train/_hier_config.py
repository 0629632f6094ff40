"""What a :mod:`irdma.train.hier` host group is asked to be, and who may join it: the arguments
and their checks (:class:`GroupSpec`), a worker's local rank and size from the environment, the
run directory and its safety, a socket peer's user, and :class:`HostGroupError`, which every
failure of a group raises. No group state: the leader's side is in :mod:`._hier_leader`, a
member's in :mod:`._hier_member`, the shared memory in :mod:`._hier_slots`.
"""

from __future__ import annotations

import math
import os
import re
import socket
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .._errors import IrdmaError

ALIGN = 64  # bytes: every slot of the shared memory starts on a multiple of it
MAX_SIZE = 4096  # the most ranks a group may have
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
SUN_PATH_MAX = 107  # bytes of sockaddr_un.sun_path, less the terminating NUL
SHM_DIR = "/dev/shm"
RESTART = "then start the group again on every rank (a HostGroup cannot take a rank back)"


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

    __module__ = "irdma.train.hier"  # where it is imported from, and named in tracebacks (as trio does)

    def __init__(self, message: str, hint: str = "", *, rank: int | None = None, step: int | None = None) -> None:
        super().__init__(message, hint)
        self.rank = rank
        self.step = step


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
    if not 1 <= size <= MAX_SIZE:
        raise ValueError(f"IRDMA_LOCAL_SIZE={raw_size!r}: the number of workers on a host must be 1 .. {MAX_SIZE}")
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


@dataclass(frozen=True)
class GroupSpec:
    """One rank's view of its group, checked: what both sides need to form it and to word errors.

    Attributes:
        name, rank, size, nbytes, timeout, run_dir: as :class:`irdma.train.hier.HostGroup` takes
            them (``run_dir`` absolute).
        sock_path: the leader's Unix socket, ``run_dir/name.sock``.
        margin: seconds a member waits for the leader beyond ``timeout``.
        pid: the process that made the group (it may use it only there).
    """

    name: str
    rank: int
    size: int
    nbytes: int
    timeout: float
    run_dir: str
    sock_path: str
    margin: float
    pid: int

    @classmethod
    def make(cls, name: str, rank: int, size: int, nbytes: int, timeout: float, run_dir: str | None) -> GroupSpec:
        """Check the arguments of a group (nothing is created or connected).

        Raises:
            ValueError: a bad argument, or a socket path longer than ``sockaddr_un`` holds.
        """
        check_args(name, rank, size, nbytes, timeout)
        run_dir = default_run_dir() if run_dir is None else os.path.abspath(run_dir)
        sock_path = os.path.join(run_dir, f"{name}.sock")
        if len(os.fsencode(sock_path)) > SUN_PATH_MAX:
            raise ValueError(f"socket path {sock_path!r} is longer than {SUN_PATH_MAX} bytes: "
                             "choose a shorter run_dir or name")
        timeout = float(timeout)
        return cls(name=name, rank=int(rank), size=int(size), nbytes=int(nbytes), timeout=timeout, run_dir=run_dir,
                   sock_path=sock_path, margin=min(5.0, max(0.5, 0.25 * timeout)), pid=os.getpid())


def check_args(name: object, rank: object, size: object, nbytes: object, timeout: object) -> None:
    """Raise ValueError, naming the argument, unless all are as :class:`~irdma.train.hier.HostGroup` documents."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"name={name!r}: 1 to 64 characters of A-Z a-z 0-9 _ . -, starting with a letter or digit")
    for arg, value in (("rank", rank), ("size", size), ("nbytes", nbytes)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise ValueError(f"{arg}={value!r} is not an integer")
    assert isinstance(rank, int | np.integer) and isinstance(size, int | np.integer)
    assert isinstance(nbytes, int | np.integer)
    if not 1 <= size <= MAX_SIZE:
        raise ValueError(f"size={size}: a group has 1 .. {MAX_SIZE} ranks")
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} is outside 0 .. size-1 (size={size})")
    if not 0 <= nbytes <= 2**62 // size:
        raise ValueError(f"nbytes={nbytes}: must be >= 0 (and size * nbytes must fit in memory)")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout={timeout!r}: seconds, > 0 and finite")


def ensure_run_dir(path: str, *, create: bool) -> bool:
    """Check that ``path`` is a directory of ours that no other user can enter (creating it, mode
    0700, when ``create``). Returns whether it exists.

    Raises:
        HostGroupError: it cannot be created, is not a directory (or is a symlink), belongs to
            another user, or is open to group or others.
    """
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


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)
