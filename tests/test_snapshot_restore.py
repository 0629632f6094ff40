"""``irdma snapshot restore PATH NAME`` (and ``clone``) act on what the user named (issue 36,
point 4): a snapshot of a directory restores only through the directory's path, a snapshot of
a file only through that file's; any other path is refused with the right command and nothing
changes (it restored whatever NAME held: ``restore /r/f whole`` reverted ``/r/g`` too). Real
shard processes and the real CLI."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import Cluster, irdma_cli, running_cluster

import irdma


@pytest.fixture()
def cl(tmp_path: str) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path / "c"), shards=2, replicas=2) as c:  # type: ignore[operator]
        yield c


def _contents(cl: Cluster) -> dict[str, bytes]:
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        return {p: bytes(c.read(p)) for p in ("/r/f", "/r/g")}


def test_restore_and_clone_refuse_a_path_the_snapshot_is_not_of(cl: Cluster) -> None:
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.makedirs("/r")
        c.write("/r/f", b"f old")
        c.write("/r/g", b"g old")
        c.snapshot("/r", "whole")
        c.snapshot("/r/f", "fonly")
        c.write("/r/f", b"f new")
        c.write("/r/g", b"g new")
    new = {"/r/f": b"f new", "/r/g": b"g new"}

    def refused(*args: str, names: str) -> None:
        res = irdma_cli(*args, "--meta", cl.meta_url, check=False)
        assert res.returncode == 1, (args, res.stdout, res.stderr)
        assert "nothing was done" in res.stderr and names in res.stderr, (args, res.stderr)
        assert "restored" not in res.stdout, res.stdout
        assert _contents(cl) == new, args

    refused("snapshot", "restore", "/r/f", "whole", names="irdma snapshot restore /r whole")
    refused("snapshot", "restore", "/r/g", "fonly", names="irdma snapshot restore /r/f fonly")
    refused("snapshot", "restore", "/r", "fonly", names="irdma snapshot restore /r/f fonly")
    refused("snapshot", "clone", "/r/g", "whole", "/copy", names="irdma snapshot clone /r whole")
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        assert c.listdir("/") == ["r"]  # no clone made

    irdma_cli("snapshot", "restore", "--meta", cl.meta_url, "/r/f", "fonly")  # the file it is of: that file only
    assert _contents(cl) == {"/r/f": b"f old", "/r/g": b"g new"}
    irdma_cli("snapshot", "restore", "--meta", cl.meta_url, "/r/", "whole")  # the directory it is of: the tree
    assert _contents(cl) == {"/r/f": b"f old", "/r/g": b"g old"}
