"""irdma.keras, the Horovod-shaped API: DistributedOptimizer wrapping a Keras optimizer equals
that optimizer step by step with one worker (real shards, real TensorFlow, ``model.fit``);
schedules, weight decay and clipping act as in Keras; models of every Keras kind train; the
optimizer survives ``model.save``/``load_model``."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from helpers import running_cluster

pytestmark = [pytest.mark.tf]

keras = pytest.importorskip("keras")
hvd = pytest.importorskip("irdma.keras")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: Any) -> Iterator[str]:
    with running_cluster(str(tmp_path_factory.mktemp("dist") / "c"), shards=2, replicas=1) as c:
        yield c.meta_url


@pytest.fixture
def job(cluster: str) -> Iterator[str]:
    path = f"/jobs/t-{uuid.uuid4().hex[:8]}"
    hvd.init(meta=cluster, job=path, rank=0, size=1)
    yield path
    hvd.shutdown()


def _data(n: int = 96) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 6)).astype("float32")
    return x, (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")


def _sequential() -> Any:
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


def _functional() -> Any:
    inp = keras.Input((6,))
    a = keras.layers.Dense(8, activation="tanh")(inp)
    b = keras.layers.Dense(8, activation="relu")(inp)
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.Concatenate()([a, b]))
    return keras.Model(inp, out)


class Subclassed(keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(10, activation="relu")
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))


def _steps(make_model: Callable[[], Any], optimizer: Any, callbacks: list[Any] | None = None,
           epochs: int = 2) -> list[list[np.ndarray]]:
    """The model's weights after every step of ``model.fit`` with ``optimizer`` (same initial
    weights and data every time)."""
    keras.utils.set_random_seed(7)
    model = make_model()
    x, y = _data()
    model(x[:1])  # built (a subclassed model has no build of its own)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    seen: list[list[np.ndarray]] = []
    def record(batch: int, logs: Any) -> None:
        getattr(model.optimizer, "flush", lambda: None)()  # per-layer rounds: the pulls in flight
        seen.append([np.array(w) for w in model.get_weights()])

    record = keras.callbacks.LambdaCallback(on_train_batch_end=record)
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=[record, *(callbacks or [])])
    return seen


def _assert_same(ours: list[list[np.ndarray]], keras_: list[list[np.ndarray]]) -> None:
    assert len(ours) == len(keras_) > 0
    for step, (a, b) in enumerate(zip(ours, keras_, strict=True)):
        for wa, wb in zip(a, b, strict=True):
            np.testing.assert_allclose(wa, wb, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")


OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.005, momentum=0.5, centered=True),
    "adagrad-schedule": lambda: keras.optimizers.Adagrad(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=3, decay_rate=0.5)),
    "sgd-clipnorm": lambda: keras.optimizers.SGD(0.2, clipnorm=0.05),
    "adam-global-clipnorm-decay": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1, weight_decay=0.02),
}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_one_worker_equals_the_wrapped_keras_optimizer_step_by_step(job: str, kind: str) -> None:
    make = OPTIMIZERS[kind]
    _assert_same(_steps(_sequential, hvd.DistributedOptimizer(make())), _steps(_sequential, make()))


@pytest.mark.parametrize("make_model", [_functional, Subclassed], ids=["functional", "subclassed"])
def test_functional_and_subclassed_models_train_as_in_keras(job: str, make_model: Callable[[], Any]) -> None:
    _assert_same(_steps(make_model, hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))),
                 _steps(make_model, keras.optimizers.Adam(0.01)))


def test_a_learning_rate_scheduler_callback_changes_the_shards_steps(job: str) -> None:
    def halve(epoch: int, lr: float) -> float:
        return lr if epoch == 0 else lr / 2

    ours = _steps(_sequential, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5)),
                  [keras.callbacks.LearningRateScheduler(halve)])
    theirs = _steps(_sequential, keras.optimizers.SGD(0.1, momentum=0.5), [keras.callbacks.LearningRateScheduler(halve)])
    _assert_same(ours, theirs)
    unscheduled = _steps(_sequential, keras.optimizers.SGD(0.1, momentum=0.5))
    assert not np.allclose(ours[-1][0], unscheduled[-1][0])  # the schedule did something


def test_the_job_holds_the_weights_and_a_small_model_gets_small_chunks(job: str, cluster: str) -> None:
    steps = _steps(_sequential, hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), epochs=1)
    from irdma.client.sync import connect

    with connect(cluster) as c:
        flat = np.frombuffer(bytes(c.read(f"{job}/params")), dtype="<f4")
        np.testing.assert_array_equal(flat, np.concatenate([w.ravel() for w in steps[-1]]))
        inode = c.stat(f"{job}/params")
        assert inode.chunk_size == 4096  # 6*12+12+12*3+3 floats = 492 bytes: the smallest chunk
        state = c._run(c.client.read_state, f"{job}/params")
    assert len(state) < 64 * 1024, len(state)  # proportional to the model, not to 4 MiB chunks


def test_the_optimizer_round_trips_through_model_save_and_load_model(job: str, tmp_path: Any) -> None:
    keras.utils.set_random_seed(7)
    model = _sequential()
    opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.1, clipnorm=1.0))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = os.path.join(str(tmp_path), "m.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, hvd.DistributedOptimizer)
    assert isinstance(loaded.optimizer.inner, keras.optimizers.AdamW)
    assert loaded.optimizer.inner.weight_decay == pytest.approx(0.1) and loaded.optimizer.clipnorm == 1.0
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    keras.models.load_model(path, compile=False)


def test_optimizers_the_shards_cannot_apply_are_refused_with_the_alternatives(job: str) -> None:
    from irdma import InvalidArgument

    with pytest.raises(InvalidArgument, match="wrap SGD, Adam, AdamW, Adagrad, RMSprop or Ftrl"):
        hvd.DistributedOptimizer(keras.optimizers.Nadam())
    with pytest.raises(InvalidArgument, match="amsgrad"):
        hvd.DistributedOptimizer(keras.optimizers.Adam(amsgrad=True))
    with pytest.raises(InvalidArgument, match=r"beta / \(2 \* learning_rate\)"):  # FTRL at Keras's fixed defaults only
        hvd.DistributedOptimizer(keras.optimizers.Ftrl(0.1, beta=1.0))


def test_without_init_the_error_says_how_to_run_the_script(monkeypatch: Any) -> None:
    from irdma import InvalidArgument

    hvd.shutdown()
    for name in ("IRDMA_META", "IRDMA_JOB"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidArgument) as info:
        hvd.init()
    assert "irdma run -n N" in str(info.value)
    with pytest.raises(InvalidArgument, match="init"):
        hvd.rank()


@pytest.mark.parametrize("how", ["model.save", "tf.train.Checkpoint"])
def test_a_checkpoint_holds_the_shards_optimizer_state_and_resuming_is_bit_identical(job: str, tmp_path: Any,
                                                                                      how: str) -> None:
    """An epoch, a checkpoint, another epoch (weights W). Restore the checkpoint, the same epoch
    again: W exactly (Adam's moments and step counts came back to the shards with it)."""
    import tensorflow as tf

    x, y = _data()
    keras.utils.set_random_seed(7)
    model = _sequential()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(str(tmp_path), "ckpt")
    if how == "model.save":
        model.save(path + ".keras")
    else:
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
        ckpt.write(path)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    want = [np.array(w) for w in model.get_weights()]
    if how == "model.save":
        model = hvd.load_model(path + ".keras")
    else:
        ckpt.read(path).assert_consumed()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_the_horovod_style_example_trains_two_workers_under_irdma_run(tmp_path: Any) -> None:
    """examples/horovod_style.py (Horovod's Keras example with its import line changed) under
    ``irdma run -n 2 --consistency bsp``: both ranks train, rank 0 checkpoints and reports the
    test accuracy."""
    import subprocess
    import sys

    from helpers import REPO

    ckpt = os.path.join(str(tmp_path), "ckpt")
    res = subprocess.run([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "2", "--consistency", "bsp", "--",
                          sys.executable, os.path.join(REPO, "examples", "horovod_style.py"), "--epochs", "10",
                          "--checkpoint-dir", ckpt], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    last = [ln for ln in res.stdout.splitlines() if ln.startswith(("[0] accuracy:", "[1] accuracy:"))]
    assert len(last) == 1 and last[0].startswith("[0] accuracy: "), res.stdout[-2000:]
    assert float(last[0].split()[2]) > 0.9, last[0]
    assert sorted(os.listdir(ckpt)) == sorted(f"checkpoint-{e}.keras" for e in range(1, 11))


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_the_shards_embedding_trains_as_keras_embedding(job: str, kind: str) -> None:
    """irdma.keras.Embedding (table on the shards, rows pulled and pushed) in a model with
    DistributedOptimizer against keras.layers.Embedding with the same Keras optimizer: the
    same dense weights and table after every step, rows absent from a batch left alone. With
    SGD, ids repeat within every example (their gradients summed). Adagrad's batches hold
    distinct ids: Keras's own sparse Adagrad squares each repeat's gradient apart (sum of
    squares), where the shards, as dense Adagrad, square the summed gradient."""
    make = {"sgd": lambda: keras.optimizers.SGD(0.5), "adagrad": lambda: keras.optimizers.Adagrad(0.3)}[kind]
    rng = np.random.default_rng(3)
    rows = 200
    if kind == "sgd":
        ids = rng.integers(0, 40, (64, 5))  # 40 of the 200 rows used: repeats, and rows never seen
        ids[:, 1] = ids[:, 0]  # a repeat inside every example
    else:
        ids = np.concatenate([rng.permutation(rows)[:80].reshape(16, 5) for _ in range(4)])
    y = (ids.sum(axis=1) % 2).astype("float32")

    def model_with(embedding: Any) -> Any:
        keras.utils.set_random_seed(11)
        inp = keras.Input((5,), dtype="int64")
        out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.GlobalAveragePooling1D()(embedding(inp)))
        return keras.Model(inp, out)

    ref_layer = keras.layers.Embedding(rows, 4, embeddings_initializer=keras.initializers.RandomUniform(-0.5, 0.5, seed=5))
    ref = model_with(ref_layer)
    ours_layer = hvd.Embedding(rows, 4, optimizer=make())
    ours = model_with(ours_layer)
    dense_ref = ref.layers[-1].get_weights()
    ours.layers[-1].set_weights(dense_ref)
    ours_layer.write_table(np.asarray(ref_layer.embeddings))
    ref.compile(optimizer=make(), loss="binary_crossentropy")
    ours.compile(optimizer=hvd.DistributedOptimizer(make()), loss="binary_crossentropy")
    for step in range(4):
        batch = slice(16 * step, 16 * step + 16)
        ref.train_on_batch(ids[batch], y[batch])
        ours.train_on_batch(ids[batch], y[batch])
        np.testing.assert_allclose(ours_layer.read_table(), np.asarray(ref_layer.embeddings), rtol=1e-5, atol=1e-6,
                                   err_msg=f"table after step {step}")
        for a, b in zip(ours.layers[-1].get_weights(), ref.layers[-1].get_weights(), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"dense layer after step {step}")
    assert np.all(ours_layer.hook.numpy() == 0)


#: A one-worker job with BackupAndRestore; STALL=E:B makes it wait to be killed after batch B
#: of epoch E (its pid in the marker file), past the last backup (epoch E-1's end).
RESUMABLE = """
import os, sys, time
import numpy as np, keras
import irdma.keras as hvd
backup, marker, out = sys.argv[1], sys.argv[2], sys.argv[3]
stall = tuple(int(v) for v in os.environ["STALL"].split(":")) if os.environ.get("STALL") else None
hvd.init()
keras.utils.set_random_seed(0)
rng = np.random.default_rng(1)
x = rng.standard_normal((256, 6)).astype("float32")
y = (x[:, 0] + x[:, 3] > 0).astype("int64")
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(2, activation="softmax")])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="sparse_categorical_crossentropy")

class Stall(keras.callbacks.Callback):
    epoch = 0
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
    def on_train_batch_end(self, batch, logs=None):
        if stall == (self.epoch, batch):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(9)

model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0,
          callbacks=[hvd.BroadcastInitialWeights(0), keras.callbacks.BackupAndRestore(backup), Stall()])
np.save(out, np.concatenate([w.ravel() for w in model.get_weights()]))
"""


@pytest.mark.long  # 29 s: make test-long (CI's time)
@pytest.mark.slow
def test_a_worker_killed_mid_epoch_resumes_from_backup_and_restore_bit_identically(cluster: str, tmp_path: Any) -> None:
    """SIGKILL a worker during epoch 2 (the shards have taken steps past its last backup), run
    the job again: BackupAndRestore's checkpoint puts the weights and the shards' optimizer
    state back, and the end weights equal an uninterrupted run's bit for bit."""
    import signal
    import subprocess
    import sys

    from helpers import wait_until

    tmp = str(tmp_path)

    def run(job: str, tag: str, stall: str | None = None) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.pop("STALL", None)
        if stall:
            env["STALL"] = stall
        return subprocess.Popen([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "1", "--meta", cluster, "--job", job,
                                 "--", sys.executable, "-c", RESUMABLE, os.path.join(tmp, f"backup-{job}"),
                                 os.path.join(tmp, f"pid-{job}"), os.path.join(tmp, f"{tag}.npy")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    whole = run("whole", "whole")
    _, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err.decode()[-3000:]

    killed = run("killed", "first", stall="2:3")
    try:
        pid_file = os.path.join(tmp, "pid-killed")
        wait_until(lambda: os.path.exists(pid_file) and os.path.getsize(pid_file) > 0, 300, "the worker to stall in epoch 2")
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        _, err = killed.communicate(timeout=120)
    finally:
        if killed.poll() is None:
            killed.kill()
    assert killed.returncode == 128 + signal.SIGKILL and b"rank 0 was killed by SIGKILL" in err, err.decode()[-2000:]
    again = run("killed", "resumed")
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err.decode()[-3000:]
    np.testing.assert_array_equal(np.load(os.path.join(tmp, "resumed.npy")), np.load(os.path.join(tmp, "whole.npy")))


def test_an_xla_compiled_step_is_refused_with_the_fix(job: str) -> None:
    """Keras turns XLA on by default where there is a GPU; the step calls the shards from
    Python, which XLA cannot compile: the error says to compile with jit_compile=False."""
    from irdma import InvalidArgument

    model = _sequential()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy",
                  jit_compile=True)
    x, y = _data(32)
    with pytest.raises(InvalidArgument, match="jit_compile=False"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    inp = keras.Input((3,), dtype="int64")
    with_table = keras.Model(inp, hvd.Embedding(10, 2, name="xla_table")(inp))
    assert not with_table.layers[-1].supports_jit


def test_compression_keeping_every_element_equals_keras_and_topk_pushes_only_the_largest(job: str, cluster: str) -> None:
    """compress="topk:1.0" keeps every element: the steps equal Keras's. With "topk:0.05" one
    SGD step changes at most 5% (rounded up) of each chunk's weights, by -lr x the kept
    gradient, and the rest waits in the worker's residual (error feedback)."""
    _assert_same(_steps(_sequential, hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                              compress="topk:1.0")),
                 _steps(_sequential, keras.optimizers.SGD(0.05, momentum=0.9)))

    hvd.init(meta=cluster, job=f"{job}-topk", rank=0, size=1)  # a new job: the one above holds trained weights
    keras.utils.set_random_seed(7)
    model = _sequential()
    x, y = _data(16)
    model(x[:1])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), compress="topk:0.05")
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    before = np.concatenate([np.ravel(w) for w in model.get_weights()])
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # one step
    after = np.concatenate([np.ravel(w) for w in model.get_weights()])
    changed = np.flatnonzero(after != before)
    # the params file is one 4 KiB chunk (1024 floats): one top-k piece of len(before) elements
    assert 0 < len(changed) <= int(np.ceil(0.05 * len(before))), len(changed)
    residual = opt._job.residual
    assert residual is not None and np.count_nonzero(residual) > len(changed)
    assert np.all(residual[changed] == 0)  # what was pushed left nothing behind


