"""The processes of :mod:`irdma._proc` under their earlier import path (scripts and tests that
import ``irdma.ops._proc``); the code lives in the bottom layer."""

from irdma._proc import (
    START_TIME_SLACK_S,
    forget_mount_record,
    last_log_line,
    mount_record_file,
    pid_alive,
    read_mount_record,
    spawn_detached,
    write_mount_record,
)

__all__ = ["START_TIME_SLACK_S", "forget_mount_record", "last_log_line", "mount_record_file", "pid_alive",
           "read_mount_record", "spawn_detached", "write_mount_record"]
