"""Process identity and background processes (shard servers, mounts) that outlive the command
that started them: the bottom layer, shared by the metadata engines (whose sessions and job
members are a host and a pid), the mount and the ``irdma`` command.

A pid names a process only while it runs: the kernel gives it to the next process once the
first is reaped. A process is therefore known by its pid *and* its start time (psutil's
``create_time``, from ``/proc/PID/stat``'s start time in clock ticks after boot, see proc(5)):
:func:`pid_alive` with ``started_by_ns`` says a pid whose process started after that moment is
another process, so a session of a dead mount is not kept alive by a reused pid.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import psutil

#: How far psutil's start time may be off (``/proc/stat``'s boot time is in whole seconds, and
#: the clock may be stepped): a process is taken for another only when it started this much later.
START_TIME_SLACK_S = 2.0


#: glibc's mallopt(3) parameters, and what a mount and a shard server set them to (their entry
#: points call :func:`keep_freed_buffers`): buffers up to 16 MiB (FUSE's 1 MiB write and read
#: payloads, 4 MiB read-ahead windows, a reply's unsent rest) come from the heap, and up to 64 MiB
#: freed at its top stays there for the next ones. glibc's defaults give a freed 1 MiB buffer back
#: to the kernel (munmap, or a trim of the heap) and the next one faults in fresh pages: on a
#: virtual machine each first touch is a host fault too. 1 GiB read through a mount with direct
#: I/O, 4 shards (2026-12-06): 1334-1343 MB/s with glibc's defaults, 1533-1547 MB/s with these in
#: the mount; a native pull of 1 GiB again from the same 4 shards, with these in the shards:
#: 2445-2693 MB/s against 1921-2289 (a first pull, whose shards' heaps still grow: the same).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_TRIM_THRESHOLD = 64 << 20
MALLOC_MMAP_THRESHOLD = 16 << 20


def keep_freed_buffers() -> bool:
    """Set :data:`MALLOC_MMAP_THRESHOLD` and :data:`MALLOC_TRIM_THRESHOLD` with glibc's
    ``mallopt`` (mallopt(3)); False where the C library has none (musl) or refuses them."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                   MALLOC_TRIM_THRESHOLD))


def spawn_detached(args: list[str], log_file: str) -> int:
    """Start ``python ARGS...`` in a new session, stdin from /dev/null, output to ``log_file``.

    Returns:
        The child's pid. It is not a ``Popen``: nothing warns when this process exits first.

    Raises:
        OSError: ``log_file`` cannot be opened for appending (its ``filename`` says which).
    """
    with open(log_file, "a"):  # here, where the error names the file, rather than in the child
        pass
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawn(sys.executable, [sys.executable, *args], os.environ, file_actions=actions, setsid=True)


def pid_alive(pid: int, started_by_ns: int | None = None) -> bool:
    """Whether ``pid`` runs (a zombie child of ours is reaped and counts as gone).

    ``started_by_ns``: the wall-clock time (ns since the epoch) by which the process meant had
    started (a session's registration, a job member's last heartbeat); a process with that pid
    that started later (beyond :data:`START_TIME_SLACK_S`) is another one, and counts as gone.
    """
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if started_by_ns is not None and proc.create_time() > started_by_ns / 1e9 + START_TIME_SLACK_S:
            return False
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
    return True


def last_log_line(path: str) -> str:
    """The last non-blank line of a process log, for a one-line error message that names the log."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError as exc:
        return f"(cannot read its log: {exc.strerror})"
    return lines[-1] if lines else "(its log is empty)"


# ---------------------------------------------------------------- what a mount shows
def mount_record_file(mountpoint: str) -> str:
    """The file where the mount on ``mountpoint`` records what it shows while it runs (JSON:
    ``mountpoint``, ``pid``, ``source`` as the mount table shows it, ``subdir``): beside its
    metrics record, in :func:`irdma.metrics.run_dir` (per user), keyed by the mountpoint."""
    from .metrics import mount_state_file

    return mount_state_file(mountpoint).removesuffix(".json") + ".view.json"


def write_mount_record(mountpoint: str, source: str, subdir: str) -> str:
    """Record that this process serves ``mountpoint``, of source ``source`` (``irdma:URL``, the
    mount table's) showing directory ``subdir`` of its namespace as its root; returns the file.

    Raises:
        OSError: the run directory cannot be written.
    """
    import json

    path = mount_record_file(mountpoint)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"mountpoint": os.path.abspath(mountpoint), "pid": os.getpid(), "source": source,
                   "subdir": os.path.normpath("/" + subdir.strip("/"))}, f)
    os.replace(tmp, path)
    return path


def read_mount_record(mountpoint: str) -> dict[str, object] | None:
    """The record of the live mount on ``mountpoint`` (:func:`write_mount_record`), or None when
    there is none, it cannot be read, or the process that wrote it is gone."""
    import json

    try:
        with open(mount_record_file(mountpoint)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("pid"), int) or not isinstance(rec.get("subdir"), str) \
            or not isinstance(rec.get("source"), str) or not pid_alive(rec["pid"]):
        return None
    return rec


def forget_mount_record(mountpoint: str) -> None:
    """Remove the record of :func:`write_mount_record` if this process made it (best effort)."""
    import json

    path = mount_record_file(mountpoint)
    try:
        with open(path) as f:
            if json.load(f).get("pid") != os.getpid():
                return
        os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass
