"""The mount as a session in the metadata: registration, heartbeats, shard health, the end.

One file's lifetime across mounts: this mount is a *session* in the metadata (heartbeats
every :data:`HEARTBEAT_S`); each file open here is recorded there, so a file unlinked or renamed
over by any mount keeps its chunks until the last handle on any live mount closes (JuiceFS's
"sustained" inodes). A mount whose session was reaped (it missed its heartbeats) registers again
and records its open files anew (:meth:`MountSession.record_open_files`); a file removed
meanwhile (its chunks may be freed) is marked lost, and answers ESTALE to every read, write and
fsync through the handles still open on it, never stale or zeroed bytes.

At start a read-write mount collects the garbage of dead sessions (their sessions, the orphans
they held open) with the collector it was given (``irdma.client.fsck.collect_garbage``, passed in by
the code that assembles the mount); the heartbeat task also keeps the shard map's health current.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sized
from typing import Protocol

import trio

from irdma._errors import IrdmaError, NotFound, Stale
from irdma.client.native import Client

from .control import Control
from .openfile import OpenFiles

log = logging.getLogger("irdma.fs")

#: Seconds between a mount's session heartbeats (and shard health checks).
HEARTBEAT_S = 5.0


class GarbageReport(Protocol):
    """What a garbage collection reports (:class:`irdma.client.fsck.Report`): the dead sessions
    reaped and the orphaned files freed."""

    @property
    def sessions(self) -> Sized: ...

    @property
    def orphans(self) -> Sized: ...


class CollectGarbage(Protocol):
    """A garbage collector run at a read-write mount's start (:func:`irdma.client.fsck.collect_garbage`):
    reap dead sessions and free their orphans, not the leaked chunks (``leaked_chunks=False``)."""

    def __call__(self, client: Client, *, leaked_chunks: bool) -> Awaitable[GarbageReport]: ...


def _fsck_collector() -> CollectGarbage:
    """The collector of a mount given none: the namespace check's own (:mod:`irdma.client.fsck`, which `irdma
    fsck` and `irdma gc` run too),
    imported only then (a mount assembled by :mod:`irdma.fs.mount` may pass it in instead)."""
    from irdma.client.fsck import collect_garbage

    return collect_garbage


class MountSession:
    """This mount's session in the metadata, and the files open here it records.

    Args:
        client: the mount's open :class:`irdma.Client`.
        control: the mount's ``.irdma/`` (it names the session as the holder of sync objects).
        files: the files open on the mount (recorded again after the session was reaped).
        read_only: a read-only mount collects no garbage at start (it changes nothing).
        collect_garbage: the collector run at start (None: :func:`irdma.client.fsck.collect_garbage`).
    """

    def __init__(self, client: Client, control: Control, files: OpenFiles, *, read_only: bool = False,
                 collect_garbage: CollectGarbage | None = None) -> None:
        self.client = client
        self.meta = client.meta
        self.control = control
        self.files = files
        self.read_only = read_only
        self.collect_garbage = collect_garbage
        self.sid = 0  # this mount's session in the metadata
        #: inodes open here not yet recorded as open in the session (after it was registered again)
        self.unrecorded: set[int] = set()

    async def start(self, name: str) -> None:
        """Register this mount as a session, then reap dead sessions and their orphans."""
        self.sid = await self.meta.open_session(name)
        self.control.session = self.sid
        if self.read_only:
            return  # it changes nothing in the namespace (the next read-write mount or `irdma gc` reaps)
        collect = self.collect_garbage if self.collect_garbage is not None else _fsck_collector()
        try:
            report = await collect(self.client, leaked_chunks=False)
            if report.sessions or report.orphans:
                log.info("reaped %d dead sessions and %d orphaned files at start", len(report.sessions),
                         len(report.orphans))
        except IrdmaError as exc:
            log.warning("garbage collection at start failed (run `irdma gc`): %s", exc)

    async def run_heartbeats(self) -> None:
        """Keep the session alive and the shard map's health current, every HEARTBEAT_S."""
        while True:
            await trio.sleep(HEARTBEAT_S)
            try:
                await self.meta.heartbeat(self.sid)
            except NotFound:
                log.error("session %d was reaped (missed heartbeats): registering again", self.sid)
                try:
                    self.sid = await self.meta.open_session(f"{self.client.pool.name} (again)")
                    self.control.session = self.sid
                    self.unrecorded.update(self.files.files)
                except IrdmaError as exc:
                    log.warning("registering the session again failed (retried in %g s): %s", HEARTBEAT_S, exc)
            except IrdmaError as exc:
                log.warning("heartbeat failed: %s", exc)
            await self.record_open_files()
            try:
                await self.client.shard_stats()  # marks shards up/down in the shard map
                await self.client.resync_all()  # shards back after being down catch up
            except IrdmaError as exc:
                log.warning("shard health check failed: %s", exc)

    async def record_open_files(self) -> None:
        """Record, in the session registered again, every file open here. A file removed while
        the session was gone (reaped: its open records dropped, so its chunks may be freed
        already) is marked lost: its handles' reads, writes, flushes and fsyncs fail with
        ESTALE from then on, never serve freed chunks. Any other failure is retried at the
        next heartbeat."""
        files = self.files
        for ino in list(self.unrecorded):
            st = files.files.get(ino)
            if st is None:
                self.unrecorded.discard(ino)
                continue
            try:
                async with files.ino_lock(ino):  # no open or last close of it meanwhile
                    if files.files.get(ino) is not st:  # closed meanwhile (a new open recorded itself)
                        self.unrecorded.discard(ino)
                        continue
                    try:
                        await self.meta.open_inode(self.sid, ino)
                    except (Stale, NotFound) as exc:
                        log.error("file %d, open here, was removed while this mount's session was reaped (%s):"
                                  " its open handles fail with ESTALE; close and reopen it by name", ino, exc)
                        st.lost = Stale(f"inode {ino} was removed while the mount's session was reaped: reopen it")
                    except IrdmaError as exc:
                        log.warning("cannot record file %d as open in session %d (retried in %g s): %s", ino,
                                    self.sid, HEARTBEAT_S, exc)
                        continue
                    self.unrecorded.discard(ino)
            finally:
                files.ino_unlock_done(ino)

    async def end(self) -> None:
        """Sync the shards this mount wrote since its last ``fsync`` (as ``umount`` of a local
        filesystem writes its pages back), close the files released but not yet closed in the
        session (freeing those with no name left), then the session (shielded, at most 10 s):
        the mount's open records go with it."""
        if self.sid:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                try:
                    await self.client.flush()
                except IrdmaError as exc:  # the shards sync what they applied within SYNC_INTERVAL_S anyway
                    log.warning("syncing the shards as the mount ends failed (each syncs its updates within"
                                " 30 s by itself): %s", exc)
                await self.files.close_pending()
                await self.meta.close_session(self.sid)