@pytest.mark.parametrize(("overlap", "hooks", "make_model", "kind"), [
    ("p3", True, _sequential, "momentum"),
    ("p3", True, _functional, "adamw"),
    ("p3", False, Subclassed, "adam"),
    ("fifo", True, _sequential, "adam-global-clipnorm-decay"),
], ids=["p3-sequential-momentum", "p3-functional-adamw", "p3-subclassed-no-hooks", "fifo-decay"])
def test_per_layer_rounds_through_model_fit_equal_keras_step_by_step(job: str, overlap: str, hooks: bool,
                                                                   make_model: Callable[[], Any], kind: str) -> None:
    """overlap="p3"/"fifo": a push per layer during back-propagation, pulls by priority that
    each layer's next forward pass waits for (with BroadcastInitialWeights' hooks). With one
    worker every step still equals the wrapped Keras optimizer's (the recording callback reads
    the weights after flush())."""
    make = OPTIMIZERS[kind]
    opt = hvd.DistributedOptimizer(make(), overlap=overlap, slice_elems=16)
    ours = _steps(make_model, opt, [hvd.BroadcastInitialWeights(0)] if hooks else [])
    _assert_same(ours, _steps(make_model, make()))
    rounds = opt._job.rounds
    assert len(rounds.groups) == (3 if make_model is _functional else 2)
    assert rounds.pushed == len(rounds.groups) * opt.rounds > 0
    assert rounds.hooked == (set(range(len(rounds.groups))) if hooks else set())


