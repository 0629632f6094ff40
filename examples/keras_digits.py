"""Data-parallel Keras on irdma as a Horovod user writes it, and the same training in one process.

    irdma run -n 4 --consistency ssp:2 -- python examples/keras_digits.py --optimizer adam --epochs 20
    python examples/keras_digits.py --single --optimizer adam --epochs 20      # ASP/SSP's baseline
    python examples/keras_digits.py --single --batch-size 128 --epochs 20      # BSP at 4 workers

Every worker trains a 64-64-10 MLP with plain ``model.fit`` on its share of scikit-learn's
digits (shipped inside the package: no download; 1347 training and 450 test images), with
:class:`irdma.keras.DistributedOptimizer` wrapping the Keras optimizer: the shards apply it
under the job's consistency model. ``--single`` trains the same model with the same Keras
optimizer and epochs on the whole training set in this process. Each worker takes
``1347 // (N * B)`` steps of batch B (``--batch-size``, 32) per epoch, and so does one process
with batch ``N * B``: under BSP a round is one step on the mean of the N workers' gradients,
what ``--single --batch-size N*B`` computes; under ASP and SSP every push is a step, and
``--single`` with batch B takes as many steps over as many examples. ``--seed S`` (0) seeds the
model's initial weights (rank 0's, broadcast), the shuffling and each rank's own shuffle
(``1000 * S + rank``); the train/test split is fixed. Rank 0 (or the single process) evaluates
the test set at each epoch's end and prints ``accuracy: 0.xxxx``; ``--json FILE`` writes the
figures (final accuracy, seconds, the per-epoch curve, clock rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

#: The Keras optimizers the table uses, by name.
OPTIMIZERS = {
    "sgd": ("SGD", {"learning_rate": 0.05, "momentum": 0.9}),
    "adam": ("Adam", {"learning_rate": 0.002}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the initial weights and the shuffles (1000 * SEED + rank); the split is fixed")
    parser.add_argument("--single", action="store_true", help="train in this process with Keras alone (the baseline)")
    parser.add_argument("--overlap", default="none", help="DistributedOptimizer's overlap: none, fifo or p3")
    parser.add_argument("--json", default=None, help="write the figures to this file (rank 0)")
    args = parser.parse_args()

    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split((x / 16.0).astype("float32"), y, test_size=0.25,
                                                        random_state=0, stratify=y)
    name, config = OPTIMIZERS[args.optimizer]
    optimizer = getattr(keras.optimizers, name)(**config)
    rank, size = 0, 1
    if not args.single:
        import irdma.keras as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        optimizer = hvd.DistributedOptimizer(optimizer, overlap=args.overlap)
    seed = 1000 * args.seed + rank  # rank 0's weights (broadcast) are the single process's
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    # every worker the same number of steps (BSP); len // B // N == len // (N * B): as many as one
    # process with batch N * B takes over as many examples
    steps = len(x_train) // args.batch_size // size
    data = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    if not args.single:
        data = hvd.shard_dataset(data)
    data = data.repeat().shuffle(2048, seed=seed).batch(args.batch_size)

    curve: list[tuple[int, float, float]] = []
    t0 = time.monotonic()

    def evaluate(epoch: int, logs: Any) -> None:
        if rank == 0:
            curve.append((epoch + 1, time.monotonic() - t0, float(model.evaluate(x_test, y_test, verbose=0)[1])))

    callbacks: list[Any] = [] if args.single else [hvd.BroadcastInitialWeights(0)]
    callbacks.append(keras.callbacks.LambdaCallback(on_epoch_end=evaluate))
    model.fit(data, steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks, verbose=0)
    seconds = time.monotonic() - t0
    rounds = None
    if not args.single:
        hvd.barrier("trained")  # every worker's steps are on the shards
        model.optimizer.pull_weights()
        rounds = model.optimizer.rounds
    if rank == 0:
        accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
        print(f"accuracy: {accuracy:.4f} ({'single process' if args.single else f'{size} workers'}, {args.optimizer})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"accuracy": accuracy, "seconds": seconds, "curve": curve, "rounds": rounds,
                           "workers": size, "optimizer": args.optimizer, "batch_size": args.batch_size,
                           "seed": args.seed, "steps_per_epoch": steps}, f)
    if not args.single:
        hvd.shutdown()


if __name__ == "__main__":
    main()
