"""Server-side optimizers (``user.irdma.update`` = sgd/adam/adagrad/rmsprop ...) against Keras 3.

Through a real two-shard cluster (two replicas of every chunk, persistent shards) and a real
FUSE mount: each file starts as initial weights, its update op is set to an optimizer, and every
write of a gradient must leave the same weights as ``keras.optimizers.X.apply`` on a Keras
variable given the same gradients (norm-wise relative error <= 1e-5), across chunk boundaries,
through a SIGKILLed replica that comes back and is resynced, then the loss of the other one
(the state was copied with the chunks), and a learning-rate change by rewriting the xattr.
"""

from __future__ import annotations

import errno
import os
import signal

import numpy as np
import pytest
from helpers import irdma_cli, mounted, wait_until
from optim_ref import CONFIGS, relative_error, spec_text

from irdma.ops import cluster
from irdma.ops._proc import pid_alive
from irdma.wire.optimizers import format_update, parse_update
from irdma.wire.protocol import OPT_NESTEROV, UpdateOp

MB = 1 << 20


# ---------------------------------------------------------------- the xattr's text
def test_specs_take_keras_names_and_defaults_and_print_canonically() -> None:
    u = parse_update("adam learning_rate=0.01, beta_1=0.8")
    assert u.op == UpdateOp.ADAM and u.args == (0.01, 0.8, 0.999, 1e-7)
    assert format_update(u) == "adam learning_rate=0.01 beta_1=0.8 beta_2=0.999 epsilon=1e-07"
    assert parse_update(format_update(u)) == u
    sgd = parse_update("sgd momentum=0.9 nesterov=true")
    assert sgd.args[:2] == (0.01, 0.9) and sgd.flags & OPT_NESTEROV
    assert parse_update("ADD").op == UpdateOp.ADD and format_update(parse_update("assign")) == "assign"
    ftrl = parse_update("ftrl l1_regularization_strength=0.01 beta=0 learning_rate_power=-0.5")  # Keras's defaults taken
    assert ftrl.op == UpdateOp.FTRL and ftrl.args == (0.001, 0.1, 0.01, 0.0) and parse_update(format_update(ftrl)) == ftrl


@pytest.mark.parametrize("text,why", [
    ("adam lr=0.1", "no argument 'lr'"), ("sgd momentum=1.5", "momentum"), ("adam learning_rate=-1", "> 0"),
    ("adam learning_rate=abc", "not a number"), ("rmsprop centered=maybe", "true or false"),
    ("adam amsgrad=true", "not applied on the shards"), ("sgd clipnorm=1", "clip"), ("lamb", "unknown update op"),
    ("add x=1", "no arguments"), ("adam beta_1", "name=value"), ("", "empty"),
    ("ftrl beta=1", "beta / \\(2 \\* learning_rate\\)"), ("ftrl learning_rate_power=-1", "must be -0.5"),
    ("ftrl l1_regularization_strength=-1", ">= 0"),
])
def test_bad_specs_are_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_update(text)


# ---------------------------------------------------------------- against Keras, through the mount
def _keras_optimizer(name: str, args: dict[str, float | bool]):  # type: ignore[no-untyped-def]
    import keras

    cls = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam, "adagrad": keras.optimizers.Adagrad,
           "rmsprop": keras.optimizers.RMSprop, "ftrl": keras.optimizers.Ftrl}[name]
    return cls(**args)


def _kill(state: list[cluster.ShardProc], shard_id: int) -> None:
    s = next(s for s in state if s.shard_id == shard_id)
    os.kill(s.pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(s.pid), 10, f"shard {shard_id} to die")