def _losses(make_model: Callable[[], Any], optimizer: Any, callbacks: list[Any]) -> list[float]:
    """The loss Keras logs after every batch (its forward passes' losses), nothing flushed."""
    keras.utils.set_random_seed(7)
    model = make_model()
    x, y = _data()
    model(x[:1])
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    seen: list[float] = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(float(logs["loss"])))
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[*callbacks, record])
    return seen


def test_p3s_forward_hooks_give_every_forward_pass_the_last_steps_weights(job: str) -> None:
    """Nothing flushed between steps: each layer's forward pass takes its own pull (the hooks'
    control dependencies). The losses of every forward pass equal Keras's, and the forward
    passes, not a flush, took the pulls."""
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), overlap="p3", slice_elems=16)
    ours = _losses(_functional, opt, [hvd.BroadcastInitialWeights(0)])
    theirs = _losses(_functional, keras.optimizers.SGD(0.05, momentum=0.9), [])
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    rounds = opt._job.rounds
    # 2 epochs of 6 steps: the first step of each epoch had nothing in flight (flushed at its end)
    assert rounds.waited_in_forward == len(rounds.groups) * (opt.rounds - 2) > 0


def test_layer_dropping_through_model_fit_holds_small_updates_back_and_loses_nothing(job: str, monkeypatch: Any) -> None:
    """drop=T with overlap="p3": some layer pushes are skipped (their gradients wait in the
    worker's residual cache); pushes + skips = layers x steps; nothing is lost: with SGD the
    shards' weights are the initial ones less lr x everything pushed, and what was pushed plus
    what waits in the cache is every gradient computed; the model learns."""
    from irdma import InvalidArgument
    from irdma.train import comm

    offered: dict[int, list[np.ndarray]] = {}
    pushed: dict[int, list[np.ndarray]] = {}
    offer = comm.ResidualCache.offer

    def recording(self: Any, key: Any, update: Any, weights: Any) -> Any:
        offered.setdefault(key, []).append(np.array(update, dtype=np.float64))
        out = offer(self, key, update, weights)
        if out is not None:
            pushed.setdefault(key, []).append(np.array(out, dtype=np.float64))
        return out

    monkeypatch.setattr(comm.ResidualCache, "offer", recording)
    keras.utils.set_random_seed(7)
    model = _sequential()
    x, y = _data(256)
    model(x[:1])
    w0 = np.concatenate([np.ravel(w) for w in model.get_weights()]).astype(np.float64)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), overlap="p3", drop=0.05)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    hist = model.fit(x, y, batch_size=16, epochs=6, shuffle=False, verbose=0, callbacks=[hvd.BroadcastInitialWeights(0)])
    rounds = opt._job.rounds
    assert rounds.skipped > 0 and rounds.pushed > 0
    assert rounds.pushed + rounds.skipped == len(rounds.groups) * opt.rounds
    assert rounds.pushed_bytes == 4 * sum(b - a for g in range(len(rounds.groups)) for a, b in rounds.runs[g]
                                          for _ in pushed.get(g, []))
    from irdma.train import distributed

    client = distributed._need("client")  # the job directory records the options (getfattr -d JOB)
    ino = client.stat(job).ino
    assert client.client.store.getxattr(ino, comm.XATTR_DROP) == b"0.05"
    assert client.client.store.getxattr(ino, comm.XATTR_SLICE) == str(opt.slice_elems).encode()
    # each step's forward pass took its layers' pulls of the step before (all but the first step's)
    assert rounds.waited_in_forward >= len(rounds.groups) * (opt.rounds - 6 - 1)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    groups = range(len(rounds.groups))
    sent = np.concatenate([np.sum(pushed.get(g, [np.zeros(1)]), axis=0) * np.ones(sum(
        b - a for a, b in rounds.runs[g])) for g in groups])
    opt.pull_weights()
    final = np.concatenate([np.ravel(w) for w in model.get_weights()]).astype(np.float64)
    np.testing.assert_allclose(final, w0 - 0.05 * sent, atol=2e-5)
    for g in groups:
        np.testing.assert_allclose(np.sum(offered[g], axis=0),
                                   np.sum(pushed.get(g, [0.0]), axis=0) + rounds.cache.residual(g), atol=1e-4)
    with pytest.raises(InvalidArgument, match="overlap='p3'"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), drop=0.1)
    with pytest.raises(InvalidArgument, match="overlap="):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), overlap="p4")


