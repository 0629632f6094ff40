"""The SQL engine's shard map, chunk map, replication, moves and sessions (a mixin of
:class:`~irdma.meta.sql.SqlMeta`, which supplies ``_db``, ``_tx``, ``_get`` and ``_host``)."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from irdma._errors import DataLost, Exists, InvalidArgument, NotFound, Stale
from irdma._proc import pid_alive
from irdma.placement import MOVE_ALL, Move

from .base import OUT_OF_SYNC, ROOT_INO, UNLINK_GRACE_S, DamagedFile, Inode, Opened, Session, ShardRecord
from .sql_rows import (
    BUMP_EPOCH,
    COLS,
    ELSEWHERE,
    NOT_CURRENT,
    SHARD_COLS,
    Cursor,
    inode_row,
    live_since,
    now,
    shard_row,
)


class SqlCluster:
    """Everything of a namespace but the names and inodes themselves (see :class:`SqlMeta`)."""

    #: ``socket.gethostname()``: sessions of this host whose process is gone count as dead.
    _host: str

    if TYPE_CHECKING:
        @property
        def _db(self) -> Cursor: ...

        def _tx(self, read_only: bool = False) -> Any: ...

        def _get(self, c: Cursor, ino: int) -> Inode: ...

        def _get_io(self, c: Cursor, ino: int) -> tuple[Inode, bytes] | None: ...

        def _writable(self, c: Cursor, *inos: int) -> None: ...

        def _insert(self, c: Cursor, parent: int, name: bytes, mode: int, uid: int, gid: int, *,
                    chunk_size: int | None = None) -> Inode: ...

        def resolve(self, path: str) -> Inode: ...

        def _shown(self, c: Cursor, inode: Inode) -> Inode: ...

        def lookup(self, parent: int, name: bytes) -> Inode: ...

        def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, *,
                   chunk_size: int | None = None) -> Inode: ...

    # ---------------------------------------------------------------- shard map
    def add_shard(self, address: str) -> ShardRecord:
        with self._tx() as c:
            if c.execute("SELECT 1 FROM shards WHERE address=?", (address,)).fetchone():
                raise Exists(f"a shard at {address} is already registered")
            t = now()
            sid = c.execute("INSERT INTO shards(address, state, added_ns) VALUES (?, 'up', ?) RETURNING id",
                            (address, t)).fetchone()[0]
            c.execute(BUMP_EPOCH)
            return ShardRecord(int(sid), address, "up", t)

    def shards(self) -> list[ShardRecord]:
        return [shard_row(r) for r in self._db.execute(f"SELECT {SHARD_COLS} FROM shards ORDER BY id")]

    def epoch(self) -> int:
        return self._epoch(self._db)
    # ---------------------------------------------------------------- shard health and memory
    def note_incarnation(self, shard_id: int, incarnation: int) -> int:
        with self._tx() as c:
            row = c.execute("SELECT incarnation FROM shards WHERE id=?", (shard_id,)).fetchone()
            if row is None:
                raise NotFound(f"shard {shard_id} is not in the shard map")
            if int(row[0]) != incarnation:
                c.execute("UPDATE shards SET incarnation=? WHERE id=?", (incarnation, shard_id))
                if int(row[0]):  # it lost its memory: out of its chains until resynced
                    c.execute("UPDATE shards SET health='syncing', health_ns=? WHERE id=?", (now(), shard_id))
                    self._bump_epoch(c)
            return int(row[0])

    def set_shard_health(self, shard_id: int, health: str) -> tuple[str, int]:
        with self._tx() as c:
            row = c.execute("SELECT health FROM shards WHERE id=?", (shard_id,)).fetchone()
            if row is None:
                raise NotFound(f"shard {shard_id} is not in the shard map")
            old = row[0]
            if health == "up" and old in NOT_CURRENT:
                health = "syncing"  # it may have missed updates: a resync brings it back
            if health != old:
                c.execute("UPDATE shards SET health=?, health_ns=? WHERE id=?", (health, now(), shard_id))
                if health in NOT_CURRENT or old in NOT_CURRENT:  # chains change: a new view
                    self._bump_epoch(c)
            return health, self._epoch(c)

    def mark_synced(self, shard_id: int, epoch: int) -> bool:
        with self._tx() as c:
            if self._epoch(c) != epoch:
                return False  # something changed since the resync began: resync again
            c.execute("UPDATE shards SET health='up', health_ns=? WHERE id=? AND health='syncing'", (now(), shard_id))
            self._bump_epoch(c)
            return True

    @staticmethod
    def _bump_epoch(c: Cursor) -> None:
        c.execute(BUMP_EPOCH)

    @staticmethod
    def _epoch(c: Cursor) -> int:
        return int(c.execute("SELECT value FROM config WHERE key='epoch'").fetchone()[0])

    def shard_view(self) -> tuple[int, list[ShardRecord], list[Move]]:
        with self._tx(read_only=True) as c:
            return (self._epoch(c), [shard_row(r) for r in c.execute(f"SELECT {SHARD_COLS} FROM shards ORDER BY id")],
                    self._moves(c))

    @staticmethod
    def _moves(c: Cursor) -> list[Move]:
        # last_ino: the highest inode number when the move was recorded (NULL: recorded before
        # moves kept it, applies to every file; see irdma.placement)
        return [Move(int(q), int(sh), tuple(int(t) for t in str(ts).split(",") if t), bool(d), int(share),
                     None if last is None else int(last))
                for q, sh, ts, share, d, last in c.execute(
                    "SELECT seq, shard, targets, share, done, last_ino FROM moves ORDER BY seq")]

    # ---------------------------------------------------------------- replication
    @staticmethod
    def _replicas(c: Cursor) -> int:
        row = c.execute("SELECT value FROM config WHERE key='replicas'").fetchone()
        return int(row[0]) if row else 1

    def replicas(self) -> int:
        return self._replicas(self._db)

    def set_replicas(self, replicas: int) -> None:
        if not 1 <= replicas <= 8:
            raise InvalidArgument(f"replicas must be 1 to 8, not {replicas}")
        with self._tx() as c:
            c.execute("INSERT INTO config VALUES ('replicas', ?) ON CONFLICT (key) DO UPDATE SET value=excluded.value", (str(replicas),))

    def note_replica(self, ino: int, idx: int, shard_id: int, incarnation: int, epoch: int | None = None) -> bool:
        with self._tx() as c:
            if epoch is not None and self._epoch(c) != epoch:
                return False
            if not c.execute("SELECT 1 FROM chunks WHERE ino=? AND idx=?", (ino, idx)).fetchone():  # still written
                return False
            c.execute("INSERT INTO chunks VALUES (?,?,?,?)"
                      " ON CONFLICT (ino, idx, shard) DO UPDATE SET incarnation=excluded.incarnation", (ino, idx, shard_id, incarnation))
            return True

    def withdraw_replicas(self, ino: int, replicas: Sequence[tuple[int, int]], epoch: int | None = None) -> bool:
        if not replicas:
            return True
        with self._tx() as c:
            if epoch is not None and self._epoch(c) != epoch:
                return False
            c.executemany(f"INSERT INTO chunks VALUES (?,?,?,{OUT_OF_SYNC})"
                          f" ON CONFLICT (ino, idx, shard) DO UPDATE SET incarnation={OUT_OF_SYNC}",
                          [(ino, idx, sid) for idx, sid in replicas])
            return True

    def replicated_chunks(self, shard_ids: Sequence[int], min_replicas: int = 2) -> list[tuple[Inode, list[int]]]:
        if not shard_ids:
            return []
        like = " OR ".join(["(',' || stripe || ',') LIKE ?"] * len(shard_ids))
        rows = self._db.execute(
            f"SELECT {COLS} FROM inodes WHERE replicas >= ? AND chunk_size IS NOT NULL AND ({like}) ORDER BY ino",
            (min_replicas, *(f"%,{s},%" for s in shard_ids))).fetchall()
        out = []
        for row in rows:
            idx = [int(r[0]) for r in
                   self._db.execute("SELECT DISTINCT idx FROM chunks WHERE ino=? ORDER BY idx", (row[0],))]
            out.append((inode_row(row), idx))
        return out

    def under_replicated(self) -> int:
        row = self._db.execute(
            "SELECT COUNT(*) FROM (SELECT c.ino, c.idx, i.replicas r,"
            f" SUM(CASE WHEN c.incarnation = s.incarnation AND s.health NOT IN {NOT_CURRENT!r} THEN 1 ELSE 0 END) good"
            " FROM chunks c JOIN shards s ON s.id = c.shard JOIN inodes i ON i.ino = c.ino"
            " GROUP BY c.ino, c.idx, i.replicas) AS g WHERE good > 0 AND good < r").fetchone()
        return int(row[0])

    # ---------------------------------------------------------------- live shard operations
    def drain_shard(self, shard_id: int) -> int:
        with self._tx() as c:
            rec = self._shard_row(c, shard_id)
            if rec.state == "draining":
                return self._epoch(c)
            if rec.state != "up":
                raise InvalidArgument(f"shard {shard_id} is {rec.state}: only a shard in service can be drained")
            self._no_move_in_progress(c)
            targets = [int(r[0]) for r in c.execute("SELECT id FROM shards WHERE state='up' AND id<>? ORDER BY id",
                                                    (shard_id,))]
            if not targets:
                raise InvalidArgument(f"shard {shard_id} is the only shard in service: its chunks have nowhere to go",
                                      "add a shard first (`irdma shard add`)")
            c.execute("INSERT INTO moves(shard, targets, share, last_ino)"
                      " VALUES (?,?,?,(SELECT COALESCE(MAX(ino), 0) FROM inodes))",
                      (shard_id, ",".join(map(str, targets)), MOVE_ALL))
            c.execute("UPDATE shards SET state='draining' WHERE id=?", (shard_id,))
            self._bump_epoch(c)
            return self._epoch(c)

    def begin_move(self, shard_id: int, targets: Sequence[int], share: int) -> int:
        with self._tx() as c:
            self._no_move_in_progress(c)
            for sid in (shard_id, *targets):
                if self._shard_row(c, sid).state != "up":
                    raise InvalidArgument(f"shard {sid} is not in service")
            if not targets or shard_id in targets or not 0 < share <= MOVE_ALL:
                raise InvalidArgument(f"bad move of {share}/{MOVE_ALL} of shard {shard_id} to {list(targets)}")
            # it moves the files there are now: later ones keep the plain stripe (spread evenly)
            c.execute("INSERT INTO moves(shard, targets, share, last_ino)"
                      " VALUES (?,?,?,(SELECT COALESCE(MAX(ino), 0) FROM inodes))",
                      (shard_id, ",".join(map(str, targets)), share))
            self._bump_epoch(c)
            return self._epoch(c)

    def cancel_move(self, seq: int) -> None:
        with self._tx() as c:
            self._cancel(c, seq)

    def _cancel(self, c: Cursor, seq: int) -> None:
        row = c.execute("SELECT shard FROM moves WHERE seq=? AND done=0", (seq,)).fetchone()
        if row is None:
            return
        c.execute("DELETE FROM moves WHERE seq=?", (seq,))
        c.execute("UPDATE shards SET state='up' WHERE id=? AND state='draining'", (int(row[0]),))
        self._bump_epoch(c)

    @staticmethod
    def _no_move_in_progress(c: Cursor) -> None:
        row = c.execute("SELECT seq, shard FROM moves WHERE done=0").fetchone()
        if row:
            raise InvalidArgument(f"chunks of shard {row[1]} are moving (move {row[0]}): one move at a time",
                                  f"finish it first (`irdma shard drain {row[1]}` or `irdma rebalance`)")

    def finish_move(self, seq: int, epoch: int, moved: Sequence[tuple[int, int]] = ()) -> bool:
        with self._tx() as c:
            row = c.execute("SELECT shard FROM moves WHERE seq=? AND done=0", (seq,)).fetchone()
            if row is None or self._epoch(c) != epoch:
                return False
            shard_id = int(row[0])
            if self._shard_row(c, shard_id).state == "draining":
                alone = c.execute(f"SELECT ino, idx FROM chunks c WHERE shard=? AND NOT {ELSEWHERE} LIMIT 5",
                                  (shard_id,)).fetchall()
                if alone:
                    raise DataLost(f"shard {shard_id} holds the only recorded copy of chunks {alone}: not drained",
                                   f"run `irdma shard drain {shard_id}` again")
                c.execute("DELETE FROM chunks WHERE shard=?", (shard_id,))
                c.execute("UPDATE shards SET state='drained' WHERE id=?", (shard_id,))
            else:
                c.executemany(f"DELETE FROM chunks AS c WHERE ino=? AND idx=? AND shard=? AND {ELSEWHERE}",
                              [(ino, idx, shard_id) for ino, idx in moved])
            c.execute("UPDATE moves SET done=1 WHERE seq=?", (seq,))
            self._bump_epoch(c)
            return True

    def remove_shard(self, shard_id: int, force: bool = False) -> list[tuple[int, int]]:
        with self._tx() as c:
            rec = self._shard_row(c, shard_id)
            if rec.state == "removed":
                raise InvalidArgument(f"shard {shard_id} was removed already")
            if rec.state != "drained" and not force:
                raise InvalidArgument(f"shard {shard_id} is {rec.state}, not drained: removing it would lose"
                                      " the chunks it holds",
                                      f"drain it first (`irdma shard drain {shard_id}`), or pass --force to"
                                      " declare its chunks lost")
            lost = [(int(i), int(x)) for i, x in c.execute(
                f"SELECT ino, idx FROM chunks c WHERE shard=? AND NOT {ELSEWHERE} ORDER BY ino, idx", (shard_id,))]
            if rec.state != "drained":  # it leaves its chains now: a move of all its chunks, done
                # a move in progress to or from it cannot finish now: cancelled
                for seq, targets in c.execute("SELECT seq, targets FROM moves WHERE done=0").fetchall():
                    if str(shard_id) in str(targets).split(","):
                        self._cancel(c, int(seq))
                c.execute("DELETE FROM moves WHERE shard=? AND done=0", (shard_id,))
                targets = [int(r[0]) for r in c.execute(
                    "SELECT id FROM shards WHERE state='up' AND id<>? ORDER BY id", (shard_id,))]
                c.execute("INSERT INTO moves(shard, targets, share, done, last_ino)"
                          " VALUES (?,?,?,1,(SELECT COALESCE(MAX(ino), 0) FROM inodes))",
                          (shard_id, ",".join(map(str, targets)), MOVE_ALL))
            # replicas held elsewhere stay readable there; a chunk it alone held stays recorded on
            # it with an incarnation no memory has (-1), so it reads as lost, never as zeros
            c.execute(f"DELETE FROM chunks AS c WHERE shard=? AND {ELSEWHERE}", (shard_id,))
            c.execute("UPDATE chunks SET incarnation=-1 WHERE shard=?", (shard_id,))
            c.execute("UPDATE shards SET state='removed', health='down', address=?, incarnation=0 WHERE id=?",
                      (f"removed-{shard_id}:{rec.address}", shard_id))
            self._bump_epoch(c)
            return lost

    @staticmethod
    def _shard_row(c: Cursor, shard_id: int) -> ShardRecord:
        row = c.execute(f"SELECT {SHARD_COLS} FROM shards WHERE id=?", (shard_id,)).fetchone()
        if row is None:
            raise NotFound(f"shard {shard_id} is not in the shard map", "`irdma shard list` shows the shards")
        return shard_row(row)

    # ---------------------------------------------------------------- chunk map
    def chunk_map(self, ino: int) -> dict[int, dict[int, int]]:
        return self._chunk_map(self._db, ino)

    @staticmethod
    def _chunk_map(c: Cursor, ino: int) -> dict[int, dict[int, int]]:
        out: dict[int, dict[int, int]] = {}
        for i, s, n in c.execute("SELECT idx, shard, incarnation FROM chunks WHERE ino=?", (ino,)):
            out.setdefault(int(i), {})[int(s)] = int(n)
        return out

    def damaged(self) -> list[DamagedFile]:
        # lost: no replica of the chunk is on the memory it was written to
        rows = self._db.execute(
            f"SELECT c.ino, c.idx, MIN(CASE WHEN c.incarnation <> {OUT_OF_SYNC} THEN c.shard END) FROM chunks c"
            " JOIN shards s ON s.id = c.shard GROUP BY c.ino, c.idx"
            " HAVING SUM(CASE WHEN c.incarnation = s.incarnation THEN 1 ELSE 0 END) = 0"
            f" AND SUM(CASE WHEN c.incarnation <> {OUT_OF_SYNC} THEN 1 ELSE 0 END) > 0 ORDER BY c.ino, c.idx"
        ).fetchall()
        out: dict[int, DamagedFile] = {}
        for ino, idx, shard in rows:
            d = out.get(ino)
            if d is None:
                d = out[ino] = DamagedFile(int(ino), self.path_of(int(ino)), [], [])
            d.lost_chunks.append(int(idx))
            if shard not in d.shards:
                d.shards.append(int(shard))
        return list(out.values())

    # ---------------------------------------------------------------- sessions and open files
    def open_session(self, name: str) -> int:
        t = now()
        with self._tx() as c:
            return int(c.execute("INSERT INTO sessions(name, host, pid, started_ns, heartbeat_ns) VALUES (?,?,?,?,?)"
                                 " RETURNING sid", (name, self._host, os.getpid(), t, t)).fetchone()[0])

    def heartbeat(self, sid: int) -> None:
        with self._tx() as c:
            if c.execute("UPDATE sessions SET heartbeat_ns=? WHERE sid=?", (now(), sid)).rowcount == 0:
                raise NotFound(f"session {sid} was reaped (it missed its heartbeats)")

    def close_session(self, sid: int) -> None:
        self.reap_session(sid)

    def reap_session(self, sid: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM open_files WHERE sid=?", (sid,))
            c.execute("DELETE FROM sessions WHERE sid=?", (sid,))

    def sessions(self) -> list[Session]:
        return [Session(*r) for r in self._db.execute(
            "SELECT sid, name, host, pid, started_ns, heartbeat_ns FROM sessions ORDER BY sid")]

    def dead_sessions(self) -> list[Session]:
        limit = live_since()
        # a pid of this host whose process started after the session did is another process
        return [s for s in self.sessions()
                if s.heartbeat_ns < limit or (s.host == self._host and not pid_alive(s.pid, s.started_ns))]

    def _live_openers(self, c: Cursor, ino: int, exclude: int = 0) -> int:
        limit = live_since()
        return int(c.execute(
            "SELECT COUNT(*) FROM open_files o JOIN sessions s ON s.sid = o.sid"
            " WHERE o.ino=? AND o.sid<>? AND s.heartbeat_ns>=?", (ino, exclude, limit)).fetchone()[0])

    def _open_in(self, c: Any, sid: int, ino: int) -> tuple[Inode, bytes]:
        """Record session ``sid``'s open of ``ino`` in transaction ``c``: its inode and I/O mode.
        Raises Stale: removed, or without a name past its grace period (and not open here)."""
        got = self._get_io(c, ino)
        if got is None:
            raise Stale(f"inode {ino} was removed")
        inode, io_mode = got
        if (inode.nlink <= 0 and now() - inode.ctime_ns > self._grace_ns(c)
                and not c.execute("SELECT 1 FROM open_files WHERE sid=? AND ino=?", (sid, ino)).fetchone()):
            raise Stale(f"inode {ino} has no name left")
        if sid:
            c.execute("INSERT INTO open_files VALUES (?,?) ON CONFLICT DO NOTHING", (sid, ino))
        return inode, io_mode

    def open_inode(self, sid: int, ino: int) -> tuple[Inode, bytes, dict[int, dict[int, int]]]:
        with self._tx() as c:
            inode, io_mode = self._open_in(c, sid, ino)
            return inode, io_mode, self._chunk_map(c, ino)

    def open_file(self, sid: int, ino: int, own: Sequence[bytes] = (), inherited: Sequence[bytes] = ()) -> Opened:
        with self._tx() as c:
            inode, io_mode = self._open_in(c, sid, ino)
            return Opened(inode, io_mode, self._chunk_map(c, ino), self._open_xattrs(c, ino, own, inherited))

    def create_open(self, sid: int, parent: int, name: bytes, mode: int, uid: int, gid: int,
                    inherited: Sequence[bytes] = ()) -> Opened:
        if not stat.S_ISREG(mode):
            raise InvalidArgument("create_open makes regular files (create, mknod, symlink: the others)")
        with self._tx() as c:
            self._writable(c, parent)
            ino = self._insert(c, parent, name, mode, uid, gid).ino
            got = self._get_io(c, ino)
            assert got is not None
            if sid:
                c.execute("INSERT INTO open_files VALUES (?,?)", (sid, ino))
            xattrs = self._open_xattrs(c, ino, (), inherited)
            return Opened(got[0], got[1], {}, xattrs, self._shown(c, self._get(c, parent)))

    @staticmethod
    def _open_xattrs(c: Cursor, ino: int, own: Sequence[bytes], inherited: Sequence[bytes]) -> dict[bytes, bytes]:
        """``own`` xattrs set on ``ino``, and ``inherited`` ones set on it, else on its parent
        (the root's parent: itself), in one query."""
        names = [*own, *inherited]
        if not names:
            return {}
        marks = ",".join("?" * len(names))
        found: dict[bytes, bytes] = {}
        parent: dict[bytes, bytes] = {}
        for at, name, value in c.execute(
                f"SELECT ino, name, value FROM xattrs WHERE name IN ({marks}) AND (ino=?"
                " OR ino=(SELECT parent FROM dentries WHERE ino=? LIMIT 1))", (*names, ino, ino)):
            (found if int(at) == ino else parent)[bytes(name)] = bytes(value)
        for name in inherited:
            if name not in found and name in parent:
                found[name] = parent[name]
        return {n: v for n, v in found.items() if n in own or n in inherited}

    def close_inodes(self, sid: int, inos: Sequence[int]) -> list[tuple[int, Inode | None, bool]]:
        out: list[tuple[int, Inode | None, bool]] = []
        with self._tx() as c:
            for ino in inos:
                c.execute("DELETE FROM open_files WHERE sid=? AND ino=?", (sid, ino))
                try:
                    inode = self._get(c, ino)
                except NotFound:
                    out.append((ino, None, False))
                    continue
                out.append((ino, inode, self._reclaimable(c, ino) is not None))
            return out

    def resolve_chunks(self, path: str, create_mode: int | None = None, uid: int = 0, gid: int = 0,
                       chunk_size: int | None = None) -> tuple[Inode, dict[int, dict[int, int]]]:
        try:
            inode = self.resolve(path)
        except NotFound:
            if create_mode is None:
                raise
            head, _, name = path.rstrip("/").rpartition("/")
            parent = self.resolve(head or "/").ino
            try:
                return self.create(parent, name.encode(), stat.S_IFREG | create_mode, uid, gid,
                                   chunk_size=chunk_size), {}
            except Exists:  # made meanwhile by another client
                inode = self.lookup(parent, name.encode())
        return inode, self._chunk_map(self._db, inode.ino)

    def close_inode(self, sid: int, ino: int) -> tuple[Inode | None, bool]:
        with self._tx() as c:
            c.execute("DELETE FROM open_files WHERE sid=? AND ino=?", (sid, ino))
            try:
                inode = self._get(c, ino)
            except NotFound:
                return None, False
            return inode, self._reclaimable(c, ino) is not None

    @staticmethod
    def _grace_ns(c: Cursor) -> int:
        row = c.execute("SELECT value FROM config WHERE key='unlink_grace_ns'").fetchone()
        return max(int(UNLINK_GRACE_S * 1e9), int(row[0]) if row else 0)

    def unlink_grace(self) -> float:
        with self._tx(read_only=True) as c:
            return self._grace_ns(c) / 1e9

    def raise_unlink_grace(self, seconds: float) -> float:
        with self._tx() as c:  # one statement: concurrent raises keep the largest
            c.execute("INSERT INTO config VALUES ('unlink_grace_ns', ?) ON CONFLICT (key) DO UPDATE"
                      " SET value=excluded.value WHERE CAST(config.value AS BIGINT) < CAST(excluded.value AS BIGINT)",
                      (str(int(seconds * 1e9)),))
            return self._grace_ns(c) / 1e9

    def reclaimable(self, ino: int, grace: bool = True) -> Inode | None:
        with self._tx(read_only=True) as c:
            return self._reclaimable(c, ino, grace)

    def _reclaimable(self, c: Cursor, ino: int, grace: bool = True) -> Inode | None:
        try:
            inode = self._get(c, ino)
        except NotFound:
            return None
        if inode.nlink > 0 or (grace and now() - inode.ctime_ns <= self._grace_ns(c)) or self._live_openers(c, ino):
            return None
        return inode

    def path_of(self, ino: int) -> str:
        parts: list[str] = []
        cur = ino
        for _ in range(4096):
            if cur == ROOT_INO:
                return "/" + "/".join(reversed(parts))
            row = self._db.execute("SELECT parent, name FROM dentries WHERE ino=? LIMIT 1", (cur,)).fetchone()
            if row is None:
                return ""
            parts.append(bytes(row[1]).decode(errors="replace"))
            cur = int(row[0])
        return ""

    def file_sizes(self) -> dict[int, tuple[int, int, bool]]:
        limit = live_since()
        open_now = {int(r[0]) for r in self._db.execute(
            "SELECT DISTINCT o.ino FROM open_files o JOIN sessions s ON s.sid = o.sid WHERE s.heartbeat_ns>=?",
            (limit,))}
        return {int(ino): (int(size), int(cs), ino in open_now) for ino, size, cs in self._db.execute(
            "SELECT ino, size, chunk_size FROM inodes WHERE chunk_size IS NOT NULL AND stripe <> ''")}
