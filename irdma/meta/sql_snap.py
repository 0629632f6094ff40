"""The SQL engine's snapshots (issue 23; a mixin of :class:`~irdma.meta.sql.SqlMeta`, which
supplies ``_db``, ``_tx`` and ``_get``).

A snapshot of a directory ``D`` (or of a file in ``D``) named ``N`` is a read-only copy of its
tree at ``D/.snapshots/N``, as CephFS's ``.snap`` directories (``mkdir .snap/NAME``) and ZFS's
``.zfs/snapshot``: every inode of the tree is copied (a new inode number, the same attributes,
xattrs and symlink targets, ``snap`` set to the snapshot's id), so the cost of a snapshot grows
with the number of files and chunks, never with their bytes. A copied file's chunks are shared
with the live file on the shards (:meth:`irdma.server.shard.Shard.clone`, copy-on-write), and its
chunk map records the replicas that cloned them. ``D/.snapshots`` is a real directory inode
(``snap`` = :data:`~irdma.meta.base.SNAPSHOTS_DIR_MARK`), hidden from ``readdir`` and never
counted in ``D``'s link count; while it holds snapshots ``rmdir D`` fails (ENOTEMPTY), as
CephFS's does. It goes once its last snapshot is deleted.

A snapshot is made in two steps around the shards' cut (:mod:`irdma.client.snapshots`):
:meth:`SqlSnap.snapshot_begin` copies the tree (state ``creating``), then
:meth:`SqlSnap.snapshot_commit` records the clones' chunk maps (state ``ready``);
:meth:`SqlSnap.snapshot_abort` takes a snapshot that did not finish away again.
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from irdma._errors import Exists, InvalidArgument, NotFound, ReadOnly

from .base import SNAPSHOTS_DIR, SNAPSHOTS_DIR_MARK, Inode, Snapshot
from .sql_rows import COLS, Cursor, check_name, inode_row, now

_SNAP_COLS = "id, dir, name, root, src, created_ns, state"
#: The inode columns a snapshot copies (all but the number and ``snap``).
_COPIED = "mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size, stripe, update_op, rdev, target, replicas"


def _snap_row(row: Sequence[Any]) -> Snapshot:
    return Snapshot(int(row[0]), int(row[1]), bytes(row[2]), int(row[3]), int(row[4]), int(row[5]), str(row[6]))


class SqlSnap:
    """Snapshots of the namespace (see the module doc)."""

    if TYPE_CHECKING:
        @property
        def _db(self) -> Cursor: ...

        def _tx(self, read_only: bool = False) -> Any: ...

        def _get(self, c: Cursor, ino: int) -> Inode: ...

    def _writable(self, c: Cursor, *inos: int) -> None:
        """Raise ReadOnly when any of ``inos`` belongs to a snapshot (or is a ``.snapshots``)."""
        for ino in inos:
            row = c.execute("SELECT snap FROM inodes WHERE ino=?", (ino,)).fetchone()
            if row is not None and int(row[0]):
                raise ReadOnly(f"inode {ino} is in a snapshot, which is read-only",
                               "write to the live file instead")

    def _emptied(self, c: Cursor, ino: int) -> bool:
        """Whether directory ``ino`` is empty to rmdir: no entry but a ``.snapshots`` holding no
        snapshot, which goes now (one holding snapshots keeps the directory: ENOTEMPTY)."""
        rows = c.execute("SELECT d.ino, i.snap FROM dentries d JOIN inodes i ON i.ino = d.ino WHERE d.parent=? LIMIT 2",
                         (ino,)).fetchall()
        if not rows:
            return True
        if len(rows) > 1 or int(rows[0][1]) != SNAPSHOTS_DIR_MARK:
            return False
        holder = int(rows[0][0])
        if c.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (holder,)).fetchone():
            return False
        c.execute("DELETE FROM dentries WHERE ino=?", (holder,))
        c.execute("DELETE FROM inodes WHERE ino=?", (holder,))
        return True

    def _snapshots_dir(self, c: Cursor, d: Inode, create: bool) -> int | None:
        """The inode number of ``d``'s ``.snapshots`` (made when ``create``), or None."""
        row = c.execute("SELECT d.ino FROM dentries d JOIN inodes i ON i.ino = d.ino"
                        " WHERE d.parent=? AND d.name=? AND i.snap=?", (d.ino, SNAPSHOTS_DIR, SNAPSHOTS_DIR_MARK)).fetchone()
        if row is not None:
            return int(row[0])
        if not create:
            return None
        if c.execute("SELECT 1 FROM dentries WHERE parent=? AND name=?", (d.ino, SNAPSHOTS_DIR)).fetchone():
            raise Exists(f"directory {d.ino} holds a file named {SNAPSHOTS_DIR.decode()}, the name of its snapshots",
                         "rename it to take snapshots of the directory")
        t = now()
        ino = c.execute("INSERT INTO inodes(mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns, snap)"
                        " VALUES (?,?,?,2,?,?,?,?) RETURNING ino",
                        (stat.S_IFDIR | (d.mode & 0o7777), d.uid, d.gid, t, t, t, SNAPSHOTS_DIR_MARK)).fetchone()[0]
        c.execute("INSERT INTO dentries VALUES (?,?,?)", (d.ino, SNAPSHOTS_DIR, ino))
        return int(ino)

    def snapshots_dir(self, ino: int) -> Inode:
        """Directory ``ino``'s ``.snapshots`` (made if missing: it is always there to a lookup,
        as CephFS's ``.snap``; hidden from readdir, and gone with the directory while empty).

        Raises:
            NotFound: ``ino`` is not a live directory (a file, or in a snapshot).
        """
        with self._tx() as c:
            d = self._get(c, ino)
            if not d.is_dir or d.snap:
                raise NotFound(f"inode {ino} is not a live directory: it has no {SNAPSHOTS_DIR.decode()}")
            holder = self._snapshots_dir(c, d, create=True)
            assert holder is not None
            return self._get(c, holder)

    def _copy_inode(self, c: Cursor, ino: int, snap_id: int) -> int:
        new = c.execute(f"INSERT INTO inodes({_COPIED}, snap) SELECT {_COPIED}, ? FROM inodes WHERE ino=? RETURNING ino",
                        (snap_id, ino)).fetchone()[0]
        c.execute("INSERT INTO xattrs SELECT ?, name, value FROM xattrs WHERE ino=?", (new, ino))
        return int(new)

    def snapshot_begin(self, ino: int, name: bytes) -> tuple[Snapshot, list[tuple[Inode, int]]]:
        """Copy the tree of ``ino`` (a directory, or a file: then into a directory of its own)
        as snapshot ``name`` of the directory that holds it (``ino`` itself for a directory),
        in state ``creating``.

        Returns:
            The snapshot and, for every regular file of the tree, ``(live inode, copy's
            inode number)``: the files whose chunks the shards clone.

        Raises:
            InvalidArgument: a bad name, or ``ino`` is neither a file nor a directory.
            Exists: that snapshot exists. ReadOnly: ``ino`` is in a snapshot. NotFound.
        """
        check_name(name)
        if name in (b".", b".."):
            raise InvalidArgument(f"{name.decode()!r} cannot name a snapshot")
        with self._tx() as c:
            src = self._get(c, ino)
            if src.snap:
                raise ReadOnly(f"inode {ino} is in a snapshot: snapshots of snapshots are not kept")
            if not (src.is_dir or stat.S_ISREG(src.mode)):
                raise InvalidArgument("snapshots are of directories and regular files")
            dir_ino = ino if src.is_dir else self._parent(c, ino)
            d = self._get(c, dir_ino)
            if c.execute("SELECT 1 FROM snapshots WHERE dir=? AND name=?", (dir_ino, name)).fetchone():
                raise Exists(f"a snapshot named {name.decode(errors='replace')!r} exists",
                             "choose another name, or delete that one first")
            holder = self._snapshots_dir(c, d, create=True)
            t = now()
            sid = int(c.execute("INSERT INTO snapshots(dir, name, root, src, created_ns, state)"
                                " VALUES (?,?,0,?,?,'creating') RETURNING id", (dir_ino, name, ino, t)).fetchone()[0])
            files: list[tuple[Inode, int]] = []
            root = self._copy_inode(c, dir_ino, sid)
            c.execute("UPDATE inodes SET nlink=2 WHERE ino=?", (root,))
            c.execute("INSERT INTO dentries VALUES (?,?,?)", (holder, name, root))
            c.execute("UPDATE inodes SET nlink=nlink+1 WHERE ino=?", (holder,))
            if not src.is_dir:
                copy = self._copy_inode(c, ino, sid)
                c.execute("UPDATE inodes SET nlink=1 WHERE ino=?", (copy,))
                c.execute("INSERT INTO dentries VALUES (?,?,?)", (root, self._name_in(c, dir_ino, ino), copy))
                files.append((src, copy))
            else:
                copies = {dir_ino: root}  # hard links: one copy per inode
                todo = [dir_ino]
                while todo:
                    parent = todo.pop()
                    rows = c.execute(f"SELECT d.name, {', '.join('i.' + x.strip() for x in COLS.split(','))}"
                                     " FROM dentries d JOIN inodes i ON i.ino = d.ino WHERE d.parent=? ORDER BY d.name",
                                     (parent,)).fetchall()
                    for r in rows:
                        child = inode_row(r[1:])
                        if child.snap:  # a .snapshots: snapshots are not copied into snapshots
                            continue
                        new = copies.get(child.ino)
                        if new is None:
                            new = copies[child.ino] = self._copy_inode(c, child.ino, sid)
                            if child.is_dir:
                                todo.append(child.ino)
                            elif stat.S_ISREG(child.mode):
                                files.append((child, new))
                        c.execute("INSERT INTO dentries VALUES (?,?,?)", (copies[parent], bytes(r[0]), new))
                for old, new in copies.items():  # link counts as the copy has them
                    if old != dir_ino:
                        n = c.execute("SELECT COUNT(*) FROM dentries WHERE ino=?", (new,)).fetchone()[0]
                        sub = c.execute("SELECT COUNT(*) FROM dentries d JOIN inodes i ON i.ino = d.ino"
                                        " WHERE d.parent=? AND i.mode >= ? AND i.mode < ?",
                                        (new, stat.S_IFDIR, stat.S_IFDIR + 0o10000)).fetchone()[0]
                        if stat.S_ISDIR(self._get(c, new).mode):
                            c.execute("UPDATE inodes SET nlink=? WHERE ino=?", (2 + int(sub), new))
                        else:
                            c.execute("UPDATE inodes SET nlink=? WHERE ino=?", (int(n), new))
                sub = c.execute("SELECT COUNT(*) FROM dentries d JOIN inodes i ON i.ino = d.ino"
                                " WHERE d.parent=? AND i.mode >= ? AND i.mode < ?",
                                (root, stat.S_IFDIR, stat.S_IFDIR + 0o10000)).fetchone()[0]
                c.execute("UPDATE inodes SET nlink=? WHERE ino=?", (2 + int(sub), root))
            c.execute("UPDATE snapshots SET root=? WHERE id=?", (root, sid))
            return Snapshot(sid, dir_ino, name, root, ino, t, "creating"), files

    def _parent(self, c: Cursor, ino: int) -> int:
        row = c.execute("SELECT parent FROM dentries WHERE ino=? LIMIT 1", (ino,)).fetchone()
        if row is None:
            raise NotFound(f"inode {ino} has no name left")
        return int(row[0])

    def _name_in(self, c: Cursor, parent: int, ino: int) -> bytes:
        row = c.execute("SELECT name FROM dentries WHERE parent=? AND ino=? LIMIT 1", (parent, ino)).fetchone()
        if row is None:
            raise NotFound(f"inode {ino} has no name in directory {parent}")
        return bytes(row[0])

    def snapshot_commit(self, snap_id: int, pairs: Sequence[tuple[int, int]], shards: Sequence[int]) -> Snapshot:
        """Record the clones' chunk maps (each ``(live file, copy)`` gets the live file's rows
        for ``shards``, the shards that cloned) and mark the snapshot ``ready``.

        Raises:
            NotFound: no such snapshot being made (it was aborted).
        """
        with self._tx() as c:
            row = c.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE id=? AND state='creating'", (snap_id,)).fetchone()
            if row is None:
                raise NotFound(f"no snapshot {snap_id} being made")
            marks = ",".join("?" * len(shards)) or "NULL"
            for src, dst in pairs:
                c.execute(f"INSERT INTO chunks SELECT ?, idx, shard, incarnation FROM chunks WHERE ino=? AND shard IN ({marks})",
                          (dst, src, *shards))
            c.execute("UPDATE snapshots SET state='ready' WHERE id=?", (snap_id,))
            snap = _snap_row(row)
            snap.state = "ready"
            return snap

    def snapshots(self, dir_ino: int) -> list[Snapshot]:
        """The snapshots of directory ``dir_ino`` (those being made too), oldest first."""
        return [_snap_row(r) for r in self._db.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots WHERE dir=? ORDER BY created_ns, id", (dir_ino,))]

    def snapshot_by_root(self, root: int) -> Snapshot | None:
        """The snapshot whose tree starts at inode ``root`` (``D/.snapshots/NAME``), or None."""
        row = self._db.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE root=?", (root,)).fetchone()
        return None if row is None else _snap_row(row)

    def snapshot_files(self, snap_id: int) -> list[Inode]:
        """Every regular file of a snapshot's tree."""
        return [inode_row(r) for r in self._db.execute(
            f"SELECT {COLS} FROM inodes WHERE snap=? AND mode >= ? AND mode < ?",
            (snap_id, stat.S_IFREG, stat.S_IFREG + 0o10000))]

    def snapshot_drop(self, snap_id: int) -> list[Inode]:
        """Take a snapshot's tree out of the namespace (its metadata: inodes, names, xattrs,
        chunk maps); ``D/.snapshots`` goes with its last snapshot.

        Returns:
            Its regular files as they were: the caller frees their chunks on the shards
            (what it misses, ``irdma gc`` frees: no inode names them any more).

        Raises:
            NotFound: no such snapshot.
        """
        with self._tx() as c:
            row = c.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE id=?", (snap_id,)).fetchone()
            if row is None:
                raise NotFound(f"no snapshot {snap_id}")
            snap = _snap_row(row)
            files = [inode_row(r) for r in c.execute(f"SELECT {COLS} FROM inodes WHERE snap=? AND mode >= ? AND mode < ?",
                                                      (snap_id, stat.S_IFREG, stat.S_IFREG + 0o10000))]
            c.execute("DELETE FROM chunks WHERE ino IN (SELECT ino FROM inodes WHERE snap=?)", (snap_id,))
            c.execute("DELETE FROM xattrs WHERE ino IN (SELECT ino FROM inodes WHERE snap=?)", (snap_id,))
            c.execute("DELETE FROM dentries WHERE parent IN (SELECT ino FROM inodes WHERE snap=?)", (snap_id,))
            c.execute("DELETE FROM dentries WHERE ino=?", (snap.root,))
            c.execute("DELETE FROM inodes WHERE snap=?", (snap_id,))
            c.execute("DELETE FROM snapshots WHERE id=?", (snap_id,))
            d = self._get(c, snap.dir)
            holder = self._snapshots_dir(c, d, create=False)
            if holder is not None:
                if c.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (holder,)).fetchone():
                    c.execute("UPDATE inodes SET nlink=nlink-1 WHERE ino=?", (holder,))
                else:
                    c.execute("DELETE FROM dentries WHERE ino=?", (holder,))
                    c.execute("DELETE FROM inodes WHERE ino=?", (holder,))
            return files
