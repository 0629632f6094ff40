"""fio, the standard file I/O benchmark, through irdma's mount, a minimal pyfuse3 passthrough of
tmpfs (the FUSE ceiling of this machine) and tmpfs itself, in one run.

    python benchmarks/fio.py [--quick]          # prints the figures as JSON
    (make bench runs it as one section of docs/benchmarks.md)

Jobs, as JuiceFS's and 3FS's documents report them: sequential 1 MiB read and write, random
4 KiB read and write, each at 1, 4 and 16 jobs (``--numjobs``, psync engine, O_DIRECT through
the FUSE mounts so the page cache does not answer; tmpfs takes no O_DIRECT and reads from
memory). Figures per job: bandwidth (MB/s, 10^6 bytes), IOPS, completion latency p50 and p99
(microseconds). Every run is bounded in bytes and seconds.
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
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

#: (name, fio --rw, --bs)
PATTERNS = (("seq read 1 MiB", "read", "1M"), ("seq write 1 MiB", "write", "1M"),
            ("rand read 4 KiB", "randread", "4k"), ("rand write 4 KiB", "randwrite", "4k"))
JOBS = (1, 4, 16)


def fio_path() -> str:
    exe = shutil.which("fio")
    if exe is None:
        raise SystemExit("fio is not installed: apt-get install fio (make install does)")
    return exe


def run_fio(directory: str, rw: str, bs: str, numjobs: int, size: str, runtime: float, direct: bool,
            verify: bool = False) -> dict[str, float]:
    """One fio run; figures summed over its jobs (bandwidth, IOPS) and their worst latency.

    Raises:
        RuntimeError: fio failed (its error output is in the message).
    """
    cmd = [fio_path(), "--name=irdma", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}", f"--size={size}",
           f"--numjobs={numjobs}", "--ioengine=psync", f"--direct={int(direct)}", "--fallocate=none",
           "--group_reporting", "--output-format=json", f"--runtime={runtime:g}"]
    if verify:
        cmd += ["--verify=crc32c", "--do_verify=1", "--verify_state_save=0"]  # no state files in the cwd
    elif "rand" in rw:
        cmd += ["--time_based"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=runtime * 4 + 300)
    if res.returncode != 0:
        raise RuntimeError(f"fio {rw} {bs} x{numjobs} in {directory} failed ({res.returncode}): {res.stderr[-2000:]}")
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
    side = job["read"] if "read" in rw else job["write"]
    pct = side["clat_ns"].get("percentile", {})
    return {"mb_s": side["bw_bytes"] / 1e6, "iops": side["iops"], "p50_us": pct.get("50.000000", 0) / 1e3,
            "p99_us": pct.get("99.000000", 0) / 1e3}


@contextlib.contextmanager
def tmpfs_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="irdma-fio-", dir="/dev/shm")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def passthrough() -> Iterator[str]:
    """benchmarks/passthrough.py over a tmpfs directory, mounted until the block ends."""
    from irdma.fs.mount import unmount

    with tmpfs_dir() as src:
        mnt = tempfile.mkdtemp(prefix="irdma-fio-pt-")
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "passthrough.py"), src, mnt])
        try:
            deadline = time.monotonic() + 30
            while not os.path.ismount(mnt):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the passthrough did not mount at {mnt} (exit {proc.poll()})")
                time.sleep(0.05)
            yield mnt
        finally:
            with contextlib.suppress(Exception):
                unmount(mnt)
            with contextlib.suppress(Exception):
                proc.wait(timeout=30)
            if proc.poll() is None:
                proc.kill()
            os.rmdir(mnt)


@contextlib.contextmanager
def irdma_mount() -> Iterator[str]:
    """A local cluster (4 shards, 1 replica as the other bandwidth figures) and a mount."""
    from irdma.fs.mount import spawn_mount, unmount

    from irdma.ops import cluster as C

    d = tempfile.mkdtemp(prefix="irdma-fio-c-")
    mnt = os.path.join(d, "m")
    os.makedirs(mnt)
    try:
        url = C.up(os.path.join(d, "c"), 4, 768 << 20, transport="tcp", fresh=True, replicas=1)
        spawn_mount(url, mnt, transport="tcp", log_file=os.path.join(d, "mount.log"))
        try:
            yield mnt
        finally:
            unmount(mnt)
    finally:
        with contextlib.suppress(Exception):
            C.down(os.path.join(d, "c"))
        shutil.rmtree(d, ignore_errors=True)


def run_all(quick: bool = False, say: object = print) -> dict[str, dict[str, dict[str, float]]]:
    """Every pattern at every job count on the three targets: ``{target: {"PATTERN xJOBS": figures}}``."""
    jobs = (1,) if quick else JOBS
    size, runtime = ("4M", 0.5) if quick else ("64M", 3.0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for target, ctx, direct in (("tmpfs", tmpfs_dir, False), ("pyfuse3 passthrough of tmpfs", passthrough, True),
                                ("irdma mount", irdma_mount, True)):
        with ctx() as d:
            out[target] = {}
            for name, rw, bs in PATTERNS:
                for n in jobs:
                    say(f"fio: {target}, {name}, {n} job{'s' if n > 1 else ''}")  # type: ignore[operator]
                    out[target][f"{name} x{n}"] = run_fio(d, rw, bs, n, size, runtime, direct)
                    for f in os.listdir(d):  # each run lays out its own files
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(d, f))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 job: a smoke run, not figures")
    args = ap.parse_args()
    print(json.dumps(run_all(args.quick, say=lambda m: print(m, file=sys.stderr)), indent=1))


if __name__ == "__main__":
    main()
