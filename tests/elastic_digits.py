"""A training script for the elastic tests: scikit-learn's digits, a 64-64-10 MLP, Adam with a
cosine-decayed learning rate through ``irdma.keras`` (evaluated at the worker's step: a worker
that rejoins takes the job's clock as its step, so it goes on at the job's rate). Rank 0 prints the test accuracy
(``accuracy: 0.xxxx``). ``--die-in-epoch E``: rank 1's first run SIGKILLs itself after batch 5
of epoch E (a restarted one has ``IRDMA_RESTART`` > 0)."""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import keras
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import irdma.keras as hvd


class Die(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.at, self.epoch = epoch, -1

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.epoch == self.at and batch == 5:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--die-in-epoch", type=int, default=None)
    parser.add_argument("--sync-timeout", type=float, default=60.0)
    args = parser.parse_args()
    hvd.init()
    keras.utils.set_random_seed(hvd.rank())
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split((x / 16.0).astype("float32"), y, test_size=0.3,
                                                        random_state=0, stratify=y)
    steps = len(x_train) // 32 // hvd.size()
    data = hvd.shard_dataset(tf.data.Dataset.from_tensor_slices((x_train, y_train)))
    data = data.repeat().shuffle(1000, seed=hvd.rank()).batch(32)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    # decay over a worker's steps (a worker that rejoins takes the job's clock as its step)
    lr = keras.optimizers.schedules.CosineDecay(0.003, decay_steps=args.epochs * steps, alpha=0.05)
    model.compile(loss="sparse_categorical_crossentropy", optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(lr),
                                                                                         sync_timeout=args.sync_timeout),
                  metrics=["accuracy"])
    callbacks: list[Any] = [hvd.BroadcastInitialWeights(0)]
    if args.die_in_epoch is not None and hvd.rank() == 1 and os.environ.get("IRDMA_RESTART", "0") == "0":
        callbacks.append(Die(args.die_in_epoch))
    model.fit(data, steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks, verbose=0)
    hvd.barrier("trained")
    if hvd.rank() == 0:
        model.optimizer.pull_weights()
        print(f"accuracy: {model.evaluate(x_test, y_test, verbose=0)[1]:.4f} ({hvd.size()} workers)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
