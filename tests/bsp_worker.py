"""A worker of ``tests/test_bsp.py`` (run by ``irdma run -n N --consistency bsp``): trains the same
small model once per optimizer given on the command line, each in a job of its own (``$IRDMA_JOB``
``-KIND``, BSP, N workers), for ``STEPS`` steps of ``BATCH`` rows per worker through plain
``model.fit``; worker r's batch k is rows ``[(k N + r) B, (k N + r + 1) B)``, so the N workers of
a step together see what one process sees with batch ``N B``. Rank 0 saves each model
(``model.save``) to ``OUT/KIND.keras`` and prints ``{"kind": ..., "rounds": ...}`` lines.
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np

import irdma
import irdma.keras as hvd
from irdma.xattrs import XATTR_CONSISTENCY, XATTR_WORKERS

STEPS, BATCH = 20, 8

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.005, momentum=0.5, centered=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "adam-bpps2": lambda: keras.optimizers.Adam(0.01),
    "adam-p3": lambda: keras.optimizers.Adam(0.01),
    "adam-p3-drop": lambda: keras.optimizers.Adam(0.01),
    "adam-p3-drops": lambda: keras.optimizers.Adam(0.01),
    "momentum-hier": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "embedding-sgd": lambda: keras.optimizers.SGD(0.5),
    "embedding-adagrad": lambda: keras.optimizers.Adagrad(0.3),
}
#: Horovod's backward_passes_per_step of a kind (its gradients added up over that many steps,
#: averaged, before one push): one process then takes a step per that many batches of every worker.
PASSES = {"adam-bpps2": 2}
#: Kinds with per-layer pushes in P3's priority slices (of this many float32: a layer is several).
P3_SLICE = {"adam-p3": 16, "adam-p3-drop": 16, "adam-p3-drops": 16}
#: Kinds with layer dropping: a threshold no layer meets (every push goes: one process's steps),
#: and one the kernels meet for a while (dropped pushes: zero contributions to the rounds).
DROP = {"adam-p3-drop": 1e-12, "adam-p3-drops": 0.05}
#: The embedding kinds' table: rows of DIM floats (three chunks over two shards), IDS ids an example.
ROWS, DIM, IDS = 5000, 4, 5


def data(workers: int, kind: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The kind's examples in step order: ``STEPS * workers * BATCH`` of them. An embedding
    kind's are IDS ids each: SGD's repeat ids within and across examples; Adagrad's hold every
    id at most once a step (Keras squares a repeated id's gradients apart, one step's sum on the
    shards: the same for distinct ids)."""
    rng = np.random.default_rng(1)
    n = STEPS * workers * BATCH
    if kind.startswith("embedding"):
        if kind == "embedding-sgd":
            ids = rng.integers(0, ROWS, (n, IDS))
            ids[:, 1] = ids[:, 0]
            ids[1::2, 2] = ids[::2, 2]  # across the workers of a step too
        else:
            ids = np.concatenate([rng.permutation(ROWS)[: workers * BATCH * IDS].reshape(-1, IDS)
                                  for _ in range(STEPS)])
        return ids.astype("int64"), (ids.sum(axis=1) % 3).astype("int64")
    x = rng.standard_normal((n, 6)).astype("float32")
    return x, (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")


def model(kind: str = "", embedding: object = None) -> keras.Model:
    """The kind's model; an embedding kind's with ``embedding`` (a layer of ROWS x DIM,
    initialized to zeros) under a mean over the example's ids."""
    keras.utils.set_random_seed(7)
    if kind.startswith("embedding"):
        inp = keras.Input((IDS,), dtype="int64")
        pooled = keras.layers.GlobalAveragePooling1D()(embedding(inp))  # type: ignore[operator]
        return keras.Model(inp, keras.layers.Dense(3, activation="softmax")(pooled))
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


def main() -> None:
    out, kinds = sys.argv[1], sys.argv[2:]
    rank, n = int(os.environ["IRDMA_RANK"]), int(os.environ["IRDMA_SIZE"])
    job, run = os.environ["IRDMA_JOB"], os.environ.get("IRDMA_RUN_ID", "")
    with irdma.connect(os.environ["IRDMA_META"]) as c:
        if rank == 0:  # the jobs, BSP over n workers, before any worker joins one
            for kind in kinds:
                ino = c.makedirs(f"{job}-{kind}").ino
                c.client.store.setxattr(ino, XATTR_WORKERS, str(n).encode())
                c.client.store.setxattr(ino, XATTR_CONSISTENCY, b"bsp")
        c.run(c.client.barrier, f"{run}-{job.strip('/').replace('/', '-')}-setup", n, 120.0)
    mine = np.concatenate([np.arange((k * n + rank) * BATCH, (k * n + rank + 1) * BATCH) for k in range(STEPS)])
    for kind in kinds:
        x, y = data(n, kind)
        hvd.init(job=f"{job}-{kind}")
        table = hvd.Embedding(ROWS, DIM, optimizer=OPTIMIZERS[kind](), embeddings_initializer="zeros",
                              name="table") if kind.startswith("embedding") else None
        m = model(kind, table)
        passes = PASSES.get(kind, 1)
        extra: dict[str, object] = {"overlap": "p3", "slice_elems": P3_SLICE[kind]} if kind in P3_SLICE else {}
        if kind in DROP:
            extra["drop"] = DROP[kind]
        if kind.endswith("-hier"):  # the host's workers sum in shared memory, its local rank 0 pushes
            extra["hierarchy"] = True
        opt = hvd.DistributedOptimizer(OPTIMIZERS[kind](), backward_passes_per_step=passes,
                                       average_aggregated_gradients=passes > 1, **extra)
        m.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        m.fit(x[mine], y[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.BroadcastInitialWeights(0)])
        if rank == 0:
            m.save(os.path.join(out, f"{kind}.keras"))
            if table is not None:  # the table lives on the shards, not in the model's file
                np.save(os.path.join(out, f"{kind}-table.npy"), table.read_table())
            skipped = opt._job.rounds.skipped if opt._job.rounds is not None else 0  # noqa: SLF001
            print(json.dumps({"kind": kind, "rounds": opt.rounds, "skipped": skipped}), flush=True)
        hvd.shutdown()


if __name__ == "__main__":
    main()
