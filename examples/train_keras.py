"""Data-parallel Keras training through an irdma mount, against the same training in one process.

    python examples/train_keras.py --mount /mnt/irdma --workers 4 --consistency ssp:2 --optimizer adam

starts N worker processes; each trains the same model with plain ``model.fit`` on its share of
scikit-learn's digits (shipped inside the package: no download), with the optimizer applied on
the shards (:class:`irdma.train.keras.ShardOptimizer`) under the consistency model asked. Then it
trains the same model in this process with the same Keras optimizer, batch size and epochs,
and ends with one line::

    accuracy: single-process 0.9611, irdma 0.9589 (4 workers, ssp:2, adam)

``--json FILE`` also writes the figures (accuracy, seconds, per-epoch accuracy of worker 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

OPTIMIZERS = {
    "sgd": "sgd learning_rate=0.05 momentum=0.9",
    "adam": "adam learning_rate=0.002",
    "adagrad": "adagrad learning_rate=0.05",
    "rmsprop": "rmsprop learning_rate=0.001",
}


def data(worker: int | None, workers: int):  # type: ignore[no-untyped-def]
    """Digits scaled to [0, 1]: (x_train, y_train, x_test, y_test); a worker gets an equal share
    of the training set (every worker the same number of steps, so BSP never waits for a
    worker that has finished)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    if worker is not None:
        per = len(x_tr) // workers
        idx = np.random.default_rng(1).permutation(len(x_tr))[worker * per : (worker + 1) * per]
        x_tr, y_tr = x_tr[idx], y_tr[idx]
    return x_tr, y_tr, x_te, y_te


def model(seed: int = 0):  # type: ignore[no-untyped-def]
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10, activation="softmax")])


def run_worker(args: argparse.Namespace) -> None:
    import keras

    from irdma.train.keras import ShardOptimizer

    x, y, x_te, y_te = data(args.worker, args.workers)
    m = model()
    opt = ShardOptimizer(args.job, args.worker, args.workers, OPTIMIZERS[args.optimizer], args.consistency)
    m.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    opt.build(m.trainable_variables)  # the job's shared weights: written by worker 0, pulled by all
    curve: list[tuple[int, float, float]] = []
    t0 = time.monotonic()

    class Progress(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            acc = float(m.evaluate(x_te, y_te, verbose=0)[1]) if args.worker == 0 else 0.0
            curve.append((epoch + 1, time.monotonic() - t0, acc))
            print(f"  worker {args.worker}: epoch {epoch + 1}/{args.epochs}"
                  + (f", test accuracy {acc:.4f}" if args.worker == 0 else ""), flush=True)

    m.fit(x, y, epochs=args.epochs, batch_size=args.batch, verbose=0, shuffle=True, callbacks=[Progress()])
    opt._barrier(f"{os.path.basename(args.job)}-done")  # every worker's last push is in
    opt.pull_weights()
    acc = float(m.evaluate(x_te, y_te, verbose=0)[1])
    opt.close()
    if args.worker == 0:
        with open(args.result, "w") as f:
            json.dump({"accuracy": acc, "seconds": time.monotonic() - t0, "curve": curve, "rounds": opt.rounds}, f)


def run_single(args: argparse.Namespace) -> dict:
    import keras

    from irdma.train.keras import keras_optimizer

    x, y, x_te, y_te = data(None, 1)
    m = model()
    m.compile(optimizer=keras_optimizer(OPTIMIZERS[args.optimizer]), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
    curve: list[tuple[int, float, float]] = []
    t0 = time.monotonic()

    class Curve(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            curve.append((epoch + 1, time.monotonic() - t0, float(m.evaluate(x_te, y_te, verbose=0)[1])))

    m.fit(x, y, epochs=args.epochs, batch_size=args.batch, verbose=0, shuffle=True, callbacks=[Curve()])
    return {"accuracy": float(m.evaluate(x_te, y_te, verbose=0)[1]), "seconds": time.monotonic() - t0, "curve": curve}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mount", required=True, help="an irdma mount (irdma mount URL DIR)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--consistency", default="asp", help="asp, bsp or ssp:S")
    p.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1200, help="seconds the workers may take in all")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--single-json", help="reuse the single-process figures kept in this file (from an earlier run"
                   " with the same optimizer, epochs and batch), or keep them there")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        run_worker(args)
        return
    if not os.path.ismount(args.mount):
        sys.exit(f"error: {args.mount} is not a mount point (mount irdma there first: `irdma mount URL {args.mount}`)")
    job = os.path.join(args.mount, "jobs", f"keras-{args.consistency.replace(':', '')}-{args.optimizer}-{uuid.uuid4().hex[:8]}")
    os.makedirs(os.path.dirname(job), exist_ok=True)
    result = job + ".result.json"
    print(f"==> {args.workers} workers, {args.consistency}, {OPTIMIZERS[args.optimizer]} on the shards; job {job}", flush=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--mount", args.mount, "--workers", str(args.workers),
                               "--consistency", args.consistency, "--optimizer", args.optimizer, "--epochs",
                               str(args.epochs), "--batch", str(args.batch), "--worker", str(k), "--job", job,
                               "--result", result]) for k in range(args.workers)]
    deadline = time.monotonic() + args.timeout
    try:
        for proc in procs:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                sys.exit(f"error: worker {procs.index(proc)} failed (exit {rc}); its output is above")
    except subprocess.TimeoutExpired:
        sys.exit(f"error: the workers did not finish within {args.timeout:g} s (raise --timeout)")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    with open(result) as f:
        irdma_run = json.load(f)
    single = None
    key = {"optimizer": args.optimizer, "epochs": args.epochs, "batch": args.batch}
    if args.single_json and os.path.exists(args.single_json):
        with open(args.single_json) as f:
            kept = json.load(f)
        if kept.get("key") == key:
            single = kept["single"]
            print(f"==> the same training in one process: kept in {args.single_json}", flush=True)
    if single is None:
        print("==> the same training in one process", flush=True)
        single = run_single(args)
        if args.single_json:
            with open(args.single_json, "w") as f:
                json.dump({"key": key, "single": single}, f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": args.workers, "consistency": args.consistency, "optimizer": args.optimizer,
                       "epochs": args.epochs, "batch": args.batch, "irdma": irdma_run, "single": single}, f, indent=1)
    print(f"accuracy: single-process {single['accuracy']:.4f}, irdma {irdma_run['accuracy']:.4f}"
          f" ({args.workers} workers, {args.consistency}, {args.optimizer})", flush=True)


if __name__ == "__main__":
    main()
