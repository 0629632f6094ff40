#!/usr/bin/env python3
"""``make bench-hosts``: irdma across hosts on the test bed (issue 10's benchmarks).

The hosts are network namespaces of this machine on one bridge (:mod:`irdma.ops.testbed`), every
link rate-shaped with ``tc tbf`` in both directions:

* host 0: PostgreSQL 15 (the metadata; SQLite where PostgreSQL is not usable), link ``--rate``;
* hosts 1-3: shard hosts, link ``--rate`` (the links under test);
* hosts 4-5: worker hosts, link ``--worker-factor`` x ``--rate`` (so they are not the limit).

What it measures, every figure against a baseline taken in the same run (the machine is
shared and noisy, so ratios are what compares):

1. SoftMemoryBox II's experiment: aggregate push (assign) and pull bandwidth of 2 worker hosts
   (one native-client process each, started together on a barrier) against N = 1, 2, 3 shard
   hosts, replicas 1, TCP; each N on a fresh namespace (fresh database, fresh shard data
   directories). Baseline: one link's throughput, a plain TCP stream (Python sockets, 64 MiB)
   between a worker host and a shard host in each direction. Target: aggregate >= 0.8 x N x link.
2. Metadata latency: p50/p99 of create, open (lookup + getattr), getattr and rename through the
   ``MetaStore`` API from a worker host, on SQLite (a local file) and on PostgreSQL on host 0
   over a shaped link. Baseline: SQLite.
3. The model round (2 worker hosts, each pushes a gradient for every tensor of a ResNet-50-sized
   model, then pulls them all; ``benchmarks/workers.py``) on 3 shard hosts, PostgreSQL metadata
   against SQLite.

Writes ``docs/benchmarks-hosts.md``, ``docs/benchmarks-hosts.json`` and ``docs/bench-hosts.png``.
Everything (processes, namespaces, PostgreSQL, data) is removed at the end, also on failure
or Ctrl-C. Needs root.

    make bench-hosts                    # or: .venv/bin/python benchmarks/hosts.py
    .venv/bin/python benchmarks/hosts.py --quick     # small sizes, a smoke test (< ~60 s)
    .venv/bin/python benchmarks/hosts.py --rate 300mbit --size 128MiB
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

MiB = 1 << 20
PY = sys.executable
IRDMA = [PY, "-m", "irdma.ops.cli"]
T0 = time.monotonic()


def say(msg: str) -> None:
    with contextlib.suppress(OSError):  # a closed pipe (`| head`) must not skip the cleanup
        print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ====================================================================== roles on bed hosts
# Each runs in its own process on a host (``hosts.py _ROLE ...``) and prints one JSON line.

def _wait_file(path: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"no {path} within {timeout:.0f} s")
        time.sleep(0.002)


def role_sink(port_file: str, host: str) -> None:
    """Accept one TCP connection, read it to EOF, answer the byte count (8 bytes)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, 0))
    srv.listen(1)
    srv.settimeout(120)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(srv.getsockname()[1]))
    os.rename(port_file + ".tmp", port_file)
    conn, _ = srv.accept()
    conn.settimeout(300)
    buf = bytearray(1 << 20)
    n = 0
    while True:
        got = conn.recv_into(buf)
        if not got:
            break
        n += got
    conn.sendall(n.to_bytes(8, "little"))
    conn.close()
    print(json.dumps({"received": n}), flush=True)


def role_source(host: str, port: int, nbytes: int) -> None:
    """Send ``nbytes`` to a sink; the clock stops when the sink has counted them all."""
    s = socket.create_connection((host, port), timeout=60)
    s.settimeout(300)
    block = os.urandom(1 << 20)
    # a short untimed warm-up is not possible on one stream without counting it: the clock
    # includes slow start, which at these rates is a few milliseconds
    t0 = time.perf_counter()
    sent = 0
    while sent < nbytes:
        n = min(len(block), nbytes - sent)
        s.sendall(memoryview(block)[:n])
        sent += n
    s.shutdown(socket.SHUT_WR)
    got = int.from_bytes(s.recv(8), "little")
    secs = time.perf_counter() - t0
    s.close()
    if got != nbytes:
        raise SystemExit(f"sink counted {got} bytes of {nbytes}")
    print(json.dumps({"bytes": nbytes, "seconds": secs, "mb_s": nbytes / secs / 1e6}), flush=True)


