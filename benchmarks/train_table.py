"""The accuracy table of docs/training.md: ``examples/keras_digits.py`` under ``irdma run`` at
ASP, BSP and SSP:2, 2 and 4 workers, with SGD+momentum and Adam applied on the shards, against
the same training in one process (``make train-table``; about 10 minutes on 2 cores).

    python benchmarks/train_table.py [--epochs 20] [--out docs] [--quick]

Each configuration is one ``irdma run -n N --consistency MODE -- python examples/keras_digits.py``
(a local cluster of 2 shards that the launcher starts and removes); the single-process baseline
of each optimizer is ``keras_digits.py --single``, trained once. A progress bar says where it is.
Writes ``docs/training.md``, ``docs/training.json`` and ``docs/training.png`` (test accuracy
against epochs and against seconds). Data: scikit-learn's digits, inside its wheel.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(REPO, "examples", "keras_digits.py")
CONSISTENCY = ("asp", "bsp", "ssp:2")
WORKERS = (2, 4)
OPTIMIZERS = ("sgd", "adam")
LABEL = {"sgd": "SGD, momentum 0.9, lr 0.05", "adam": "Adam, lr 0.002"}
ENV = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3"}


def _run(cmd: list[str], out: str) -> dict:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=ENV)
    if res.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)  # type: ignore[no-any-return]


def single(work: str, optimizer: str, epochs: int) -> dict:
    out = os.path.join(work, f"single-{optimizer}.json")
    return _run([sys.executable, SCRIPT, "--single", "--optimizer", optimizer, "--epochs", str(epochs), "--json", out],
                out)


def run(work: str, workers: int, consistency: str, optimizer: str, epochs: int) -> dict:
    out = os.path.join(work, f"{optimizer}-{consistency.replace(':', '')}-{workers}.json")
    return _run([sys.executable, "-m", "irdma.ops.cli", "run", "-n", str(workers), "--consistency", consistency,
                 "--shards", "2", "--capacity", "256MiB", "--", sys.executable, SCRIPT, "--optimizer", optimizer,
                 "--epochs", str(epochs), "--json", out], out)


def write_report(results: list[dict], out: str, took: float, epochs: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(results, f, indent=1)
    fig, axes = plt.subplots(2, len(OPTIMIZERS), figsize=(6 * len(OPTIMIZERS), 8), squeeze=False)
    for j, opt in enumerate(OPTIMIZERS):
        rows = [r for r in results if r["optimizer"] == opt]
        if not rows:
            continue
        single = rows[0]["single"]
        for i, (x, name) in enumerate(((0, "epoch"), (1, "seconds"))):
            ax = axes[i][j]
            ax.plot([c[x] for c in single["curve"]], [c[2] for c in single["curve"]], "k-", lw=2.5,
                    label="single process")
            for r in rows:
                ax.plot([c[x] for c in r["irdma"]["curve"]], [c[2] for c in r["irdma"]["curve"]],
                        "-" if r["workers"] == 2 else "--", label=f"irdma {r['consistency']}, {r['workers']} workers")
            ax.set_xlabel(name if x == 0 else "seconds since the start of training")
            ax.set_ylabel("test accuracy")
            ax.set_ylim(0.5, 1.0)
            ax.set_title(f"{LABEL[opt]}: accuracy against {'epochs' if x == 0 else 'time'}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "training.png"), dpi=90)
    plt.close(fig)

    worst = max(abs(r["irdma"]["accuracy"] - r["single"]["accuracy"]) for r in results) * 100
    L = ["# Training as TensorFlow users write it", "",
         "Start the workers with `irdma run` and write the script as for Horovod: `import irdma.keras as hvd`,"
         " `hvd.init()`, `hvd.DistributedOptimizer(any Keras optimizer)`, `hvd.BroadcastInitialWeights(0)`,"
         " `hvd.shard_dataset(ds)`, plain `model.fit`. The optimizer runs on the shards; the job's consistency"
         " model (ASP, BSP, SSP) decides how far a worker may run ahead. `docs/keras.md` has the whole API:"
         " checkpoints, elastic jobs, P3 and layer dropping (`overlap=`, `drop=`), compression, `hvd.Embedding`.", "",
         "```sh",
         "irdma run -n 4 --consistency ssp:2 -- python examples/keras_digits.py --optimizer adam",
         "irdma run -n 4 --elastic 2:4 --consistency bsp -- python train.py       # restarts a failed worker",
         "irdma run -n 8 -H node1:4,node2:4 --meta postgresql://... -- python train.py",
         "```", "",
         "## What each system needs from the user", "",
         "| | Horovod (Keras) | TF ParameterServerStrategy | irdma |",
         "|---|---|---|---|",
         "| start the job | `horovodrun -np N -H hosts python train.py` (MPI or Gloo, ssh) | a `TF_CONFIG` cluster spec"
         " per process (chief, workers, parameter servers), each started by hand or by a scheduler |"
         " `irdma run -n N [-H hosts] -- python train.py` (a local cluster, or `--meta URL`) |",
         "| per-worker code | `hvd.init()`, `hvd.DistributedOptimizer(opt)`, broadcast callback, learning rate x"
         " `size()` | a `ClusterCoordinator`, `strategy.scope()` around the model, a dataset function |"
         " `hvd.init()`, `hvd.DistributedOptimizer(opt)`, `hvd.BroadcastInitialWeights(0)` |",
         "| where the optimizer runs | every worker (allreduce, then the same step) | the chief's steps, variables on"
         " the parameter servers | the shards (Keras's arithmetic); clipping, weight decay, schedules on the worker |",
         "| consistency | BSP | asynchronous | `--consistency bsp`, `ssp:K` or `asp` |",
         "| a worker dies | the job ends (Elastic Horovod: reset to the last commit) | its steps are retried on"
         " others | `--elastic`: restarted, rejoins at the job's clock and weights; else named in every error |",
         "| checkpoints | rank 0's `ModelCheckpoint` | the chief's `tf.train.Checkpoint` | `ModelCheckpoint`,"
         " `model.save`, `tf.train.Checkpoint`, `BackupAndRestore`: the shards' optimizer state included |",
         "| tables larger than a worker | no (every worker holds the model) | sharded variables |"
         " `hvd.Embedding` (rows pulled and pushed) |", "",
         "## Accuracy kept", "",
         f"One run of `make train-table` (`.venv/bin/python benchmarks/train_table.py`) on"
         f" {datetime.datetime.now():%Y-%m-%d %H:%M}: {os.cpu_count()} cores, Python {platform.python_version()};"
         f" it took {took / 60:.0f} min.", "",
         "Each row is `irdma run -n N --consistency MODE -- python examples/keras_digits.py --optimizer NAME"
         f" --epochs {epochs}`: N workers train the same Keras model (64-64-10 MLP) with plain `model.fit` on"
         " equal shares of scikit-learn's digits (1347 training, 450 test images) through"
         " `irdma.keras.DistributedOptimizer` (a local cluster of 2 shards). The baseline"
         " (`keras_digits.py --single`) trains the same model in one process with the same Keras optimizer,"
         " batch size (32) and epochs on the whole training set: both take the same number of gradient steps"
         " in all. Accuracy is on the test set after the last epoch; the curves (rank 0 for irdma) are in"
         " `docs/training.png`.", "",
         f"Largest difference to the single process: {worst:.1f} points"
         f" ({'within' if worst <= 1.0 else 'NOT within'} the 1-point target).", "",
         "| optimizer (on the shards) | consistency | workers | single-process | irdma | difference (points) |"
         " within 1 point | irdma s | single s | clock rounds per worker |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = (r["irdma"]["accuracy"] - r["single"]["accuracy"]) * 100
        L.append(f"| {LABEL[r['optimizer']]} | {r['consistency']} | {r['workers']} | {r['single']['accuracy']:.4f} |"
                 f" {r['irdma']['accuracy']:.4f} | {d:+.1f} | {'yes' if abs(d) <= 1.0 else '**no**'} |"
                 f" {r['irdma']['seconds']:.1f} | {r['single']['seconds']:.1f} | {r['irdma'].get('rounds') or '-'} |")
    L += ["", "![accuracy against epochs and time](training.png)", "",
          "Data: only scikit-learn's digits here. The larger image sets this machine's registries offer",
          "(`keras.datasets` MNIST/CIFAR, `tensorflow-datasets`, `emnist`) download their files at run time,",
          "which this project does not do; a package that ships one inside its wheel was not found.", "",
          "How to read the times: rank 0 and the baseline evaluate the test set at the end of each epoch"
          " (included); the workers share 2 cores with the shards, so N workers take about N times the wall"
          " time of one here. On a real cluster each worker has its own machine.", "",
          "Through a FUSE mount (any framework, no irdma import) the same training runs with"
          " `irdma.train.keras.ShardOptimizer` (`examples/train_keras.py`; docs/user-guide.md, \"Training with Keras\").", ""]
    with open(os.path.join(out, "training.md"), "w") as f:
        f.write("\n".join(L))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--out", default=os.path.join(REPO, "docs"))
    p.add_argument("--quick", action="store_true", help="2 epochs, ASP and BSP at 2 workers with Adam (a smoke run)")
    args = p.parse_args()
    configs = [(o, c, w) for o in OPTIMIZERS for c in CONSISTENCY for w in WORKERS]
    if args.quick:
        args.epochs, configs = 2, [("adam", "asp", 2), ("adam", "bsp", 2)]
    work = tempfile.mkdtemp(prefix="irdma-train-")
    t0 = time.monotonic()
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task("training", total=len(configs) + len({c[0] for c in configs}))
        baselines = {}
        for opt in dict.fromkeys(c[0] for c in configs):
            bar.update(task, description=f"{opt}, single process")
            baselines[opt] = single(work, opt, args.epochs)
            bar.advance(task)
        for opt, cons, n in configs:
            bar.update(task, description=f"{opt}, {cons}, {n} workers")
            r = {"optimizer": opt, "consistency": cons, "workers": n, "single": baselines[opt],
                 "irdma": run(work, n, cons, opt, args.epochs)}
            results.append(r)
            bar.console.print(f"{opt:5} {cons:6} {n} workers: single-process {r['single']['accuracy']:.4f},"
                              f" irdma {r['irdma']['accuracy']:.4f} ({r['irdma']['seconds']:.0f} s)")
            bar.advance(task)
    os.makedirs(args.out, exist_ok=True)
    write_report(results, args.out, time.monotonic() - t0, args.epochs)
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {os.path.join(args.out, 'training.md')} and training.png ({(time.monotonic() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    main()
