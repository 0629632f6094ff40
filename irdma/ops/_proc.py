"""Background processes (shard servers, mounts) that outlive the command that started them."""

from __future__ import annotations

import os
import sys


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


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie child of ours is reaped and counts as gone)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def last_log_line(path: str) -> str:
    """The last non-blank line of a process log, for a one-line error message that names the log."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError as exc:
        return f"(cannot read its log: {exc.strerror})"
    return lines[-1] if lines else "(its log is empty)"