def role_bw(meta: str, rank: int, size: int, block: int, chunk: int, concurrency: int, barrier: str,
            repeats: int) -> None:
    """One worker of the bandwidth experiment: push (assign) its own file, then pull it, each
    phase started on the coordinator's go file. Wall-clock stamps (time.time: the hosts share
    one clock) so the coordinator can take the union of both workers' intervals."""
    import numpy as np
    import trio

    from irdma.client.native import Client, layout_of
    from irdma.wire.protocol import UpdateOp

    src = np.random.default_rng(rank).integers(0, 255, block, dtype=np.uint8).tobytes()
    out: dict[str, Any] = {"rank": rank, "bytes": size, "push": [], "pull": []}

    async def main() -> None:
        async with Client.open(meta, transport="tcp") as c:
            inode = await c.create(f"/bw-{rank}", chunk_size=chunk)
            layout = layout_of(inode)
            # warm-up (untimed): a connection to every shard, the first chunk of each created
            for off in range(0, min(size, chunk * 8), chunk):
                await c.write_from(layout, off, memoryview(src)[: min(block, chunk)], UpdateOp.ASSIGN)
            bufs = [bytearray(block) for _ in range(concurrency)]
            free = list(range(concurrency))

            async def phase(kind: str) -> tuple[float, float]:
                limiter = trio.Semaphore(concurrency)

                async def one(off: int) -> None:
                    async with limiter:
                        n = min(block, size - off)
                        if kind == "push":
                            await c.write_from(layout, off, memoryview(src)[:n], UpdateOp.ASSIGN)
                        else:
                            i = free.pop()
                            try:
                                await c.read_into(layout, off, memoryview(bufs[i])[:n])
                            finally:
                                free.append(i)

                t0 = time.time()
                async with trio.open_nursery() as nursery:
                    for off in range(0, size, block):
                        nursery.start_soon(one, off)
                return t0, time.time()

            for rep in range(repeats):
                for kind in ("push", "pull"):
                    tag = f"{kind}-{rep}"
                    open(os.path.join(barrier, f"{tag}.ready.{rank}"), "w").close()
                    await trio.to_thread.run_sync(_wait_file, os.path.join(barrier, f"{tag}.go"), 180.0)
                    out[kind].append(await phase(kind))
                    if kind == "push" and rep == 0:
                        await c.meta.extend(inode.ino, size, time.time_ns())
            # the bytes pulled are the bytes pushed (checked once, untimed)
            got = bytearray(block)
            await c.read_into(layout, 0, memoryview(got))
            out["verified"] = bytes(got) == src

    trio.run(main)
    print(json.dumps(out), flush=True)


def role_metalat(url: str, n: int) -> None:
    """p50/p99 (us) of create, open (lookup + getattr), getattr and rename, ``n`` each."""
    from irdma.meta import open_meta

    m = open_meta(url, create=True)
    try:
        if not m.shards():
            m.add_shard("10.213.0.250:7700")  # files need a stripe; no data moves here
        reg = 0o100644
        for i in range(20):  # warm-up: connections, statement caches
            ino = m.create(1, f"warm{i}".encode(), reg, 0, 0)
            m.getattr(ino.ino)
            m.lookup(1, f"warm{i}".encode())
        names = [f"f{i:05d}".encode() for i in range(n)]
        res: dict[str, list[float]] = {"create": [], "open": [], "getattr": [], "rename": []}
        inos = []
        pc = time.perf_counter
        for name in names:
            t = pc()
            inos.append(m.create(1, name, reg, 0, 0).ino)
            res["create"].append(pc() - t)
        for name in names:
            t = pc()
            ino = m.lookup(1, name)
            m.getattr(ino.ino)
            res["open"].append(pc() - t)
        for ino in inos:
            t = pc()
            m.getattr(ino)
            res["getattr"].append(pc() - t)
        for name in names:
            t = pc()
            m.rename(1, name, 1, b"r" + name)
            res["rename"].append(pc() - t)
    finally:
        m.close()
    out = {}
    for op, xs in res.items():
        us = sorted(x * 1e6 for x in xs)
        out[op] = {"n": len(us), "p50_us": statistics.median(us),
                   "p99_us": us[min(len(us) - 1, int(round(0.99 * (len(us) - 1))))]}
    print(json.dumps(out), flush=True)


def role_model_setup(meta: str, shapes_file: str) -> None:
    """Create the model's tensors (zeros, update op add) as run.py's model round does."""
    import numpy as np

    import irdma

    with open(shapes_file) as f:
        shapes = json.load(f)
    with irdma.connect(meta, transport="tcp") as c:
        c.makedirs("/model")
        for i, s in enumerate(shapes):
            n = 4 * int(np.prod(s))
            chunk = 64 * 1024
            while chunk < n and chunk < 4 * MiB:
                chunk *= 2
            c.write(f"/model/l{i:03d}", np.zeros(n // 4, "<f4"), chunk_size=chunk)
            c.set_update_op(f"/model/l{i:03d}", "add")
    print(json.dumps({"tensors": len(shapes)}), flush=True)


ROLES = {"_sink", "_source", "_bw", "_metalat", "_model_setup"}


def run_role(argv: list[str]) -> None:
    role, rest = argv[0], argv[1:]
    if role == "_sink":
        role_sink(rest[0], rest[1])
    elif role == "_source":
        role_source(rest[0], int(rest[1]), int(rest[2]))
    elif role == "_bw":
        role_bw(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]), int(rest[5]), rest[6], int(rest[7]))
    elif role == "_metalat":
        role_metalat(rest[0], int(rest[1]))
    elif role == "_model_setup":
        role_model_setup(rest[0], rest[1])


