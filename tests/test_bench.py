"""Smoke tests of the benchmark tools (the figures come from `make bench`, not from CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, Cluster, irdma_cli


def _results(stdout: str) -> dict[str, dict[str, float]]:
    return {r["name"]: r for r in json.loads(stdout)["results"]}


def test_irdma_bench_native_reports_every_test(cluster: Cluster) -> None:
    res = irdma_cli("bench", "--meta", cluster.meta_url, "--transport", "tcp", "--size", "8MiB", "--chunk-size",
                    "1MiB", "--block", "1MiB", "--latency-ops", "50", "--json")
    r = _results(res.stdout)
    assert set(r) == {"push-assign", "pull", "push-add", "latency-4k-read"}
    assert all(x["mb_s"] > 0 for x in r.values())
    assert 0 < r["latency-4k-read"]["p50_us"] <= r["latency-4k-read"]["p99_us"]
    assert r["pull"]["bytes"] == 8 << 20


def test_irdma_bench_assigns_again_onto_the_chunks_it_made(cluster: Cluster) -> None:
    res = irdma_cli("bench", "--meta", cluster.meta_url, "--transport", "tcp", "--size", "8MiB", "--chunk-size",
                    "1MiB", "--block", "1MiB", "--tests", "push-assign-existing,pull", "--json")
    r = _results(res.stdout)
    assert set(r) == {"pull", "push-assign-existing"}  # the first assign made the chunks, untimed
    assert r["push-assign-existing"]["bytes"] == 8 << 20 and r["push-assign-existing"]["mb_s"] > 0


@pytest.mark.fuse
def test_irdma_bench_through_the_mount(mnt: str) -> None:
    res = irdma_cli("bench", "--mount", mnt, "--size", "8MiB", "--latency-ops", "50", "--json")
    r = _results(res.stdout)
    assert set(r) == {"push-assign", "pull", "push-add", "latency-4k-read"}
    assert not os.path.exists(os.path.join(mnt, ".irdma-bench"))  # cleaned up


def test_irdma_bench_refuses_bad_input(cluster: Cluster) -> None:
    res = irdma_cli("bench", "--meta", cluster.meta_url, "--tests", "pull,sideways", check=False)
    assert res.returncode == 2 and "sideways" in res.stderr
    res = irdma_cli("bench", check=False)
    assert res.returncode == 2 and "--meta" in res.stderr


@pytest.mark.tf
@pytest.mark.slow
@pytest.mark.long  # about 150 s: `make test-long` (CI keeps to `make test`)
def test_benchmark_suite_quick_run_writes_the_report(tmp_path: object) -> None:
    out = os.path.join(str(tmp_path), "docs")
    res = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "run.py"), "--quick", "--out", out],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(os.path.join(out, "benchmarks.md")) as f:
        md = f.read()
    assert "## Targets" in md and "ParameterServerStrategy" in md and "Redis" in md and "## fio" in md
    assert "## Sparse rows" in md and "sparse rows pull" in md
    assert "4 KiB native read p50, over a Python socket ping-pong" in md
    for png in ("bench-scaling.png", "bench-peers.png", "bench-fio.png"):
        assert os.path.getsize(os.path.join(out, png)) > 10_000
    with open(os.path.join(out, "benchmarks.json")) as f:
        data = json.load(f)
    assert data["rounds"]["irdma-native"] > 0 and data["tcp"]["pull"] > 0
    assert data["rounds"]["irdma-mount-unified"] > 0 and data["fio"]["irdma mount"]["rand read 4 KiB x1"]["iops"] > 0
    assert data["rows"]["rows-pull"]["mb_s"] > 0 and data["rows"]["mount-pread-x16"]["mb_s"] > 0
    assert 0 < data["rows"]["zipf"]["distinct"] < data["rows"]["picked"] and data["rows"]["zipf"]["rows-pull"]["seconds"] > 0
    assert data["round_trip"]["irdma_p50_us"] > 0 and data["round_trip"]["socket_p50_us"] > 0


@pytest.mark.tf
@pytest.mark.slow
@pytest.mark.long  # about 190 s: `make test-long`
@pytest.mark.skipif(os.geteuid() != 0, reason="the test bed of bench-comm needs root (network namespaces)")
def test_bench_comm_quick_run_measures_every_technique(tmp_path: object) -> None:
    """``make bench-comm ARGS=--quick``: the four techniques and the cost model, end to end on the
    namespace test bed, with real Keras training (small models, few steps)."""
    out = os.path.join(str(tmp_path), "docs")
    res = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "comm.py"), "--quick", "--out", out],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(os.path.join(out, "communication.md")) as f:
        md = f.read()
    for section in ("## Targets", "## P3 priority slicing", "## The cost model", "## Layer dropping and compression",
                    "## Hierarchical aggregation"):
        assert section in md, section
    with open(os.path.join(out, "communication.json")) as f:
        data = json.load(f)
    names = {r["name"] for r in data["p3"][0]["runs"]}
    assert names == {"none", "fifo", "p3", "p3-1MiB"}
    assert all(r["step_s"] > 0 and 0 <= r["acc"] <= 1 for r in data["p3"][0]["runs"])
    dense = {c["model"]: {r["name"]: r for r in c["runs"]} for c in data["compress"]}
    for model, runs in dense.items():  # compression sends fewer bytes than the dense pushes
        assert runs["topk:0.01"]["wire_tx"] < runs["dense"]["wire_tx"] / 5, model
        assert runs["sign"]["wire_tx"] < runs["dense"]["wire_tx"] / 5, model
    drop = {d["model"]: {r["name"]: r for r in d["runs"]} for d in data["drop"]}
    assert max(r["skipped"] for r in drop["digits"].values()) > 0
    flat, hier = (next(h for h in data["hier"] if h["name"] == n) for n in ("flat", "hier"))
    assert hier["link_tx"] < 0.75 * flat["link_tx"]  # one push per host of two workers
    assert data["model"] and all(m["predicted"] > 0 for m in data["model"])
    assert os.path.getsize(os.path.join(out, "communication.png")) > 10_000


@pytest.mark.fuse
def test_fio_through_the_mount_verifies_what_it_wrote(mnt: str) -> None:
    """fio's own check through the mount: 2 jobs write 8 MiB each in 1 MiB blocks with a crc32c
    in every block, read it all back and verify it; then a short random 4 KiB read run."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import fio

    d = os.path.join(mnt, "fio-smoke")
    os.makedirs(d, exist_ok=True)
    w = fio.run_fio(d, "write", "1M", 2, "8M", 30, True, verify=True)
    assert w["mb_s"] > 0 and w["iops"] > 0
    r = fio.run_fio(d, "randread", "4k", 1, "8M", 1, True)
    assert r["iops"] > 0 and 0 < r["p50_us"] <= r["p99_us"]
