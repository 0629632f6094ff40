#!/usr/bin/env python3
"""The side-by-side benchmark suite, in one run: ceilings, irdma (native and through the
mount), peers (TensorFlow ParameterServerStrategy, Redis), how cost grows, memory, checkpoints,
sparse rows, fio, snapshots.

Writes ``docs/benchmarks.md`` (tables, every figure also as a ratio to its baseline from the
same run), ``docs/benchmarks.json`` and PNG plots under ``docs/``. Bandwidth is in MB/s
(10^6 bytes/s). Every load is bounded in bytes and rounds, on 127.0.0.1 only.

It ends with the regression check (benchmarks/guard.py): every target ratio beside the last
committed docs/benchmarks.json, FELL where one got worse by more than 15%; the exit status stays 0.

The clusters, mounts, model shapes and worker barrier every section uses are in
benchmarks/harness.py; the sections that also run on their own are modules beside this one
(rows.py, fio.py, snapshots.py, readcache.py), as are the report (report.py, its targets in
targets.py) and the regression check (guard.py). None of them imports this script.

    make bench                 # or: .venv/bin/python benchmarks/run.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import trio

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)  # the other benchmark modules: harness, guard, report, the sections

import ceilings  # noqa: E402
from harness import PY, cleanup_barrier, cluster, model_shapes, mounted, pow2_chunk, start_together  # noqa: E402

from irdma.client.native import Client  # noqa: E402
from irdma.ops import bench as B  # noqa: E402
from irdma.ops import cluster as C  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
RESULTS: dict[str, Any] = {}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rss(pid: int) -> int:
    """Resident set size of a process, bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def native(meta: str, size: int, chunk: int, concurrency: int = 4, tests: tuple[str, ...] = ("push-assign", "pull", "push-add"),
           path: str = "/.irdma-bench") -> dict[str, float]:
    cfg = B.BenchConfig(size=size, chunk_size=chunk, block=min(4 * MiB, size), concurrency=concurrency, tests=tests,
                        path=path)

    async def run() -> list[B.BenchResult]:
        async with Client.open(meta, transport="tcp") as c:
            return await B.bench_native(c, cfg, lambda *a: None)

    return {r.name: r.mb_s for r in trio.run(run)}


def fresh_ceilings(size: int) -> dict[str, float]:
    """The push ceilings into fresh memory (:func:`ceilings.tcp_ceiling` ``fresh``), raw and
    with the GMAC, on the filesystem of the clusters' data directories: ``raw`` and ``mac``, MB/s.
    Each starts 3 s after the memory the sections before it freed (a virtual machine's guest
    reports free pages to its host after 2 s, and a page the host took back costs a fault there
    at its next first touch), and so does the native section's push: the same state of memory
    for both."""
    out = {}
    for kind in ("raw", "mac"):
        time.sleep(3.0)  # not a wait for readiness: the state of the memory the push lands in
        out[kind] = ceilings.tcp_ceiling(size, 4, mac=kind == "mac", fresh=tempfile.gettempdir())["push"]
    return out


