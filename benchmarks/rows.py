"""Sparse rows: ``pull_rows``/``push_rows`` against a contiguous pull/push of the same bytes.

Issue 13's target: 10,000 random rows of 256 float32 from a 1M-row file (1 GiB over 4 shards)
pulled in one call at >= 0.5x the bandwidth of a contiguous pull of the same 10 MB, pushed with
``add`` at >= 0.4x. Each figure is the median of ``repeats`` runs, sparse and contiguous
alternating so that the machine's drift hits both alike, each reusing its output buffer (as a
training loop does; a fresh buffer costs both the same page faults). Also measured, through the mount:
the same rows read with one ``pread`` per row from 1 thread and from 16, and the rows pulled
by the native client in batches of 1,000 (for the "fastest way" of docs/user-guide.md, "Sparse rows").

Run on its own: ``.venv/bin/python benchmarks/rows.py [--quick]`` (prints JSON), or as the
``rows`` section of ``benchmarks/run.py``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from harness import cluster, mounted  # noqa: E402

from irdma import Client, UpdateOp  # noqa: E402
from irdma.client.native import layout_of  # noqa: E402

MiB = 1 << 20
ROW = 256  # float32 per row
PICK = 10_000  # rows per call
#: The Zipf exponent of the skewed ids (row of rank r drawn with probability ~ r**-s).
ZIPF_S = 1.1


def _median_pair(fa: Callable[[], float], fb: Callable[[], float], repeats: int) -> tuple[float, float]:
    a, b = [], []
    for _ in range(repeats):
        a.append(fa())
        b.append(fb())
    return statistics.median(a), statistics.median(b)


def measure(meta: str, mountpoint: str | None, nrows: int, repeats: int = 7,
            say: Callable[[str], None] = print) -> dict[str, Any]:
    """Figures of one cluster (already up at ``meta``), one file of ``nrows`` rows."""
    rb = ROW * 4
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"rows": nrows, "row_bytes": rb, "picked": PICK, "repeats": repeats}

    async def main() -> None:
        async with Client.open(meta, transport="tcp") as c:
            inode = await c.create("/.bench-rows", chunk_size=4 * MiB)
            await c.set_shape("/.bench-rows", (nrows, ROW))
            layout = layout_of(inode)
            block = np.ones(16 * MiB // 4, "<f4")
            say(f"rows: writing {nrows * rb >> 20} MiB")
            created: list[tuple[int, int, int]] = []
            for off in range(0, nrows * rb, len(block) * 4):
                n = min(len(block) * 4, nrows * rb - off)
                created += await c.write_from(layout, off, memoryview(block).cast("B")[:n], UpdateOp.ASSIGN)
            await c.meta.extend(inode.ino, nrows * rb, time.time_ns(), tuple(created))
            await c.set_update_op("/.bench-rows", "add")
            chunks = await c.meta.chunk_map(inode.ino)
            times: dict[str, list[float]] = {k: [] for k in ("contig-pull", "rows-pull", "contig-add", "rows-add")}
            buf = np.zeros(PICK * ROW, "<f4")
            rows_buf = np.zeros((PICK, ROW), "<f4")
            delta = np.full((PICK, ROW), 0.5, "<f4")
            for _ in range(repeats):
                ids = rng.choice(nrows, size=PICK, replace=False)
                start = int(rng.integers(0, nrows - PICK)) * rb
                t = time.perf_counter()
                await c.read_into(layout, start, memoryview(buf).cast("B"), chunks)  # type: ignore[arg-type]
                times["contig-pull"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await c.pull_rows("/.bench-rows", ids, out=rows_buf)  # both reuse their buffer
                times["rows-pull"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await c.write_from(layout, start, memoryview(delta).cast("B"), UpdateOp.ADD, chunks)  # type: ignore[arg-type]
                times["contig-add"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await c.push_rows("/.bench-rows", ids, delta)
                times["rows-add"].append(time.perf_counter() - t)
            nbytes = PICK * rb
            for k, v in times.items():
                out[k] = {"seconds": statistics.median(v), "mb_s": nbytes / statistics.median(v) / 1e6}
            out["pull_ratio"] = out["rows-pull"]["mb_s"] / out["contig-pull"]["mb_s"]
            out["add_ratio"] = out["rows-add"]["mb_s"] / out["contig-add"]["mb_s"]
            t = time.perf_counter()
            for k in range(0, PICK, 1000):
                await c.pull_rows("/.bench-rows", ids[k : k + 1000])
            out["rows-pull-batches-of-1000"] = {"seconds": time.perf_counter() - t}
            # Zipf ids (issue 40): a batch of PICK ids drawn as a recommendation model's are, the
            # popular rows spread over the table by a fixed permutation; against the contiguous
            # pull/push of the distinct rows' bytes (what crosses the wire either way)
            cdf = np.cumsum(np.arange(1, nrows + 1, dtype=np.float64) ** -ZIPF_S)
            cdf /= cdf[-1]
            spread = rng.permutation(nrows)
            zt: dict[str, list[float]] = {k: [] for k in ("contig-pull", "rows-pull", "contig-add", "rows-add")}
            distinct = []
            for _ in range(repeats):
                zids = spread[np.minimum(np.searchsorted(cdf, rng.random(PICK)), nrows - 1)]
                u = len(np.unique(zids))
                distinct.append(u)
                start = int(rng.integers(0, nrows - u)) * rb
                view = memoryview(buf).cast("B")[: u * rb]
                dview = memoryview(delta).cast("B")[: u * rb]
                t = time.perf_counter()
                await c.read_into(layout, start, view, chunks)  # type: ignore[arg-type]
                zt["contig-pull"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await c.pull_rows("/.bench-rows", zids, out=rows_buf)
                zt["rows-pull"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await c.write_from(layout, start, dview, UpdateOp.ADD, chunks)  # type: ignore[arg-type]
                zt["contig-add"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await c.push_rows("/.bench-rows", zids, delta)
                zt["rows-add"].append(time.perf_counter() - t)
            z: dict[str, Any] = {"s": ZIPF_S, "distinct": statistics.median(distinct)}
            for k, v in zt.items():
                z[k] = {"seconds": statistics.median(v)}
            z["pull_ratio"] = z["contig-pull"]["seconds"] / z["rows-pull"]["seconds"]
            z["add_ratio"] = z["contig-add"]["seconds"] / z["rows-add"]["seconds"]
            out["zipf"] = z

    trio.run(main)
    if mountpoint is not None:
        many = PICK if repeats > 3 else PICK // 10  # quick mode: a smoke run
        ids = rng.choice(nrows, size=many, replace=False)
        path = os.path.join(mountpoint, ".bench-rows")
        for threads in (1, 16):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                def read(part: np.ndarray, fd: int = fd) -> None:
                    mm = bytearray(rb)
                    for i in part.tolist():
                        os.preadv(fd, [mm], i * rb)

                t = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(threads) as ex:
                    list(ex.map(read, np.array_split(ids, threads)))
                secs = time.perf_counter() - t
            finally:
                os.close(fd)
            out[f"mount-pread-x{threads}"] = {"seconds": secs * PICK / many, "mb_s": many * rb / secs / 1e6}
    say(f"rows: sparse pull {out['rows-pull']['mb_s']:.0f} vs contiguous {out['contig-pull']['mb_s']:.0f} MB/s"
        f" ({out['pull_ratio']:.2f}x); sparse add {out['rows-add']['mb_s']:.0f} vs {out['contig-add']['mb_s']:.0f}"
        f" MB/s ({out['add_ratio']:.2f}x)")
    z = out["zipf"]
    say(f"rows, Zipf s={z['s']} ({z['distinct']:.0f} distinct of {PICK}): pull {z['rows-pull']['seconds'] * 1e3:.1f}"
        f" vs contiguous {z['contig-pull']['seconds'] * 1e3:.1f} ms ({z['pull_ratio']:.2f}x); add"
        f" {z['rows-add']['seconds'] * 1e3:.1f} vs {z['contig-add']['seconds'] * 1e3:.1f} ms ({z['add_ratio']:.2f}x)")
    return out


def run(quick: bool, say: Callable[[str], None] = print) -> dict[str, Any]:
    """A 4-shard cluster and a mount (direct I/O), the file of 1M rows (64K in quick mode)."""
    nrows = 1 << 16 if quick else 1 << 20
    with cluster(4, nrows * ROW + 256 * MiB) as (meta, _), mounted(meta, direct_io=True) as (mp, _pid):
        return measure(meta, mp, nrows, 3 if quick else 7, say)


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv, lambda m: print(m, file=sys.stderr)), indent=1))