# ====================================================================== the coordinator
class Bench:
    def __init__(self, args: argparse.Namespace, bed: Any, work: str, pg: Any) -> None:
        self.args, self.bed, self.work, self.pg = args, bed, work, pg
        self.h = bed.hosts
        self.shard_hosts, self.workers = self.h[1:4], self.h[4:6]
        self.env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "TF_CPP_MIN_LOG_LEVEL": "3"}
        if pg is not None:
            self.env["PGPASSFILE"] = pg.passfile
        self.seq = 0

    def me(self, role: str, *args: object) -> list[str]:
        return [PY, os.path.abspath(__file__), role, *map(str, args)]

    def run_json(self, host: Any, argv: list[str], timeout: float) -> dict[str, Any]:
        res = self.bed.run(host, argv, timeout=timeout, capture_output=True, text=True, env=self.env)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[1:4])} on host {host.index} failed ({res.returncode}):\n"
                               f"{res.stderr[-3000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    # ------------------------------------------------------------ baseline: one link
    def link(self, src: Any, dst: Any, nbytes: int) -> float:
        port_file = os.path.join(self.work, f"sink-{self.seq}.port")
        self.seq += 1
        sink = self.bed.popen(dst, self.me("_sink", port_file, dst.address), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=self.env)
        end = time.monotonic() + 60
        while not os.path.exists(port_file):
            if sink.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the sink on host {dst.index} did not start: {sink.stderr.read()[-2000:]}")
            time.sleep(0.01)
        with open(port_file) as f:
            port = int(f.read())
        r = self.run_json(src, self.me("_source", dst.address, port, nbytes), timeout=300)
        sink.wait(60)
        return float(r["mb_s"])

    def baseline(self) -> dict[str, float]:
        nbytes = self.args.link_bytes
        w, s = self.workers[0], self.shard_hosts[0]
        up = self.link(w, s, nbytes)  # the push direction: worker -> shard
        down = self.link(s, w, nbytes)  # the pull direction: shard -> worker
        say(f"  one link: worker->shard {up:.1f} MB/s, shard->worker {down:.1f} MB/s"
            f" (tc rate {self.args.rate} = {rate_mb_s(self.args.rate):.1f} MB/s)")
        return {"push": up, "pull": down}

    # ------------------------------------------------------------ a namespace with N shards
    @contextlib.contextmanager
    def namespace(self, engine: str, shards: int, capacity: int) -> Iterator[str]:
        self.seq += 1
        tag = f"ns{self.seq}"
        d = os.path.join(self.work, tag)
        os.makedirs(d)
        key = os.path.join(d, "cluster.key")
        if engine == "postgresql":
            url = self.pg.create_database(f"irdma_{tag}")
        else:
            url = f"sqlite://{os.path.join(d, 'meta.db')}"
        env = {**self.env, "IRDMA_KEY_FILE": key}
        res = self.bed.run(self.workers[0], [*IRDMA, "format", url, "--key-file", key, "--replicas", "1"],
                           timeout=120, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise RuntimeError(f"irdma format failed: {res.stderr[-2000:]}")
        procs = []
        try:
            for h in self.shard_hosts[:shards]:
                log = open(os.path.join(d, f"shard-{h.index}.log"), "w")
                procs.append(self.bed.popen(
                    h, [*IRDMA, "server", "--listen", f"{h.address}:7700", "--meta", url, "--transport", "tcp",
                        "--data-dir", os.path.join(d, f"shard-{h.index}"), "--capacity", str(capacity),
                        "--durability", "memory", "--key-file", key],
                    stdout=log, stderr=subprocess.STDOUT, env=env))
                log.close()
            # every shard listening before anything connects: a client that connects to a shard
            # registered but not yet serving records it down, and it comes back as `syncing`
            end = time.monotonic() + 90
            for h, p in zip(self.shard_hosts[:shards], procs, strict=True):
                logf = os.path.join(d, f"shard-{h.index}.log")
                while " serving " not in read_text(logf):
                    if p.poll() is not None or time.monotonic() > end:
                        raise RuntimeError(f"shard on host {h.index} did not start:\n{read_text(logf)[-2000:]}")
                    time.sleep(0.05)
            try:
                self.wait_for_shards(url, [f"{h.address}:7700" for h in self.shard_hosts[:shards]], procs, env)
            except RuntimeError as exc:
                logs = ""
                for h in self.shard_hosts[:shards]:
                    with open(os.path.join(d, f"shard-{h.index}.log")) as f:
                        logs += f"\n--- shard host {h.index} ({h.address}):\n{f.read()[-1500:]}"
                raise RuntimeError(f"{exc}{logs}") from None
            self.key = key
            yield url
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
            shutil.rmtree(d, ignore_errors=True)

    def wait_for_shards(self, url: str, addresses: list[str], procs: list[Any], env: dict[str, str],
                        deadline_s: float = 90) -> None:
        end = time.monotonic() + deadline_s
        delay = 0.2
        while True:
            res = self.bed.run(self.workers[0], [*IRDMA, "shard", "list", "--meta", url], timeout=60,
                               capture_output=True, text=True, env=env)
            rows = res.stdout.splitlines()
            if res.returncode == 0 and all(any(a in r and " up " in r for r in rows) for a in addresses):
                return
            if time.monotonic() > end or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the shards did not all come up within {deadline_s:.0f} s:\n"
                                   f"{res.stdout}{res.stderr}")
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)

    # ------------------------------------------------------------ 1. bandwidth against N
    def bandwidth(self, engine: str, n: int) -> dict[str, Any]:
        a = self.args
        size = a.size
        with self.namespace(engine, n, capacity=2 * size + 128 * MiB) as url:
            barrier = tempfile.mkdtemp(prefix="barrier-", dir=self.work)
            env = {**self.env, "IRDMA_KEY_FILE": self.key}
            procs = [self.bed.popen(w, self.me("_bw", url, r, size, a.block, a.chunk, a.concurrency, barrier,
                                               a.repeats),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                     for r, w in enumerate(self.workers)]
            try:
                for rep in range(a.repeats):
                    for kind in ("push", "pull"):
                        tag = f"{kind}-{rep}"
                        end = time.monotonic() + 180
                        while len(glob.glob(os.path.join(barrier, f"{tag}.ready.*"))) < len(procs):
                            dead = [p for p in procs if p.poll() is not None]
                            if dead or time.monotonic() > end:
                                err = dead[0].stderr.read()[-3000:] if dead else "timeout"
                                raise RuntimeError(f"bandwidth workers did not get ready for {tag}: {err}")
                            time.sleep(0.005)
                        open(os.path.join(barrier, f"{tag}.go"), "w").close()
                outs = []
                for p in procs:
                    stdout, stderr = p.communicate(timeout=600)
                    if p.returncode != 0:
                        raise RuntimeError(f"a bandwidth worker failed ({p.returncode}): {stderr[-3000:]}")
                    outs.append(json.loads(stdout.strip().splitlines()[-1]))
            finally:
                for p in procs:
                    if p.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(p.pid, signal.SIGKILL)
                        p.wait(10)
        res: dict[str, Any] = {"shards": n, "verified": all(o.get("verified") for o in outs)}
        total = sum(o["bytes"] for o in outs)
        for kind in ("push", "pull"):
            runs = []
            for rep in range(a.repeats):
                t0 = min(o[kind][rep][0] for o in outs)
                t1 = max(o[kind][rep][1] for o in outs)
                runs.append(total / (t1 - t0) / 1e6)
            res[kind] = {"runs_mb_s": runs, "mb_s": max(runs)}
        return res

    # ------------------------------------------------------------ 2. metadata latency
    def metalat(self, engine: str) -> dict[str, Any]:
        if engine == "postgresql":
            self.seq += 1
            url = self.pg.create_database(f"irdma_lat{self.seq}")
        else:
            url = f"sqlite://{os.path.join(self.work, f'lat{self.seq}.db')}"
            self.seq += 1
        return self.run_json(self.workers[0], self.me("_metalat", url, self.args.meta_ops), timeout=600)

    # ------------------------------------------------------------ 3. the model round
    def model_round(self, engine: str, shapes_file: str) -> dict[str, Any]:
        a = self.args
        with self.namespace(engine, 3, capacity=a.model_capacity) as url:
            env = {**self.env, "IRDMA_KEY_FILE": self.key}
            r = self.bed.run(self.workers[0], self.me("_model_setup", url, shapes_file), timeout=600,
                             capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise RuntimeError(f"model setup failed: {r.stderr[-3000:]}")
            start = os.path.join(self.work, f"model-start-{self.seq}")
            procs = [self.bed.popen(w, [PY, os.path.join(HERE, "workers.py"), "irdma-native", url, shapes_file,
                                        str(a.rounds), str(rank), start],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                     for rank, w in enumerate(self.workers)]
            try:
                end = time.monotonic() + 300
                while len(glob.glob(start + ".ready.*")) < len(procs):
                    dead = [p for p in procs if p.poll() is not None]
                    if dead or time.monotonic() > end:
                        err = dead[0].stderr.read()[-3000:] if dead else "timeout"
                        raise RuntimeError(f"model workers did not get ready: {err}")
                    time.sleep(0.01)
                open(start, "w").close()
                outs = []
                for p in procs:
                    stdout, stderr = p.communicate(timeout=600)
                    if p.returncode != 0:
                        raise RuntimeError(f"a model worker failed ({p.returncode}): {stderr[-3000:]}")
                    outs.append(json.loads(stdout.strip().splitlines()[-1]))
            finally:
                for p in procs:
                    if p.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(p.pid, signal.SIGKILL)
                        p.wait(10)
        round_s = max(o["round_s"] for o in outs)
        nbytes = sum(o["bytes"] for o in outs)
        return {"round_s": round_s, "bytes_per_round": nbytes, "mb_s": nbytes / round_s / 1e6}


def rate_mb_s(rate: str) -> float:
    from irdma.ops.testbed import _rate_bits

    return _rate_bits(rate) / 8 / 1e6


def scale_rate(rate: str, factor: int) -> str:
    from irdma.ops.testbed import _rate_bits

    bits = _rate_bits(rate) * factor
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits % mult == 0:
            return f"{bits // mult}{unit}"
    return f"{bits}bit"


def model_shapes(quick: bool) -> tuple[list[list[int]], str]:
    """ResNet-50's variables (25.6 M float32 in 320 tensors) from Keras without weights; in
    --quick (or where Keras is missing) a synthetic model of 1/8 the size with the same mix."""
    if not quick:
        code = ("import os, json; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'\nimport keras\n"
                "print(json.dumps([list(v.shape) for v in keras.applications.ResNet50(weights=None).weights]))")
        res = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=300)
        if res.returncode == 0:
            return json.loads(res.stdout.strip().splitlines()[-1]), "ResNet-50 (Keras, no weights)"
        say(f"  Keras model unavailable ({res.stderr.strip().splitlines()[-1:]}): a synthetic model instead")
    shapes = [[3, 3, 64, 64]] * 16 + [[1, 1, 256, 512]] * 8 + [[512]] * 16
    return shapes, "synthetic (40 tensors)"


def pct(x: float) -> str:
    return f"{x:.2f}"


def main() -> int:
    from irdma.ops.testbed import PostgresServer, TestBed
    from irdma.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test (under ~60 s)")
    ap.add_argument("--rate", default="400mbit", help="the shard hosts' (and host 0's) link rate, tc units")
    ap.add_argument("--worker-factor", type=int, default=4, help="worker links are this many times --rate")
    ap.add_argument("--size", default=None, help="bytes each worker pushes and pulls per phase [128MiB; quick 16MiB]")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each phase per N; the best is kept [2; quick 1]")
    ap.add_argument("--block", default="4MiB", help="bytes per request")
    ap.add_argument("--chunk", default="4MiB", help="chunk size of the test files")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight per worker")
    ap.add_argument("--meta-ops", type=int, default=None, help="operations of each kind for metadata latency [300]")
    ap.add_argument("--rounds", type=int, default=None, help="model rounds [3; quick 1]")
    ap.add_argument("--meta", choices=("auto", "sqlite", "postgresql"), default="auto",
                    help="the metadata of the bandwidth experiment (auto: PostgreSQL where it works)")
    ap.add_argument("--skip-model", action="store_true", help="leave out the model round")
    ap.add_argument("--out", default=os.path.join(REPO, "docs"), help="where the report goes")
    args = ap.parse_args()
    args.size = parse_size(args.size or ("16MiB" if args.quick else "128MiB"))
    args.block, args.chunk = parse_size(args.block), parse_size(args.chunk)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.meta_ops = args.meta_ops or (50 if args.quick else 300)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.model_runs = 1 if args.quick else 2
    args.link_bytes = 16 * MiB if args.quick else 64 * MiB
    args.model_capacity = 512 * MiB
    if os.geteuid() != 0:
        print("bench-hosts needs root (network namespaces): run it as root", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    R: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"nproc": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "rate": args.rate, "worker_rate": scale_rate(args.rate, args.worker_factor),
        "size": args.size, "block": args.block, "chunk": args.chunk, "concurrency": args.concurrency,
        "repeats": args.repeats, "quick": args.quick, "load_start": loadavg(),
    }
    say(f"bench-hosts: load average {R['load_start']}, shard links {args.rate}, worker links {R['worker_rate']}")
    work = tempfile.mkdtemp(prefix="irdma-bench-hosts-")
    os.chmod(work, 0o755)
    bed = pg = None
    rc = 1
    try:
        say("building the test bed: 6 hosts (0: metadata, 1-3: shards, 4-5: workers)")
        bed = TestBed(6, rate=args.rate, delay_us=50, rates={4: R["worker_rate"], 5: R["worker_rate"]})
        R["delay_shaped"] = bed.delay_shaped
        say(f"  delay shaped (netem): {bed.delay_shaped}")
        if args.meta in ("auto", "postgresql"):
            try:
                say("PostgreSQL 15 on host 0")
                pg = PostgresServer(listen=bed.hosts[0].address, port=5432, prefix=bed.hosts[0].nsenter)
                os.environ["PGPASSFILE"] = pg.passfile
                probe = pg.create_database("irdma_probe")
                res = bed.run(bed.hosts[4], [PY, "-c", "import sys; from irdma.meta import open_meta; "
                                             "open_meta(sys.argv[1], create=True).close()", probe],
                              timeout=120, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": REPO, "PGPASSFILE": pg.passfile})
                if res.returncode != 0:
                    raise RuntimeError((res.stderr.strip().splitlines() or ["?"])[-1])
                R["postgresql"] = "yes"
            except Exception as exc:  # noqa: BLE001 - reported, SQLite instead
                if args.meta == "postgresql":
                    raise
                say(f"  PostgreSQL metadata not usable ({exc!s:.300}): SQLite only")
                R["postgresql"] = f"no: {exc!s:.300}"
                if pg is not None:
                    pg.close()
                pg = None
        engine = "postgresql" if pg is not None else "sqlite"
        R["bandwidth_meta"] = engine
        b = Bench(args, bed, work, pg)

        say(f"1. baseline: one link, a TCP stream of {args.link_bytes >> 20} MiB each way")
        links = [b.baseline()]
        R["bandwidth"] = []
        for n in (1, 2, 3):
            say(f"1. bandwidth: 2 workers x {args.size >> 20} MiB against {n} shard host(s), {engine} metadata,"
                f" {args.repeats} run(s) (load {loadavg()})")
            r = b.bandwidth(engine, n)
            say(f"  N={n}: push {r['push']['mb_s']:.1f} MB/s {r['push']['runs_mb_s']},"
                f" pull {r['pull']['mb_s']:.1f} MB/s {r['pull']['runs_mb_s']}, verified {r['verified']}")
            R["bandwidth"].append(r)
        say("1. baseline again (the machine drifts: the mean of both is the link)")
        links.append(b.baseline())
        R["links"] = links
        link = {k: statistics.mean(x[k] for x in links) for k in ("push", "pull")}
        R["link"] = link
        for r in R["bandwidth"]:
            for kind in ("push", "pull"):
                r[kind]["ideal_mb_s"] = r["shards"] * link[kind]
                r[kind]["ratio"] = r[kind]["mb_s"] / r[kind]["ideal_mb_s"]

        R["metalat"] = {}
        for eng in ["sqlite"] + (["postgresql"] if pg is not None else []):
            say(f"2. metadata latency on {eng}, {args.meta_ops} ops each (load {loadavg()})")
            R["metalat"][eng] = b.metalat(eng)
            say("  " + ", ".join(f"{op} p50 {v['p50_us']:.0f} us p99 {v['p99_us']:.0f} us"
                                 for op, v in R["metalat"][eng].items()))

        if not args.skip_model:
            shapes, what = model_shapes(args.quick)
            floats = sum(int(_prod(s)) for s in shapes)
            R["model"] = {"shapes": what, "tensors": len(shapes), "floats": floats, "rounds": args.rounds}
            shapes_file = os.path.join(work, "shapes.json")
            with open(shapes_file, "w") as f:
                json.dump(shapes, f)
            engines = ["sqlite"] + (["postgresql"] if pg is not None else [])
            runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
            for k in range(args.model_runs):  # alternately: the machine drifts
                for eng in engines:
                    say(f"3. model round ({what}, {floats / 1e6:.1f} M float32 in {len(shapes)} tensors),"
                        f" 2 workers, 3 shards, {eng} metadata, pass {k + 1}/{args.model_runs} (load {loadavg()})")
                    r = b.model_round(eng, shapes_file)
                    runs[eng].append(r)
                    say(f"  {eng}: {r['round_s']:.2f} s per round, {r['mb_s']:.1f} MB/s")
            for eng, rs in runs.items():
                round_s = statistics.mean(r["round_s"] for r in rs)
                R["model"][eng] = {"round_s": round_s, "runs_s": [r["round_s"] for r in rs],
                                   "bytes_per_round": rs[0]["bytes_per_round"],
                                   "mb_s": rs[0]["bytes_per_round"] / round_s / 1e6}
        R["load_end"] = loadavg()
        R["seconds"] = time.monotonic() - T0
        write_report(R, args.out)
        rc = 0
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        rc = 130
    finally:
        say("stopping every process and removing the test bed")
        try:
            if pg is not None:
                pg.close()
        finally:
            try:
                if bed is not None:
                    bed.close()
            finally:
                shutil.rmtree(work, ignore_errors=True)
    say(f"bench-hosts {'done' if rc == 0 else 'FAILED'} in {time.monotonic() - T0:.0f} s")
    return rc


def _prod(s: list[int]) -> int:
    p = 1
    for x in s:
        p *= x
    return p


# ====================================================================== the report
def write_report(R: dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "benchmarks-hosts.json"), "w") as f:
        json.dump(R, f, indent=1)
    plot(R, os.path.join(out, "bench-hosts.png"))
    link = R["link"]
    L: list[str] = []
    w = L.append
    w("# irdma across hosts: benchmarks (issue 10)\n")
    w(f"Run {R['date']}{' (--quick: small sizes, a smoke test)' if R['quick'] else ''}, in "
      f"{R['seconds']:.0f} s, on {R['machine']['nproc']} cores, Linux {R['machine']['kernel']}, "
      f"Python {R['machine']['python']}; load average {R['load_start']} at the start, {R['load_end']} at the end "
      "(the machine is shared: every figure is a ratio to a baseline measured in the same run).\n")
    w("The hosts are network namespaces of this machine on one bridge (`irdma/ops/testbed.py`): host 0 "
      "runs the metadata (PostgreSQL 15), hosts 1-3 are shard hosts, hosts 4-5 worker hosts. Every link "
      f"is shaped with `tc tbf` in both directions: shard hosts and host 0 at **{R['rate']}** "
      f"({rate_mb_s(R['rate']):.1f} MB/s), worker hosts at **{R['worker_rate']}** (so they are not the "
      "limit). " + ("Links are rate-shaped only: this kernel has no `sch_netem`, so no delay is added "
                    "(`TestBed.delay_shaped` is False)." if not R.get("delay_shaped") else
                    "The kernel has `sch_netem`: each link also has a 50 us one-way delay."))
    w("")
    w(f"Metadata of the bandwidth experiment: **{R['bandwidth_meta']}**"
      + ("" if R.get("postgresql") == "yes" else f" (PostgreSQL: {R.get('postgresql')})") + ".\n")

    w("## 1. Aggregate bandwidth against shard hosts (SoftMemoryBox II's experiment)\n")
    w(f"2 worker hosts, one native-client process each (`irdma.Client`, TCP), started together on a "
      f"barrier; each pushes (`assign`) its own file of {R['size'] >> 20} MiB, then pulls it, in "
      f"{R['block'] >> 20} MiB requests, {R['concurrency']} in flight, chunks of {R['chunk'] >> 20} MiB, "
      "replicas 1. Aggregate = both workers' bytes over the union of their intervals; the best of "
      f"{R['repeats']} run(s). Each N on a fresh namespace (fresh database, fresh shard data directories). "
      "Pulled bytes were checked against the pushed ones.\n")
    w(f"Baseline, one link: a plain TCP stream (Python sockets, {('16' if R['quick'] else '64')} MiB) over one "
      "shaped link, measured before and after the sweep, the mean kept: worker->shard (push direction) "
      + ", ".join(f"{x['push']:.1f}" for x in R["links"]) + f" -> **{link['push']:.1f} MB/s**; shard->worker "
      "(pull direction) " + ", ".join(f"{x['pull']:.1f}" for x in R["links"]) + f" -> **{link['pull']:.1f} MB/s**.\n")
    w("| shard hosts N | push MB/s | N x link | ratio | target >= 0.8 | pull MB/s | N x link | ratio | target >= 0.8 |")
    w("|---:|---:|---:|---:|:--|---:|---:|---:|:--|")
    for r in R["bandwidth"]:
        p, q = r["push"], r["pull"]
        w(f"| {r['shards']} | {p['mb_s']:.1f} | {p['ideal_mb_s']:.1f} | {pct(p['ratio'])} | "
          f"{'met' if p['ratio'] >= 0.8 else '**not met**'} | {q['mb_s']:.1f} | {q['ideal_mb_s']:.1f} | "
          f"{pct(q['ratio'])} | {'met' if q['ratio'] >= 0.8 else '**not met**'} |")
    w("")
    w("Runs (MB/s): " + "; ".join(
        f"N={r['shards']}: push {', '.join(f'{x:.1f}' for x in r['push']['runs_mb_s'])}, "
        f"pull {', '.join(f'{x:.1f}' for x in r['pull']['runs_mb_s'])}" for r in R["bandwidth"]) + ".\n")
    w("![aggregate bandwidth against shard hosts](bench-hosts.png)\n")

    w("## 2. Metadata latency\n")
    ml = R.get("metalat", {})
    n_ops = next(iter(ml.values()))["create"]["n"] if ml else 0
    w(f"Through the `MetaStore` API (`irdma.meta.open_meta(url)`) from worker host 4, {n_ops} of each, "
      "one at a time: create (a regular file in the root), open (lookup + getattr), getattr, rename. "
      "SQLite: a file on the shared filesystem, opened locally. PostgreSQL: on host 0, reached over "
      f"the {R['rate']} links of hosts 0 and 4. Microseconds; ratio = PostgreSQL / SQLite.\n")
    if "postgresql" in ml:
        w("| op | SQLite p50 | SQLite p99 | PostgreSQL p50 | PostgreSQL p99 | p50 ratio | p99 ratio |")
        w("|:--|---:|---:|---:|---:|---:|---:|")
        for op in ("create", "open", "getattr", "rename"):
            s, g = ml["sqlite"][op], ml["postgresql"][op]
            w(f"| {op} | {s['p50_us']:.0f} | {s['p99_us']:.0f} | {g['p50_us']:.0f} | {g['p99_us']:.0f} | "
              f"{g['p50_us'] / s['p50_us']:.1f} | {g['p99_us'] / s['p99_us']:.1f} |")
    elif ml:
        w("PostgreSQL metadata was not usable in this run; SQLite only.\n")
        w("| op | SQLite p50 | SQLite p99 |")
        w("|:--|---:|---:|")
        for op in ("create", "open", "getattr", "rename"):
            s = ml["sqlite"][op]
            w(f"| {op} | {s['p50_us']:.0f} | {s['p99_us']:.0f} |")
    w("")
    if "model" in R:
        m = R["model"]
        w("## 3. The model round, PostgreSQL metadata against SQLite\n")
        w(f"2 worker hosts (`benchmarks/workers.py irdma-native`, started on a barrier), 3 shard hosts, "
          f"replicas 1: each worker pushes a gradient (`add`) for every tensor of {m['shapes']}: "
          f"{m['floats'] / 1e6:.1f} M float32 in {m['tensors']} tensors, then pulls them all; seconds per "
          f"round (the slower worker's mean of {m['rounds']} round(s) after an untimed one), each engine "
          f"{len(m['sqlite']['runs_s'])} time(s) alternately on a fresh namespace, the mean kept. The layouts are "
          "resolved once before the clock starts, so the round measures the data path of each namespace: "
          "the metadata engine should make no difference beyond noise.\n")
        if "postgresql" in m:
            s, g = m["sqlite"], m["postgresql"]
            w("| metadata | s per round | runs (s) | MB/s (both workers) | ratio to SQLite (time) |")
            w("|:--|---:|:--|---:|---:|")
            for name, x in (("SQLite", s), ("PostgreSQL", g)):
                w(f"| {name} | {x['round_s']:.2f} | {', '.join(f'{v:.2f}' for v in x['runs_s'])} | "
                  f"{x['mb_s']:.1f} | {x['round_s'] / s['round_s']:.2f} |")
            ideal = 3 * min(link["push"], link["pull"])
            w(f"\nFor scale: a round moves every byte over the 3 shard links (pushes, then pulls), so its ideal "
              f"is 3 x one link = {ideal:.1f} MB/s; the round reaches {s['mb_s'] / ideal:.2f} (SQLite) and "
              f"{g['mb_s'] / ideal:.2f} (PostgreSQL) of it. Not investigated here; unlike section 1, the pushes are "
              "`add` (summed by the shards' CPU) and most of the tensors are small.")
        else:
            s = m["sqlite"]
            w(f"SQLite only (PostgreSQL not usable): {s['round_s']:.2f} s per round, {s['mb_s']:.1f} MB/s.")
        w("")
    w("## How to reproduce\n")
    w("```sh\nmake bench-hosts                                  # as root: writes this file, "
      "docs/bench-hosts.png and docs/benchmarks-hosts.json\n"
      ".venv/bin/python benchmarks/hosts.py --quick      # small sizes, a smoke test\n"
      ".venv/bin/python benchmarks/hosts.py --rate 300mbit --size 256MiB\n```\n")
    with open(os.path.join(out, "benchmarks-hosts.md"), "w") as f:
        f.write("\n".join(L))
    say(f"wrote {os.path.join(out, 'benchmarks-hosts.md')}, bench-hosts.png, benchmarks-hosts.json")


def plot(R: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["shards"] for r in R["bandwidth"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    link = R["link"]
    xs = [0, *ns]
    ax.plot(xs, [x * link["push"] for x in xs], "--", color="C0", alpha=0.6, label="ideal push: N x link")
    ax.plot(xs, [x * link["pull"] for x in xs], ":", color="C1", alpha=0.8, label="ideal pull: N x link")
    ax.plot(xs, [0.8 * x * min(link.values()) for x in xs], "-", color="grey", alpha=0.3, lw=6,
            label="target: 0.8 x N x link")
    ax.plot(ns, [r["push"]["mb_s"] for r in R["bandwidth"]], "o-", color="C0", label="push (assign), 2 workers")
    ax.plot(ns, [r["pull"]["mb_s"] for r in R["bandwidth"]], "s-", color="C1", label="pull, 2 workers")
    ax.set_xlabel("shard hosts N")
    ax.set_ylabel("aggregate MB/s")
    ax.set_xticks(ns)
    ax.set_xlim(0, max(ns) + 0.2)
    ax.set_ylim(0, None)
    ax.set_title(f"irdma on the test bed: links {R['rate']}, workers {R['worker_rate']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ROLES:
        run_role(sys.argv[1:])
        sys.exit(0)
    sys.exit(main())
