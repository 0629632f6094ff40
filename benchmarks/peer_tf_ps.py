"""Peer: TensorFlow's ParameterServerStrategy (gRPC), a local in-process cluster.

Two parameter servers and two workers, each a ``tf.distribute.Server`` in this process, talking
gRPC over loopback. Variables of the model's layer shapes are created under the strategy (placed
round-robin on the parameter servers). One round: each worker, in a closure scheduled by the
``ClusterCoordinator``, pushes a gradient (``assign_add`` of a tensor made on the worker) into
every variable and pulls every variable back to the worker.

    python benchmarks/peer_tf_ps.py --rounds 3 --shapes shapes.json   -> prints JSON
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import tensorflow as tf

    with open(args.shapes) as f:
        shapes = [tuple(s) for s in json.load(f)]
    spec = {
        "worker": [f"127.0.0.1:{_port()}" for _ in range(2)],
        "ps": [f"127.0.0.1:{_port()}" for _ in range(2)],
    }
    cluster = tf.train.ClusterSpec(spec)
    # as TensorFlow's own in-process cluster does: enough inter-op threads on a small machine,
    # or the workers deadlock
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = max(3, os.cpu_count() or 1)
    servers = [tf.distribute.Server(cluster, job_name=job, task_index=i, protocol="grpc", config=config, start=True)
               for job in ("worker", "ps") for i in range(len(spec[job]))]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(s, tf.float32)) for s in shapes]

    @tf.function
    def round_fn() -> tf.Tensor:
        total = tf.constant(0.0)
        for v in variables:  # push: a gradient made on the worker, added on the parameter server
            v.assign_add(tf.fill(v.shape, 1e-3))
        for v in variables:  # pull: every variable's value to the worker
            total += tf.reduce_sum(tf.identity(v.read_value()))
        return total

    coordinator.schedule(round_fn)  # warm-up: tracing and connections
    coordinator.join()
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        for _w in range(2):
            coordinator.schedule(round_fn)
        coordinator.join()
    secs = (time.perf_counter() - t0) / args.rounds
    n = sum(int(tf.size(v)) for v in variables)
    print(json.dumps({"round_s": secs, "params": n, "bytes_per_worker_round": 8 * n}))
    del servers


if __name__ == "__main__":
    main()
