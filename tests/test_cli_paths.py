"""Paths given to the CLI name what the user named (issue 36, points 5 and 6): a path under a
``--subdir`` mount is in that directory of the namespace, and a path under another cluster's
mount is in that cluster's namespace, whatever the default cluster is; a --meta or $IRDMA_META
that names another namespace is an error that changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import Cluster, irdma_cli, mounted, running_cluster

from irdma import IrdmaError

pytestmark = pytest.mark.fuse

NOBODY = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


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
        # $IRDMA_META naming A yields to the mount's namespace (as the default cluster does)
        doc = json.loads(irdma_cli("info", f"{mb}/x", "--json", env=_env(a.dir, meta=a.meta_url)).stdout)
        assert (doc["path"], doc["size"], doc["mount"]) == ("/x", 3000, mb)
        # a --meta naming A on the command line: an error that says so, and nothing done
        for env in (_env(a.dir), _env(a.dir, meta=a.meta_url)):
            res = irdma_cli("snapshot", "create", f"{mb}/d", "s2", "--meta", a.meta_url, env=env, check=False)
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 1 and len(lines) == 1, res.stderr
            assert f"under the mount on {mb} of {b.meta_url}" in lines[0] and "but --meta names" in lines[0]
            assert not os.path.exists(f"{mb}/d/.snapshots/s2") and not os.path.exists(f"{ma}/d/.snapshots/s2")
            res = irdma_cli("info", f"{mb}/x", "--meta", a.meta_url, env=env, check=False)
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


def test_the_mount_says_what_it_shows_without_its_record(two: tuple[Cluster, Cluster], tmp_path: object) -> None:
    """The mount answers (xattr user.irdma.mount of its root); its record is only a fallback, and
    a path under a mount that neither says is refused."""
    from irdma.ops import _proc
    from irdma.ops import info as I

    a, _ = two
    m, sub = f"{tmp_path}/m", f"{tmp_path}/sub"
    with mounted(a.meta_url, m):
        os.makedirs(f"{m}/jobs/r", exist_ok=True)
        _write(f"{m}/jobs/r/f", b"job's f")
        with mounted(a.meta_url, sub, subdir="/jobs/r"):
            shown = json.loads(os.getxattr(sub, "user.irdma.mount"))
            assert (shown["source"], shown["subdir"]) == (f"irdma:{a.meta_url}", "/jobs/r"), shown
            assert "user.irdma.mount" not in os.listxattr(sub)  # not stored: cp -a / rsync -X do not copy it
            with pytest.raises(OSError):
                os.getxattr(f"{sub}/f", "user.irdma.mount")  # the mount's root answers, no other file
            record = _proc.mount_record_file(os.path.realpath(sub))
            os.rename(record, record + ".away")  # as for root via sudo, or another user: no record here
            try:
                doc = json.loads(irdma_cli("info", f"{sub}/f", "--json", env=_env(a.dir)).stdout)
                assert (doc["path"], doc["size"]) == ("/jobs/r/f", len(b"job's f")), doc
                # neither the mount (an older irdma's) nor a record: refused, nothing done
                with pytest.raises(IrdmaError, match="which directory") as e:
                    I.resolve_target(f"{sub}/f", a.meta_url, False, ask=lambda _: None)
                assert "--meta" in str(e.value.hint)
            finally:
                os.rename(record + ".away", record)
            # a record without the mount's answer: the record says
            t = I.resolve_target(f"{sub}/f", a.meta_url, False, ask=lambda _: None)
            assert (t.path, t.mount) == ("/jobs/r/f", os.path.realpath(sub))


def _nobody_env(tmp: str) -> dict[str, str]:
    """An environment of uid 65534's own: its HOME and XDG_RUNTIME_DIR (no mount records)."""
    env = {k: v for k, v in os.environ.items() if k not in ("IRDMA_META", "IRDMA_KEY_FILE", "IRDMA_RUN_DIR")}
    for name, d in (("HOME", f"{tmp}/home"), ("XDG_RUNTIME_DIR", f"{tmp}/run"), ("IRDMA_HOME", f"{tmp}/home/.irdma")):
        os.makedirs(d, mode=0o700, exist_ok=True)
        os.chown(d, NOBODY, NOBODY)
        env[name] = d
    return env