@pytest.mark.tf
@pytest.mark.fuse
@pytest.mark.slow
def test_every_optimizer_matches_keras_through_failover_resync_and_a_new_learning_rate(tmp_path: object) -> None:
    import keras

    d = os.path.join(str(tmp_path), "c")
    url = cluster.up(d, 2, 64 * MB, replicas=2)
    n = 3000  # 12,000 bytes: three chunks of 4 KiB, the last one partly used
    rng = np.random.default_rng(3)
    try:
        with mounted(url, os.path.join(str(tmp_path), "m"), allow_log=("shard", "EIO", "connection", "replica"),
                     timeout=3) as m:
            os.makedirs(os.path.join(m, "opt"))
            os.setxattr(os.path.join(m, "opt"), "user.irdma.chunk_size", b"4096")
            runs = []
            for k, (name, args) in enumerate(CONFIGS):
                path = os.path.join(m, "opt", f"w{k}")
                w0 = rng.standard_normal(n).astype("<f4")
                with open(path, "wb") as f:  # the initial weights, written while the op is assign
                    f.write(w0.tobytes())
                os.setxattr(path, "user.irdma.update", spec_text(name, args).encode())
                runs.append((path, name, dict(args), keras.Variable(w0), _keras_optimizer(name, args)))

            def steps(count: int) -> None:
                for _ in range(count):
                    for path, _, _, var, opt in runs:
                        g = rng.standard_normal(n).astype("<f4")
                        opt.apply([g], [var])
                        with open(path, "r+b") as f:  # one push of the whole gradient
                            f.write(g.tobytes())

            def check(when: str) -> None:
                for path, name, args, var, _ in runs:
                    with open(path, "rb") as f:
                        got = np.frombuffer(f.read(), "<f4")
                    err = relative_error(got, np.asarray(var.numpy(), np.float64))
                    assert err <= 1e-5, f"{name} {args} {when}: relative error {err:.2e}"

            def healthy() -> bool:
                return irdma_cli("status", "--meta", url, check=False).returncode == 0

            steps(3)
            check("after 3 steps")
            a, b = (s.shard_id for s in cluster.read_state(d))
            _kill(cluster.read_state(d), a)  # steps go on against the other replica alone
            steps(2)
            irdma_cli("up", "--dir", d)  # restarts it on its data; the mount resyncs it
            wait_until(healthy, 90, f"shard {a} resynced", interval=0.5)
            _kill(cluster.read_state(d), b)  # now only the resynced copy: state and weights
            steps(2)
            check(f"on shard {a} alone after its resync")
            irdma_cli("up", "--dir", d)
            wait_until(healthy, 90, f"shard {b} resynced", interval=0.5)

            # a learning-rate schedule: rewrite the xattr; the state stays
            for i, (path, name, args, var, opt) in enumerate(runs):
                args["learning_rate"] = float(args["learning_rate"]) / 4
                os.setxattr(path, "user.irdma.update", spec_text(name, args).encode())
                opt.learning_rate = args["learning_rate"]
                runs[i] = (path, name, args, var, opt)
            steps(2)
            check("after the learning rate changed")

            # a bad spec: EINVAL, the op stays as it was
            path = runs[2][0]
            before = os.getxattr(path, "user.irdma.update")
            with pytest.raises(OSError) as exc:
                os.setxattr(path, "user.irdma.update", b"adam lr=1")
            assert exc.value.errno == errno.EINVAL
            assert os.getxattr(path, "user.irdma.update") == before
            assert before.startswith(b"adam learning_rate=0.0025 ")
            # a gradient must be float32-aligned
            fd = os.open(path, os.O_WRONLY)
            try:
                with pytest.raises(OSError) as exc:
                    os.pwrite(fd, b"abc", 0)
                assert exc.value.errno == errno.EINVAL
            finally:
                os.close(fd)
        with open(os.path.join(str(tmp_path), "m.log")) as f:
            assert "no argument 'lr'" in f.read()  # the refusal is logged
    finally:
        irdma_cli("down", "--dir", d, check=False)


