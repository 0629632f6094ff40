"""A process is its pid and its start time (issue 37, point 2; :mod:`irdma._proc`): a metadata
session or job member whose pid the kernel gave to a later process is dead, not kept alive by
the new one; a live process of that pid that started before it is alive.

Real processes (a ``sleep`` child) and a real SQLite namespace; the dead session is a row
whose pid belongs to a process started after the session registered, as when a mount dies and
its pid is reused.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from irdma._proc import START_TIME_SLACK_S, pid_alive
from irdma.meta import open_meta
from irdma.meta.base import ROOT_INO


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def test_a_pid_is_alive_only_for_the_process_that_started_by_then(child: subprocess.Popen[bytes]) -> None:
    now_ns = time.time_ns()
    assert pid_alive(child.pid)
    assert pid_alive(child.pid, now_ns)  # it started before now
    before = now_ns - int((START_TIME_SLACK_S + 60) * 1e9)
    assert not pid_alive(child.pid, before), "a process started after the moment was taken for the one meant"
    child.kill()
    child.wait()
    assert not pid_alive(child.pid) and not pid_alive(child.pid, now_ns)


def test_a_session_whose_pid_was_reused_is_dead(tmp_path: object, child: subprocess.Popen[bytes]) -> None:
    meta = open_meta(f"sqlite:///{tmp_path}/meta.db", create=True)
    try:
        mine = meta.open_session("this process")
        old_ns = time.time_ns() - int((START_TIME_SLACK_S + 60) * 1e9)
        host = socket.gethostname()
        with meta._tx() as c:  # type: ignore[attr-defined]  # a row as a mount that died a minute ago left it
            reused = int(c.execute(
                "INSERT INTO sessions(name, host, pid, started_ns, heartbeat_ns) VALUES (?,?,?,?,?) RETURNING sid",
                ("a dead mount", host, child.pid, old_ns, time.time_ns())).fetchone()[0])
            live = int(c.execute(
                "INSERT INTO sessions(name, host, pid, started_ns, heartbeat_ns) VALUES (?,?,?,?,?) RETURNING sid",
                ("the child's", host, child.pid, time.time_ns(), time.time_ns())).fetchone()[0])
        dead = {s.sid for s in meta.dead_sessions()}
        assert reused in dead, "a session kept alive by a process that took its pid later"
        assert mine not in dead and live not in dead
        assert meta.getattr(ROOT_INO).ino == ROOT_INO
    finally:
        meta.close()