def test_another_user_names_the_tree_of_roots_allow_other_subdir_mount(tmp_path_factory: pytest.TempPathFactory,
                                                                       ) -> None:
    """Root's --allow-other --subdir mount (an fstab or systemd mount): uid 65534, which has no
    record of it, names the right tree with a path under it (it was refused)."""
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="irdma-cli-paths-")  # not under pytest's 0700 basetemp: nobody enters it
    try:
        os.chmod(work, 0o755)
        with running_cluster(f"{work}/c", shards=1, capacity=64 << 20) as c:
            # the namespace open to nobody's CLI: its database and a key of its own (a user with the key)
            for name in os.listdir(c.dir):
                if name.startswith("meta.db"):
                    os.chmod(f"{c.dir}/{name}", 0o666)
            os.chmod(c.dir, 0o777)
            key = f"{work}/nobody.key"
            shutil.copy(f"{c.dir}/cluster.key", key)
            os.chown(key, NOBODY, NOBODY)
            whole, sub = f"{work}/whole", f"{work}/sub"
            with mounted(c.meta_url, whole):
                os.makedirs(f"{whole}/jobs/n", exist_ok=True)
                _write(f"{whole}/x", b"the root's x")
                _write(f"{whole}/jobs/n/x", b"the job's x, longer")
                with mounted(c.meta_url, sub, subdir="/jobs/n", allow_other=True):
                    env = _nobody_env(f"{work}/nobody")
                    env["IRDMA_KEY_FILE"] = key
                    res = subprocess.run([*SETPRIV, sys.executable, "-m", "irdma.ops.cli", "info", f"{sub}/x", "--json"],
                                         capture_output=True, text=True, env=env, cwd="/", timeout=120)
                    assert res.returncode == 0, res.stderr
                    doc = json.loads(res.stdout)
                    assert (doc["path"], doc["size"], doc["mount"]) == ("/jobs/n/x", len(b"the job's x, longer"), sub)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_another_spelling_of_the_mounts_namespace_is_that_namespace(two: tuple[Cluster, Cluster],
                                                                     tmp_path: object) -> None:
    """--meta naming the mount's namespace by another path (here a bind mount of its directory;
    for PostgreSQL another host name or the default port) is that namespace: the metadata it opens
    holds the mount's session. Another namespace is still refused."""
    _, b = two
    mb, bind = f"{tmp_path}/mb", f"{tmp_path}/bind"
    os.makedirs(bind)
    subprocess.run(["mount", "--bind", b.dir, bind], check=True)
    try:
        with mounted(b.meta_url, mb):
            _write(f"{mb}/y", b"y" * 77)
            other = f"sqlite://{bind}/meta.db"
            from irdma.ops import info as I

            assert I.namespace_key(other) != I.namespace_key(b.meta_url)  # the text differs
            doc = json.loads(irdma_cli("info", f"{mb}/y", "--json", "--meta", other, env=_env(b.dir)).stdout)
            assert (doc["path"], doc["size"]) == ("/y", 77)
    finally:
        subprocess.run(["umount", bind], check=True)


@pytest.mark.parametrize(("one", "other"), [
    ("postgresql://u@db.example:5432/ns", "postgresql://u@db.example/ns"),
    ("postgresql://u:secret@localhost/ns", "postgres://u@127.0.0.1:5432/ns"),
    ("postgresql://u@[::1]:5432/ns?sslmode=require", "postgresql://u@localhost/ns?sslmode=require"),
    ("postgresql://u@h1,h2:5433/ns", "postgresql://u@h1:5432,h2:5433/ns"),
])
def test_postgresql_urls_of_one_namespace_have_one_key(one: str, other: str) -> None:
    from irdma.ops import info as I

    assert I.namespace_key(one) == I.namespace_key(other)


@pytest.mark.parametrize(("one", "other"), [
    ("postgresql://u@db.example/ns", "postgresql://u@db.example:5433/ns"),
    ("postgresql://u@localhost/ns", "postgresql://u@localhost/other"),
    ("postgresql://u@db1/ns", "postgresql://u@db2/ns"),
])
def test_postgresql_urls_of_other_namespaces_differ(one: str, other: str) -> None:
    from irdma.ops import info as I

    assert I.namespace_key(one) != I.namespace_key(other)