# ---------------------------------------------------------------- the state in a checkpoint
@pytest.mark.long  # 18 s: make test-long (CI's time)
@pytest.mark.fuse
def test_the_optimizer_state_checkpoints_and_restores_through_the_mount(tmp_path: object) -> None:
    """Save the weights and ``.irdma-state@w`` (Adam's m, v and steps) to a local directory,
    train on, restore both (op ``assign`` for the weights, then the optimizer and its state):
    the same gradients then give bit-identical weights. The native API reads the same state,
    equal to a float64 reference of Adam; a restore of the wrong size is EINVAL."""
    import trio
    from optim_ref import Reference

    import irdma

    d = os.path.join(str(tmp_path), "c")
    url = cluster.up(d, 2, 64 * MB, replicas=2)
    n, spec = 3000, "adam learning_rate=0.01 beta_1=0.8"
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal(n).astype("<f4")
    grads = [rng.standard_normal(n).astype("<f4") for _ in range(5)]
    ckpt = os.path.join(str(tmp_path), "ckpt")
    os.makedirs(ckpt)
    try:
        with mounted(url, os.path.join(str(tmp_path), "m")) as m:
            os.makedirs(os.path.join(m, "job"))
            os.setxattr(os.path.join(m, "job"), "user.irdma.chunk_size", b"4096")  # 3 chunks, the last partly used
            path, state = os.path.join(m, "job", "w"), os.path.join(m, "job", ".irdma-state@w")
            with open(path, "wb") as f:
                f.write(w0.tobytes())
            assert os.stat(state).st_size == 0  # assign: no optimizer, no state
            for reserved in (".irdma-state@nope", ".irdma-clock@x"):  # the mount's own names: never real files
                with pytest.raises(OSError) as exc:
                    open(os.path.join(m, "job", reserved), "w").close()
                assert exc.value.errno == errno.EINVAL, reserved
            os.setxattr(path, "user.irdma.update", spec.encode())
            assert os.stat(state).st_size == 3 * (4096 + 3 * 4096)  # header + m, v, step per chunk
            ref = Reference("adam", {"learning_rate": 0.01, "beta_1": 0.8}, n)
            w_ref = w0.astype(np.float64)
            for g in grads[:3]:
                with open(path, "r+b") as f:
                    f.write(g.tobytes())
                ref.step(w_ref, g.astype(np.float64), slice(None))
            for name in ("w", ".irdma-state@w"):  # the checkpoint: two plain copies
                with open(os.path.join(m, "job", name), "rb") as src, open(os.path.join(ckpt, name), "wb") as dst:
                    dst.write(src.read())

            with open(os.path.join(ckpt, ".irdma-state@w"), "rb") as f:
                image = f.read()

            async def native() -> dict[str, np.ndarray]:
                async with irdma.Client.open(url) as c:
                    assert await c.read_state("/job/w") == image
                    return await c.optimizer_state("/job/w")

            st = trio.run(native)
            assert sorted(st) == ["m", "step", "v"] and st["step"].dtype == np.dtype("<u4")
            assert (st["step"] == 3).all()
            assert relative_error(st["m"], ref.s1) <= 1e-5 and relative_error(st["v"], ref.s2) <= 1e-5

            def train(gs: list[np.ndarray]) -> np.ndarray:
                for g in gs:
                    with open(path, "r+b") as f:
                        f.write(g.tobytes())
                with open(path, "rb") as f:
                    return np.frombuffer(f.read(), "<f4").copy()

            straight = train(grads[3:])
            # restore: the weights under assign, then the optimizer and its state
            os.setxattr(path, "user.irdma.update", b"assign")
            with open(os.path.join(ckpt, "w"), "rb") as src, open(path, "r+b") as dst:
                dst.write(src.read())
            os.setxattr(path, "user.irdma.update", spec.encode())
            with pytest.raises(OSError) as exc:  # an image of another size: refused, nothing written
                with open(state, "r+b") as f:
                    f.write(bytes(os.stat(state).st_size + 4))
            assert exc.value.errno == errno.EINVAL
            with open(os.path.join(ckpt, ".irdma-state@w"), "rb") as src, open(state, "r+b") as dst:
                dst.write(src.read())
            again = train(grads[3:])
            assert np.array_equal(again, straight), "a restored Adam state must give the same steps"
            # the weights restored without the state: the same gradients give other weights
            os.setxattr(path, "user.irdma.update", b"assign")
            with open(os.path.join(ckpt, "w"), "rb") as src, open(path, "r+b") as dst:
                dst.write(src.read())
            os.setxattr(path, "user.irdma.update", spec.encode())
            assert not np.array_equal(train(grads[3:]), straight)
    finally:
        irdma_cli("down", "--dir", d, check=False)
