"""Running a mount: the FUSE main loop with the client beside it, and its start/stop.

``irdma mount`` starts this module in a detached child process (``python -m irdma.fs``),
waits until the mountpoint is mounted, and returns; ``irdma mount --foreground`` runs it
in-process. The loop ends when the filesystem is unmounted (``irdma umount``) or on SIGTERM
or SIGINT, which unmount it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

import pyfuse3
import trio

from irdma._errors import IrdmaError
from irdma._proc import pid_alive, spawn_detached
from irdma.client import Client

from .operations import IrdmaFS

log = logging.getLogger("irdma.fs")


async def serve_mount(
    meta_url: str, mountpoint: str, *, transport: str = "auto", debug: bool = False, direct_io: bool = False,
    allow_other: bool = False,
) -> None:
    """Mount the namespace at ``mountpoint`` and serve it until unmounted.

    The kernel checks permissions against the files' modes and owners (FUSE's
    ``default_permissions``). Only the user who mounted may use the mount unless
    ``allow_other`` (FUSE's ``allow_other``): then every user may, as on a local filesystem.
    A mount by a user other than root needs ``user_allow_other`` in ``/etc/fuse.conf`` for it.

    Raises:
        IrdmaError: the namespace cannot be opened.
        RuntimeError: FUSE could not mount (``/dev/fuse`` missing, mountpoint busy).
    """
    async with Client.open(meta_url, transport=transport, client_name=f"irdma-mount {mountpoint}") as client:
        fs = IrdmaFS(client, direct_io=direct_io)
        await fs.start_session(f"mount {mountpoint}")
        options = set(pyfuse3.default_options)
        options.add("default_permissions")  # the kernel checks modes, owners and the sticky bit
        if allow_other:
            options.add("allow_other")
        options.add("fsname=irdma")
        options.add("subtype=irdma")
        if debug:
            options.add("debug")
        fs.after_init = lambda: set_readahead(mountpoint, READAHEAD_KB)
        pyfuse3.init(fs, mountpoint, options)
        unmounted = False
        try:
            async with trio.open_nursery() as nursery:
                fs.nursery = nursery

                async def on_signal() -> None:
                    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for _ in signals:
                            log.info("signal: unmounting %s", mountpoint)
                            pyfuse3.terminate()
                            return

                nursery.start_soon(on_signal)
                nursery.start_soon(fs.run_heartbeats)
                log.info("mounted %s on %s (transport %s)", meta_url, mountpoint, client.transport.name)
                await pyfuse3.main()
                unmounted = True
                nursery.cancel_scope.cancel()
        finally:
            # after terminate() the kernel mount is still there: take it down ourselves
            pyfuse3.close(unmount=not unmounted or _still_mounted(mountpoint))
            await fs.end_session()


#: Kernel read-ahead for the mount, KiB. libfuse offers the kernel 128 KiB and pyfuse3 cannot
#: change that, but the mount's backing device takes a larger value from sysfs once INIT is
#: done: the kernel then asks for larger reads and keeps more in flight (a cold sequential read
#: of 200 MB through the page cache went from 389 to 681 MB/s here).
READAHEAD_KB = 4096


def set_readahead(mountpoint: str, kib: int) -> bool:
    """Set the read-ahead of the mount's backing device (``/sys/class/bdi/MAJ:MIN``).

    Returns False (and logs why) where it cannot be set, for instance without root.
    """
    # from /proc/self/mountinfo, not stat(2): a stat of the mountpoint would be a FUSE request
    # to this very process, which is not serving yet
    dev = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == mountpoint:
                dev = fields[2]
    if dev is None:
        log.info("read-ahead stays at the kernel's default: %s not in /proc/self/mountinfo", mountpoint)
        return False
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kib))
    except OSError as exc:
        log.info("read-ahead stays at the kernel's default: cannot write %s (%s)", path, exc.strerror)
        return False
    return True


def _still_mounted(mountpoint: str) -> bool:
    return os.path.ismount(mountpoint)


def spawn_mount(
    meta_url: str, mountpoint: str, *, transport: str, log_file: str, timeout: float = 30.0, direct_io: bool = False,
    allow_other: bool = False,
) -> int:
    """Start a mount process in the background and wait until the mount is up (options as
    :func:`serve_mount`'s).

    Returns:
        The mount process's pid.

    Raises:
        IrdmaError: the process died or the mount did not appear within ``timeout`` seconds;
            the message carries the end of its log.
    """
    mountpoint = os.path.abspath(mountpoint)
    if not os.path.isdir(mountpoint):
        raise IrdmaError(f"mountpoint {mountpoint} is not a directory", f"mkdir -p {mountpoint}")
    if os.path.ismount(mountpoint):
        raise IrdmaError(f"{mountpoint} is already a mountpoint", f"irdma umount {mountpoint}")
    args = ["-m", "irdma.fs", meta_url, mountpoint, "--transport", transport]
    args += ["--direct-io"] if direct_io else []
    args += ["--allow-other"] if allow_other else []
    pid = spawn_detached(args, log_file)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(mountpoint):
            return pid
        if not pid_alive(pid):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGTERM)
    raise IrdmaError(
        f"mount of {mountpoint} failed; its log {log_file} ends:\n{_tail(log_file)}",
        "check that /dev/fuse exists and fuse3 is installed (apt-get install fuse3)",
    )


def unmount(mountpoint: str, timeout: float = 30.0) -> None:
    """Unmount with ``fusermount3 -u`` and wait until the mountpoint is free.

    Raises:
        IrdmaError: not mounted, or busy (a process still has files open there).
    """
    mountpoint = os.path.abspath(mountpoint)
    if not os.path.ismount(mountpoint):
        raise IrdmaError(f"{mountpoint} is not mounted")
    res = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if res.returncode != 0:
        raise IrdmaError(
            f"cannot unmount {mountpoint}: {res.stderr.strip()}",
            f"close the files open there (`fuser -m {mountpoint}`), or `fusermount3 -uz {mountpoint}`",
        )
    deadline = time.monotonic() + timeout
    while os.path.ismount(mountpoint) and time.monotonic() < deadline:
        time.sleep(0.05)


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"
