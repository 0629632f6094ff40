#!/usr/bin/env python3
"""The whole path on one machine: a local cluster of 2 shards, a FUSE mount, two TensorFlow
workers training on scikit-learn's digits through the mount, a checkpoint saved to the mount
and restored in a fresh process. Everything it started is stopped and removed at the end,
also on Ctrl-C or SIGTERM.

    python examples/demo.py [--shards 2] [--steps 400] [--keep-dir]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def irdma(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "irdma.cli", *args], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--capacity", default="512MiB")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    work = tempfile.mkdtemp(prefix="irdma-demo-")
    cluster_dir, mnt = os.path.join(work, "cluster"), os.path.join(work, "mnt")
    os.makedirs(mnt)
    t0 = time.monotonic()
    mounted = started = False
    rc = 1
    try:
        step(f"starting a local cluster of {args.shards} shards in {cluster_dir}")
        started = True
        irdma("up", "--dir", cluster_dir, "--shards", str(args.shards), "--capacity", args.capacity)
        meta = f"sqlite://{cluster_dir}/meta.db"
        step(f"mounting {meta} on {mnt}")
        irdma("mount", meta, mnt)
        mounted = True
        step(f"training: {args.workers} workers share parameters only through {mnt}")
        rc = subprocess.run([sys.executable, os.path.join(HERE, "train_digits.py"), "--mount", mnt,
                             "--steps", str(args.steps), "--workers", str(args.workers)]).returncode
        step("the cluster after training")
        irdma("shard", "list", "--meta", meta)
        irdma("status", "--meta", meta)
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        rc = 130
    except subprocess.CalledProcessError as exc:
        print(f"step failed: {exc}", file=sys.stderr)
        rc = 1
    finally:
        if mounted:
            step("unmounting")
            if subprocess.run([sys.executable, "-m", "irdma.cli", "umount", mnt]).returncode != 0:
                rc = rc or 1  # the reason and the fix were printed by irdma umount
        if started:
            step("stopping the cluster")
            if subprocess.run([sys.executable, "-m", "irdma.cli", "down", "--dir", cluster_dir]).returncode != 0:
                rc = rc or 1
        if os.path.ismount(mnt):
            print(f"{mnt} is still mounted: `irdma umount {mnt}` cleans it", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\ndemo {'passed' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
