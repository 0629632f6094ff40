#!/usr/bin/env python3
"""``make bench-comm``: less and smarter communication on shaped links (issue 12).

Hosts are network namespaces of this machine on one bridge (:mod:`irdma.ops.testbed`), every link
rate-shaped with ``tc tbf`` both ways: hosts 0-1 run a shard each, hosts 2-3 are worker hosts.
Workers train real Keras models on real data (scikit-learn's digits, no download) with plain
``model.fit`` and :class:`irdma.keras.DistributedOptimizer`, one process per worker, so
back-propagation is real and the figures include it. Every figure is against a baseline measured
in the same run:

1. P3 priority slicing: time per iteration of ``overlap="p3"`` against ``"fifo"`` (the same
   overlap of pushes with back-propagation in arrival order, whole tensors: "no priority") and
   ``"none"``, on a VGG-shaped MLP (>= 20 layers, small first, large last) scaled so that one
   iteration's computation is about as long as its communication, at two link rates.
   Targets: p3 >= 1.2x fifo; p3 takes >= 80% of what any overlap could take off the iteration
   (none less the larger of the computation and the model's one-way link time).
2. Layer dropping with a residual cache: bytes pushed and test accuracy, against no dropping,
   on a digits MLP and on the larger model. Target: >= 50% fewer bytes, accuracy within 0.5 point.
3. Compression with error feedback (top-k 1%, scaled sign): bytes pushed, time per iteration
   and accuracy against no compression.
4. Hierarchical aggregation: 2 hosts x 2 workers, flat pushes (4 workers) against one push per
   host (``hierarchy=True``: :class:`irdma.train.hier.HostGroup`) and DASO's global step every 4
   (``sync_every=4``): bytes on the worker hosts' links (the kernel's counters) and time per iteration.
5. Combined: the hierarchy with top-k compression.
6. The cost model (:mod:`irdma.train.costmodel`, ``irdma tune``): its prediction of each measured
   configuration's time per iteration, from the link rate measured by a plain TCP stream and the
   computation time measured by the workers without communication. Target: within 25%.

Writes ``docs/communication.md``, ``docs/communication.json`` and ``docs/communication.png``.
Everything is removed at the end, also on failure or Ctrl-C. Needs root.

    make bench-comm                       # or: .venv/bin/python benchmarks/comm.py
    .venv/bin/python benchmarks/comm.py --quick    # small models, few steps: a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import hosts as H  # noqa: E402  (the test bed's roles: TCP stream baseline, shard namespaces)

PY = sys.executable
MiB = 1 << 20
DEFAULT_SLICE = 40_000  # P3's slice, float32
BIG_SLICE = 262_144  # 1 MiB: fewer requests where each costs CPU (the cost model's overhead term)
WINDOW = int(os.environ.get("IRDMA_BENCH_WINDOW", "4"))  # requests in flight per shard
# layer dropping's thresholds (relative L1 of a step's update): the models' updates differ in
# size by orders (the deep CNN's relative steps are small), so each has its own
DROPS = (0.002, 0.003, 0.004, 0.006)  # digits
DROP_LARGE = 0.0005
TECH_NAMES = ("topk:0.01", "sign")
say, loadavg = H.say, H.loadavg


# ====================================================================== models and data
def architecture(kind: str, quick: bool) -> list[tuple[str, int]]:
    """The layers of the models, first first: ``("conv", channels)`` (3x3, same padding, ReLU),
    ``("pool", 2)``, ``("dense", units)``. ``large`` is VGG-shaped (P3's best case): 12
    convolutions that hold most of the computation and few weights, then 8 dense layers that
    hold most of the weights; ``digits`` is a small MLP."""
    if kind == "digits":
        return [("dense", 128), ("dense", 128), ("dense", 64)]
    s = 2 if quick else 1
    convs = [32, 32, 64, 64, 96, 96, 128, 128, 160, 160, 192, 192]
    dense = [2048, 2048, 1024, 512, 256, 128, 64]
    arch: list[tuple[str, int]] = []
    for j, c in enumerate(convs):
        arch.append(("conv", c // s))
        if j == 5:
            arch.append(("pool", 2))
    return arch + [("dense", d // s) for d in dense]


def make_model(kind: str, quick: bool, seed: int) -> Any:
    import keras

    keras.utils.set_random_seed(seed)
    layers: list[Any] = [keras.Input((64,))]
    arch = architecture(kind, quick)
    if arch[0][0] == "conv":
        layers.append(keras.layers.Reshape((8, 8, 1)))
    flat = True
    for what, n in arch:
        if what == "conv":
            layers.append(keras.layers.Conv2D(n, 3, padding="same", activation="relu", kernel_initializer="he_normal"))
            flat = False
        elif what == "pool":
            layers.append(keras.layers.MaxPooling2D(n))
        else:
            if not flat:
                layers.append(keras.layers.Flatten())
                flat = True
            layers.append(keras.layers.Dense(n, activation="relu", kernel_initializer="he_normal"))
    layers.append(keras.layers.Dense(10, activation="softmax"))
    return keras.Sequential(layers)


def param_bytes(kind: str, quick: bool) -> list[int]:
    """Bytes of each layer's weights (kernel + bias, float32), first layer first."""
    out, cin, side, flat = [], 1, 8, None
    for what, n in architecture(kind, quick):
        if what == "conv":
            out.append(4 * (9 * cin * n + n))
            cin = n
        elif what == "pool":
            side //= n
        else:
            fan_in = flat if flat is not None else (cin * side * side if kind != "digits" else 64)
            out.append(4 * (fan_in * n + n))
            flat = n
    out.append(4 * ((flat or 64) * 10 + 10))
    return out


def digits() -> tuple[Any, Any, Any, Any]:
    """scikit-learn's digits (ships with the package): 1,497 training and 300 test images."""
    import numpy as np
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return x[:-300], y[:-300], x[-300:], y[-300:]


# ====================================================================== the worker role
def role_worker(spec_json: str) -> None:
    """Train on a worker host: every run of ``spec["runs"]`` in turn, one JSON line at the end."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import irdma

    # The computation gets one core; the other is left to the transfers, the shards and the
    # kernel's TCP (what a NIC's offload does on a real worker): on a 2-core machine they would
    # otherwise take their CPU from back-propagation and no overlap could show.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    # the client's loop thread and the training thread share the GIL; Python's default hand-over
    # (5 ms) is kept: 0.5 ms made P3 slightly better against fifo but the computation 25% slower
    sys.setswitchinterval(float(os.environ.get("IRDMA_BENCH_SWITCH_S", "0.005")))
    spec = json.loads(spec_json)
    xtr, ytr, xte, yte = digits()
    k, n = spec["worker"], spec["workers"]
    xtr, ytr = xtr[k::n], ytr[k::n]  # this worker's part of the data
    out = []
    with irdma.connect(spec["url"], transport="tcp", window=spec.get("window", WINDOW), timeout=60) as client:
        if spec.get("probe"):
            out.append(probe(client, spec["worker"], spec["quick"]))
        for run in spec["runs"]:
            out.append(fit_run(spec, run, xtr, ytr, xte, yte))

            async def drop_job(c: Any, job: str = f"/{run['job']}") -> None:  # room for the next run
                for name in await c.listdir(job):
                    await c.unlink(f"{job}/{name}")

            if n == 1:  # alone on the job: nobody else is still using its files
                client.submit(drop_job).result(120)
    print(json.dumps(out), flush=True)


def profile_layers(model: Any, x: Any, y: Any, steps: int, batch: int, seed: int) -> tuple[list[float], float]:
    """What the cost model takes per tensor: seconds of forward pass and back-propagation of each
    layer with weights (the layers without weights that follow one count with it; those before
    the first, with the first), eager and layer by layer, median over ``steps`` after the first;
    and back-propagation's share of the total. The weights do not change."""
    import numpy as np
    import tensorflow as tf

    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()
    owners = [layer for layer in model.layers if layer.trainable_weights]
    index = {id(layer): i for i, layer in enumerate(owners)}
    rng = np.random.default_rng(seed)
    per_step, shares = [], []
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        h = tf.convert_to_tensor(x[idx])
        spent: dict[int, float] = {}
        records = []
        for layer in model.layers:
            t1 = time.perf_counter()
            with tf.GradientTape() as tape:
                tape.watch(h)
                out = layer(h, training=True)
            spent[id(layer)] = time.perf_counter() - t1
            records.append((layer, tape, h, out))
            h = out
        with tf.GradientTape() as tape:
            tape.watch(h)
            loss = tf.reduce_mean(loss_fn(y[idx], tf.identity(h)))
        g = tape.gradient(loss, h)
        backward = 0.0
        for layer, tape, hin, out in reversed(records):
            t1 = time.perf_counter()
            g = tape.gradient(out, [hin, *layer.trainable_weights], output_gradients=g)[0]
            spent[id(layer)] += time.perf_counter() - t1
            backward += time.perf_counter() - t1
        per, cur = [0.0] * len(owners), 0
        for layer in model.layers:
            cur = index.get(id(layer), cur)
            per[cur] += spent[id(layer)]
        per_step.append(per)
        shares.append(backward / max(sum(per), 1e-9))
    keep = per_step[1:] or per_step
    return [statistics.median(c) for c in zip(*keep, strict=True)], statistics.median(shares[1:] or shares)


def fit_run(spec: dict[str, Any], run: dict[str, Any], xtr: Any, ytr: Any, xte: Any, yte: Any) -> dict[str, Any]:
    """One run through plain ``model.fit`` with :class:`irdma.keras.DistributedOptimizer`
    (``overlap`` none, fifo or p3, ``compress``, ``drop``, ``hierarchy``, ``sync_every``; its
    forward hooks from ``BroadcastInitialWeights``): time per iteration (the median gap between
    batch ends after the warm-up), what the host's link carried, the push payload, accuracy;
    first, with ``compute_steps``, the same model's computation alone (``model.fit`` with Keras's
    own SGD: no transfers) and its per-layer profile (:func:`profile_layers`)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import irdma.keras as hvd

    k, n, batch, steps = spec["worker"], spec["workers"], run["batch"], run["steps"]
    if run.get("hier"):  # what `irdma run -H` gives each worker: its place on its host
        os.environ["IRDMA_LOCAL_RANK"], os.environ["IRDMA_LOCAL_SIZE"] = (str(spec["local"]["rank"]),
                                                                          str(spec["local"]["size"]))
    lr = float(run["update"].split("learning_rate=")[1])
    data = tf.data.Dataset.from_tensor_slices((xtr, ytr)).repeat().shuffle(2048, seed=k).batch(batch)
    ends: list[float] = []
    timer = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: ends.append(time.perf_counter()))
    warm = run.get("warmup", 2)

    def gaps() -> list[float]:
        return [b - a for a, b in zip(ends[warm:], ends[warm + 1 :], strict=False)]

    compute = layers = share = None
    if run.get("compute_steps"):
        alone = make_model(run["model"], spec["quick"], seed=1)
        alone.compile(optimizer=keras.optimizers.SGD(lr), loss="sparse_categorical_crossentropy")
        alone.fit(data, steps_per_epoch=run["compute_steps"] + warm + 1, epochs=1, verbose=0, callbacks=[timer])
        compute = statistics.median(gaps())
        ends.clear()
        layers, share = profile_layers(alone, xtr, ytr, run["compute_steps"] + 1, batch, k)
    hvd.init(meta=spec["url"], job=f"/{run['job']}", rank=k, size=n, transport="tcp",
             window=spec.get("window", WINDOW), timeout=60)
    model = make_model(run["model"], spec["quick"], seed=1)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), overlap=run["overlap"], sync_timeout=300,
                                   slice_elems=run.get("slice", DEFAULT_SLICE), drop=run.get("drop", 0.0),
                                   compress=run.get("compress"), hierarchy=bool(run.get("hier")),
                                   sync_every=run.get("sync_every", 1))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    link0, cpu0, self0 = own_link(), cpu_times(), os.times()
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[hvd.BroadcastInitialWeights(0), timer])
    link1, cpu1, self1 = own_link(), cpu_times(), os.times()
    spent = {key: cpu1[key] - cpu0[key] for key in cpu0}
    total = sum(spent.values()) or 1.0
    cpu = {key: v / total for key, v in spent.items()}  # shares of the machine's CPU time (all cores)
    cpu["worker_s_per_step"] = ((self1.user + self1.system) - (self0.user + self0.system)) / max(steps, 1)
    pred = model.predict(xte, verbose=0, batch_size=256)
    rounds = opt._job.rounds
    out = {"name": run["name"], "step_s": statistics.median(gaps()), "steps_s": gaps(), "compute_s": compute,
           "layer_compute_s": layers, "backward_share": share,
           "acc": float((np.argmax(pred, 1) == yte).mean()), "steps": steps, "rounds": opt.rounds,
           "pushes": rounds.pushed if rounds is not None else opt.pushes,
           "skipped": rounds.skipped if rounds is not None else 0,
           "pushed": rounds.pushed_bytes if rounds is not None else opt.pushed_bytes,
           "waited_in_forward": rounds.waited_in_forward if rounds is not None else 0,
           # what this host's link carried during the run (the kernel's counters): tx is the
           # pushes (and the pulls' small requests), rx the pulled weights
           "wire_tx": link1["tx"] - link0["tx"], "wire_rx": link1["rx"] - link0["rx"], "cpu": cpu}
    hvd.shutdown()
    return out


def probe(client: Any, worker: int, quick: bool) -> dict[str, Any]:
    """The cost model's inputs that a plain TCP stream does not give: the rate at which this
    client pushes and pulls (assign, 1 MiB pieces: the software cap with the link) and the wall
    time of one small request with the window full (its per-request overhead)."""
    import numpy as np

    path, n = f"/probe-{worker}", (8 if quick else 32) * MiB
    data = np.ones(n // 4, dtype="<f4")
    client.write(path, data, op="assign")
    rates: dict[str, float] = {}
    for kind in ("push", "pull"):
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            if kind == "push":
                client.submit(lambda c: c.write(path, data, op="assign"), slice_bytes=MiB).result(120)
            else:
                client.submit(lambda c: c.read(path), slice_bytes=MiB).result(120)
            best = max(best, n / (time.perf_counter() - t0))
        rates[kind] = best
    count = 400

    async def many(c: Any) -> float:
        import trio

        from irdma.client.native import layout_of

        inode = await c.meta.resolve(path)
        layout, chunks = layout_of(inode), await c.meta.chunk_map(inode.ino)
        buf = memoryview(bytearray(4096 * count))
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(c.read_into, layout, 4096 * (i % 64), buf[4096 * i : 4096 * (i + 1)], chunks)
        return (trio.current_time() - t0) / count

    per = client.submit(many).result(120)
    client.unlink(path)
    from irdma.wire import compress

    # a compressed push costs the worker its encoding and the shard its decoding, per P3 slice:
    # the time of a 32 MiB push in 160 KB slices, less its bytes' time on the link, per dense byte
    grad = np.random.default_rng(0).standard_normal(n // 4).astype("<f4")
    gpath = f"/probe-grad-{worker}"
    client.write(gpath, np.zeros(n // 4, dtype="<f4"), op="assign")
    client.set_update_op(gpath, "add")
    encode = {}
    for spec in ("topk:0.01", "sign"):
        c = compress.parse_compress(spec)
        best = math.inf
        for _ in range(2):
            res = np.zeros(n // 4, dtype=np.float32)
            t0 = time.perf_counter()
            client.submit(lambda cl, c=c, res=res: cl.push(gpath, grad, compress=c, residual=res),
                          slice_bytes=4 * DEFAULT_SLICE).result(120)
            best = min(best, time.perf_counter() - t0)
        wire = compress.wire_bytes(n // 4, c) / rates["push"]
        encode[spec] = max(0.0, best - wire) / n
    client.unlink(gpath)
    return {"name": "probe", "push_bytes_per_s": rates["push"], "pull_bytes_per_s": rates["pull"],
            "request_s": per, "encode_s_per_byte": encode}


def cpu_times() -> dict[str, float]:
    """The machine's CPU time by kind (``/proc/stat``, all cores, seconds): what a run left idle."""
    with open("/proc/stat") as f:
        cols = [int(x) for x in f.readline().split()[1:8]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq = (c / hz for c in cols)
    return {"user": user + nice, "system": system + irq, "softirq": softirq, "idle": idle + iowait}


def own_link() -> dict[str, int]:
    """Byte counters of this network namespace's ``eth0`` (``/proc/net/dev`` is per namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                cols = rest.split()
                return {"rx": int(cols[0]), "tx": int(cols[8])}
    return {"rx": 0, "tx": 0}


# ====================================================================== the coordinator
def link_bytes(bed: Any, host: Any) -> dict[str, int]:
    """The kernel's byte counters of a host's link (its ``eth0``)."""
    res = subprocess.run(["ip", "-n", host.netns, "-s", "-j", "link", "show", "eth0"], capture_output=True,
                         text=True, timeout=30, check=True)
    st = json.loads(res.stdout)[0]["stats64"]
    return {"tx": int(st["tx"]["bytes"]), "rx": int(st["rx"]["bytes"])}


class CommBench:
    def __init__(self, args: argparse.Namespace, bed: Any, work: str) -> None:
        self.args, self.bed, self.work = args, bed, work
        hargs = argparse.Namespace(link_bytes=args.link_bytes, rate=bed.rate)
        self.b = H.Bench(hargs, bed, work, None)
        self.b.shard_hosts, self.b.workers = bed.hosts[0:2], bed.hosts[2:4]
        self.seq = 0

    def train(self, runs_by_proc: list[tuple[Any, dict[str, Any]]], url: str) -> list[list[dict[str, Any]]]:
        """Start one worker process per ``(host, spec)`` together; their results, in order."""
        env = {**self.b.env, "IRDMA_KEY_FILE": self.b.key}
        before = {h.index: link_bytes(self.bed, h) for h in self.b.workers}
        procs = [self.bed.popen(h, [PY, os.path.abspath(__file__), "_worker", json.dumps({**spec, "url": url})],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for h, spec in runs_by_proc]
        results = []
        try:
            for p in procs:
                stdout, stderr = p.communicate(timeout=self.args.run_timeout)
                if p.returncode != 0:
                    raise RuntimeError(f"a worker failed ({p.returncode}):\n{stderr[-4000:]}")
                results.append(json.loads(stdout.strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
        after = {h.index: link_bytes(self.bed, h) for h in self.b.workers}
        self.last_link = {i: {k: after[i][k] - before[i][k] for k in ("tx", "rx")} for i in before}
        return results

    def runs(self, model: str, names: list[tuple[str, dict[str, Any]]], steps: int, batch: int,
             update: str, compute_steps: int = 0) -> list[dict[str, Any]]:
        out = []
        for j, (name, extra) in enumerate(names):
            self.seq += 1
            out.append({"name": name, "job": f"job{self.seq}", "model": model, "steps": steps, "batch": batch,
                        "update": update, "warmup": 2, "compute_steps": compute_steps if j == 0 else 0, **extra})
        return out


def fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        role_worker(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models and few steps: a smoke test (~2 min)")
    ap.add_argument("--rates", default=None, help="link rates to measure P3 at (default: 500mbit,1gbit)")
    ap.add_argument("--out", default=os.path.join(REPO, "docs"), help="where communication.md/json/png go")
    ap.add_argument("--run-timeout", type=float, default=1200.0)
    ap.add_argument("--only", default="p3,techniques,hier", help="which parts to run (comma-separated)")
    ap.add_argument("--update", action="store_true", help="put the parts run into --out's existing report")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench-comm needs root (network namespaces): run it as root", file=sys.stderr)
        return 2
    from irdma.ops.testbed import TestBed

    q = args.quick
    # communication about as long as computation: the large model's weights (59 MB) take about
    # its computation on one core (~0.9 s) at 500 Mbit/s, half of it at 1 Gbit/s
    rates = (args.rates or ("1gbit" if q else "500mbit,1gbit")).split(",")
    args.link_bytes = 16 * MiB if q else 64 * MiB
    steps_large = 6 if q else 14
    steps_tech = 6 if q else 30  # accuracy needs more steps than timing
    batch_large = 32 if q else 128
    digits_steps = 40 if q else 300
    R: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": q,
                         "machine": {"nproc": os.cpu_count(), "kernel": platform.release(),
                                     "python": platform.python_version()},
                         "load_start": loadavg(), "large_layers": len(param_bytes("large", q)),
                         "large_bytes": sum(param_bytes("large", q)), "digits_bytes": sum(param_bytes("digits", q))}

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    work = tempfile.mkdtemp(prefix="irdma-bench-comm-")
    os.chmod(work, 0o755)
    sgd = "sgd learning_rate=0.02"
    R["p3"], R["drop"], R["compress"], R["hier"], R["combined"] = [], [], [], [], []
    try:
        for rate in rates:
            say(f"test bed at {rate}: hosts 0-1 shards, 2-3 workers (load {loadavg()})")
            with TestBed(4, rate=rate) as bed:
                bed_work = os.path.join(work, rate)  # each bed's own files (port files are numbered per bed)
                os.makedirs(bed_work)
                cb = CommBench(args, bed, bed_work)
                link = cb.b.baseline()
                with cb.b.namespace("sqlite", 2, capacity=2048 * MiB) as url:
                    w = bed.hosts[2]
                    if "p3" in args.only:
                        say(f"1. P3 at {rate}: none, fifo, p3 on the {R['large_layers']}-layer model"
                            f" ({fmt_bytes(R['large_bytes'])}), {steps_large} steps of batch {batch_large}")
                        runs = cb.runs("large", [("none", {"overlap": "none"}), ("fifo", {"overlap": "fifo"}),
                                                 ("p3", {"overlap": "p3"}),
                                                 ("p3-1MiB", {"overlap": "p3", "slice": BIG_SLICE})],
                                       steps_large, batch_large, sgd, compute_steps=4)
                        res = cb.train([(w, {"worker": 0, "workers": 1, "quick": q, "runs": runs, "probe": True})],
                                       url)[0]
                        pr = res.pop(0)
                        R["p3"].append({"rate": rate, "link": link, "runs": res, "probe": pr})
                        say(f"  probe: client push {pr['push_bytes_per_s'] / 1e6:.0f} MB/s, pull"
                            f" {pr['pull_bytes_per_s'] / 1e6:.0f} MB/s, {1e6 * pr['request_s']:.0f} us per 4 KB request")
                        say("  " + ", ".join(f"{r['name']} {r['step_s']:.3f} s/iter" for r in res)
                            + f" (compute alone {res[0]['compute_s']:.3f} s)")
                    if rate == rates[0] and "techniques" in args.only:
                        say("2-3. dropping and compression on digits (accuracy) and on the large model (bytes, time)")
                        compression = [("topk:0.01", {"overlap": "p3", "compress": "topk:0.01"}),
                                       ("sign", {"overlap": "p3", "compress": "sign"})]
                        drops = [(f"drop {d:g}", {"overlap": "p3", "drop": d}) for d in (DROPS[-1:] if q else DROPS)]
                        res = cb.train([(w, {"worker": 0, "workers": 1, "quick": q,
                                             "runs": cb.runs("digits", [("dense", {"overlap": "p3"}), *drops, *compression],
                                                             digits_steps, 32, "sgd learning_rate=0.1")})], url)[0]
                        R["drop"].append({"model": "digits", "runs": [r for r in res if r["name"] not in TECH_NAMES]})
                        R["compress"].append({"model": "digits", "runs": [r for r in res if not r["name"].startswith("drop")]})
                        res = cb.train([(w, {"worker": 0, "workers": 1, "quick": q,
                                             "runs": cb.runs("large", [("dense", {"overlap": "p3"}),
                                                                       (f"drop {DROP_LARGE:g}", {"overlap": "p3", "drop": DROP_LARGE}),
                                                                       *compression],
                                                             steps_tech, batch_large, sgd)})], url)[0]
                        R["drop"].append({"model": "large", "runs": [r for r in res if r["name"] not in TECH_NAMES]})
                        R["compress"].append({"model": "large", "runs": [r for r in res if not r["name"].startswith("drop")]})
                        for r in res:
                            say(f"  large {r['name']}: {r['step_s']:.3f} s/iter, pushed {fmt_bytes(r['pushed'])},"
                                f" acc {r['acc']:.3f}")

                    if rate == rates[0] and "hier" in args.only:
                        say("4-5. hierarchy: 2 hosts x 2 workers, flat against one push per host; then all combined")
                        for name, extra in (("flat", {"overlap": "none"}), ("hier", {"overlap": "none", "hier": True}),
                                            *([] if q else [("hier-K4", {"overlap": "none", "hier": True,
                                                                         "sync_every": 4})]),
                                            ("combined", {"overlap": "none", "hier": True, "compress": "topk:0.01"})):
                            procs = []
                            cb.seq += 1
                            for hi, host in enumerate(bed.hosts[2:4]):
                                for lr in range(2):
                                    run = {"name": name, "job": f"hier{cb.seq}", "model": "digits", "steps": digits_steps // 2,
                                           "batch": 32, "update": "sgd learning_rate=0.1", "warmup": 2, **extra}
                                    spec = {"worker": 2 * hi + lr, "workers": 4, "quick": q, "runs": [run],
                                            "local": {"rank": lr, "size": 2}}  # the optimizer forms the host group
                                    procs.append((host, spec))
                            res = cb.train(procs, url)
                            links = cb.last_link
                            entry = {"name": name, "runs": [r[0] for r in res], "link": links,
                                     "link_tx": sum(v["tx"] for v in links.values()),
                                     "step_s": statistics.mean(r[0]["step_s"] for r in res),
                                     "acc": statistics.mean(r[0]["acc"] for r in res)}
                            (R["combined"] if name == "combined" else R["hier"]).append(entry)
                            say(f"  {name}: {entry['step_s']:.3f} s/iter, worker links sent {fmt_bytes(entry['link_tx'])},"
                                f" acc {entry['acc']:.3f}")
        R["load_end"] = loadavg()
        if args.update:  # measure some sections again into the report of an earlier full run
            with open(os.path.join(args.out, "communication.json")) as f:
                old = json.load(f)
            old.pop("fit", None)  # the CommTrainer era's second P3 table: P3 runs through model.fit now
            for key, part in (("p3", "p3"), ("drop", "techniques"), ("compress", "techniques"), ("hier", "hier"),
                              ("combined", "hier")):
                if part in args.only:
                    old[key] = R[key]
            old.setdefault("updated", []).append(f"{R['date']}: {args.only}")
            R = old
        R["model"] = model_rows(R, q)
        R["targets"] = targets(R)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "communication.json"), "w") as f:
            json.dump(R, f, indent=1)
        with open(os.path.join(args.out, "communication.md"), "w") as f:
            f.write(report(R))
        with contextlib.suppress(Exception):
            plot(R, os.path.join(args.out, "communication.png"))
        say(f"wrote {args.out}/communication.md")
        for t in R["targets"]:
            say(f"  {t['target']}: {t['ratio']:.2f} (wanted {t['wanted']}) {'met' if t['met'] else 'NOT met'}")
        return 0
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def model_rows(R: dict[str, Any], quick: bool) -> list[dict[str, Any]]:
    """The cost model's prediction of every measured configuration of a large-model run.

    Its inputs are measured apart from the runs it predicts: the link (a plain TCP stream), the
    client's own push and pull rate and the wall time of one request with the window full (the
    probe), and the computation alone (the workers, without transfers)."""
    from irdma.train import costmodel as cm

    out: list[dict[str, Any]] = []
    for e in R["p3"]:
        pr = e["probe"]
        compute = _run(e, "none")["compute_s"]
        base = {"sizes": tuple(param_bytes("large", quick)), "workers": 1, "hosts": 1, "shards": 2,
                "link_bytes_per_s": 1e6 * min(e["link"]["push"], e["link"]["pull"]), "latency_s": 50e-6,
                "cap_bytes_per_s": min(pr["push_bytes_per_s"], pr["pull_bytes_per_s"]), "window": 4,
                # the model charges o/(S*window) per request; the probe measured the wall time per
                # request with S*window requests in flight
                "overhead_s": pr["request_s"] * 2 * 4}
        # per layer, as measured (forward + back-prop): a convolution computes much per byte
        # of weights, a dense layer little, so "proportional to bytes" would misplace the work
        layers = _run(e, "none")["layer_compute_s"]
        scale = compute / sum(layers)  # the per-layer split of the measured total
        base["layer_compute_s"] = tuple(x * scale for x in layers)
        base["backward_fraction"] = _run(e, "none")["backward_share"]
        runs = [(r, {}) for r in e["runs"]]
        if e is R["p3"][0]:
            runs += [(r, {"compress": True}) for c in R["compress"] if c["model"] == "large" for r in c["runs"]
                     if r["name"] != "dense"]
        for r, flags in runs:
            name = r["name"]
            overlap = "none" if name == "none" else "fifo" if name == "fifo" else "p3"
            slice_bytes = {"p3": 4 * DEFAULT_SLICE, "p3-1MiB": 4 * BIG_SLICE}.get(name, 0)
            mode = name if flags.get("compress") else "flat"
            extra = {}
            if flags.get("compress"):
                slice_bytes = 4 * DEFAULT_SLICE
                extra["encode_s_per_byte"] = pr["encode_s_per_byte"][name]
            cfg = cm.Config(**base, **extra, overlap=overlap, slice_bytes=slice_bytes, mode=mode)  # type: ignore[arg-type]
            p = cm.predict(cfg)
            out.append({"config": f"{e['rate']} {name}", "predicted": p.time_s, "measured": r["step_s"],
                        "error": p.time_s / r["step_s"] - 1, "bound": p.bound})
    return out


def _idle(r: dict[str, Any]) -> str:
    c = r.get("cpu")
    return f"{100 * c['idle']:.0f}%" if c else "-"


def _hideable(e: dict[str, Any], model_bytes: int) -> tuple[float, float]:
    """``(exposed, bound)`` of a P3 entry's run without overlap: the exposed communication (its
    time less the computation alone) and the most any overlap can take off the iteration:
    ``none - max(computation, one-way link time)``. An iteration can be no shorter than its
    computation, nor than moving the model one way over the link (pushes and pulls share a
    full-duplex link, so each direction carries the model once per step)."""
    none = _run(e, "none")
    exposed = max(0.0, none["step_s"] - none["compute_s"])
    one_way = model_bytes / (1e6 * min(e["link"]["push"], e["link"]["pull"]))
    return exposed, max(0.0, none["step_s"] - max(none["compute_s"], one_way))


def _run(entry: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in entry["runs"] if r["name"] == name)


def targets(R: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for e in R["p3"]:
        fifo = _run(e, "fifo")
        for name, what in (("p3", "160 KB slices"), ("p3-1MiB", "1 MiB slices")):
            p3 = _run(e, name)
            ratio = fifo["step_s"] / p3["step_s"]
            out.append({"target": f"P3 time per iteration at {e['rate']}, {what}", "ratio": ratio,
                        "baseline": f"fifo {fifo['step_s']:.3f} s", "wanted": ">= 1.2x", "met": ratio >= 1.2})
    for e in R["drop"]:
        base = _run(e, "dense")
        runs = [r for r in e["runs"] if r["name"].startswith("drop")]
        for r in runs:
            r["saved"] = 1 - r["wire_tx"] / base["wire_tx"]
            r["dacc"] = 100 * (r["acc"] - base["acc"])
        ok = [r for r in runs if r["dacc"] >= -0.5]
        # the threshold a user would pick: the most bytes saved with the accuracy kept
        d = max(ok, key=lambda r: r["saved"]) if ok else max(runs, key=lambda r: r["dacc"])
        out.append({"target": f"layer dropping: bytes saved ({e['model']}, {d['name']})", "ratio": d["saved"],
                    "baseline": f"{fmt_bytes(base['wire_tx'])} sent", "wanted": ">= 0.50", "met": d["saved"] >= 0.5})
        out.append({"target": f"layer dropping: accuracy change, points ({e['model']}, {d['name']})", "ratio": d["dacc"],
                    "baseline": f"accuracy {base['acc']:.3f}", "wanted": ">= -0.5", "met": d["dacc"] >= -0.5})
    for e in R["p3"]:
        none = _run(e, "none")
        best = min((_run(e, k) for k in ("p3", "p3-1MiB")), key=lambda r: r["step_s"])
        exposed, bound = _hideable(e, R["large_bytes"])
        hidden = (none["step_s"] - best["step_s"]) / bound if bound > 0 else 0.0
        out.append({"target": f"P3 at {e['rate']}: iteration time saved, of its bound", "ratio": hidden,
                    "baseline": f"bound {bound:.3f} s (exposed {exposed:.3f} s)", "wanted": ">= 0.80",
                    "met": hidden >= 0.8})
    flat = next((h for h in R.get("hier", []) if h["name"] == "flat"), None)
    for name, what, want in (("hier", "one push per host", 0.55), ("hier-K4", "a global step every 4 (DASO)", 0.55 / 4)):
        h = next((h for h in R.get("hier", []) if h["name"] == name), None)
        if flat and h:
            ratio = h["link_tx"] / flat["link_tx"]
            out.append({"target": f"hierarchy: bytes on the worker hosts' links, {what} (2 x 2 workers)",
                        "ratio": ratio, "baseline": f"flat {fmt_bytes(flat['link_tx'])}", "wanted": f"<= {want:.2f}",
                        "met": ratio <= want})
    for c in R.get("model", []):
        out.append({"target": f"cost model: {c['config']}", "ratio": c["error"], "baseline": f"measured {c['measured']:.3f} s",
                    "wanted": "<= 0.25", "met": abs(c["error"]) <= 0.25})
    return out


def report(R: dict[str, Any]) -> str:
    L = [f"# Communication: P3, layer dropping, compression, hierarchy ({R['date']})", "",
         "Made by `make bench-comm` (`benchmarks/comm.py`" + (" --quick" if R["quick"] else "") + ") on this machine"
         f" ({R['machine']['nproc']} cores, kernel {R['machine']['kernel']}); load average {R['load_start']} at the"
         f" start, {R.get('load_end', '?')} at the end. Hosts are network namespaces with `tc`-shaped links;"
         " workers train real Keras models on scikit-learn's digits. Every ratio is against a baseline"
         " measured in the same run." + ("".join(f" Measured again into this report: {u} (`--only ... --update`)."
                                                for u in R.get("updated", []))), "", "## Targets", "",
         "| target | ratio | baseline | wanted | met |", "|---|---|---|---|---|"]
    for t in R["targets"]:
        L.append(f"| {t['target']} | {t['ratio']:.2f} | {t['baseline']} | {t['wanted']} | {'yes' if t['met'] else 'no'} |")
    L += ["", f"## P3 priority slicing through `model.fit` (VGG-shaped CNN: {R['large_layers']} layers with weights,"
          f" 12 convolutions then 8 dense; {fmt_bytes(R['large_bytes'])} of weights; batch 128, one core computing)", "",
          "`irdma.keras.DistributedOptimizer(keras.optimizers.SGD(0.02), overlap=...)` in plain `model.fit`."
          " Computation alone: `model.fit` with Keras's own SGD (compiled, no transfers). Saved of bound:"
          " (none - best p3) / (none - max(computation, the model's bytes over one direction of the link)),"
          " the share of what any overlap could take off the iteration.", "",
          "| link | measured link MB/s (push, pull) | computation alone s | none s/iter | fifo s/iter |"
          " p3 160 KB s/iter | p3 1 MiB s/iter | best p3 vs fifo | best p3 vs none | saved of bound |"
          " accuracy (none, fifo, p3, p3 1 MiB) | machine CPU idle during fifo, p3 1 MiB |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in R["p3"]:
        n, f, p, pb = (_run(e, k) for k in ("none", "fifo", "p3", "p3-1MiB"))
        best = min(p["step_s"], pb["step_s"])
        bound = _hideable(e, R["large_bytes"])[1]
        L.append(f"| {e['rate']} | {e['link']['push']:.0f}, {e['link']['pull']:.0f} | {n['compute_s']:.3f} |"
                 f" {n['step_s']:.3f} | {f['step_s']:.3f} | {p['step_s']:.3f} | {pb['step_s']:.3f} |"
                 f" {f['step_s'] / best:.2f}x | {n['step_s'] / best:.2f}x |"
                 f" {(n['step_s'] - best) / bound if bound > 0 else 0:.2f} |"
                 f" {n['acc']:.3f}, {f['acc']:.3f}, {p['acc']:.3f}, {pb['acc']:.3f} |"
                 f" {_idle(f)}, {_idle(pb)} |")
    L += ["", "## The cost model against the measurements (`irdma tune`, `irdma/train/costmodel.py`)", "",
          "| configuration | predicted s/iter | measured s/iter | error | bound (model) |", "|---|---|---|---|---|"]
    for c in R.get("model", []):
        L.append(f"| {c['config']} | {c['predicted']:.3f} | {c['measured']:.3f} | {100 * c['error']:+.0f}% | {c['bound']} |")
    L += ["", "## Layer dropping and compression (one worker, P3 on, through model.fit)", "",
          "Bytes sent: what the worker host's link carried during the run (the kernel's counters: the"
          " pushes, TCP/IP headers and the pulls' requests); payload: the optimizer's count of push payload"
          " (an estimate for the compressed pushes: the client also cuts at chunk boundaries).", "",
          "| model | technique | bytes sent | vs dense | payload pushed | pushes skipped | s/iter | accuracy |",
          "|---|---|---|---|---|---|---|---|"]
    for e in R["compress"]:
        base = _run(e, "dense")
        rows = e["runs"] + [r for d in R["drop"] if d["model"] == e["model"] for r in d["runs"]
                            if r["name"].startswith("drop")]
        for r in rows:
            L.append(f"| {e['model']} | {r['name']} | {fmt_bytes(r['wire_tx'])} | {r['wire_tx'] / base['wire_tx']:.3f} |"
                     f" {fmt_bytes(r['pushed'])} | {r['skipped']} of {r['skipped'] + r['pushes']} | {r['step_s']:.3f} |"
                     f" {r['acc']:.3f} |")
    L += ["", "## Hierarchical aggregation (2 hosts x 2 workers, digits MLP, an ASP job; model.fit with"
          " `DistributedOptimizer(SGD(0.1), hierarchy=True)`; hier-K4: `sync_every=4` (DASO); combined: hierarchy"
          " with `compress='topk:0.01'`)", "",
          "| mode | bytes sent by the worker hosts' links | vs flat | s/iter | accuracy |", "|---|---|---|---|---|"]
    flat = next((h for h in R["hier"] if h["name"] == "flat"), None)
    for h in R["hier"] + R["combined"]:
        rel = f"{h['link_tx'] / flat['link_tx']:.3f}" if flat else "-"
        L.append(f"| {h['name']} | {fmt_bytes(h['link_tx'])} | {rel} | {h['step_s']:.3f} | {h['acc']:.3f} |")
    L.append("")
    return "\n".join(L) + "\n"


def plot(R: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    for j, e in enumerate(R["p3"]):
        vals = [_run(e, k)["step_s"] for k in ("none", "fifo", "p3", "p3-1MiB")]
        ax.bar([x + 0.27 * j for x in range(4)], vals, width=0.25, label=e["rate"])
    ax.set_xticks(range(4), ["none", "fifo", "p3", "p3 1MiB"])
    ax.set_ylabel("s per iteration")
    ax.set_title("P3 priority slicing")
    ax.legend()
    ax = axes[1]
    for e in R["compress"]:
        base = _run(e, "dense")["wire_tx"]
        rows = e["runs"] + [r for d in R["drop"] if d["model"] == e["model"] for r in d["runs"]
                            if r["name"].startswith("drop")]
        ax.scatter([r["wire_tx"] / base for r in rows], [r["acc"] for r in rows], label=e["model"])
        for r in rows:
            ax.annotate(r["name"], (r["wire_tx"] / base, r["acc"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent / dense")
    ax.set_ylabel("test accuracy")
    ax.set_title("dropping and compression")
    ax.legend()
    ax = axes[2]
    rows = R["hier"] + R["combined"]
    ax.bar([h["name"] for h in rows], [h["link_tx"] / 1e6 for h in rows])
    ax.set_ylabel("MB sent by worker hosts")
    ax.set_title("hierarchy (2 hosts x 2 workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