def replication(size: int, moved: int | None = None) -> dict[str, Any]:
    """R=2 against R=1 (4 shards, native client), durable flush against --durability memory,
    the rate at which a restarted shard that missed ``moved`` bytes (default ``size``) is
    resynced, and the rate at which a shard holding ``moved`` bytes is drained."""
    moved = moved or size
    import signal as _signal

    out: dict[str, Any] = {}
    for r in (1, 2):
        with cluster(4, r * size // 2 + 256 * MiB, replicas=r) as (meta, _):
            out[f"r{r}"] = native(meta, size, 4 * MiB)
    for mode in ("fsync", "memory"):
        with cluster(4, size // 2 + 256 * MiB, replicas=2, durability=mode) as (meta, _):
            out[f"durability-{mode}"] = flushed_push(meta, size)
    dirs: list[str] = []
    with cluster(2, moved + 256 * MiB, replicas=2, dirs=dirs) as (meta, procs):
        async def write(seed: int) -> None:
            async with Client.open(meta, transport="tcp") as c:
                await c.write("/resync", np.full(moved // 4, seed, "<f4"), chunk_size=4 * MiB)

        trio.run(write, 1)
        os.kill(procs[1].pid, _signal.SIGKILL)
        trio.run(write, 2)  # the killed shard misses all of it
        C.up(dirs[0], 2, moved + 256 * MiB)  # back on its data, syncing

        async def resync() -> tuple[int, float]:
            async with Client.open(meta, transport="tcp") as c:
                await c.shard_stats()
                t0 = time.perf_counter()
                copied = await c.resync_shard(procs[1].shard_id)
                return copied, time.perf_counter() - t0

        copied, secs = trio.run(resync)
        out["resync"] = {"bytes": copied, "seconds": secs, "mb_s": copied / secs / 1e6}
    # drain: 3 shards, 2 replicas, 1.5x ``moved`` written, so each shard holds ``moved``
    with cluster(3, 2 * moved + 256 * MiB, replicas=2) as (meta, procs):  # room for half of it each
        async def drain() -> tuple[int, float]:
            async with Client.open(meta, transport="tcp") as c:
                await c.write("/drain", np.ones(3 * moved // 8, "<f4"), chunk_size=4 * MiB)
                t0 = time.perf_counter()
                copied = await c.drain_shard(procs[0].shard_id)
                return copied, time.perf_counter() - t0

        copied, secs = trio.run(drain)
        out["drain"] = {"bytes": copied, "seconds": secs, "mb_s": copied / secs / 1e6}
    return out


@contextlib.contextmanager
def open_cluster(shards: int, capacity: int) -> Iterator[str]:
    """Shards started by hand with ``--no-auth`` and a namespace without a key, each on a data
    directory as ``irdma up``'s are: the baseline the authentication section compares with."""
    from irdma.meta import open_meta

    d = tempfile.mkdtemp(prefix="irdma-bench-noauth-")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        meta = open_meta(os.path.join(d, "meta.db"), create=True)
        for i in range(shards):
            port_file = os.path.join(d, f"port-{i}")
            with open(os.path.join(d, f"shard-{i}.log"), "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "irdma.ops.cli", "server", "--listen", "127.0.0.1:0", "--capacity", str(capacity),
                     "--shard-id", str(i + 1), "--port-file", port_file, "--transport", "tcp", "--no-auth",
                     "--data-dir", os.path.join(d, f"data-{i}")],  # as `irdma up` does: only auth differs
                    stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 60
            while not os.path.exists(port_file):
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise RuntimeError(f"shard {i + 1} did not start: see {d}/shard-{i}.log")
                time.sleep(0.05)
            with open(port_file) as f:
                meta.add_shard(f.read().strip())
        meta.set_replicas(1)
        meta.close()
        yield f"sqlite://{d}/meta.db"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(Exception):
                p.wait(30)
        shutil.rmtree(d, ignore_errors=True)


def authentication(size: int) -> dict[str, Any]:
    """Pull and push (native client, 4 shards, one replica) with every frame authenticated
    (GMAC tags; ``on``: security level integrity, ``auth``: level auth, payloads untagged)
    against shards run with --no-auth, each on a data directory, in one run."""
    out: dict[str, Any] = {}
    with cluster(4, size // 4 + 256 * MiB) as (meta, _):
        out["on"] = native(meta, size, 4 * MiB)
    with cluster(4, size // 4 + 256 * MiB, security="auth") as (meta, _):
        out["auth"] = native(meta, size, 4 * MiB)
    with open_cluster(4, size // 4 + 256 * MiB) as meta:
        out["off"] = native(meta, size, 4 * MiB)
    return out


def flushed_push(meta: str, size: int) -> float:
    """MB/s of a push (assign) of ``size`` bytes followed by a flush (what fsync waits for)."""
    async def run() -> float:
        async with Client.open(meta, transport="tcp") as c:
            data = np.ones(size // 4, "<f4")
            await c.write("/durable", data, chunk_size=4 * MiB)  # chunks made: now time the overwrite
            await c.flush()
            t0 = time.perf_counter()
            await c.write("/durable", data)
            await c.flush()
            return size / (time.perf_counter() - t0) / 1e6

    return trio.run(run)


def through_mount(mp: str, size: int, chunk: int, concurrency: int = 4,
                  tests: tuple[str, ...] = ("push-assign", "pull", "push-add")) -> dict[str, float]:
    cfg = B.BenchConfig(size=size, chunk_size=chunk, block=4 * MiB, concurrency=concurrency, tests=tests)
    return {r.name: r.mb_s for r in B.bench_mount(mp, cfg, lambda *a: None)}


def round_trip(meta: str, ops: int = 2000) -> dict[str, float]:
    """p50/p99 in microseconds of a 4 KiB native read (``irdma bench``'s latency test, one
    request at a time) and of a plain Python socket ping-pong in the same run: a 40-byte
    request to another process, answered with 4 KiB and a 24-byte header and tag, as irdma's
    READ is; blocking sockets, TCP_NODELAY, loopback."""
    cfg = B.BenchConfig(size=64 * MiB, chunk_size=4 * MiB, block=4 * MiB, concurrency=4, tests=("latency",),
                        latency_ops=ops, path="/.irdma-bench-rtt")

    async def run() -> list[B.BenchResult]:
        async with Client.open(meta, transport="tcp") as c:
            return await B.bench_native(c, cfg, lambda *a: None)

    lat = [r for r in trio.run(run) if r.name == "latency-4k-read"][0]
    samples = ceilings.socket_ping(ops)
    us = sorted(x * 1e6 for x in samples)
    return {"irdma_p50_us": float(lat.p50_us or 0.0), "irdma_p99_us": float(lat.p99_us or 0.0),
            "socket_p50_us": us[len(us) // 2], "socket_p99_us": us[int(0.99 * (len(us) - 1))]}


def small_files_held(files: int = 1000, size: int = 4096) -> dict[str, Any]:
    """Shard bytes held by ``files`` files of ``size`` bytes (random, written by the native
    client, default 4 MiB chunks) on 2 shards with 2 replicas: what each shard's STAT says is
    used, all shards together, against the files' bytes times the replicas (issue 39: a 4 KiB
    file holds at most 8 KiB a replica). ``{"files", "size", "replicas", "held"}``, bytes."""
    rng = np.random.default_rng(39)

    async def run(meta: str) -> int:
        async with Client.open(meta, transport="tcp") as c:
            await c.makedirs("/small")
            for k in range(files):
                await c.write(f"/small/f{k}", rng.integers(0, 256, size, dtype=np.uint8))
            return sum(st.used for _, st, _ in await c.shard_stats() if st is not None)

    with cluster(2, 256 * MiB, replicas=2) as (meta, _):
        held = trio.run(run, meta)
    return {"files": files, "size": size, "replicas": 2, "held": held}


def small_files_time(files: int = 2000, size: int = 4096, repeats: int = 2) -> dict[str, Any]:
    """``files`` files of ``size`` random bytes written then read, one after the other: through a
    mount (``open(O_CREAT)``, ``write``, ``close``, then ``open``, ``read``, ``close`` each: what a
    framework saving a file per tensor does) against the native client (``write(path)``, then
    ``read(path)`` each), in a new directory each time, alternately ``repeats`` times on one
    cluster (2 shards, 2 replicas, durability fsync). Seconds, the mean of each:
    ``{"files", "size", "mount_s", "native_s", "runs"}`` (issue 39: mount at most 2x native)."""
    data = [np.random.default_rng(k).integers(0, 256, size, dtype=np.uint8).tobytes() for k in range(files)]

    async def native(meta: str, d: str) -> float:
        async with Client.open(meta, transport="tcp") as c:
            await c.makedirs(d)
            t0 = time.perf_counter()
            for k in range(files):
                await c.write(f"{d}/f{k}", data[k])
            for k in range(files):
                if bytes(await c.read(f"{d}/f{k}")) != data[k]:
                    raise RuntimeError(f"native client read back other bytes from {d}/f{k}")
            return time.perf_counter() - t0

    def mount(mp: str, d: str) -> float:
        os.makedirs(mp + d)
        t0 = time.perf_counter()
        for k in range(files):
            with open(f"{mp}{d}/f{k}", "wb") as f:
                f.write(data[k])
        for k in range(files):
            with open(f"{mp}{d}/f{k}", "rb") as f:
                if f.read() != data[k]:
                    raise RuntimeError(f"the mount read back other bytes from {d}/f{k}")
        return time.perf_counter() - t0

    runs: dict[str, list[float]] = {"mount": [], "native": []}
    with cluster(2, 256 * MiB, replicas=2) as (meta, _), mounted(meta) as (mp, _):
        for i in range(repeats):
            runs["native"].append(trio.run(native, meta, f"/native-{i}"))
            runs["mount"].append(mount(mp, f"/mount-{i}"))
    return {"files": files, "size": size, "mount_s": sum(runs["mount"]) / repeats,
            "native_s": sum(runs["native"]) / repeats, "runs": runs}


def dd_into_mount(size: int, repeats: int = 3) -> dict[str, Any]:
    """``dd bs=4k`` and ``dd bs=1M`` of ``size`` bytes (``conv=fsync``: the time includes every
    push) into a mount (page cache, as a user's dd gets; 4 shards, 1 replica) and into
    benchmarks/passthrough.py over tmpfs (the FUSE ceiling: a 4 KiB write there is one FUSE round
    trip and nothing else), alternately ``repeats`` times each from a file of random bytes on
    tmpfs. MB/s, the median of each: ``{"mount": {"4k": ..., "1M": ...}, "passthrough": {...}}``."""
    import statistics

    import fio

    src = f"/dev/shm/irdma-bench-dd-{os.getpid()}"
    with open(src, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())

    def dd(directory: str) -> dict[str, float]:
        runs: dict[str, list[float]] = {"4k": [], "1M": []}
        for i in range(repeats):
            for bs, block in (("4k", 4096), ("1M", MiB)):
                dst = os.path.join(directory, f"dd-{bs}-{i}")
                t0 = time.perf_counter()
                subprocess.run(["dd", f"if={src}", f"of={dst}", f"bs={bs}", f"count={size // block}", "conv=fsync"],
                               check=True, capture_output=True, timeout=600)
                runs[bs].append(size / (time.perf_counter() - t0) / 1e6)
                os.unlink(dst)
        return {bs: statistics.median(v) for bs, v in runs.items()}

    try:
        with cluster(4, 256 * MiB) as (meta, _), mounted(meta) as (mp, _):
            out = {"mount": dd(mp)}
        with fio.passthrough() as pt:
            out["passthrough"] = dd(pt)
    finally:
        os.unlink(src)
    return {**out, "size": size}


# ---------------------------------------------------------------- the model round (peers)
def _run_workers(kind: str, target: str, shapes_file: str, rounds: int, n: int = 2) -> float:
    start = tempfile.mktemp(prefix="irdma-bench-start-")
    procs = [subprocess.Popen([PY, os.path.join(HERE, "workers.py"), kind, target, shapes_file, str(rounds), str(r),
                               start], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
             for r in range(n)]
    start_together(procs, start)
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"{kind} worker failed ({p.returncode})")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    cleanup_barrier(start)
    return max(o["round_s"] for o in outs)


def model_rounds(shapes: list[list[int]], rounds: int) -> dict[str, float]:
    shapes_file = tempfile.mktemp(suffix=".json")
    with open(shapes_file, "w") as f:
        json.dump(shapes, f)
    out: dict[str, float] = {}
    nbytes = [4 * int(np.prod(s)) for s in shapes]
    with cluster(2, 2 * GiB) as (meta, _):
        import irdma

        with irdma.connect(meta, transport="tcp") as c:
            c.makedirs("/model")
            for i, n in enumerate(nbytes):
                c.write(f"/model/l{i:03d}", np.zeros(n // 4, "<f4"), chunk_size=pow2_chunk(n))
                c.set_update_op(f"/model/l{i:03d}", "add")
            # SoftMemoryBox II's unified buffer: every tensor at its offset in one file
            c.write("/model/params", np.zeros(sum(nbytes) // 4, "<f4"), chunk_size=4 * MiB)
            c.set_update_op("/model/params", "add")

        def through_mounts(kind: str) -> float:
            with mounted(meta) as (mp1, _), mounted(meta) as (mp2, _):
                start = tempfile.mktemp()
                procs = [subprocess.Popen([PY, os.path.join(HERE, "workers.py"), kind, mp, shapes_file,
                                           str(rounds), str(r), start], stdout=subprocess.PIPE, text=True)
                         for r, mp in enumerate((mp1, mp2))]
                start_together(procs, start)
                res = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
                cleanup_barrier(start)
                return max(r["round_s"] for r in res)

        say("model round: irdma through the mount, a file per tensor (2 workers, one mount each)")
        out["irdma-mount"] = through_mounts("irdma-mount")
        # the unified buffer (native and mount), ParameterServerStrategy and Redis alternately,
        # twice: the machine drifts
        runs: dict[str, list[float]] = {"irdma-native-unified": [], "irdma-mount-unified": [], "irdma-native": [],
                                        "tf-ps": [], "redis": []}
        for _ in range(2):
            say("model round: irdma through the mount, one unified buffer file (2 workers, one mount each)")
            runs["irdma-mount-unified"].append(through_mounts("irdma-mount-unified"))
            say("model round: irdma native, one unified buffer file (2 workers, 2 shards)")
            runs["irdma-native-unified"].append(_run_workers("irdma-native-unified", meta, shapes_file, rounds))
            say("model round: irdma native, a file per tensor (2 workers, 2 shards)")
            runs["irdma-native"].append(_run_workers("irdma-native", meta, shapes_file, rounds))
            say("model round: TensorFlow ParameterServerStrategy (2 ps, 2 workers, gRPC in-process)")
            res_ps = subprocess.run([PY, os.path.join(HERE, "peer_tf_ps.py"), "--shapes", shapes_file, "--rounds",
                                     str(rounds)], capture_output=True, text=True, timeout=900)
            if res_ps.returncode != 0:
                raise RuntimeError(f"ParameterServerStrategy peer failed:\n{res_ps.stderr[-2000:]}")
            runs["tf-ps"].append(json.loads(res_ps.stdout.strip().splitlines()[-1])["round_s"])
            say("model round: Redis (2 redis-server, 2 workers, WATCH/MULTI read-modify-write)")
            runs["redis"].append(redis_round(shapes, shapes_file, rounds))
        # BSP rounds (issue 38): one optimizer step per worker's push against one step per round on
        # the shards' sum of the pushes, alternately, each in a job of its own (its clocks from 0)
        with irdma.connect(meta, transport="tcp") as c:
            c.write("/model/bsp", np.zeros(sum(nbytes) // 4, "<f4"), chunk_size=4 * MiB)
            c.set_update_op("/model/bsp", "sgd learning_rate=0.01 momentum=0.9")
        bsp_rounds = max(rounds, 10)
        for i in range(2):
            for mode in ("push", "round"):
                job = f"/jobs/bench-bsp-{mode}-{i}"
                with irdma.connect(meta, transport="tcp") as c:
                    ino = c.makedirs(job).ino
                    c.client.store.setxattr(ino, b"user.irdma.workers", b"2")
                    c.client.store.setxattr(ino, b"user.irdma.consistency", b"bsp")
                how = "a step per push" if mode == "push" else "one step per round on the summed pushes"
                say(f"model round: BSP, one unified buffer under SGD momentum, {how} (2 workers, 2 shards)")
                runs.setdefault(f"bsp-{mode}", []).append(
                    _run_workers("irdma-native-bsp", f"{meta}|{job}|{mode}", shapes_file, bsp_rounds))
        for k, v in runs.items():
            out[k] = sum(v) / len(v)
        out["runs"] = runs  # type: ignore[assignment]
    os.unlink(shapes_file)
    return out


def redis_round(shapes: list[list[int]], shapes_file: str, rounds: int) -> float:
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed: apt-get install redis-server (make bench does)")
    ports, procs = [], []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                       "no", "--protected-mode", "no"], stdout=subprocess.DEVNULL))
        ports.append(port)
    try:
        conns = [redis.Redis(port=p) for p in ports]
        deadline = time.monotonic() + 30
        for r in conns:
            while True:
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        for i, s in enumerate(shapes):
            conns[i % 2].set(f"l{i:03d}", np.zeros(int(np.prod(s)), "<f4").tobytes())
        return _run_workers("redis", ",".join(map(str, ports)), shapes_file, rounds)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


# ---------------------------------------------------------------- checkpoints
_CKPT = r"""
import os, sys, json, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
base = sys.argv[1]
rng = np.random.default_rng(0)
vars_ = [tf.Variable(rng.standard_normal((5000, 5000), dtype=np.float32))]   # 100 MB
ckpt = tf.train.Checkpoint(v=vars_)
mgr = tf.train.CheckpointManager(ckpt, base, max_to_keep=1)
mgr.save()  # warm-up: graph building and first allocation, untimed
t0 = time.perf_counter(); path = mgr.save(); save = time.perf_counter() - t0
t0 = time.perf_counter(); ckpt.restore(path).assert_consumed(); restore = time.perf_counter() - t0
print(json.dumps({"save_s": save, "restore_s": restore}))
"""


def checkpoints(meta: str, repeats: int = 3) -> dict[str, float]:
    """tmpfs, a pyfuse3 passthrough of tmpfs (the FUSE ceiling: benchmarks/passthrough.py) and
    the mount, measured in turn, ``repeats`` times each; medians in seconds:
    ``{"tmpfs_save_s", "tmpfs_restore_s", "passthrough_save_s", ..., "mount_restore_s"}``.

    A restore reads back what the save just wrote, and in neither FUSE filesystem does the
    kernel keep those pages: the save's writes leave the kernel's mtime of the file stale, the
    first getattr after them brings the new one, and FUSE's auto_inval_data (which libfuse
    turns on and pyfuse3 cannot turn off) drops the file's page cache on a changed mtime
    (fs/fuse/inode.c, fuse_change_attributes). So the restore is a read through FUSE on both,
    and the passthrough's restore over tmpfs is the least a FUSE mount's can be."""
    import statistics

    import fio

    runs: dict[str, list[dict[str, float]]] = {"tmpfs": [], "passthrough": [], "mount": []}
    with mounted(meta) as (mp, _), fio.passthrough() as pt:
        for i in range(repeats):
            for where in runs:
                base = tempfile.mkdtemp(prefix="irdma-ckpt-", dir="/dev/shm") if where == "tmpfs" else None
                target = os.path.join(base, "ckpt") if base else os.path.join(mp if where == "mount" else pt, f"ckpt{i}")
                try:
                    res = subprocess.run([PY, "-c", _CKPT, target], capture_output=True, text=True, check=True)
                    runs[where].append(json.loads(res.stdout.strip().splitlines()[-1]))
                finally:
                    if base:
                        shutil.rmtree(base, ignore_errors=True)
    out = {}
    for where, rs in runs.items():
        out[f"{where}_save_s"] = statistics.median(r["save_s"] for r in rs)
        out[f"{where}_restore_s"] = statistics.median(r["restore_s"] for r in rs)
    return out


# ---------------------------------------------------------------- the run
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the suite, not figures")
    ap.add_argument("--out", default=os.path.join(REPO, "docs"))
    ap.add_argument("--only", choices=["replication", "authentication", "rounds", "fio", "rows", "cache", "snapshots",
                                       "dd", "smallfiles", "embedding", "round_trip", "ckpt"],
                    help="run one section, print its figures as JSON and compare only its ratios")
    ap.add_argument("--cache-file-size", default="1GiB",
                    help="--only cache: bytes of the hot file 4 readers read (benchmarks/readcache.py)")
    args = ap.parse_args()
    import guard

    # the run to compare with, read before anything is overwritten: docs/benchmarks.json as committed
    previous, against = guard.load_previous(REPO, args.out)
    commit = guard.git_commit(REPO)
    if args.only == "cache":  # the local read cache: figures printed, no report written
        import readcache

        from irdma.units import parse_size

        print(json.dumps(readcache.run(64 * MiB if args.quick else parse_size(args.cache_file_size), say), indent=1))
        return 0
    if args.only in ("round_trip", "ckpt"):  # figures printed, no report written
        if args.only == "round_trip":  # the 4 KiB read against a socket ping-pong
            with cluster(1, 256 * MiB) as (meta, _):
                part = round_trip(meta, 500 if args.quick else 2000)
        else:  # checkpoints, on the cluster the full run gives them
            with cluster(4, GiB // 4 + 256 * MiB) as (meta, _):
                part = checkpoints(meta, 1 if args.quick else 3)
        print(json.dumps(part, indent=1))
        # its ratios are targets of the full run: computed over the committed run's figures with
        # this section's in their place, only this section's ratios compared
        merged = {k: v for k, v in (previous or {}).items() if k not in ("machine", "ratios", "regression_check")}
        regression_check({**merged, args.only: part}, previous, against, [args.only], args.quick)
        return 0
    if args.only in ("replication", "authentication"):  # figures printed, no report written
        size = 64 * MiB if args.quick else (256 if args.only == "replication" else 512) * MiB
        part = replication(size) if args.only == "replication" else authentication(size)
        print(json.dumps(part, indent=1))
        regression_check({args.only: part}, previous, against, [args.only], args.quick)
        return 0
    if args.only in ("rounds", "fio", "rows", "snapshots", "dd", "smallfiles", "embedding"):  # one section again
        if args.only == "rounds":
            part = model_rounds(model_shapes(), 1 if args.quick else 3)
        elif args.only == "smallfiles":
            part = {**small_files_held(100 if args.quick else 1000),
                    "timed": small_files_time(200 if args.quick else 2000)}
        elif args.only == "dd":
            part = dd_into_mount((8 if args.quick else 64) * MiB)
        elif args.only == "embedding":
            import embedding

            part = embedding.section(args.quick)
        elif args.only == "rows":
            import rows

            part = rows.run(args.quick, say)
        elif args.only == "snapshots":
            import snapshots

            part = snapshots.run(args.quick, say)
        else:
            import fio

            part = fio.run_all(args.quick, say)
        print(json.dumps(part, indent=1))
        with open(os.path.join(args.out, "benchmarks.json")) as f:
            R = json.load(f)
        R[args.only] = part
        R[f"{args.only}_date"] = time.strftime("%Y-%m-%d %H:%M")
        R[f"{args.only}_commit"] = commit
        from report import write_report

        chk = regression_check(R, previous, against, [args.only], args.quick)
        write_report(R, args.out)
        say(f"wrote {args.out}/benchmarks.md ({args.only} measured again, the rest kept)")
        if chk:
            guard.show(chk)
        return 0
    big = 64 * MiB if args.quick else GiB
    sweep = 16 * MiB if args.quick else 256 * MiB
    rounds = 1 if args.quick else 3
    t_start = time.monotonic()
    R = RESULTS
    R["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                    "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit}

    say(f"ceilings: loopback TCP with 4 streams, raw and with a GMAC per 4 MiB block (the same work as the"
        f" integrity level), tmpfs with 4 MiB blocks ({big >> 20} MiB)")
    tcp_before = ceilings.tcp_ceiling(big, 4)
    mac_before = ceilings.tcp_ceiling(big, 4, mac=True)
    R["tmpfs"] = ceilings.tmpfs_ceiling(big)
    fresh_before = fresh_ceilings(big)

    say(f"irdma: {big >> 20} MiB over 4 shards, native client and mount (direct I/O)")
    with cluster(4, big // 4 + 256 * MiB) as (meta, procs):
        time.sleep(3.0)  # the push lands in memory in the state the fresh ceilings' did (fresh_ceilings)
        R["native"] = native(meta, big, 4 * MiB, tests=("push-assign", "pull", "push-assign-existing", "push-add"))
        with mounted(meta) as (mp, mpid):
            peak = [0]
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], rss(mpid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                R["mount"] = through_mount(mp, big, 4 * MiB)
            finally:
                stop.set()
                sampler.join()
            R["fuse_rss_peak"] = peak[0]
        # the ceiling again, right after: the machine drifts; the baseline is the mean of both
        tcp_after = ceilings.tcp_ceiling(big, 4)
        mac_after = ceilings.tcp_ceiling(big, 4, mac=True)
        R["tcp"] = {k: (tcp_before[k] + tcp_after[k]) / 2 for k in tcp_before}
        R["tcp_runs"] = [tcp_before, tcp_after]
        R["tcp_mac"] = {k: (mac_before[k] + mac_after[k]) / 2 for k in mac_before}
        R["tcp_mac_runs"] = [mac_before, mac_after]
        fresh_after = fresh_ceilings(big)
        R["tcp_fresh"] = {k: (fresh_before[k] + fresh_after[k]) / 2 for k in fresh_before}
        R["tcp_fresh_runs"] = [fresh_before, fresh_after]
        say("checkpoints: tf.train.CheckpointManager, 100 MB, tmpfs and mount alternately,"
            f" {1 if args.quick else 3} each")
        R["ckpt"] = checkpoints(meta, 1 if args.quick else 3)  # quick: a smoke run, not figures

    say("how cost grows: shards")
    R["by_shards"] = {}
    for n in (1, 2, 4):
        with cluster(n, sweep + 128 * MiB) as (meta, _):
            R["by_shards"][n] = native(meta, sweep, 4 * MiB, tests=("push-assign", "pull"))
    say("how cost grows: chunk size, file size, workers (4 shards)")
    with cluster(4, big // 2 + 256 * MiB) as (meta, _):
        R["by_chunk"] = {c: native(meta, sweep, c, tests=("push-assign", "pull"))
                         for c in (256 * 1024, MiB, 4 * MiB, 16 * MiB)}
        sizes = [MiB, 16 * MiB, 256 * MiB, big] if not args.quick else [MiB, 16 * MiB, big]
        R["by_size"] = {s: native(meta, s, 4 * MiB, tests=("push-assign", "pull")) for s in sizes}
        R["by_workers"] = {}
        for w in (1, 2, 4):
            per = sweep // w
            procs = [subprocess.Popen([PY, "-m", "irdma.ops.cli", "bench", "--meta", meta, "--transport", "tcp", "--size",
                                       str(per), "--tests", "push-assign,pull", "--json", "--path", f"/.bench-worker-{i}"],
                                      stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
                     for i in range(w)]
            res = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
            # each process used its own file; aggregate = bytes of all over the longest time
            agg = {}
            for test in ("push-assign", "pull"):
                secs = max(r["seconds"] for x in res for r in x["results"] if r["name"] == test)
                agg[test] = per * w / secs / 1e6
            R["by_workers"][w] = agg

    say("replication: 2 replicas against 1, durable fsync against memory, resync of a shard")
    R["replication"] = replication(sweep, big)
    say("authentication: every frame tagged (GMAC) against --no-auth shards")
    R["authentication"] = authentication(sweep)
    say("round trip: 4 KiB native read against a Python socket ping-pong")
    with cluster(1, 256 * MiB) as (meta, _):
        R["round_trip"] = round_trip(meta, 500 if args.quick else 2000)

    say("memory: shard RSS against data held")
    R["shard_rss"] = {}
    with cluster(1, 2 * big) as (meta, procs):
        import irdma

        pid = procs[0].pid
        R["shard_rss"][0] = rss(pid)
        with irdma.connect(meta, transport="tcp") as c:
            held = 0
            for step in (big // 4, big // 4, big // 2):
                c.write(f"/held-{held}", np.ones(step // 4, "<f4"), chunk_size=4 * MiB)
                held += step
                R["shard_rss"][held] = rss(pid)

    say("model rounds: 25.6 M float32 (ResNet-50's variables), 2 workers, 2 servers")
    shapes = model_shapes()
    R["rounds"] = model_rounds(shapes[:40] if args.quick else shapes, rounds)  # quick: a smoke run, not figures

    import rows

    say("sparse rows: 10,000 random rows of 256 float32, pull_rows/push_rows against contiguous transfers")
    R["rows"] = rows.run(args.quick, say)
    say("embedding training: examples/recommend.py (1M x 64 table, Adagrad, 2 workers) against ParameterServerStrategy")
    import embedding

    R["embedding"] = embedding.section(args.quick)

    import fio

    say("fio: sequential 1 MiB and random 4 KiB, read and write, on tmpfs, a pyfuse3 passthrough and the mount")
    R["fio"] = fio.run_all(args.quick, say)

    say("dd: bs=4k against bs=1M, 64 MiB into the mount and into a pyfuse3 passthrough of tmpfs")
    R["dd"] = dd_into_mount((8 if args.quick else 64) * MiB)

    say("small files: shard bytes held by 1,000 files of 4 KiB, 2 replicas")
    R["smallfiles"] = small_files_held(100 if args.quick else 1000)
    say("small files: 2,000 files of 4 KiB written then read, through a mount and by the native client")
    R["smallfiles"]["timed"] = small_files_time(200 if args.quick else 2000)

    import snapshots

    say("snapshots: create time against copies, training while taking them, bytes held (2 shards, 2 replicas)")
    R["snapshots"] = snapshots.run(args.quick, say, shapes)
    R["elapsed_s"] = time.monotonic() - t_start
    from report import write_report

    chk = regression_check(R, previous, against, None, args.quick)
    write_report(R, args.out)
    say(f"done in {R['elapsed_s']:.0f} s: {os.path.join(args.out, 'benchmarks.md')}")
    if chk:
        guard.show(chk)  # last: each ratio beside the last committed run, and what fell
    return 0


def regression_check(R: dict[str, Any], previous: dict[str, Any] | None, against: str | None,
                     only: list[str] | None, quick: bool) -> dict[str, Any] | None:
    """Record this run's ratios (R["ratios"]) and their comparison with ``previous``
    (R["regression_check"], the report's "Regression check" section); printed without a report
    when R is one section's figures. A failure of the guard never loses the run's figures."""
    import guard

    try:
        R["ratios"] = guard.compute_ratios(R)
        chk = guard.check(previous, against, R, only, quick)
    except Exception as e:  # noqa: BLE001 - benchmarks never fail on their bookkeeping
        say(f"regression check failed ({type(e).__name__}: {e}); the figures are kept")
        return None
    if "machine" in R:  # a whole report: the check is part of it
        R["regression_check"] = chk
    else:
        guard.show(chk)
    return chk


if __name__ == "__main__":
    sys.exit(main())
