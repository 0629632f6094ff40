#!/usr/bin/env python3
"""Data-parallel training of a Keras model whose parameters live on irdma shards.

Two worker processes share parameters only through files on an irdma FUSE mount:

* each parameter tensor is one file ``MOUNT/RUN/params/NN-NAME``: little-endian float32,
  C order, the tensor's shape as Keras gives it; its update op (xattr ``user.irdma.update``)
  is ``add``;
* each step a worker reads every parameter file (a pull), computes the gradient of its own
  batch, and writes ``-lr * gradient`` to the same files (a push, summed on the shards);
* training is asynchronous (ASP): workers never wait for each other.

Then the coordinator pulls the final weights, reports test accuracy on scikit-learn's digits
(shipped with the package: no download), saves a ``tf.train.CheckpointManager`` checkpoint to
the mount, and a fresh process restores it and checks the weights are bit-identical.

    python examples/train_digits.py --mount /mnt/irdma            # coordinator: does it all
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits 8x8 as float32 in [0, 1], shape (n, 64); labels int32 0..9; a fixed 75/25 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    return tuple(train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y))  # type: ignore[return-value]


def build_model(seed: int = 0):  # type: ignore[no-untyped-def]
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    return model


def param_files(model, run_dir: str) -> list[str]:  # type: ignore[no-untyped-def]
    names = []
    for i, v in enumerate(model.trainable_variables):
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", v.path)
        names.append(os.path.join(run_dir, "params", f"{i:02d}-{safe}"))
    return names


def pull(files: list[str], model) -> None:  # type: ignore[no-untyped-def]
    """Read every parameter file and load it into the model (a pull)."""
    for path, v in zip(files, model.trainable_variables, strict=True):
        with open(path, "rb") as f:
            data = f.read()
        v.assign(np.frombuffer(data, dtype="<f4").reshape(v.shape))


def push(files: list[str], deltas: list[np.ndarray]) -> None:
    """Write each delta to its file; the file's update op ``add`` sums it on the shards."""
    for path, d in zip(files, deltas, strict=True):
        with open(path, "r+b") as f:
            f.write(np.ascontiguousarray(d, dtype="<f4").tobytes())


def accuracy(model, x: np.ndarray, y: np.ndarray) -> float:  # type: ignore[no-untyped-def]
    logits = model(x, training=False).numpy()
    return float((logits.argmax(axis=1) == y).mean())


def weights_digest(model) -> str:  # type: ignore[no-untyped-def]
    h = hashlib.sha256()
    for v in model.trainable_variables:
        h.update(np.asarray(v.numpy(), dtype="<f4").tobytes())
    return h.hexdigest()


def worker(args: argparse.Namespace) -> int:
    import tensorflow as tf

    x_train, _, y_train, _ = load_data()
    x_mine, y_mine = x_train[args.rank :: args.workers], y_train[args.rank :: args.workers]
    model = build_model()
    files = param_files(model, args.run_dir)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def grads(xb: tf.Tensor, yb: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return tape.gradient(loss, model.trainable_variables)

    rng = np.random.default_rng(1000 + args.rank)
    t0 = time.monotonic()
    for step in range(args.steps):
        idx = rng.integers(0, len(x_mine), args.batch)
        pull(files, model)
        g = grads(x_mine[idx], y_mine[idx])
        push(files, [-args.lr * gi.numpy() for gi in g])
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"[worker {args.rank}] step {step + 1}/{args.steps} ({time.monotonic() - t0:.1f} s)", flush=True)
    # tell the coordinator through the mount: an atomic rename makes the marker appear whole
    done = os.path.join(args.run_dir, f"done-{args.rank}")
    with open(done + ".tmp", "w") as f:
        f.write(json.dumps({"steps": args.steps}))
    os.rename(done + ".tmp", done)
    return 0


def restore(args: argparse.Namespace) -> int:
    """A fresh process: restore the latest checkpoint from the mount, report digest and accuracy."""
    import tensorflow as tf

    _, x_test, _, y_test = load_data()
    model = build_model(seed=123)  # different init: the restore must overwrite every weight
    ckpt = tf.train.Checkpoint(model=model)
    mgr = tf.train.CheckpointManager(ckpt, os.path.join(args.run_dir, "ckpt"), max_to_keep=2)
    if mgr.latest_checkpoint is None:
        print(json.dumps({"error": "no checkpoint found"}))
        return 1
    ckpt.restore(mgr.latest_checkpoint).assert_existing_objects_matched()
    print(json.dumps({"digest": weights_digest(model), "accuracy": accuracy(model, x_test, y_test),
                      "checkpoint": mgr.latest_checkpoint}))
    return 0


