#!/usr/bin/env python3
"""The whole path on one machine: a local cluster of 2 shards, a FUSE mount, two TensorFlow
workers training on scikit-learn's digits through the mount, a checkpoint saved to the mount
and restored in a fresh process. Everything it started is stopped and removed at the end,
also on Ctrl-C or SIGTERM: the training and its workers at once, then the mount is unmounted
and the cluster stopped (a step that starts or stops the cluster or the mount is let finish
first, within its own timeout, so that nothing it starts is left behind).

    python examples/demo.py [--shards 2] [--steps 400] [--workers 2]
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
#: Seconds the processes of an interrupted step get to exit after SIGTERM, before SIGKILL.
STOP_GRACE_S = 10.0


def step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


class Stopped(Exception):
    """A signal (SIGTERM, SIGINT) asked the demo to stop."""


class Steps:
    """Runs each step as a child process in a process group of its own, so a worker the
    training starts is found and stopped with it, and Ctrl-C reaches this process only.

    On SIGTERM or SIGINT the step in progress, if interruptible (the training), gets SIGTERM
    (its whole group); any other step (cluster or mount up or down) is let finish, so that
    what it started can be stopped. Either way the next check raises :class:`Stopped`.
    """

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._interruptible: subprocess.Popen[bytes] | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)
        if self._interruptible is not None:
            _signal_group(self._interruptible.pid, signal.SIGTERM)

    def check(self) -> None:
        if self.signals:
            raise Stopped(signal.Signals(self.signals[0]).name)

    def run(self, args: list[str], *, interruptible: bool = False) -> int:
        """Run one step to its end (and every process of its group); returns its exit code."""
        proc = subprocess.Popen(args, start_new_session=True)
        try:
            if interruptible:
                self._interruptible = proc
                if self.signals:  # one came before the step could be told
                    _signal_group(proc.pid, signal.SIGTERM)
            proc.wait()
        finally:
            self._interruptible = None
            _end_group(proc.pid)
        return proc.returncode

    def irdma(self, *args: str) -> None:
        """An ``irdma`` command that must succeed (not interruptible)."""
        rc = self.run([sys.executable, "-m", "irdma.ops.cli", *args])
        if rc != 0:
            raise subprocess.CalledProcessError(rc, ["irdma", *args])


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting to be reaped do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _end_group(pgid: int) -> None:
    """Stop what is left of a step's process group (workers whose parent exited): SIGTERM, then
    SIGKILL after STOP_GRACE_S; return once none of them runs."""
    if not _group_alive(pgid):
        return
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            _signal_group(pgid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--capacity", default="512MiB")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    steps = Steps()
    steps.install()
    work = tempfile.mkdtemp(prefix="irdma-demo-")
    cluster_dir, mnt = os.path.join(work, "cluster"), os.path.join(work, "mnt")
    os.makedirs(mnt)
    t0 = time.monotonic()
    mounted = started = False
    rc = 1
    try:
        step(f"starting a local cluster of {args.shards} shards in {cluster_dir}")
        started = True
        steps.irdma("up", "--dir", cluster_dir, "--shards", str(args.shards), "--capacity", args.capacity)
        steps.check()
        meta = f"sqlite://{cluster_dir}/meta.db"
        step(f"mounting {meta} on {mnt}")
        steps.irdma("mount", meta, mnt)
        mounted = True
        steps.check()
        step(f"training: {args.workers} workers share parameters only through {mnt}")
        rc = steps.run([sys.executable, os.path.join(HERE, "train_digits.py"), "--mount", mnt,
                        "--steps", str(args.steps), "--workers", str(args.workers)], interruptible=True)
        steps.check()
        step("the cluster after training")
        steps.irdma("shard", "list", "--meta", meta)
        steps.irdma("status", "--meta", meta)
        steps.check()
    except Stopped as exc:
        print(f"\n{exc}: stopping what the demo started", file=sys.stderr, flush=True)
        rc = 128 + steps.signals[0]
    except subprocess.CalledProcessError as exc:
        print(f"step failed: {exc}", file=sys.stderr)
        rc = 128 + steps.signals[0] if steps.signals else 1
    finally:
        if mounted:
            step("unmounting")
            if steps.run([sys.executable, "-m", "irdma.ops.cli", "umount", mnt]) != 0:
                rc = rc or 1  # the reason and the fix were printed by irdma umount
        if started:
            step("stopping the cluster")
            # --force: stop the shards even when the unmount above failed (down refuses live mounts)
            if steps.run([sys.executable, "-m", "irdma.ops.cli", "down", "--dir", cluster_dir, "--force"]) != 0:
                rc = rc or 1
        if os.path.ismount(mnt):
            print(f"{mnt} is still mounted: `irdma umount {mnt}` cleans it", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\ndemo {'passed' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
