"""``irdma info PATH``: a file's chunks and their replicas, a directory's summary, on a real
cluster of 2 shard processes with 2 replicas; the real ``irdma`` in a subprocess. The last
test SIGKILLs a shard."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pytest
import trio
from helpers import Cluster, irdma_cli, running_cluster, wait_until

import irdma
from irdma.ops import info as I
from irdma.ops._proc import pid_alive

CHUNK = 64 * 1024
SIZES = {"/d/w": 3 * CHUNK + 1000, "/d/sub/x": 100_000}  # 4 and 2 chunks, all written
HOLES = ("/d/sub/h", 3 * CHUNK + 1)  # 4 chunks, none written


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path_factory.mktemp("info")), shards=2, replicas=2) as c:
        async def fill() -> None:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                await cl.makedirs("/d/sub")
                for path, size in SIZES.items():
                    await cl.write(path, os.urandom(size), chunk_size=CHUNK)
                await cl.create(HOLES[0], chunk_size=CHUNK)
                await cl.truncate(*HOLES)

        trio.run(fill)
        yield c


def _ids(c: Cluster) -> set[int]:
    return {s.shard_id for s in c.shards}


def _info(c: Cluster, *args: str, code: int = 0) -> dict[str, object]:
    res = irdma_cli("info", *args, "--meta", c.meta_url, "--json", check=False)
    assert res.returncode == code, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert isinstance(doc, dict) and doc["totals"]["exit_code"] == code  # type: ignore[index]
    return doc


def test_a_file_shows_every_chunk_on_both_shards(cluster: Cluster) -> None:
    doc = _info(cluster, "/d/w")
    size = SIZES["/d/w"]
    assert (doc["type"], doc["kind"], doc["size"], doc["chunk_size"], doc["replicas"]) == ("file", "file", size, CHUNK, 2)
    assert doc["update_op"] == "assign" and doc["io"] == "cached" and doc["mount"] is None
    chunks = doc["chunks"]
    assert isinstance(chunks, list) and [c["index"] for c in chunks] == [0, 1, 2, 3]
    assert [c["length"] for c in chunks] == [CHUNK, CHUNK, CHUNK, 1000]
    for c in chunks:
        assert c["state"] == "ok" and c["wanted"] == 2 and c["good"] == 2
        assert {r["shard_id"] for r in c["replicas"]} == _ids(cluster)
        for r in c["replicas"]:
            assert r["health"] == "up" and r["state"] == "in-sync" and r["good"]
            assert r["version"] == 1, r  # one write of the chunk: version 1 on each replica
            assert r["address"] in {s.address for s in cluster.shards}
    totals = doc["totals"]
    assert isinstance(totals, dict)
    assert (totals["chunks"], totals["written"], totals["holes"], totals["under_replicated"], totals["unavailable"],
            totals["replicas_held"]) == (4, 4, 0, 0, 0, 8)
    assert [(s["shard_id"], s["chunks"], s["bytes"], s["allocated_bytes"], s["share_pct"]) for s in totals["shards"]] \
        == [(sid, 4, size, 3 * CHUNK + 4096, 50.0) for sid in sorted(_ids(cluster))]  # the last chunk's 1000 bytes: a page

    res = irdma_cli("info", "/d/w", "--meta", cluster.meta_url, "--chunks", "3", env={**os.environ, "COLUMNS": "200"})
    assert "... and 1 more (--json lists all)" in res.stdout, res.stdout
    assert "193.0 KiB (197608 bytes)" in res.stdout and "64.0 KiB" in res.stdout, res.stdout
    assert "4 (4 written, 0 holes); 8 in-sync replicas" in res.stdout, res.stdout
    for s in cluster.shards:
        assert f"{s.shard_id} up in-sync v1" in res.stdout and s.address in res.stdout, res.stdout


def test_a_directory_sums_its_files_and_each_shards_share(cluster: Cluster) -> None:
    doc = _info(cluster, "/d", "--recursive")
    assert (doc["type"], doc["files"], doc["dirs"], doc["others"], doc["recursive"]) == ("directory", 3, 1, 0, True)
    assert doc["bytes"] == sum(SIZES.values()) + HOLES[1]
    totals = doc["totals"]
    assert isinstance(totals, dict)
    assert (totals["chunks"], totals["written"], totals["holes"], totals["under_replicated"]) == (10, 6, 4, 0)
    shards = totals["shards"]
    assert {s["shard_id"] for s in shards} == _ids(cluster)
    assert sum(s["chunks"] for s in shards) == totals["replicas_held"] == 2 * 6
    assert sum(s["bytes"] for s in shards) == 2 * sum(SIZES.values())  # holes hold nothing
    assert sum(s["allocated_bytes"] for s in shards) == 2 * (5 * CHUNK + 4096)  # w's last chunk: a page; x's 34,464 bytes: 64 KiB
    assert abs(sum(s["share_pct"] for s in shards) - 100.0) < 0.05

    # without --recursive: the directory's own entries (sub is counted, not entered)
    async def own() -> I.FileInfo | I.DirInfo:
        async with irdma.Client.open(cluster.meta_url, transport="tcp") as cl:
            return await I.path_info(cl, "/d")

    got = trio.run(own)
    assert isinstance(got, I.DirInfo) and (got.files, got.dirs, got.bytes, got.totals.chunks) == (1, 1, SIZES["/d/w"], 4)


def test_a_hole_has_its_placement_and_no_version(cluster: Cluster) -> None:
    async def hole() -> I.FileInfo | I.DirInfo:
        async with irdma.Client.open(cluster.meta_url, transport="tcp") as cl:
            return await I.path_info(cl, HOLES[0])

    got = trio.run(hole)
    assert isinstance(got, I.FileInfo) and got.size == HOLES[1] and len(got.chunks) == 4
    assert got.totals.exit_code == 0 and got.totals.holes == 4 and got.totals.replicas_held == 0
    for c in got.chunks:
        assert c.state == "hole" and {r.shard_id for r in c.replicas} == _ids(cluster)
        assert all(r.state == "unrecorded" and r.version is None for r in c.replicas)


def test_no_such_path_or_a_bad_url_is_one_line(cluster: Cluster) -> None:
    res = irdma_cli("info", "/d/nope", "--meta", cluster.meta_url, check=False)
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert res.returncode == 1 and len(lines) == 1, res.stdout + res.stderr
    assert lines[0].startswith("error: ") and "/d/nope" in lines[0] and "(check the path" in lines[0], lines[0]
    res = irdma_cli("info", "/", "--meta", "http://x", check=False)
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert res.returncode == 1 and len(lines) == 1 and "sqlite:///PATH/meta.db" in lines[0], res.stdout + res.stderr


def test_a_path_under_a_mount_names_the_path_below_it(tmp_path: object) -> None:
    mnt = os.path.join(str(tmp_path), "m")
    table = os.path.join(str(tmp_path), "mountinfo")
    with open(table, "w") as f:
        f.write("22 1 0:21 / /proc rw - proc proc rw\n"
                f"90 22 0:55 / {mnt.replace(' ', chr(92) + '040')} rw - fuse.irdma irdma rw,user_id=0\n"
                f"91 22 0:56 / {mnt}2 rw - fuse.other x rw\n")
    mounts = I.irdma_mounts(table)
    assert mounts == [mnt]
    assert I.namespace_path(os.path.join(mnt, "jobs", "w"), mounts) == ("/jobs/w", mnt)
    assert I.namespace_path(mnt, mounts) == ("/", mnt)
    assert I.namespace_path(mnt + "2/w", mounts) == (mnt + "2/w", None)  # not irdma's
    assert I.namespace_path("/jobs/w", mounts) == ("/jobs/w", None)
    assert I.namespace_path("jobs/w/", []) == ("/jobs/w", None)
    assert I.namespace_path("/", []) == ("/", None)


def test_a_stopped_shard_shows_down_and_exit_1(cluster: Cluster) -> None:
    victim = cluster.shards[1]
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(victim.pid), 10, "the killed shard to exit")
    cluster.shards = [s for s in cluster.shards if s is not victim]  # its log is not checked
    res = irdma_cli("info", "/d/w", "--meta", cluster.meta_url, check=False, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"{victim.shard_id} down in-sync -" in res.stdout, res.stdout
    assert "4 under-replicated" in res.stdout and "fewer replicas than asked" in res.stderr, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
