"""Snapshots (issue 23): what one costs against a copy, what taking them does to training, and
the bytes they hold.

One cluster of 2 shards with 2 replicas (each shard holds a copy of every chunk) and one mount
(page cache on, as a user's), on 127.0.0.1:

1. **Create time** of a snapshot of a directory holding one 1 GiB file (4 MiB chunks) and of a
   directory of ResNet-50's 320 tensors (25.6 M float32, shapes from Keras with no weights
   downloaded), taken through the native client (``Client.snapshot``) and through the mount
   (``mkdir DIR/.snapshots/NAME``), against ``cp -r`` of the same directory through the mount
   and ``cp -r`` of a copy of it on tmpfs (/dev/shm); medians of 3 runs, alternating, each
   snapshot and copy deleted, untimed, before the next. The 1 GiB file is copied through the
   mount with 4 MiB reads and writes (2 runs): ``cp`` 9 calls copy_file_range(2) there, which
   the mount does not implement, and the kernel's fallback splices page by page (2 to 7 MB/s
   here); the tensors are copied with ``cp -r`` (1 run: 320 files, each created and flushed).
2. **Step time** of 2 worker processes training on the tensors (``benchmarks/workers.py
   irdma-native``: each round pushes a gradient into every tensor, update op ``add``, then pulls
   every tensor, through the native client) in one run of 150 rounds, while a thread of this
   process alternates phases of 8 s: none, then one where it takes a snapshot of the directory
   every second (the next at once when one takes longer) and deletes the oldest beyond 2 (as
   ``tf.train.CheckpointManager(max_to_keep=2)``), and so on. Each round counts for the phase
   it started in (both workers' rounds; the workers log each round's start and end on the
   machine's monotonic clock). Alternating within one run cancels the machine's drift, which
   between runs here is as large as the effect (+-15%). The target figure is the steady state,
   as a long training run sees it: the rounds that start :data:`SETTLE_S` seconds or more into
   their phase and end in it (the first snapshots of a phase copy onto memory the shards have
   not touched lately, and the kernel, here the hypervisor too, faults its pages in: 38 to
   210 ms per 100 MB here, against 9 ms to rewrite touched memory; a phase without snapshots
   starts with the copy-on-write of the last one). The ratio over every round is given beside
   it. A snapshot refused ("take the snapshot again") is counted and its messages kept, not
   retried.
3. **Bytes held** after N snapshots of the 1 GiB file with a random fraction f of its chunks
   rewritten after each: the shards' ``used`` (STAT) for the file against ZFS's cost model
   (Bonwick et al. 2003: a snapshot costs the blocks written after it), (1 + N f) x the file's
   bytes x replicas; then the snapshots are deleted and ``used`` is read again.

Run on its own: ``.venv/bin/python benchmarks/snapshots.py [--quick]`` (prints JSON), or as the
``snapshots`` section of ``benchmarks/run.py`` (``--only snapshots``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from harness import cleanup_barrier, cluster, model_shapes, mounted, pow2_chunk, start_together  # noqa: E402

import irdma  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
PY = sys.executable
SHARDS, REPLICAS = 2, 2
SNAPSHOTS_N, REWRITE_F = 5, 0.1  # part 3
#: Part 2: seconds of each phase (none, then a snapshot every second, and so on), and how far
#: into its phase a round must start to count as the steady state.
PHASE_S, SETTLE_S = 8.0, 3.0
CHUNK = 4 * MiB  # the 1 GiB file's chunks


def used(c: Any) -> int:
    """Bytes the shards hold, all replicas (the sum of every shard's STAT ``used``)."""
    return sum(st.used for _, st, _ in c.shard_stats() if st is not None)


def _cp(src: str, dst: str) -> float:
    """Seconds of ``cp -r SRC DST`` (close() of each file included: the mount pushes on close)."""
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    return time.perf_counter() - t0


def _block_copy(src: str, dst: str, block: int = 4 * MiB) -> float:
    """Seconds to copy directory SRC's files to a new DST with ``block``-byte reads and writes
    (cp's own loop, as when copy_file_range(2) is not available), each file closed."""
    t0 = time.perf_counter()
    os.mkdir(dst)
    buf = bytearray(block)
    view = memoryview(buf)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb", buffering=0) as fi, \
                open(os.path.join(dst, name), "wb", buffering=0) as fo:
            while n := fi.readinto(buf):
                fo.write(view[:n])
    return time.perf_counter() - t0


def create_times(c: Any, mp: str, dirs: dict[str, tuple[str, str, int]], repeats: int,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """Part 1: for each directory (key -> (path in the namespace, how to copy it through the
    mount: ``cp -r`` or ``block``, how many times)), the medians in seconds of a snapshot
    through the native client and through the mount (``repeats`` each), of the copy through
    the mount and of ``cp -r`` on tmpfs (``repeats``), alternating; and ``copy / snapshot``."""
    out: dict[str, Any] = {}
    shm = tempfile.mkdtemp(prefix="irdma-bench-snap-", dir="/dev/shm")
    try:
        for what, (path, how, copies) in dirs.items():
            say(f"snapshots: create time, {path}: snapshot (native, mount) {repeats} times each, copy through the"
                f" mount ({'cp -r' if how == 'cp' else '4 MiB blocks'}) {copies}, cp -r on tmpfs {repeats}")
            src = os.path.join(mp, path.strip("/"))
            shutil.copytree(src, os.path.join(shm, "src"))  # tmpfs's copy of the same bytes, untimed
            runs: dict[str, list[float]] = {"snapshot_native": [], "snapshot_mount": [], "copy_mount": [],
                                            "cp_tmpfs": []}
            for i in range(repeats):
                t0 = time.perf_counter()
                c.snapshot(path, f"bench-n{i}")
                runs["snapshot_native"].append(time.perf_counter() - t0)
                c.delete_snapshot(path, f"bench-n{i}")
                snap = os.path.join(src, ".snapshots", f"bench-m{i}")
                t0 = time.perf_counter()
                os.mkdir(snap)
                runs["snapshot_mount"].append(time.perf_counter() - t0)
                os.rmdir(snap)
                if i < copies:
                    dst = f"{src}-copy"
                    runs["copy_mount"].append(_cp(src, dst) if how == "cp" else _block_copy(src, dst))
                    shutil.rmtree(dst)
                runs["cp_tmpfs"].append(_cp(os.path.join(shm, "src"), os.path.join(shm, "dst")))
                shutil.rmtree(os.path.join(shm, "dst"))
            shutil.rmtree(os.path.join(shm, "src"))
            med = {k: statistics.median(v) for k, v in runs.items()}
            names = os.listdir(src)
            out[what] = {**med, "runs": runs, "path": path, "copy_mount_how": "cp -r" if how == "cp" else "4 MiB blocks",
                         "files": len(names), "bytes": sum(os.path.getsize(os.path.join(src, f)) for f in names),
                         "copy_mount_over_snapshot_mount": med["copy_mount"] / med["snapshot_mount"],
                         "copy_mount_over_snapshot_native": med["copy_mount"] / med["snapshot_native"],
                         "cp_tmpfs_over_snapshot_mount": med["cp_tmpfs"] / med["snapshot_mount"]}
            say(f"snapshots: {path}: snapshot {med['snapshot_native'] * 1e3:.0f} ms native,"
                f" {med['snapshot_mount'] * 1e3:.0f} ms mount; copy {med['copy_mount']:.2f} s mount,"
                f" cp -r {med['cp_tmpfs']:.2f} s tmpfs")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return out


def bytes_held(c: Any, path: str, size: int, n: int, f: float, seed: int = 0) -> dict[str, Any]:
    """Part 3: ``n`` snapshots of ``path`` (``size`` bytes in CHUNK chunks, the only file whose
    chunks change), a random fraction ``f`` of its chunks rewritten (assign) after each; the
    shards' ``used`` before, after, and after the snapshots are deleted (bytes, all replicas)."""
    rng = np.random.default_rng(seed)
    chunks = size // CHUNK
    per = round(chunks * f)
    before = used(c)
    for i in range(n):
        c.snapshot(path, f"held-{i}")
        for k in sorted(rng.choice(chunks, size=per, replace=False).tolist()):
            c.write(path, np.full(CHUNK // 4, i + 1, "<f4"), k * CHUNK)
    c.flush()
    after = used(c)
    for i in range(n):
        c.delete_snapshot(path, f"held-{i}")
    gone = used(c)
    expected = size * REPLICAS * (1 + n * per / chunks)  # per / chunks: f rounded to whole chunks
    return {"file_bytes": size, "chunks": chunks, "rewritten_per_snapshot": per, "snapshots": n, "f": per / chunks,
            "replicas": REPLICAS, "used_before": before, "used_after": after, "used_after_delete": gone,
            "expected_growth": expected - size * REPLICAS, "growth": after - before,
            # the file's share of ``used``: what the shards held before minus the file's own
            # bytes is the rest of the namespace, which nothing here changes
            "file_used": after - (before - size * REPLICAS), "expected": expected,
            "ratio": (after - (before - size * REPLICAS)) / expected}


def _leaves(e: BaseException) -> list[BaseException]:
    """The exceptions in ``e``: itself, or the leaves of an exception group."""
    if isinstance(e, BaseExceptionGroup):
        return [x for sub in e.exceptions for x in _leaves(sub)]
    return [e]


def _workers(meta: str, shapes_file: str, rounds: int, snap_dir: str, phase_s: float = PHASE_S,
             every_s: float = 1.0, keep: int = 2, first: str = "none") -> dict[str, Any]:
    """Part 2: 2 ``workers.py irdma-native`` processes, ``rounds`` timed rounds each after
    their barrier, while a thread of this process alternates phases of ``phase_s`` seconds from
    the barrier on: none (no snapshot), then one of a snapshot of ``snap_dir`` every ``every_s``
    seconds (the next at once when one takes longer; the oldest beyond ``keep`` deleted), and so
    on until both workers are done (``first="every_1s"``: that phase first).

    Returns the phases (``[kind, start, end]``, ``time.monotonic()`` seconds), every worker's
    rounds (``[start, end]``), and the snapshots' create and delete times."""
    start = tempfile.mktemp(prefix="irdma-bench-start-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), REPO) if p)}
    procs = [subprocess.Popen([PY, os.path.join(HERE, "workers.py"), "irdma-native", meta, shapes_file, str(rounds),
                               str(r), start], stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    stop = threading.Event()
    phases: list[list[Any]] = []  # [kind, start, end]
    took: list[float] = []  # create, seconds
    dropped: list[float] = []  # delete of the oldest beyond ``keep``, seconds
    failed: list[str] = []  # snapshots refused ("take the snapshot again"): counted, not retried
    errors: list[BaseException] = []

    def snapshotter() -> None:
        try:
            with irdma.connect(meta, transport="tcp") as c:
                k, kept = 0, []
                kind, t_end = first, time.monotonic() + phase_s
                phases.append([kind, time.monotonic(), None])
                t_next = time.monotonic() if kind == "every_1s" else t_end
                while not stop.wait(max(0.0, min(t_next, t_end) - time.monotonic())):
                    now = time.monotonic()
                    if now >= t_end:  # the next phase
                        phases[-1][2] = now
                        kind = "every_1s" if kind == "none" else "none"
                        phases.append([kind, now, None])
                        t_end = now + phase_s
                        t_next = now if kind == "every_1s" else t_end
                    if kind != "every_1s" or time.monotonic() < t_next:
                        continue
                    name = f"every-{k:04d}"
                    k += 1
                    t_next = max(t_next + every_s, time.monotonic())
                    t0 = time.perf_counter()
                    try:
                        c.snapshot(snap_dir, name)
                    except Exception as e:  # an IrdmaError, or (as of 8590026) a group of them
                        if not all(isinstance(x, irdma.IrdmaError) for x in _leaves(e)):
                            raise
                        failed.append(f"after {time.perf_counter() - t0:.2f} s: "
                                      + "; ".join(f"{type(x).__name__}: {x}" for x in _leaves(e)))
                        continue
                    took.append(time.perf_counter() - t0)
                    kept.append(name)
                    if len(kept) > keep:  # CheckpointManager's max_to_keep
                        t0 = time.perf_counter()
                        c.delete_snapshot(snap_dir, kept.pop(0))
                        dropped.append(time.perf_counter() - t0)
                phases[-1][2] = time.monotonic()
                for s in c.snapshots(snap_dir):  # untimed: the next run starts with none
                    c.delete_snapshot(snap_dir, s.name)
        except BaseException as e:  # noqa: BLE001 - reported after the workers are done
            errors.append(e)

    thread = threading.Thread(target=snapshotter, name="snapshotter")
    try:
        start_together(procs, start)
        thread.start()
        res = []
        for p in procs:
            stdout, _ = p.communicate(timeout=900)
            if p.returncode != 0:
                raise RuntimeError(f"a training worker failed ({p.returncode})")
            res.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(120)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        cleanup_barrier(start)
    if errors:
        raise RuntimeError(f"taking snapshots while training failed: {errors[0]!r}") from errors[0]
    return {"phases": phases, "rounds_t": [r["rounds_t"] for r in res], "snapshot_s": took, "delete_s": dropped,
            "failed": failed}


def _classify(phases: list[list[Any]], rounds_t: list[list[list[float]]], settle_s: float) -> dict[str, Any]:
    """Each worker's rounds by the phase they ran in: ``steady`` holds the rounds that start
    ``settle_s`` or more into their phase and end in it, ``all`` every round that starts in it
    (seconds per round, per kind of phase)."""
    out: dict[str, Any] = {"steady": {"none": [], "every_1s": []}, "all": {"none": [], "every_1s": []}}
    for worker in rounds_t:
        for t0, t1 in worker:
            for kind, p0, p1 in phases:
                if p0 <= t0 < p1:
                    out["all"][kind].append(t1 - t0)
                    if t0 >= p0 + settle_s and t1 <= p1:
                        out["steady"][kind].append(t1 - t0)
                    break
    return out


def _timeline(phases: list[list[Any]], rounds_t: list[list[list[float]]]) -> dict[str, Any]:
    """The phases and rounds, seconds from the first phase's start (milliseconds resolution)."""
    t0 = phases[0][1]
    return {"phases": [[k, round(a - t0, 3), round(b - t0, 3)] for k, a, b in phases],
            "rounds": [[[round(a - t0, 3), round(b - a, 3)] for a, b in w] for w in rounds_t]}


def step_times(meta: str, shapes: list[list[int]], rounds: int, say: Callable[[str], None],
               phase_s: float = PHASE_S, settle_s: float = SETTLE_S) -> dict[str, Any]:
    """Part 2: training through phases of no snapshots and of one every second (keep 2)."""
    shapes_file = tempfile.mktemp(suffix=".json")
    with open(shapes_file, "w") as f:
        json.dump(shapes, f)
    try:
        say(f"snapshots: training, 2 workers, {rounds} rounds, in phases of {phase_s:.0f} s: none, then a snapshot of"
            " /model every second (keep 2), and again")
        r = _workers(meta, shapes_file, rounds, "/model", phase_s)
    finally:
        os.unlink(shapes_file)
    by = _classify(r["phases"], r["rounds_t"], settle_s)
    st, al = by["steady"], by["all"]
    if not st["none"] or not st["every_1s"]:
        raise RuntimeError(f"too few rounds in the phases' steady state ({len(st['none'])} with none,"
                           f" {len(st['every_1s'])} with snapshots): run more rounds")
    none, every = statistics.mean(st["none"]), statistics.mean(st["every_1s"])
    ratio_all = statistics.mean(al["every_1s"]) / statistics.mean(al["none"])
    took, dropped, failed = r["snapshot_s"], r["delete_s"], r["failed"]
    say(f"snapshots: round {every * 1e3:.0f} ms with a snapshot every second against {none * 1e3:.0f} ms with none"
        f" ({every / none:.2f}x from {settle_s:.0f} s into a phase on, {len(st['every_1s'])} and {len(st['none'])}"
        f" rounds; {ratio_all:.2f}x over every round); {len(took)} made"
        + (f", median {statistics.median(took) * 1e3:.0f} ms" if took else "")
        + (f"; deletes median {statistics.median(dropped) * 1e3:.0f} ms" if dropped else "")
        + f"; {len(failed)} refused" + (f" (first: {failed[0]})" if failed else ""))
    return {"round_s_none": none, "round_s_every_1s": every, "ratio": every / none,
            "rounds_steady": {k: len(v) for k, v in st.items()}, "rounds_all": {k: len(v) for k, v in al.items()},
            "phase_s": phase_s, "phases": len(r["phases"]), "settle_s": settle_s, "ratio_all_rounds": ratio_all,
            "timeline": _timeline(r["phases"], r["rounds_t"]),
            "rounds": rounds, "snapshots_taken": len(took), "snapshots_failed": len(failed), "failures": failed,
            "snapshot_s": took, "delete_s": dropped,
            "snapshot_s_median": statistics.median(took) if took else None,
            "snapshot_s_max": max(took) if took else None,
            "delete_s_median": statistics.median(dropped) if dropped else None}


def run(quick: bool, say: Callable[[str], None] = print, shapes: list[list[int]] | None = None) -> dict[str, Any]:
    """The three parts on one cluster (2 shards, 2 replicas, 3 GiB of region each; 512 MiB in
    quick mode) and one mount. Quick mode: a 64 MiB file, the first 40 tensors, 1 repeat."""
    if shapes is None:
        shapes = model_shapes()
    if quick:
        shapes = shapes[:40]
    size = 64 * MiB if quick else GiB
    out: dict[str, Any] = {"shards": SHARDS, "replicas": REPLICAS, "chunk_size": CHUNK, "tensors": len(shapes),
                           "tensor_bytes": 4 * sum(int(np.prod(s)) for s in shapes)}
    # room on each shard (2 shards, 2 replicas: each holds every chunk) for the file, the 5
    # snapshots' copies of 10% of it, the tensors and a copy of each made through the mount (whose
    # new files get 4 MiB chunks, each held whole: 320 tensors take 1.3 GiB)
    with cluster(SHARDS, 512 * MiB if quick else 4 * GiB, replicas=REPLICAS) as (meta, _):
        say(f"snapshots: writing a {size >> 20} MiB file and {len(shapes)} tensors ({out['tensor_bytes'] / 1e6:.0f} MB)"
            f" on {SHARDS} shards, {REPLICAS} replicas")
        with irdma.connect(meta, transport="tcp") as c:
            c.makedirs("/big")
            c.create("/big/w", chunk_size=CHUNK)
            for off in range(0, size, 64 * MiB):  # pieces: one 1 GiB call keeps shards busy past the client's 10 s
                c.write("/big/w", np.ones(min(64 * MiB, size - off) // 4, "<f4"), off)
            c.makedirs("/model")
            for i, s in enumerate(shapes):
                n = 4 * int(np.prod(s))
                c.write(f"/model/l{i:03d}", np.zeros(n // 4, "<f4"), chunk_size=pow2_chunk(n))
                c.set_update_op(f"/model/l{i:03d}", "add")
            c.flush()

            say(f"snapshots: bytes held after {SNAPSHOTS_N} snapshots of the {size >> 20} MiB file,"
                f" {REWRITE_F:.0%} of its chunks rewritten after each")
            out["bytes_held"] = bh = bytes_held(c, "/big/w", size, SNAPSHOTS_N, REWRITE_F)
            say(f"snapshots: the file holds {bh['file_used'] / 1e6:.0f} MB against {bh['expected'] / 1e6:.0f} MB"
                f" expected ({bh['ratio']:.3f}x); {bh['used_after_delete'] / 1e6:.0f} MB after deleting them"
                f" ({bh['used_before'] / 1e6:.0f} MB before)")

            with mounted(meta) as (mp, _pid):
                out["create"] = create_times(c, mp, {"file": ("/big", "block", 1 if quick else 2),
                                                     "tensors": ("/model", "cp", 1)}, 1 if quick else 3, say)
            out["used_after_create"] = used(c)  # the copies removed: as before part 1 if unlink frees
        out["step"] = step_times(meta, shapes, 300, say, 1.0, 0.3) if quick else step_times(meta, shapes, 150, say)
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not figures")
    ap.add_argument("--shapes", help="a JSON list of tensor shapes (default: ResNet-50's, from Keras)")
    args = ap.parse_args()
    shapes = None
    if args.shapes:
        with open(args.shapes) as f:
            shapes = json.load(f)
    print(json.dumps(run(args.quick, lambda m: print(m, file=sys.stderr, flush=True), shapes), indent=1))


if __name__ == "__main__":
    main()
