"""The local read cache (issue 24): a hot read-mostly file read by 4 processes at once through
the mount, with the cache on and off, against tmpfs (the same bytes read from /dev/shm).

Each reader process reads the whole file sequentially in 1 MiB ``preadv`` calls (into an
mmap'd buffer: into a ``bytearray`` CPython's ``preadv`` ran 5x slower on tmpfs); the figure is
the bytes all of them read over the time from the first one's start to the last one's end
(MB/s, 10^6 bytes/s). The mounts use direct I/O, so the kernel's page cache never answers in
the mount's place (what a second epoch sees once the page cache no longer holds the file, or
after a remount). Cache on: ``--cache-dir`` on local disk and ``--cache-memory`` as large as the
file, filled by one read first (timed: the first epoch); cache off: a second mount without a
cache, also after one read. Both mounts run at once; each round measures off, on and tmpfs one
after the other, and the figures are the medians of the rounds. Also measured: the cost of an
``open`` + ``close`` with the cache on (one version query to the shards per open) and off.

Run on its own: ``.venv/bin/python benchmarks/readcache.py [--size 1GiB] [--quick]`` (prints
JSON), or as ``benchmarks/run.py --only cache [--cache-file-size 1GiB]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from irdma.fs.mount import spawn_mount, unmount  # noqa: E402

from irdma.ops import cluster as C  # noqa: E402
from irdma.units import parse_size  # noqa: E402

MiB = 1 << 20
READERS = 4
#: One reader: waits for the start file, reads the whole file, prints its start and end times.
READER = """
import mmap, os, sys, time
path, start, me = sys.argv[1], sys.argv[2], sys.argv[3]
buf = mmap.mmap(-1, 1 << 20)  # os.preadv into a bytearray ran at a fifth of this speed on tmpfs here
open(start + ".ready." + me, "w").close()
while not os.path.exists(start):
    time.sleep(0.001)
t0 = time.time()
fd = os.open(path, os.O_RDONLY)
off = 0
while True:
    n = os.preadv(fd, [buf], off)
    if n <= 0:
        break
    off += n
os.close(fd)
print(t0, time.time(), off)
"""


def _readers(path: str, n: int = READERS) -> float:
    """MB/s of ``n`` processes each reading ``path`` whole, started together."""
    start = tempfile.mktemp(prefix="irdma-cache-start-")
    procs = [subprocess.Popen([sys.executable, "-c", READER, path, start, str(i)], stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    try:
        deadline = time.monotonic() + 60
        while sum(os.path.exists(f"{start}.ready.{i}") for i in range(n)) < n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("readers did not get ready")
            time.sleep(0.01)
        open(start, "w").close()
        rows = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"a reader failed ({p.returncode})")
            rows.append([float(x) for x in out.split()])
    finally:
        for f in [start, *(f"{start}.ready.{i}" for i in range(n))]:
            with contextlib.suppress(OSError):
                os.unlink(f)
    t0, t1 = min(r[0] for r in rows), max(r[1] for r in rows)
    return sum(r[2] for r in rows) / (t1 - t0) / 1e6


def _read_once(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(4 * MiB):
            pass


def _open_us(path: str, n: int = 300) -> float:
    """Microseconds of one open + close (median of ``n``)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        os.close(os.open(path, os.O_RDONLY))
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


@contextlib.contextmanager
def _mount(meta: str, work: str, name: str, **cache: Any) -> Iterator[str]:
    mp = os.path.join(work, name)
    os.makedirs(mp)
    spawn_mount(meta, mp, transport="tcp", log_file=mp + ".log", direct_io=True, **cache)
    try:
        yield mp
    finally:
        with contextlib.suppress(Exception):
            unmount(mp)


def run(size: int, say: Callable[[str], None] = print, rounds: int = 3) -> dict[str, Any]:
    """The figures: MB/s with the cache on, off, and of tmpfs (the median of ``rounds`` rounds,
    each measuring the three one after the other, so that the machine's drift hits all alike),
    their ratios, the first (filling) read and open costs."""
    import statistics

    import irdma

    work = tempfile.mkdtemp(prefix="irdma-bench-cache-")
    shm = f"/dev/shm/irdma-bench-cache-{os.getpid()}"
    try:
        meta = C.up(os.path.join(work, "c"), 2, size // 2 + 64 * MiB, transport="tcp", fresh=True, replicas=1)
        say(f"cache: writing a {size / MiB:.0f} MiB file")
        block = os.urandom(4 * MiB)
        with irdma.connect(meta, transport="tcp") as c, open(shm, "wb") as f:
            for off in range(0, size, len(block)):
                c.write("/hot.bin", block, offset=off)
                f.write(block)
        out: dict[str, Any] = {"size_bytes": size, "readers": READERS, "rounds": rounds}
        cache = {"cache_dir": os.path.join(work, "cache"), "cache_size": str(size + 64 * MiB),
                 "cache_memory": str(size + 64 * MiB)}
        with _mount(meta, work, "off") as m_off, _mount(meta, work, "on", **cache) as m_on:
            p_off, p_on = os.path.join(m_off, "hot.bin"), os.path.join(m_on, "hot.bin")
            t0 = time.perf_counter()
            _read_once(p_off)
            out["first_read_off_mb_s"] = size / (time.perf_counter() - t0) / 1e6
            t0 = time.perf_counter()
            _read_once(p_on)  # fills the cache (the first epoch)
            out["first_read_on_mb_s"] = size / (time.perf_counter() - t0) / 1e6
            os.sync()  # the disk tier's writes (page cache -> disk) do not compete with the readers
            _read_once(shm)
            runs: dict[str, list[float]] = {"tmpfs": [], "off": [], "on": []}
            for r in range(rounds):
                runs["off"].append(_readers(p_off))
                runs["on"].append(_readers(p_on))
                runs["tmpfs"].append(_readers(shm))
                say(f"cache: round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f} MB/s" for k, v in runs.items()))
            out["off_open_us"] = _open_us(p_off)
            out["on_open_us"] = _open_us(p_on)
        for k, v in runs.items():
            out[f"{k}_mb_s"] = statistics.median(v)
            out[f"{k}_mb_s_runs"] = [round(x) for x in v]
        out["on_over_tmpfs"] = out["on_mb_s"] / out["tmpfs_mb_s"]
        out["off_over_tmpfs"] = out["off_mb_s"] / out["tmpfs_mb_s"]
        out["on_over_off"] = out["on_mb_s"] / out["off_mb_s"]
        return out
    finally:
        with contextlib.suppress(Exception):
            C.down(os.path.join(work, "c"))
        with contextlib.suppress(OSError):
            os.unlink(shm)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="bytes of the hot file [default: 1GiB]")
    ap.add_argument("--quick", action="store_true", help="64 MiB: a smoke test, not figures")
    args = ap.parse_args()
    print(json.dumps(run(64 * MiB if args.quick else parse_size(args.size)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
