"""Paths given to the CLI name what the user named (issue 36, points 5 and 6): a path under a
``--subdir`` mount is in that directory of the namespace, and a path under another cluster's
mount is in that cluster's namespace, whatever the default cluster is; a --meta or $IRDMA_META
that names another namespace is an error that changes nothing."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from helpers import Cluster, irdma_cli, mounted, running_cluster

pytestmark = pytest.mark.fuse


def _env(home: str, meta: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("IRDMA_META", "IRDMA_KEY_FILE")}
    env["IRDMA_HOME"] = home  # the default cluster
    if meta is not None:
        env["IRDMA_META"] = meta
    return env


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Cluster]]:
    """Cluster A (the default one) and cluster B, one shard each, on this machine."""
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: FUSE tests cannot run (load the fuse module)")
    with running_cluster(str(tmp_path_factory.mktemp("a")), shards=1, capacity=64 << 20) as a, \
            running_cluster(str(tmp_path_factory.mktemp("b")), shards=1, capacity=64 << 20) as b:
        yield a, b


def test_paths_under_a_subdir_mount_are_in_that_directory(two: tuple[Cluster, Cluster], tmp_path: object) -> None:
    a, _ = two
    env = _env(a.dir)
    whole, sub = f"{tmp_path}/whole", f"{tmp_path}/sub"
    with mounted(a.meta_url, whole):
        os.makedirs(f"{whole}/jobs/a", exist_ok=True)
        _write(f"{whole}/model", b"root model, not the job's")
        with mounted(a.meta_url, sub, subdir="/jobs/a"):
            _write(f"{sub}/model", b"job v1")
            irdma_cli("snapshot", "create", f"{sub}/model", "nightly", env=env)
            assert os.path.isdir(f"{whole}/jobs/a/.snapshots/nightly")
            assert not os.path.exists(f"{whole}/.snapshots/nightly")
            _write(f"{sub}/model", b"job v2")
            res = irdma_cli("snapshot", "restore", f"{sub}/model", "nightly", env=env)
            assert "/jobs/a/model" in res.stderr, res.stderr
            assert _read(f"{sub}/model") == b"job v1"
            assert _read(f"{whole}/model") == b"root model, not the job's"
            irdma_cli("snapshot", "clone", f"{sub}/model", "nightly", f"{sub}/copy", env=env)
            assert _read(f"{sub}/copy") == b"job v1"
            assert not os.path.exists(f"{whole}/copy")
            doc = json.loads(irdma_cli("info", f"{sub}/model", "--json", env=env).stdout)
            assert (doc["path"], doc["mount"], doc["size"]) == ("/jobs/a/model", sub, len(b"job v1"))
            def names(path: str) -> list[str]:
                return [s["name"] for s in json.loads(irdma_cli("snapshot", "list", path, "--json", env=env).stdout)]

            assert names(sub) == ["nightly"] and names(whole) == []  # /jobs/a's, not the root's
            irdma_cli("snapshot", "delete", f"{sub}/model", "nightly", env=env)
            assert not os.path.exists(f"{whole}/jobs/a/.snapshots/nightly")


def test_paths_under_another_clusters_mount_are_in_its_namespace(two: tuple[Cluster, Cluster],
                                                                 tmp_path: object) -> None:
    a, b = two
    ma, mb = f"{tmp_path}/ma", f"{tmp_path}/mb"
    with mounted(a.meta_url, ma), mounted(b.meta_url, mb):
        os.makedirs(f"{ma}/d", exist_ok=True)
        os.makedirs(f"{mb}/d", exist_ok=True)
        _write(f"{ma}/x", b"A" * 10)
        _write(f"{mb}/x", b"B" * 3000)
        # no --meta, no $IRDMA_META: the default cluster is A, the path is B's
        doc = json.loads(irdma_cli("info", f"{mb}/x", "--json", env=_env(a.dir)).stdout)
        assert (doc["path"], doc["size"], doc["mount"]) == ("/x", 3000, mb)
        irdma_cli("snapshot", "create", f"{mb}/d", "s1", env=_env(a.dir))
        assert os.path.isdir(f"{mb}/d/.snapshots/s1")
        assert not os.path.exists(f"{ma}/d/.snapshots/s1")
        # a --meta or $IRDMA_META naming A: an error that says so, and nothing done
        for how, env in ((["--meta", a.meta_url], _env(a.dir)), ([], _env(a.dir, meta=a.meta_url))):
            res = irdma_cli("snapshot", "create", f"{mb}/d", "s2", *how, env=env, check=False)
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 1 and len(lines) == 1, res.stderr
            assert f"under the mount on {mb} of {b.meta_url}" in lines[0] and "--meta (or $IRDMA_META)" in lines[0]
            assert not os.path.exists(f"{mb}/d/.snapshots/s2") and not os.path.exists(f"{ma}/d/.snapshots/s2")
            res = irdma_cli("info", f"{mb}/x", *how, env=env, check=False)
            assert res.returncode == 1 and "under the mount on" in res.stderr, res.stderr
        # naming B (another spelling of its URL) is fine
        doc = json.loads(irdma_cli("info", f"{mb}/x", "--json", "--meta", b.meta_url.replace("sqlite://", ""),
                                   env=_env(a.dir, meta=a.meta_url)).stdout)
        assert doc["size"] == 3000
        # a clone's new path is in the snapshot's namespace, never the default one
        irdma_cli("snapshot", "clone", f"{mb}/d", "s1", "/d2", env=_env(a.dir))
        assert os.path.isdir(f"{mb}/d2") and not os.path.exists(f"{ma}/d2")
        res = irdma_cli("snapshot", "clone", f"{mb}/d", "s1", f"{ma}/d3", env=_env(a.dir), check=False)
        assert res.returncode == 1 and "the namespace of" in res.stderr, res.stderr
        assert not os.path.exists(f"{ma}/d3") and not os.path.exists(f"{mb}/d3")


def test_a_mount_without_its_record_is_refused(two: tuple[Cluster, Cluster], tmp_path: object) -> None:
    from irdma.ops import _proc

    a, _ = two
    m = f"{tmp_path}/m"
    with mounted(a.meta_url, m):
        _write(f"{m}/f", b"f")
        record = _proc.mount_record_file(os.path.realpath(m))
        os.rename(record, record + ".away")  # as for a mount of another user: which directory it shows is unknown
        try:
            res = irdma_cli("info", f"{m}/f", env=_env(a.dir), check=False)
        finally:
            os.rename(record + ".away", record)
        assert res.returncode == 1 and "which directory" in res.stderr and "--meta" in res.stderr, res.stderr
        assert json.loads(irdma_cli("info", f"{m}/f", "--json", env=_env(a.dir)).stdout)["path"] == "/f"
