"""A ``--read-only`` mount changes nothing in the namespace, even to look at snapshots (issue 36,
point 12): a lookup of ``DIR/.snapshots`` made that directory's ``.snapshots`` inode (as a
read-write mount does, where it is always there); on a read-only mount only one that exists
(that holds snapshots) is answered, and nothing is written. Real shard processes, a real FUSE
mount, the namespace's rows read before and after."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest
from helpers import Cluster, mounted, running_cluster

import irdma
from irdma.meta import open_meta


@pytest.fixture()
def cl(tmp_path: str) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path / "c"), shards=2, replicas=2) as c:  # type: ignore[operator]
        yield c


def _namespace(cl: Cluster) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    """Every inode and every name, as the metadata database holds them."""
    meta = open_meta(cl.meta_url)
    try:
        db = meta._db  # type: ignore[attr-defined]
        return (sorted(tuple(r) for r in db.execute("SELECT ino, mode, uid, gid, nlink, snap FROM inodes")),
                sorted(tuple(r) for r in db.execute("SELECT parent, name, ino FROM dentries")))
    finally:
        meta.close()


def test_a_read_only_mount_looks_at_snapshots_without_writing(cl: Cluster, tmp_path: str) -> None:
    """``ls -d RO/clean/.snapshots`` of a directory with no snapshot is ENOENT and adds no
    inode; a directory's existing snapshots read as on any mount (its ``.snapshots`` with the
    directory's mode); the namespace is row for row what it was."""
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.makedirs("/clean")
        c.makedirs("/held")
        c.write("/held/w", b"x" * 1000)
        c.snapshot("/held", "s1")
    before = _namespace(cl)
    ro = str(tmp_path / "ro")  # type: ignore[operator]
    with mounted(cl.meta_url, ro, read_only=True):
        with pytest.raises(FileNotFoundError):
            os.stat(f"{ro}/clean/.snapshots")
        with pytest.raises(FileNotFoundError):
            os.listdir(f"{ro}/.snapshots")  # the root's too
        assert os.listdir(f"{ro}/held/.snapshots") == ["s1"]
        with open(f"{ro}/held/.snapshots/s1/w", "rb") as f:
            assert f.read() == b"x" * 1000
        shown = os.stat(f"{ro}/held/.snapshots")
        assert stat.S_ISDIR(shown.st_mode) and stat.S_IMODE(shown.st_mode) == stat.S_IMODE(os.stat(f"{ro}/held").st_mode)
        assert sorted(os.listdir(ro)) == ["clean", "held"]
    assert _namespace(cl) == before
