"""Horovod's Keras example, ported to irdma.

Horovod's ``examples/tensorflow2/tensorflow2_keras_mnist.py`` with its import line changed
(marked ``# irdma:``), MNIST replaced by scikit-learn's digits (shipped with the package: no
download), each rank given its shard of them (``hvd.shard_dataset``; Horovod's example gives every
rank the whole data) and an evaluation at the end. Run it with the launcher, as ``horovodrun -np 2 python ...`` would::

    irdma run -n 2 --consistency bsp -- python examples/horovod_style.py --epochs 12

Each step the shards average the workers' gradients and take one Adam step, as Horovod's
allreduce does, so the learning rate is Horovod's (scaled by the workers) with its warm-up;
rank 0 saves a checkpoint every epoch and prints the test accuracy at the end (``accuracy: 0.9xxx``).
"""

from __future__ import annotations

import argparse
import os

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import irdma.keras as hvd  # irdma: was `import horovod.tensorflow.keras as hvd`


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default=None, help="Where rank 0 saves a checkpoint each epoch.")
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different initial weights per rank: the broadcast makes them one

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split((x / 16.0).astype("float32"), y, test_size=0.2,
                                                        random_state=0, stratify=y)
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    dataset = hvd.shard_dataset(dataset).repeat().shuffle(1000, seed=hvd.rank()).batch(args.batch_size)

    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(10, activation="softmax"),
    ])
    # Horovod: scale the learning rate by the number of workers (their gradients are averaged)
    scaled_lr = 0.001 * hvd.size()
    opt = keras.optimizers.Adam(scaled_lr)
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)
    model.compile(loss="sparse_categorical_crossentropy", optimizer=opt, metrics=["accuracy"])

    callbacks = [
        # every rank starts from rank 0's weights
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # the epoch's metrics averaged over the ranks at each epoch's end (before any callback that
        # reads them: ReduceLROnPlateau, TensorBoard, ModelCheckpoint)
        hvd.callbacks.MetricAverageCallback(),
        # scaled_lr / size() ramped to scaled_lr over the first three epochs (Goyal et al.)
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]
    if hvd.rank() == 0 and args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))
    steps = len(x_train) // args.batch_size // hvd.size()
    model.fit(dataset, steps_per_epoch=steps, callbacks=callbacks, epochs=args.epochs,
              verbose=2 if hvd.rank() == 0 else 0)

    hvd.barrier("trained")  # every worker's steps are on the shards
    if hvd.rank() == 0:
        model.optimizer.pull_weights()  # the shards' weights: every worker's steps
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        print(f"accuracy: {accuracy:.4f} ({hvd.size()} workers)")
    hvd.shutdown()


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