HIER = """
import json, sys, keras, numpy as np
import irdma.keras as hvd
hvd.init()
keras.utils.set_random_seed(hvd.rank())
rng = np.random.default_rng(1)
x = rng.standard_normal((512, 6)).astype("float32")
y = (x[:, 0] + x[:, 3] > 0).astype("int64")
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(2, activation="softmax")])
lr, momentum, sync_every = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=momentum), hierarchy=True, sync_every=sync_every)
model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
xs, ys = hvd.shard_dataset((x, y))
model.fit(xs, ys, batch_size=32, epochs=5, verbose=0, callbacks=[hvd.BroadcastInitialWeights(0)])
weights = np.concatenate([w.ravel() for w in model.get_weights()])
print(json.dumps({"rank": hvd.rank(), "pushes": opt.pushes, "rounds": opt.rounds,
                  "accuracy": float(model.evaluate(x, y, verbose=0)[1]), "checksum": float(weights.sum()),
                  "first": float(weights[0])}), flush=True)
hvd.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize(("lr", "momentum", "sync_every"), [(0.05, 0.5, 1), (0.1, 0.0, 4)],
                         ids=["every-step", "daso-K4"])
def test_hierarchy_pushes_once_per_host_and_every_worker_gets_the_same_weights(lr: float, momentum: float,
                                                                                sync_every: int) -> None:
    """DistributedOptimizer(hierarchy=True) under irdma run -n 2 (one host): the two workers sum
    their gradients in shared memory, local rank 0 pushes once per step (with sync_every=4,
    DASO: once every 4 steps, the others local steps with the host's mean gradient) and hands
    the pulled weights to the other; both end with the same weights and the model learns."""
    import json
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "2", "--consistency", "bsp", "--",
                          sys.executable, "-c", HIER, str(lr), str(momentum), str(sync_every)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = {d["rank"]: d for d in (json.loads(line.split("] ", 1)[1]) for line in res.stdout.splitlines()
                                  if line.startswith(("[0] {", "[1] {")))}
    steps = 5 * 512 // 2 // 32  # 5 epochs of each worker's half, batch 32
    assert got[0]["pushes"] == got[0]["rounds"] == got[1]["rounds"] == steps // sync_every and got[1]["pushes"] == 0
    assert got[0]["checksum"] == got[1]["checksum"] and got[0]["first"] == got[1]["first"]
    assert got[0]["accuracy"] > 0.9, got
    from irdma import InvalidArgument

    with pytest.raises(InvalidArgument, match="overlap='none'"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), overlap="p3", hierarchy=True)


@pytest.mark.parametrize(("k", "rounds"), [(3, 4), (5, 4)])
def test_daso_local_steps_with_a_global_step_every_k_equal_keras_sgd_for_one_worker(job: str, cluster: str, k: int,
                                                                                     rounds: int) -> None:
    """sync_every=K with one worker: K-1 local SGD steps, then the model's change goes to the
    shards (op add) and comes back, and again at each epoch's end (2 epochs of 6 steps: K=3
    syncs at steps 3, 6, 9, 12; K=5 at 5, 6 (the epoch's end), 11, 12); step by step the same
    weights as Keras's SGD, and the shards hold the last ones."""
    from irdma import InvalidArgument

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sync_every=k)
    ours = _steps(_sequential, opt, callbacks=[hvd.BroadcastInitialWeights(0)])
    _assert_same(ours, _steps(_sequential, keras.optimizers.SGD(0.1)))
    assert len(ours) == 12 and opt.rounds == opt.pushes == rounds

    import irdma

    with irdma.connect(cluster) as c:  # the shards hold the last global step's weights
        flat = np.frombuffer(bytes(c.read(f"{job}/params")), dtype="<f4")
    np.testing.assert_allclose(flat, np.concatenate([w.ravel() for w in ours[-1]]), rtol=1e-5, atol=1e-6)
    for bad, match in (({"optimizer": keras.optimizers.SGD(0.1, momentum=0.9)}, "plain SGD"),
                       ({"optimizer": keras.optimizers.Adam(0.1)}, "plain SGD"),
                       ({"optimizer": keras.optimizers.SGD(0.1), "overlap": "p3"}, "overlap='none'"),
                       ({"optimizer": keras.optimizers.SGD(0.1), "compress": "sign"}, "no compress"),
                       ({"optimizer": keras.optimizers.SGD(0.1), "sync_every_": 0}, "1 \\(every step\\)")):
        kwargs = dict(bad)
        optimizer = kwargs.pop("optimizer")
        k = kwargs.pop("sync_every_", 2)
        with pytest.raises(InvalidArgument, match=match):
            hvd.DistributedOptimizer(optimizer, sync_every=k, **kwargs)