def on_host(netns: list[str], rank: int) -> list[str]:
    """The command prefix that runs a process on the host (network namespace) of ``rank``, if any."""
    return ["nsenter", f"--net=/run/netns/{netns[rank]}", "--"] if netns else []


def worker_dir(args: argparse.Namespace, rank: int) -> str:
    """The run directory worker ``rank`` uses: the same run seen through its own host's mount."""
    return args.worker_run_dirs[rank] if args.worker_run_dirs else args.run_dir


def coordinator(args: argparse.Namespace) -> int:
    import tensorflow as tf

    _, x_test, _, y_test = load_data()
    model = build_model()
    os.makedirs(os.path.join(args.run_dir, "params"), exist_ok=True)
    files = param_files(model, args.run_dir)
    for path, v in zip(files, model.trainable_variables, strict=True):  # initial weights: assign, then op add
        with open(path, "wb") as f:
            f.write(np.asarray(v.numpy(), dtype="<f4").tobytes())
        os.setxattr(path, "user.irdma.update", b"add")
    print(f"initial weights on {args.run_dir}/params: {len(files)} files,"
          f" {sum(os.path.getsize(p) for p in files)} bytes; test accuracy {accuracy(model, x_test, y_test):.3f}",
          flush=True)
    t0 = time.monotonic()
    procs = [
        subprocess.Popen([*on_host(args.worker_netns, r), sys.executable, __file__, "--role", "worker", "--rank", str(r),
                          "--run-dir", worker_dir(args, r), "--workers", str(args.workers), "--steps", str(args.steps),
                          "--lr", str(args.lr), "--batch", str(args.batch)])
        for r in range(args.workers)
    ]
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    if any(codes):
        print(f"a worker failed: exit codes {codes}", file=sys.stderr)
        return 1
    missing = [r for r in range(args.workers) if not os.path.exists(os.path.join(args.run_dir, f"done-{r}"))]
    if missing:
        print(f"workers {missing} left no done marker", file=sys.stderr)
        return 1
    pull(files, model)
    acc = accuracy(model, x_test, y_test)
    print(f"trained: {args.workers} workers x {args.steps} steps in {time.monotonic() - t0:.1f} s;"
          f" test accuracy {acc:.4f}", flush=True)

    ckpt = tf.train.Checkpoint(model=model)
    mgr = tf.train.CheckpointManager(ckpt, os.path.join(args.run_dir, "ckpt"), max_to_keep=2)
    saved = mgr.save()
    digest = weights_digest(model)
    print(f"checkpoint saved to {saved} (weights sha256 {digest[:16]})", flush=True)
    res = subprocess.run([*on_host([args.restore_netns] if args.restore_netns else [], 0), sys.executable, __file__,
                          "--role", "restore", "--run-dir", args.restore_run_dir or args.run_dir],
                         capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stdout, res.stderr, file=sys.stderr)
        return 1
    restored = json.loads(res.stdout.strip().splitlines()[-1])
    same = restored["digest"] == digest
    print(f"restored in a fresh process: weights {'bit-identical' if same else 'DIFFERENT'},"
          f" test accuracy {restored['accuracy']:.4f}", flush=True)
    result = {"accuracy": acc, "restored_accuracy": restored["accuracy"], "bit_identical": same,
              "workers": args.workers, "steps": args.steps}
    print("RESULT " + json.dumps(result), flush=True)
    if not same or restored["accuracy"] != acc:
        return 1
    if acc < args.min_accuracy:
        print(f"accuracy {acc:.4f} is below the bound {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mount", help="an irdma mountpoint (the run goes in MOUNT/digits)")
    ap.add_argument("--run-dir", help="directory on the mount for this run (default MOUNT/digits)")
    ap.add_argument("--role", choices=("coordinator", "worker", "restore"), default="coordinator")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400, help="steps per worker")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--min-accuracy", type=float, default=0.93)
    ap.add_argument("--worker-run-dirs", type=lambda v: v.split(","), default=[],
                    help="comma-separated run directory of each worker (the same run on each worker host's mount)")
    ap.add_argument("--worker-netns", type=lambda v: v.split(","), default=[],
                    help="comma-separated network namespace (test bed host) each worker runs in")
    ap.add_argument("--restore-run-dir", help="the run directory the restoring process reads (another host's mount)")
    ap.add_argument("--restore-netns", help="the network namespace (test bed host) the restoring process runs in")
    args = ap.parse_args()
    for name in ("worker_run_dirs", "worker_netns"):
        if getattr(args, name) and len(getattr(args, name)) != args.workers:
            ap.error(f"--{name.replace('_', '-')} needs one entry per worker ({args.workers})")
    if args.run_dir is None:
        if args.mount is None:
            ap.error("give --mount (or --run-dir)")
        args.run_dir = os.path.join(args.mount, "digits")
    return {"coordinator": coordinator, "worker": worker, "restore": restore}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
