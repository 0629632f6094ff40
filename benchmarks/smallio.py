"""Small random reads (issue 13): 4 KiB preads through irdma's mount against the native client
doing the same reads, and against the minimal pyfuse3 passthrough of tmpfs (the FUSE ceiling).

    python benchmarks/smallio.py [--seconds S] [--threads 1,16] [--only mount,native,passthrough]
                                 [--base-tree DIR]

One local cluster (4 shards, 1 replica, TCP) holds a 64 MiB file written through the mount.
Per target and thread count: every thread reads 4 KiB at random aligned offsets for ``--seconds``
and the figures are IOPS (all threads together) and completion latency p50 / p99 (microseconds).
Mount reads go through an O_DIRECT descriptor (``direct``: no page cache, every read a FUSE
request) and through a normal one after POSIX_FADV_DONTNEED and POSIX_FADV_RANDOM (``cached``:
a miss is a FUSE read of one page, the kernel's read-ahead off). Native reads are
``Client.read_into`` of 4 KiB from trio tasks, one task per "thread".

``--base-tree DIR``: also mount the same cluster with the irdma tree in DIR (say a
``git worktree`` of the commit before a change) and measure it in the same run, alternating
with this tree's mount, so a before/after comparison sees the same machine.

Prints one JSON object: ``{target: {"direct x16": {"iops":, "p50_us":, "p99_us":}}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

BLOCK = 4096
FILE_BYTES = 64 << 20


#: Processes whose CPU time per read is reported: {"mount": pid, "shards": [pids], ...}.
PIDS: dict[str, list[int]] = {}


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_now() -> dict[str, float]:
    return {k: sum(cpu_seconds(p) for p in pids) for k, pids in PIDS.items()}


def _figures(samples: list[float], elapsed: float, cpu0: dict[str, float] | None = None) -> dict[str, float]:
    us = sorted(s * 1e6 for s in samples)
    out = {"iops": round(len(us) / elapsed), "p50_us": round(statistics.median(us), 1),
           "p99_us": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1), "n": len(us)}
    if cpu0:  # CPU microseconds per read, by process
        for k, v in _cpu_now().items():
            out[f"cpu_us_{k}"] = round((v - cpu0[k]) / len(us) * 1e6, 1)
    return out


def bench_path(path: str, threads: int, seconds: float, direct: bool) -> dict[str, float]:
    """``threads`` threads of random 4 KiB preads of ``path`` for ``seconds``."""
    size = os.path.getsize(path)
    blocks = size // BLOCK
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = [os.open(path, flags) for _ in range(threads)]
    if not direct:
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    samples: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def worker(i: int) -> None:
        rng = random.Random(i)
        buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
        fd, out = fds[i], samples[i]
        start.wait()
        while True:
            off = rng.randrange(blocks) * BLOCK
            t0 = time.perf_counter()
            n = os.preadv(fd, [buf], off)
            t1 = time.perf_counter()
            assert n == BLOCK, n
            out.append(t1 - t0)
            if t1 > stop_at[0]:
                return

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    stop_at[0] = time.perf_counter() + seconds
    cpu0 = _cpu_now()
    t0 = time.perf_counter()
    start.wait()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return _figures([s for ss in samples for s in ss], elapsed, cpu0)


def bench_native(meta_url: str, name: str, threads: int, seconds: float) -> dict[str, float]:
    """The same reads with the native client (:meth:`irdma.Client.read_into`), ``threads`` tasks."""
    import trio

    from irdma.client.native import Client, layout_of

    async def main() -> dict[str, float]:
        async with Client.open(meta_url, transport="tcp") as client:
            inode = await client.stat(name)
            layout = layout_of(inode)
            chunks = await client.meta.chunk_map(inode.ino)
            blocks = inode.size // BLOCK
            samples: list[float] = []
            buf0 = memoryview(bytearray(BLOCK))
            await client.read_into(layout, 0, buf0, chunks)  # connections up
            stop_at = trio.current_time() + seconds

            async def one(i: int) -> None:
                rng = random.Random(i)
                buf = memoryview(bytearray(BLOCK))
                while True:
                    t0 = time.perf_counter()
                    await client.read_into(layout, rng.randrange(blocks) * BLOCK, buf, chunks)
                    samples.append(time.perf_counter() - t0)
                    if trio.current_time() > stop_at:
                        return

            cpu0 = _cpu_now()
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(threads):
                    nursery.start_soon(one, i)
            return _figures(samples, time.perf_counter() - t0, cpu0)

    return trio.run(main)


@contextlib.contextmanager
def mount(meta_url: str, where: str, tree: str | None = None) -> Iterator[tuple[str, int]]:
    """A mount of the cluster (its pid with it), with the irdma tree ``tree`` first on the path."""
    from irdma.fs.mount import spawn_mount, unmount

    os.makedirs(where, exist_ok=True)
    old = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = tree
    try:
        pid = spawn_mount(meta_url, where, transport="tcp", log_file=where + ".log")
    finally:
        if tree is not None:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
    try:
        yield where, pid
    finally:
        unmount(where)


@contextlib.contextmanager
def cluster() -> Iterator[tuple[str, str]]:
    from irdma.ops import cluster as C

    d = tempfile.mkdtemp(prefix="irdma-smallio-")
    try:
        url = C.up(os.path.join(d, "c"), 4, 256 << 20, transport="tcp", fresh=True, replicas=1)
        PIDS["shards"] = [s.pid for s in C.read_state(os.path.join(d, "c"))]
        PIDS["self"] = [os.getpid()]
        yield url, d
    finally:
        with contextlib.suppress(Exception):
            C.down(os.path.join(d, "c"))
        shutil.rmtree(d, ignore_errors=True)


def write_file(path: str) -> None:
    data = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(FILE_BYTES // len(data)):
            f.write(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", default="1,16")
    ap.add_argument("--only", default="mount,native,passthrough")
    ap.add_argument("--base-tree", help="an older irdma tree to mount beside this one (A/B)")
    ap.add_argument("--rounds", type=int, default=1, help="A/B rounds (alternating)")
    ap.add_argument("--hold", type=float, default=0.0,
                    help="after the file is written, run 16 direct readers on this tree's mount for this many"
                         " seconds first (to attach a profiler: the mount's pid is printed)")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    only = set(args.only.split(","))
    out: dict[str, dict[str, dict[str, float]]] = {}
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    def run_mount(label: str, mnt: str, r: int) -> None:
        path = os.path.join(mnt, "f")
        PIDS["mount"] = [pids[label]]
        for n in threads:
            for kind, direct in (("direct", True), ("cached", False)):
                key = f"{kind} x{n}" + (f" r{r}" if args.rounds > 1 else "")
                out.setdefault(label, {})[key] = got = bench_path(path, n, args.seconds, direct)
                say(f"{label} {key}: {got}")

    if "passthrough" in only:
        from fio import passthrough  # benchmarks/fio.py

        with passthrough() as mnt:
            write_file(os.path.join(mnt, "f"))
            for n in threads:
                out.setdefault("passthrough", {})[f"direct x{n}"] = got = bench_path(
                    os.path.join(mnt, "f"), n, args.seconds, True)
                say(f"passthrough direct x{n}: {got}")
    with cluster() as (url, d):
        with contextlib.ExitStack() as stack:
            mnt, pid = stack.enter_context(mount(url, os.path.join(d, "m")))
            pids = {"mount": pid}
            say(f"mount (this tree) pid {pid}")
            write_file(os.path.join(mnt, "f"))
            base = None
            if args.base_tree:
                base, bpid = stack.enter_context(mount(url, os.path.join(d, "b"), args.base_tree))
                pids["mount (base)"] = bpid
                say(f"mount (base tree {args.base_tree}) pid {bpid}")
            if args.hold:
                say(f"holding 16 direct readers on pid {pid} for {args.hold} s")
                bench_path(os.path.join(mnt, "f"), 16, args.hold, True)
            if "native" in only:
                PIDS.pop("mount", None)
                for n in threads:
                    out.setdefault("native", {})[f"x{n}"] = got = bench_native(url, "/f", n, args.seconds)
                    say(f"native x{n}: {got}")
            if "mount" in only:
                for r in range(args.rounds):  # A, B, A, B: the machine's speed drifts
                    if base is not None:
                        run_mount("mount (base)", base, r)
                    run_mount("mount", mnt, r)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
