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
CephFS's does. It goes once its last snapshot is deleted. Its mode, owner and group are
``D``'s at every look (:meth:`SqlSnap._shown`: what ``stat`` shows and the kernel checks for
``mkdir``/``rmdir`` in it), never a copy taken once; ``chmod`` of it is refused (EROFS: change
``D``'s).

A snapshot is its maker's: the user who made it through a mount (``owner``) is recorded in
its row (``snapshots.maker_uid``; NULL when root or the CLI made it) and shown as the owner of
its top directory (``D/.snapshots/N``, :meth:`SqlSnap._shown`), so its maker may delete it in a
sticky ``D`` as in ``/tmp``; ``D``'s owner and root may delete any
(:func:`irdma.client.snapshots.delete_at`). The tree itself keeps its owners as they were (the
top directory ``D``'s), and so does a clone of it. A maker other than ``D``'s owner who could
not reach and read every file of the tree (read permission on the file, search permission on
every directory on its way from ``D``) is refused (``reader``: the snapshot would keep bytes it
may not read), and the
``user.irdma.max_snapshots`` of ``D`` and its ancestors (the smallest) bounds how many ``D``
holds (:data:`~irdma.meta.base.XATTR_MAX_SNAPSHOTS`).

A snapshot is made in two steps around the shards' cut (:mod:`irdma.client.snapshots`):
:meth:`SqlSnap.snapshot_begin` copies the tree (state ``creating``), then
:meth:`SqlSnap.snapshot_commit` records the clones' chunk maps (state ``ready``);
:meth:`SqlSnap.snapshot_abort` takes a snapshot that did not finish away again.
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from irdma._errors import (
    Exists,
    InvalidArgument,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    QuotaExceeded,
    ReadOnly,
)

from .base import (
    ROOT_INO,
    SNAPSHOTS_DIR,
    SNAPSHOTS_DIR_MARK,
    XATTR_MAX_SNAPSHOTS,
    Inode,
    Snapshot,
    parse_max_snapshots,
)
from .sql_rows import COLS, Cursor, check_name, inode_row, now

_SNAP_COLS = "id, dir, name, root, src, created_ns, state, maker_uid"
#: The inode columns a snapshot copies (all but the number and ``snap``).
_COPIED = "mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size, stripe, update_op, rdev, target, replicas"


def _snap_row(row: Sequence[Any]) -> Snapshot:
    return Snapshot(int(row[0]), int(row[1]), bytes(row[2]), int(row[3]), int(row[4]), int(row[5]), str(row[6]),
                    None if row[7] is None else int(row[7]))


class SqlSnap:
    """Snapshots of the namespace (see the module doc)."""

    if TYPE_CHECKING:
        @property
        def _db(self) -> Cursor: ...

        def _tx(self, read_only: bool = False) -> Any: ...

        def _get(self, c: Cursor, ino: int) -> Inode: ...

        def _drop_name(self, c: Cursor, parent: int, name: bytes, inode: Inode) -> None: ...

    def _writable(self, c: Cursor, *inos: int) -> None:
        """Raise ReadOnly when any of ``inos`` belongs to a snapshot (or is a ``.snapshots``)."""
        for ino in inos:
            row = c.execute("SELECT snap FROM inodes WHERE ino=?", (ino,)).fetchone()
            if row is not None and int(row[0]) == SNAPSHOTS_DIR_MARK:
                raise ReadOnly(f"inode {ino} is a directory's {SNAPSHOTS_DIR.decode()}: its mode, owner and group are"
                               " the directory's", "chmod or chown the directory itself; mkdir/rmdir in"
                               f" {SNAPSHOTS_DIR.decode()} take and delete snapshots")
            if row is not None and int(row[0]):
                raise ReadOnly(f"inode {ino} is in a snapshot, which is read-only",
                               "write to the live file instead")

    def _shown(self, c: Cursor, inode: Inode) -> Inode:
        """``inode`` as a lookup, getattr or readdir shows it: a ``.snapshots`` takes its
        directory's mode bits, owner and group now (so ``chmod D`` applies to it at once); a
        snapshot's top directory has its maker as owner, when recorded (the kernel lets the
        maker rmdir it in a sticky ``D``); the rest as stored."""
        if inode.snap and inode.snap != SNAPSHOTS_DIR_MARK:
            if inode.is_dir:
                row = c.execute("SELECT maker_uid FROM snapshots WHERE id=? AND root=?", (inode.snap, inode.ino)).fetchone()
                if row is not None and row[0] is not None:
                    inode.uid = int(row[0])
            return inode
        if inode.snap != SNAPSHOTS_DIR_MARK:
            return inode
        row = c.execute("SELECT i.mode, i.uid, i.gid FROM dentries d JOIN inodes i ON i.ino = d.parent"
                        " WHERE d.ino=? LIMIT 1", (inode.ino,)).fetchone()
        if row is not None:
            inode.mode = stat.S_IFDIR | (int(row[0]) & 0o7777)
            inode.uid, inode.gid = int(row[1]), int(row[2])
        return inode

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

    def snapshots_dir(self, ino: int, create: bool = True) -> Inode:
        """Directory ``ino``'s ``.snapshots``, made if missing when ``create`` (it is always
        there to a lookup, as CephFS's ``.snap``; hidden from readdir, and gone with the
        directory while empty). Without ``create`` (a read-only mount) nothing is written: only
        one that exists is answered. Its mode, owner and group are the directory's.

        Raises:
            NotFound: ``ino`` is not a live directory (a file, or in a snapshot); or, without
                ``create``, it has no ``.snapshots`` yet (it holds no snapshot).
        """
        if not create:
            c = self._db
            d = self._get(c, ino)
            holder = self._snapshots_dir(c, d, create=False) if d.is_dir and not d.snap else None
            if holder is None:
                raise NotFound(f"inode {ino} has no {SNAPSHOTS_DIR.decode()}: it holds no snapshot")
            return self._shown(c, self._get(c, holder))
        with self._tx() as c:
            d = self._get(c, ino)
            if not d.is_dir or d.snap:
                raise NotFound(f"inode {ino} is not a live directory: it has no {SNAPSHOTS_DIR.decode()}")
            holder = self._snapshots_dir(c, d, create=True)
            assert holder is not None
            return self._shown(c, self._get(c, holder))

    def _copy_inode(self, c: Cursor, ino: int, snap_id: int) -> int:
        # placed as the file it copies (its chunks are that file's, shared: Layout.place_id)
        new = c.execute(f"INSERT INTO inodes({_COPIED}, snap, place) SELECT {_COPIED}, ?,"
                        " CASE WHEN place = 0 THEN ino ELSE place END FROM inodes WHERE ino=? RETURNING ino",
                        (snap_id, ino)).fetchone()[0]
        c.execute("INSERT INTO xattrs SELECT ?, name, value FROM xattrs WHERE ino=?", (new, ino))
        return int(new)

    def snapshot_begin(self, ino: int, name: bytes, *, owner: int | None = None,
                       reader: tuple[int, Sequence[int]] | None = None,
                       spare: int = 0) -> tuple[Snapshot, list[tuple[Inode, int]]]:
        """Copy the tree of ``ino`` (a directory, or a file: then into a directory of its own)
        as snapshot ``name`` of the directory that holds it (``ino`` itself for a directory),
        in state ``creating``.

        ``owner``: the snapshot's maker (recorded with it, shown as its top directory's owner:
        who may delete it besides ``D``'s owner and root); None: none recorded (``D``'s owner
        at the cut shows). The tree's inodes keep their owners, the top directory ``D``'s.
        ``reader``: ``(uid, gids)`` of a maker who must be able to reach and read every regular
        file of the tree (read permission on it and search permission on each directory on
        its way from ``D``, by mode bits, owner and group, as POSIX); root and ``D``'s owner
        pass; None: no check (the operator's tools).
        ``spare``: snapshots of ``D`` the caller deletes once this one is made (``keep``): not
        counted against ``D``'s :data:`~irdma.meta.base.XATTR_MAX_SNAPSHOTS`.

        Returns:
            The snapshot and, for every regular file of the tree, ``(live inode, copy's
            inode number)``: the files whose chunks the shards clone.

        Raises:
            InvalidArgument: a bad name, or ``ino`` is neither a file nor a directory.
            Exists: that snapshot exists. ReadOnly: ``ino`` is in a snapshot. NotFound.
            QuotaExceeded: ``D`` holds as many snapshots as its limit allows.
            NotPermitted: ``reader`` may not reach or read a file of the tree.
            Nothing is written when any is raised.
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
            self._check_limit(c, dir_ino, spare)
            if reader is not None:
                self._check_reach(c, src, d, reader)
            holder = self._snapshots_dir(c, d, create=True)
            assert holder is not None
            t = now()
            sid = int(c.execute("INSERT INTO snapshots(dir, name, root, src, created_ns, state, maker_uid)"
                                " VALUES (?,?,0,?,?,'creating',?) RETURNING id",
                                (dir_ino, name, ino, t, owner)).fetchone()[0])
            if src.is_dir:
                root, files = self._copy_tree(c, dir_ino, holder, name, sid)
            else:
                root, _ = self._copy_tree(c, dir_ino, holder, name, sid, children=False)
                _, files = self._copy_tree(c, ino, root, self._name_in(c, dir_ino, ino), sid)
                c.execute("UPDATE inodes SET nlink=2 WHERE ino=?", (root,))
            c.execute("UPDATE inodes SET nlink=nlink+1 WHERE ino=?", (holder,))
            c.execute("UPDATE snapshots SET root=? WHERE id=?", (root, sid))
            return Snapshot(sid, dir_ino, name, root, ino, t, "creating", owner), files

    def _check_reach(self, c: Cursor, src: Inode, d: Inode, reader: tuple[int, Sequence[int]]) -> None:
        """Raise NotPermitted when ``reader`` (``(uid, gids)``; root and ``d``'s owner pass) may
        not read a regular file a snapshot of ``src`` would keep, or may not reach it: no name
        of it lies in a directory it may search all the way from ``d`` (a 0700 directory of
        another user keeps what it holds out of reach, whatever the files' modes)."""
        if reader[0] in (0, d.uid):
            return
        cols = ", ".join("i." + x.strip() for x in COLS.split(","))

        def kept(at: Inode) -> list[Inode]:  # what the snapshot keeps of directory ``at``
            rows = c.execute(f"SELECT {cols} FROM dentries d JOIN inodes i ON i.ino = d.ino WHERE d.parent=?"
                             " ORDER BY d.name", (at.ino,)).fetchall()
            return [x for x in map(inode_row, rows)
                    if x.snap != SNAPSHOTS_DIR_MARK and (src.is_dir or x.ino == src.ino)]

        reached: set[int] = set()  # regular files with a name in a directory it may search
        shut: list[Inode] = []  # directories it may not search: what only they hold is out of reach
        todo = [d] if _may(reader, d, 0o1) else []
        if not todo:
            shut.append(d)
        while todo:
            for child in kept(todo.pop()):
                if child.is_dir:
                    (todo if _may(reader, child, 0o1) else shut).append(child)
                elif stat.S_ISREG(child.mode):
                    if not _may(reader, child, 0o4):
                        raise NotPermitted(f"a snapshot of {self._path(c, src.ino)} would keep"
                                           f" {self._path(c, child.ino)} (owner {child.uid}, mode"
                                           f" {stat.S_IMODE(child.mode):04o}), which you may not read: no snapshot"
                                           " was taken", "snapshot a directory that holds only files you may read,"
                                           " or ask the directory's owner to take it")
                    reached.add(child.ino)
        for top in shut:  # a file named only below a directory it may not enter
            below = [top]
            while below:
                for child in kept(below.pop()):
                    if child.is_dir:
                        below.append(child)
                    elif stat.S_ISREG(child.mode) and child.ino not in reached:
                        raise NotPermitted(f"a snapshot of {self._path(c, src.ino)} would keep"
                                           f" {self._path(c, child.ino)}, inside {self._path(c, top.ino)} (owner"
                                           f" {top.uid}, mode {stat.S_IMODE(top.mode):04o}), a directory you may not"
                                           " enter: no snapshot was taken", "snapshot a directory whose files you"
                                           " may reach and read, or ask the directory's owner to take it")

    def _copy_tree(self, c: Cursor, src: int, parent: int, name: bytes, snap_id: int,
                   children: bool = True) -> tuple[int, list[tuple[Inode, int]]]:
        """Copy inode ``src`` (and, for a directory with ``children``, its tree but its
        ``.snapshots``) as ``name`` in ``parent``, the copies' ``snap`` set to ``snap_id``;
        link counts as the copy has them. Returns the copy's inode number and, per regular
        file, ``(source inode, copy's number)``."""
        top = self._get(c, src)
        copies = {src: self._copy_inode(c, src, snap_id)}  # hard links: one copy per inode
        c.execute("INSERT INTO dentries VALUES (?,?,?)", (parent, name, copies[src]))
        # link counts as the copy has them: a file's, its names in the copy; a directory's,
        # 2 and one per subdirectory
        links: dict[int, int] = {copies[src]: 2 if top.is_dir else 1}
        files: list[tuple[Inode, int]] = [] if top.is_dir else [(top, copies[src])]
        todo = [src] if top.is_dir and children else []
        cols = ", ".join("i." + x.strip() for x in COLS.split(","))
        names: list[tuple[int, bytes, int]] = []
        while todo:
            at = todo.pop()
            for r in c.execute(f"SELECT d.name, {cols} FROM dentries d JOIN inodes i ON i.ino = d.ino"
                               " WHERE d.parent=? ORDER BY d.name", (at,)).fetchall():
                child = inode_row(r[1:])
                if child.snap == SNAPSHOTS_DIR_MARK:  # snapshots are not copied into copies
                    continue
                new = copies.get(child.ino)
                if new is None:
                    new = copies[child.ino] = self._copy_inode(c, child.ino, snap_id)
                    links[new] = 2 if child.is_dir else 0
                    if child.is_dir:
                        todo.append(child.ino)
                        links[copies[at]] += 1
                    elif stat.S_ISREG(child.mode):
                        files.append((child, new))
                if not child.is_dir:
                    links[new] += 1
                names.append((copies[at], bytes(r[0]), new))
        c.executemany("INSERT INTO dentries VALUES (?,?,?)", names)
        c.executemany("UPDATE inodes SET nlink=? WHERE ino=?", [(n, ino) for ino, n in links.items()])
        return copies[src], files

    def clone_tree(self, src: int, parent: int, name: bytes) -> tuple[Inode, list[tuple[Inode, int]]]:
        """Copy inode ``src`` (a snapshot's file or directory tree) as a live, writable
        ``name`` in ``parent`` (``irdma snapshot clone``; the shards then clone its chunks).

        Returns:
            The copy's inode and, per regular file, ``(source inode, copy's number)``.

        Raises:
            Exists: ``name`` exists in ``parent``. ReadOnly: ``parent`` is in a snapshot.
        """
        check_name(name)
        with self._tx() as c:
            self._writable(c, parent)
            if not self._get(c, parent).is_dir:
                raise NotADirectory(f"inode {parent} is not a directory")
            if c.execute("SELECT 1 FROM dentries WHERE parent=? AND name=?", (parent, name)).fetchone():
                raise Exists(f"{name.decode(errors='replace')!r} exists", "choose a new path for the clone")
            root, files = self._copy_tree(c, src, parent, name, 0)
            copy = self._get(c, root)
            if copy.is_dir:
                c.execute("UPDATE inodes SET nlink=nlink+1 WHERE ino=?", (parent,))
            t = now()
            c.execute("UPDATE inodes SET mtime_ns=?, ctime_ns=? WHERE ino=?", (t, t, parent))
            return copy, files

    def copy_chunk_maps(self, pairs: Sequence[tuple[int, int]], shards: Sequence[int]) -> None:
        """Give each ``(source, copy)`` file the source's chunk-map rows on ``shards`` (the
        shards that cloned its chunks)."""
        with self._tx() as c:
            marks = ",".join("?" * len(shards)) or "NULL"
            for src, dst in pairs:
                c.execute(f"INSERT INTO chunks SELECT ?, idx, shard, incarnation FROM chunks WHERE ino=? AND shard IN ({marks})",
                          (dst, src, *shards))

    def remove_tree(self, ino: int) -> list[int]:
        """Take a live directory tree (or file) with no snapshots in it out of the namespace in
        one transaction: directories go, files lose their names. Returns the files left with no
        name (the caller frees them once unused, as after unlink).

        Raises:
            NotEmpty: a directory of the tree holds snapshots (delete them first).
        """
        with self._tx() as c:
            return self._remove_tree(c, ino)

    def _remove_tree(self, c: Cursor, ino: int, names: bool = True) -> list[int]:
        top = self._get(c, ino)
        unnamed: list[int] = []
        if names:  # the tree's own name(s)
            for parent, name in c.execute("SELECT parent, name FROM dentries WHERE ino=?", (ino,)).fetchall():
                self._drop_name(c, int(parent), bytes(name), top)
                if top.is_dir:
                    c.execute("UPDATE inodes SET nlink=nlink-1 WHERE ino=?", (int(parent),))
        if not top.is_dir:
            return [ino] if top.nlink <= 0 else []
        todo, dirs = [ino], []
        while todo:
            d = todo.pop()
            dirs.append(d)
            for name, child_ino in c.execute("SELECT name, ino FROM dentries WHERE parent=?", (d,)).fetchall():
                child = self._get(c, int(child_ino))
                if child.snap == SNAPSHOTS_DIR_MARK:
                    if c.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (child.ino,)).fetchone():
                        raise NotEmpty(f"directory {d} holds snapshots: delete them first (`irdma snapshot list`)")
                    c.execute("DELETE FROM inodes WHERE ino=?", (child.ino,))
                    c.execute("DELETE FROM dentries WHERE parent=? AND name=?", (d, bytes(name)))
                elif child.is_dir:
                    c.execute("DELETE FROM dentries WHERE parent=? AND name=?", (d, bytes(name)))
                    todo.append(child.ino)
                else:
                    self._drop_name(c, d, bytes(name), child)
                    if child.nlink <= 0:
                        unnamed.append(child.ino)
        for d in dirs:
            c.execute("DELETE FROM xattrs WHERE ino=?", (d,))
            c.execute("DELETE FROM inodes WHERE ino=?", (d,))
        return unnamed

    def restore_contents(self, dir_ino: int, tree: int) -> list[int]:
        """Make live directory ``dir_ino``'s entries those of directory ``tree`` (a clone of a
        snapshot), in one transaction: a reader sees the old tree or the new one, never a mix.
        ``dir_ino`` keeps its inode number and its ``.snapshots``; ``tree`` goes.

        Returns:
            The old tree's files left with no name (the caller frees them once unused).

        Raises:
            NotEmpty: a subdirectory of the old tree holds snapshots (delete them first).
        """
        with self._tx() as c:
            self._writable(c, dir_ino)
            unnamed: list[int] = []
            for name, child_ino in c.execute("SELECT name, ino FROM dentries WHERE parent=?", (dir_ino,)).fetchall():
                child = self._get(c, int(child_ino))
                if child.snap == SNAPSHOTS_DIR_MARK or child.ino == tree:
                    continue
                if child.is_dir:
                    unnamed += self._remove_tree(c, child.ino)
                else:  # this name only (a hard link elsewhere keeps the file)
                    self._drop_name(c, dir_ino, bytes(name), child)
                    if child.nlink <= 0:
                        unnamed.append(child.ino)
            c.execute("UPDATE dentries SET parent=? WHERE parent=?", (dir_ino, tree))
            self._remove_tree(c, tree)  # now empty
            sub = c.execute("SELECT COUNT(*) FROM dentries d JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND"
                            " i.mode >= ? AND i.mode < ? AND i.snap = 0",
                            (dir_ino, stat.S_IFDIR, stat.S_IFDIR + 0o10000)).fetchone()[0]
            t = now()
            c.execute("UPDATE inodes SET nlink=?, mtime_ns=?, ctime_ns=? WHERE ino=?", (2 + int(sub), t, t, dir_ino))
            return unnamed

    def _path(self, c: Cursor, ino: int) -> str:
        """One path of inode ``ino`` in the namespace (for messages)."""
        parts: list[str] = []
        while ino != ROOT_INO and len(parts) < 4096:
            row = c.execute("SELECT parent, name FROM dentries WHERE ino=? LIMIT 1", (ino,)).fetchone()
            if row is None:
                return f"(inode {ino})/" + "/".join(reversed(parts))
            parts.append(bytes(row[1]).decode(errors="replace"))
            ino = int(row[0])
        return "/" + "/".join(reversed(parts))

    def _check_limit(self, c: Cursor, dir_ino: int, spare: int) -> None:
        """Raise QuotaExceeded when directory ``dir_ino`` holds (less ``spare``) as many
        snapshots as the smallest :data:`~irdma.meta.base.XATTR_MAX_SNAPSHOTS` set on it or
        an ancestor allows."""
        limit: tuple[int, int] | None = None  # (snapshots at most, the inode that says so)
        at, hops = dir_ino, 0
        while hops < 4096:
            row = c.execute("SELECT value FROM xattrs WHERE ino=? AND name=?", (at, XATTR_MAX_SNAPSHOTS)).fetchone()
            if row is not None:
                try:
                    n = int(parse_max_snapshots(bytes(row[0])))
                except ValueError:  # (set before it was checked: ignored, as unset)
                    n = -1
                if n >= 0 and (limit is None or n < limit[0]):
                    limit = (n, at)
            if at == ROOT_INO:
                break
            up = c.execute("SELECT parent FROM dentries WHERE ino=? LIMIT 1", (at,)).fetchone()
            if up is None:
                break
            at, hops = int(up[0]), hops + 1
        if limit is None:
            return
        held = int(c.execute("SELECT COUNT(*) FROM snapshots WHERE dir=?", (dir_ino,)).fetchone()[0])
        if max(held - max(spare, 0), 0) >= limit[0]:  # (0: none may be made)
            where = self._path(c, dir_ino)
            setter = "" if limit[1] == dir_ino else f" (set on {self._path(c, limit[1])})"
            raise QuotaExceeded(f"{where} holds {held} snapshots and its {XATTR_MAX_SNAPSHOTS.decode()} is"
                                f" {limit[0]}{setter}: no snapshot was taken",
                                f"delete one first (rmdir {where.rstrip('/')}/{SNAPSHOTS_DIR.decode()}/NAME, or"
                                " `irdma snapshot delete`), or ask the directory's owner to raise the limit")

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

    def snapshot_sizes(self, snap_id: int, pairs: Sequence[tuple[int, int]]) -> None:
        """Give each copy the live file's size now (called during the cut's freeze: the tree
        was copied before it)."""
        with self._tx() as c:
            for src, dst in pairs:
                c.execute("UPDATE inodes SET size=(SELECT l.size FROM inodes l WHERE l.ino=?) WHERE ino=? AND snap=?",
                          (src, dst, snap_id))

    def snapshot_commit(self, snap_id: int, cloned: Sequence[tuple[int, int, int, int]]) -> Snapshot:
        """Record the clones' chunk maps and mark the snapshot ``ready``: for each ``(live file,
        copy, chunk index, shard)`` the shards cloned at the cut, the live file's chunk-map row
        of that replica (its in-sync state) becomes the copy's.

        Raises:
            NotFound: no such snapshot being made (it was aborted).
        """
        with self._tx() as c:
            row = c.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE id=? AND state='creating'", (snap_id,)).fetchone()
            if row is None:
                raise NotFound(f"no snapshot {snap_id} being made")
            c.executemany("INSERT INTO chunks SELECT ?, idx, shard, incarnation FROM chunks WHERE ino=? AND idx=? AND shard=?",
                          [(dst, src, idx, shard) for src, dst, idx, shard in cloned])
            c.execute("UPDATE snapshots SET state='ready' WHERE id=?", (snap_id,))
            snap = _snap_row(row)
            snap.state = "ready"
            return snap

    def snapshots(self, dir_ino: int) -> list[Snapshot]:
        """The snapshots of directory ``dir_ino`` (those being made too), oldest first."""
        return [_snap_row(r) for r in self._db.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots WHERE dir=? ORDER BY created_ns, id", (dir_ino,))]

    def abandoned_snapshots(self, before_ns: int) -> list[Snapshot]:
        """Snapshots still ``creating`` that were begun before ``before_ns`` (nanoseconds since
        the Unix epoch), of every directory, oldest first: their creators died (a create ends
        within its shards' freeze lease, 30 s at most, or fails and takes its snapshot away)."""
        return [_snap_row(r) for r in self._db.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots WHERE state='creating' AND created_ns < ? ORDER BY created_ns, id",
            (before_ns,))]

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


def _may(reader: tuple[int, Sequence[int]], inode: Inode, bit: int) -> bool:
    """Whether ``reader`` (``(uid, gids)``) has permission ``bit`` (0o4 read, 0o1 search) on
    ``inode`` by its mode bits, owner and group (POSIX's classes: the owner's bits for its
    owner, the group's for its group, else the others'; uid 0 has all)."""
    uid, gids = reader
    if uid == 0:
        return True
    if inode.uid == uid:
        bits = inode.mode >> 6
    elif inode.gid in gids:
        bits = inode.mode >> 3
    else:
        bits = inode.mode
    return bool(bits & bit)
