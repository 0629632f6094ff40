"""Running a mount: the FUSE main loop with the client beside it, and its start/stop.

``irdma mount`` starts this module in a detached child process (``python -m irdma.fs``),
waits until the mountpoint is mounted, and returns; ``irdma mount --foreground`` runs it
in-process. The loop ends when the filesystem is unmounted (``irdma umount``) or on SIGTERM
or SIGINT, which unmount it.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import math
import os
import posixpath
import re
import signal
import stat
import subprocess
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import pyfuse3
import trio

from irdma._errors import IrdmaError, NotADirectory, NotFound
from irdma._proc import forget_mount_record, last_log_line, pid_alive, spawn_detached, write_mount_record
from irdma.client.cache import ChunkCache, make_cache
from irdma.client.native import Client
from irdma.meta import ROOT_INO, meta_path, meta_scheme, redact
from irdma.meta.base import UNLINK_GRACE_S, MetaStore
from irdma.metrics import Exporter, forget_mount, parse_metrics_address, record_mount
from irdma.metrics import serve as serve_metrics
from irdma.metrics import set_transport as set_metrics_transport
from irdma.xattrs import DEFAULT_SYNC_TIMEOUT

from .operations import IrdmaFS
from .options import MountOptions, process_argv

log = logging.getLogger("irdma.fs")


#: The mount process's defaults (:class:`irdma.fs.options.MountOptions`): serve_mount's too.
_DEFAULTS = MountOptions()


async def serve_mount(
    meta_url: str, mountpoint: str, *, transport: str = _DEFAULTS.transport, debug: bool = _DEFAULTS.debug,
    direct_io: bool = _DEFAULTS.direct_io, timeout: float = _DEFAULTS.timeout,
    allow_other: bool = _DEFAULTS.allow_other, metrics: str | None = _DEFAULTS.metrics,
    sync_timeout: float = _DEFAULTS.sync_timeout, read_only: bool = _DEFAULTS.read_only,
    subdir: str | None = _DEFAULTS.subdir, attr_cache: float = _DEFAULTS.attr_cache,
    entry_cache: float = _DEFAULTS.entry_cache, cache: ChunkCache | None = None,
) -> None:
    """Mount the namespace at ``mountpoint`` and serve it until unmounted (the options and
    their defaults: :class:`irdma.fs.options.MountOptions`).

    ``cache``: the local read cache of hot read-mostly files (``--cache-dir``, ``--cache-size``,
    ``--cache-memory``; :mod:`irdma.client.cache`), or None.

    ``read_only``: every request that would change something fails with EROFS, and the kernel
    mounts it ``ro``. ``subdir``: a directory of the namespace (``/jobs/x``) served as the
    mount's root; nothing above it can be reached. ``attr_cache``, ``entry_cache``: seconds the
    kernel caches attributes and names (:func:`check_cache_seconds`). These are ``juicefs
    mount``'s ``--read-only``, ``--subdir``, ``--attr-cache`` and ``--entry-cache``.
    ``/proc/mounts`` shows the mount as ``irdma:URL`` (:func:`mount_source`; an SQLite path made
    absolute) of type ``fuse.irdma``; its root answers the xattr ``user.irdma.mount`` with that
    source and the directory it shows (:meth:`irdma.fs.control.Control.mount_xattr`, any user
    who may read the root), and while it runs the mount also records them for its user
    (:func:`irdma._proc.write_mount_record`, the fallback), so that ``irdma info`` and
    ``irdma snapshot`` map a path under it to that namespace and directory.

    ``metrics``: ``HOST:PORT`` to serve Prometheus metrics on (:mod:`irdma.metrics`: FUSE
    requests, the client's requests to shards; port 0 picks one). The bound address is recorded
    in :func:`irdma.metrics.mount_state_file` while the mount runs, where ``irdma stats MNT``
    finds it.

    ``timeout``: seconds each request to a shard, and each wait for the metadata database's
    write lock, may take before the request fails (EIO, EBUSY).

    ``sync_timeout``: seconds a barrier or lock wait of ``.irdma/`` may take before it fails
    (ETIMEDOUT; :mod:`irdma.fs.control`).

    The kernel checks permissions against the files' modes and owners (FUSE's
    ``default_permissions``). Only the user who mounted may use the mount unless
    ``allow_other`` (FUSE's ``allow_other``): then every user may, as on a local filesystem.
    A mount by a user other than root needs ``user_allow_other`` in ``/etc/fuse.conf`` for it.

    Raises:
        IrdmaError: the namespace cannot be opened, or FUSE could not mount (``/dev/fuse``
            missing, mountpoint busy), or the metrics address cannot be served (bad address,
            port in use), or ``subdir`` is not a directory of the namespace.
    """
    exporter: Exporter | None = None
    if metrics:
        exporter = await trio.to_thread.run_sync(serve_metrics, metrics)
    try:
        view = _View(read_only, subdir, check_cache_seconds("attr cache", attr_cache),
                     check_cache_seconds("entry cache", entry_cache))
        await _serve_mount(meta_url, mountpoint, transport=transport, debug=debug, direct_io=direct_io,
                           timeout=timeout, allow_other=allow_other, exporter=exporter, sync_timeout=sync_timeout,
                           view=view, cache=cache)
    finally:
        if exporter is not None:
            forget_mount(mountpoint)
            exporter.close()


async def _serve_mount(
    meta_url: str, mountpoint: str, *, transport: str, debug: bool, direct_io: bool, timeout: float,
    allow_other: bool, exporter: Exporter | None, sync_timeout: float = DEFAULT_SYNC_TIMEOUT, view: _View,
    cache: ChunkCache | None = None,
) -> None:
    async with Client.open(meta_url, transport=transport, client_name=f"irdma-mount {mountpoint}",
                           timeout=timeout, cache=cache) as client:
        set_metrics_transport(client.transport.name)  # irdma_build_info's label
        root = ROOT_INO if view.subdir is None else await trio.to_thread.run_sync(resolve_subdir, client.meta.store,
                                                                                   view.subdir)
        if 2 * view.entry_cache > UNLINK_GRACE_S:  # a name cached here stays openable (irdma.meta.base)
            grace = await client.meta.raise_unlink_grace(2 * view.entry_cache)
            log.info("entry cache %g s: unlinked files stay openable for %g s", view.entry_cache, grace)
        fs = IrdmaFS(client, direct_io=direct_io, read_only=view.read_only, root=root, attr_cache=view.attr_cache,
                     entry_cache=view.entry_cache)
        fs.control.sync_timeout = sync_timeout
        await fs.start_session(f"mount {mountpoint}")
        # No max_write: libfuse3 (3.14) already asks the kernel for its largest requests, 1 MiB
        # (max_pages 256, the kernel's fs.fuse.max_pages_limit), big writes are always on in
        # FUSE 3, and its session refuses max_write, max_pages and big_writes as options; small
        # writes are gathered by the mount instead (irdma.fs.cache).
        options = set(pyfuse3.default_options)
        options.add("default_permissions")  # the kernel checks modes, owners and the sticky bit
        if allow_other:
            options.add("allow_other")
        if view.read_only:
            options.add("ro")
        source = mount_source(_absolute(meta_url))
        options.add("fsname=" + source.replace("\\", "\\\\").replace(",", "\\,"))
        options.add("subtype=irdma")
        if debug:
            options.add("debug")
        fs.after_init = lambda: set_readahead(mountpoint, READAHEAD_KB)
        fs.control.shows = (source, posixpath.normpath("/" + (view.subdir or "/").strip("/")))  # user.irdma.mount
        # the signal receiver is open before the kernel mount exists: SIGTERM at any moment after it
        # (`irdma umount`, a test that saw the mount) unmounts cleanly instead of killing the process
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            try:  # before the mount is up: a command that finds it in the mount table finds the record too
                await trio.to_thread.run_sync(write_mount_record, mountpoint, source, view.subdir or "/")
            except OSError as exc:  # a fallback: commands ask the mount first (user.irdma.mount of its root)
                log.info("cannot record what the mount shows (%s: %s): irdma commands ask the mount itself",
                         exc.filename, exc.strerror)
            try:
                pyfuse3.init(fs, mountpoint, options)
            except RuntimeError as exc:
                forget_mount_record(mountpoint)
                raise IrdmaError(f"FUSE could not mount {mountpoint}: {exc}",
                                 "check that /dev/fuse exists and fuse3 is installed (apt-get install fuse3)") from None
            unmounted = False
            try:
                async with trio.open_nursery() as nursery:
                    fs.nursery = nursery

                    async def on_signal() -> None:
                        async for _ in signals:  # one that came before main() ends it as soon as it runs
                            log.info("signal: unmounting %s", mountpoint)
                            pyfuse3.terminate()
                            return

                    nursery.start_soon(on_signal)
                    nursery.start_soon(fs.run_heartbeats)
                    nursery.start_soon(fs.refresh_pulled_pages)  # read-only parameter files held open
                    nursery.start_soon(fs.expire_gathered_writes)  # a slow writer's bytes go out anyway
                    nursery.start_soon(fs.run_closes)  # released files leave the session in batches
                    log.info("mounted %s on %s (transport %s)", redact(meta_url), mountpoint, client.transport.name)
                    if exporter is not None:
                        try:
                            where = record_mount(mountpoint, exporter.address, redact(meta_url))
                            log.info("metrics on %s (recorded in %s for `irdma stats %s`)", exporter.url, where,
                                     mountpoint)
                        except OSError as exc:
                            log.warning("metrics on %s, but `irdma stats %s` cannot find them: cannot write %s: %s"
                                        " (set $IRDMA_RUN_DIR to a writable directory)", exporter.url, mountpoint,
                                        exc.filename, exc.strerror)
                    await pyfuse3.main(min_tasks=FUSE_IDLE_TASKS, max_tasks=FUSE_MAX_TASKS)
                    unmounted = True
                    nursery.cancel_scope.cancel()
            finally:
                # after terminate() the kernel mount is still there: take it down ourselves
                pyfuse3.close(unmount=not unmounted or _still_mounted(mountpoint))
                forget_mount_record(mountpoint)
                await fs.end_session()


@dataclasses.dataclass(frozen=True)
class _View:
    """What a mount shows of the namespace (``--read-only``, ``--subdir``, the kernel caches)."""

    read_only: bool
    subdir: str | None
    attr_cache: float
    entry_cache: float


#: Longest ``--attr-cache`` / ``--entry-cache``, seconds: an entry cache of E keeps unlinked
#: files (their chunks) for 2E (see :data:`irdma.meta.base.UNLINK_GRACE_S`).
MAX_CACHE_S = 3600.0


def check_cache_seconds(what: str, seconds: float) -> float:
    """``seconds`` if it is a valid kernel cache time (0 to :data:`MAX_CACHE_S`, finite).

    Raises:
        IrdmaError: it is negative, NaN, infinite or longer than :data:`MAX_CACHE_S`.
    """
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_CACHE_S):
        raise IrdmaError(f"{what} of {seconds!r} s is out of range",
                         f"give 0 to {MAX_CACHE_S:g} seconds; 0 turns caching off, the default is 1")
    return float(seconds)


def resolve_subdir(meta: MetaStore, subdir: str) -> int:
    """The inode of directory ``subdir`` of the namespace (``/jobs/x``; ``/`` is the root).

    Raises:
        IrdmaError: no such path, or it is not a directory.
    """
    try:
        inode = meta.resolve(subdir)
    except NotFound:
        raise IrdmaError(f"--subdir {subdir}: no such directory in {redact(meta.url)}",
                         "create it first with mkdir through a mount of the whole namespace, or give an"
                         " existing directory") from None
    except NotADirectory:
        inode = None
    if inode is None or not inode.is_dir:
        raise IrdmaError(f"--subdir {subdir}: not a directory in {redact(meta.url)}",
                         "give a directory, a path such as /jobs/x from the namespace's root")
    return inode.ino


def _absolute(meta_url: str) -> str:
    """``meta_url`` with an SQLite path made absolute (``sqlite:///abs/meta.db``): the mount table
    names the namespace for commands run from any directory."""
    return f"sqlite://{meta_path(meta_url)}" if meta_scheme(meta_url) == "sqlite" else meta_url


def mount_source(meta_url: str) -> str:
    """What ``/proc/mounts`` and ``df`` show as the mount's source: ``irdma:`` and the metadata
    URL without secrets (a PostgreSQL URL's password and ``password=`` parameters go:
    ``postgresql://u:secret@h/db`` shows as ``irdma:postgresql://u@h/db``); an SQLite path as
    given. No I/O."""
    if meta_scheme(meta_url) == "sqlite":
        return f"irdma:{meta_url}"
    try:
        parts = urlsplit(meta_url)
        if parts.password is not None:
            parts = parts._replace(netloc=f"{parts.username or ''}@{parts.netloc.rsplit('@', 1)[1]}")
        query = "&".join(q for q in parts.query.split("&") if not q.split("=", 1)[0].endswith("password"))
        return "irdma:" + urlunsplit(parts._replace(query=query))
    except ValueError:
        return "irdma:" + meta_url.split("://", 1)[0] + "://"


#: pyfuse3 serves each request in flight with one trio task; a task that answered its request
#: goes back to reading ``/dev/fuse`` unless more than FUSE_IDLE_TASKS already wait there, and a
#: new task starts whenever none waits (up to FUSE_MAX_TASKS requests at once). pyfuse3's
#: default of 1 idle task makes a burst of parallel reads (16 readers of O_DIRECT 4 KiB) start
#: and end a task per request; a pool the size of a busy reader set keeps them.
FUSE_IDLE_TASKS = 32
FUSE_MAX_TASKS = 256

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
    entry = find_mount(mountpoint)
    if entry is None:
        log.info("read-ahead stays at the kernel's default: %s not in /proc/self/mountinfo", mountpoint)
        return False
    dev = entry.device
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kib))
    except OSError as exc:
        log.info("read-ahead stays at the kernel's default: cannot write %s (%s)", path, exc.strerror)
        return False
    return True


@dataclasses.dataclass(frozen=True)
class MountEntry:
    """One line of ``/proc/self/mountinfo`` (see proc(5))."""

    mountpoint: str
    device: str  # "MAJOR:MINOR" of the mounted filesystem
    fstype: str  # "fuse.irdma" for ours: FUSE's type, a dot, the subtype
    source: str

    @property
    def is_fuse(self) -> bool:
        return self.fstype == "fuse" or self.fstype.startswith("fuse.")

    @property
    def is_irdma(self) -> bool:
        return self.fstype == "fuse.irdma"


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \ooo octal escapes
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def find_mount(mountpoint: str, mountinfo: str = "/proc/self/mountinfo") -> MountEntry | None:
    """What is mounted on ``mountpoint`` (the last, topmost mount there), from the mount table.

    Reads only ``/proc``: it never sends a request to a filesystem, so it neither hangs on a mount
    whose process is stuck nor fails on one whose process died (``os.path.ismount`` does both:
    it calls stat(2), which a dead FUSE mount answers with ENOTCONN).

    Only the parent directory's path is resolved (symbolic links, ``..``): resolving the last
    component would stat it, and in the mount process that stat would wait for itself.

    Returns:
        The entry, or None where nothing is mounted on that path.
    """
    path = os.path.abspath(mountpoint)
    path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    found = None
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            if len(fields) < 5 or "-" not in fields[6:]:
                continue
            if _unescape(fields[4]) != path:
                continue
            sep = fields.index("-", 6)
            fstype = fields[sep + 1] if len(fields) > sep + 1 else ""
            source = _unescape(fields[sep + 2]) if len(fields) > sep + 2 else ""
            found = MountEntry(path, fields[2], fstype, source)
    return found


class MountState(enum.Enum):
    """What a mountpoint is now (:func:`mount_state`)."""

    FREE = "free"  # nothing mounted there
    LIVE = "live"  # a mount whose filesystem answers
    DEAD = "dead"  # a FUSE mount whose process exited: every access fails with ENOTCONN
    HUNG = "hung"  # a FUSE mount whose process does not answer a stat(2) in time


#: Errors a FUSE mount gives once its process is gone (ECONNABORTED after a forced abort).
_DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


def mount_state(mountpoint: str, timeout: float = 5.0) -> tuple[MountState, MountEntry | None]:
    """Whether ``mountpoint`` is free, a live mount, or a dead or hung FUSE mount.

    A FUSE mount is probed with stat(2) in a helper thread, so a stuck mount process costs at
    most ``timeout`` seconds here rather than a hang.

    Returns:
        The state and the mount-table entry (None when free).
    """
    entry = find_mount(mountpoint)
    if entry is None:
        return MountState.FREE, None
    if not entry.is_fuse:
        return MountState.LIVE, entry
    result: list[BaseException | None] = []

    def probe() -> None:
        try:
            os.stat(entry.mountpoint)
            result.append(None)
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=probe, name=f"stat {entry.mountpoint}", daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        return MountState.HUNG, entry
    exc = result[0]
    if isinstance(exc, OSError) and exc.errno in _DEAD_ERRNOS:
        return MountState.DEAD, entry
    return MountState.LIVE, entry


def _still_mounted(mountpoint: str) -> bool:
    # the mount table, not stat(2): this runs in the mount process once it stopped serving, where a
    # stat of its own mountpoint would wait for an answer from itself
    return find_mount(mountpoint) is not None


def check_mountpoint(mountpoint: str, *, nonempty: bool = False) -> str:
    """Check that a mount can be made on ``mountpoint``; returns its absolute, resolved path.

    A directory that holds entries is refused unless ``nonempty``: the mount would hide them
    (they come back when it is unmounted), which looks like data loss to whoever lists it
    (libfuse 2 refused the same way unless given its ``nonempty`` option; fusermount3 no
    longer checks).

    Raises:
        IrdmaError: it does not exist, is not a directory, is not empty (without
            ``nonempty``), or is already a mountpoint (a dead irdma mount included: the
            message says how to clean it).
    """
    mountpoint = os.path.realpath(mountpoint)  # the kernel mounts on the target of a symlink
    state, entry = mount_state(mountpoint)
    kind = "irdma" if entry is not None and entry.is_irdma else "FUSE"
    if state is MountState.DEAD:
        raise IrdmaError(f"{mountpoint} is a dead {kind} mount: its process exited",
                         f"clean it with `irdma umount {mountpoint}`")
    if state is MountState.HUNG:
        raise IrdmaError(f"{mountpoint} is a {kind} mount whose process does not answer",
                         f"unmount it with `irdma umount {mountpoint}`")
    if state is MountState.LIVE:
        raise IrdmaError(f"{mountpoint} is already a mountpoint", f"unmount it first with `irdma umount {mountpoint}`")
    try:
        st = os.stat(mountpoint)
    except FileNotFoundError:
        raise IrdmaError(f"mountpoint {mountpoint} does not exist", f"mkdir -p {mountpoint}") from None
    except OSError as exc:
        raise IrdmaError(f"cannot use {mountpoint} as a mountpoint: {exc.strerror}",
                         "pick another directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise IrdmaError(f"mountpoint {mountpoint} is not a directory", "pick a directory (mkdir one)")
    if not nonempty:
        try:
            names = os.listdir(mountpoint)
        except OSError:
            names = []  # unreadable here: FUSE decides
        if names:
            shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
            raise IrdmaError(f"mountpoint {mountpoint} is not empty ({len(names)} entries: {shown}): a mount would"
                             " hide them until it is unmounted",
                             "mount on an empty directory, or pass --nonempty to hide them anyway")
    return mountpoint


def spawn_mount(
    meta_url: str, mountpoint: str, *, transport: str, log_file: str, timeout: float = 30.0, direct_io: bool = False,
    request_timeout: float = _DEFAULTS.timeout, allow_other: bool = False, metrics: str | None = None,
    sync_timeout: float | None = None,
    nonempty: bool = False, read_only: bool = False, subdir: str | None = None, attr_cache: float | None = None,
    entry_cache: float | None = None,
    cache_dir: str | None = None,
    cache_size: str | None = None,
    cache_memory: str | None = None,
) -> int:
    """Start a mount process in the background and wait until the mount is up (options as
    :func:`serve_mount`'s, :class:`irdma.fs.options.MountOptions`; one given as None or False
    gets the process's default: its command line carries only what was given,
    :func:`irdma.fs.options.process_argv`; ``request_timeout``: the process's ``timeout``;
    ``metrics``: ``HOST:PORT`` of its Prometheus exporter, or None;
    ``nonempty``: mount over a directory that holds entries, see :func:`check_mountpoint`;
    ``cache_dir``, ``cache_size``, ``cache_memory``: the local read cache, see
    :func:`irdma.client.cache.make_cache`, checked here before anything starts).

    Returns:
        The mount process's pid.

    Raises:
        IrdmaError: the mountpoint cannot take a mount (see :func:`check_mountpoint`), or the
            process died or the mount did not answer within ``timeout`` seconds; the message
            carries the last line of its log.
    """
    mountpoint = check_mountpoint(mountpoint, nonempty=nonempty)
    for what, seconds in (("attr cache", attr_cache), ("entry cache", entry_cache)):
        if seconds is not None:
            check_cache_seconds(what, seconds)
    if cache_dir is not None or cache_memory is not None:
        make_cache(cache_dir, cache_size, cache_memory)  # a bad size or directory fails here, before anything starts
    if metrics:
        parse_metrics_address(metrics)  # a malformed address fails here, before anything starts
    # only what was given: the process has the defaults (--transport and --timeout always)
    args = ["-m", "irdma.fs", meta_url, mountpoint, *process_argv({
        "transport": transport, "timeout": request_timeout, "direct_io": direct_io, "allow_other": allow_other,
        "sync_timeout": sync_timeout, "read_only": read_only, "subdir": subdir, "attr_cache": attr_cache,
        "entry_cache": entry_cache, "cache_dir": None if cache_dir is None else os.path.abspath(cache_dir),
        "cache_size": cache_size, "cache_memory": cache_memory, "metrics": metrics or None})]
    pid = spawn_detached(args, log_file)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # in the mount table (not os.path.ismount, which a dead mount confuses), then answering
        if find_mount(mountpoint) is not None:
            state, _ = mount_state(mountpoint, timeout=max(0.1, deadline - time.monotonic()))
            if state is MountState.LIVE:
                return pid
            if state is MountState.DEAD or not pid_alive(pid):
                break
        elif not pid_alive(pid):
            break
        time.sleep(0.05)
    if pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
    last = last_log_line(log_file)
    # an error of irdma's own (a key, the namespace, --subdir) carries its advice; FUSE's does not
    said = " ERROR irdma.fs: " in last and "FUSE could not mount" not in last
    raise IrdmaError(
        f"mount of {mountpoint} failed: {last.split(' ERROR irdma.fs: ', 1)[-1] if said else last}",
        f"its log is {log_file}" + ("" if said else
                                    "; check that /dev/fuse exists and fuse3 is installed (apt-get install fuse3)"),
    )


def unmount(mountpoint: str, timeout: float = 30.0) -> MountState:
    """Unmount with ``fusermount3 -u`` and wait until the mountpoint is free.

    A dead mount (its process exited) is cleaned the same way, lazily (``-uz``) where the
    kernel still holds it busy.

    Returns:
        What the mount was: :attr:`MountState.LIVE`, or :attr:`MountState.DEAD` /
        :attr:`MountState.HUNG` for a mount whose process had exited or did not answer.

    A live irdma mount of this host is unmounted once its process has exited (it finishes its
    local read cache's disk writes after the kernel lets go).

    Raises:
        IrdmaError: not mounted, not a FUSE mount, busy (a process still has files open
            there), still in the mount table, or its process still running, after ``timeout``
            seconds.
    """
    mountpoint = os.path.abspath(mountpoint)
    state, entry = mount_state(mountpoint)
    if entry is None:
        raise IrdmaError(f"{mountpoint} is not mounted", "nothing to do; `grep fuse /proc/mounts` lists the FUSE mounts")
    if not entry.is_fuse:
        raise IrdmaError(f"{mountpoint} is a {entry.fstype} mount, not a FUSE one",
                         f"irdma leaves it alone; `umount {mountpoint}` if you mean it")
    server = _mount_pid(entry) if state is MountState.LIVE else None
    res = subprocess.run(["fusermount3", "-u", entry.mountpoint], capture_output=True, text=True)
    if res.returncode != 0 and state is not MountState.LIVE:
        # a dead mount that a process still uses (its cwd, say): detach it now, freed when unused
        res = subprocess.run(["fusermount3", "-uz", entry.mountpoint], capture_output=True, text=True)
    if res.returncode != 0:
        raise IrdmaError(
            f"cannot unmount {mountpoint}: {res.stderr.strip()}",
            f"close the files open there (`fuser -m {mountpoint}`), or `fusermount3 -uz {mountpoint}`",
        )
    deadline = time.monotonic() + timeout
    while find_mount(mountpoint) is not None:
        if time.monotonic() > deadline:
            raise IrdmaError(f"{mountpoint} is still mounted {timeout:.0f} s after fusermount3 -u",
                             f"`fusermount3 -uz {mountpoint}` detaches it")
        time.sleep(0.05)
    # the kernel lets go first; the process then stops its session and finishes its local read
    # cache's disk writes: the unmount is over when it has exited (a next mount of the same cache
    # directory, or a look at it, sees every entry)
    while server is not None and pid_alive(server):
        if time.monotonic() > deadline:
            raise IrdmaError(f"{mountpoint} is unmounted but its process {server} still runs {timeout:.0f} s later",
                             f"its log says what it waits for; `kill {server}` stops it (its pushes were flushed)")
        time.sleep(0.05)
    return state


def _mount_pid(entry: MountEntry, timeout: float = 5.0) -> int | None:
    """The pid of the live irdma mount ``entry`` when it runs on this host (its root's
    :data:`irdma.fs.control.XATTR_MOUNT`), else None (another FUSE filesystem, an older irdma,
    no answer within ``timeout`` seconds, or a mount served from another host's pid namespace)."""
    import json
    import socket

    from .control import XATTR_MOUNT

    if not entry.is_irdma:
        return None
    got: list[int] = []

    def ask() -> None:
        try:
            shown = json.loads(os.getxattr(entry.mountpoint, XATTR_MOUNT))
        except (OSError, ValueError):
            return
        if isinstance(shown, dict) and shown.get("host") == socket.gethostname() and isinstance(shown.get("pid"), int):
            got.append(shown["pid"])

    thread = threading.Thread(target=ask, name=f"pid of {entry.mountpoint}", daemon=True)
    thread.start()
    thread.join(timeout)
    return got[0] if got and got[0] != os.getpid() else None
