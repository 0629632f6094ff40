"""``Client.push`` applies the file's update op (issue 36, point 3): on a file under an optimizer
(``adam``, ``sgd momentum=...``, ...) a native push is one optimizer step on the shards, as a
write through the mount is, never the raw gradient added. Checked against the float64 reference
optimizers (``tests/optim_ref.py``) on a real two-shard cluster (two replicas), across a chunk
boundary; a push through the mount and a native push of the same gradients leave the same bytes;
``push_rows`` steps only the rows pushed; a file under ``assign`` still has the delta added.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import Cluster, mounted, running_cluster
from optim_ref import CONFIGS, Reference, relative_error, spec_text

import irdma

CHUNK = 64 << 10  # small chunks: a push crosses chunk boundaries
N = 3 * CHUNK // 4 + 1000  # float32 elements: four chunks, the last one partial


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path_factory.mktemp("optpush")), shards=2, capacity=64 << 20) as c:
        yield c


def test_the_user_guides_native_block_takes_one_adam_step(cl: Cluster) -> None:
    """docs/user-guide.md's native block: add, then one Adam step; Adam's first step moves each
    weight by about the learning rate against the gradient's sign."""
    grad = np.full((64, 10), 0.01, "<f4")
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.makedirs("/native/w")
        c.write("/native/w/kernel", np.zeros((64, 10), "<f4"))
        c.set_update_op("/native/w/kernel", "add")
        c.push("/native/w/kernel", -0.1 * grad)
        w = c.pull("/native/w/kernel", shape=(64, 10))
        assert np.allclose(w, -0.001)
        c.set_update_op("/native/w/kernel", "adam learning_rate=0.001")
        c.push("/native/w/kernel", grad)
        got = c.pull("/native/w/kernel", shape=(64, 10))
        state = c.submit(lambda cl: cl.optimizer_state("/native/w/kernel")).result(timeout=30)
    ref = Reference("adam", {"learning_rate": 0.001}, grad.size)
    want = np.full(grad.size, -0.001, np.float64)
    ref.step(want, grad.reshape(-1).astype(np.float64), slice(None))
    assert np.allclose(got.reshape(-1), want, rtol=1e-5, atol=1e-7), (got[0, :3], want[:3])
    assert np.allclose(got, -0.002, atol=1e-5), "one Adam step, not the raw gradient added (0.009)"
    assert np.all(state["step"] == 1) and np.allclose(state["m"], 0.001)


@pytest.mark.parametrize(("name", "args"), CONFIGS, ids=[spec_text(n, a) for n, a in CONFIGS])
def test_native_pushes_step_the_files_optimizer(cl: Cluster, name: str, args: dict[str, float | bool]) -> None:
    """Five pushes of random gradients (one at an offset) leave the reference optimizer's weights."""
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(N).astype("<f4")
    path = f"/dense-{name}-{len(args)}"
    ref = Reference(name, args, N)
    want = w0.astype(np.float64)
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write(path, w0, chunk_size=CHUNK)
        c.set_update_op(path, spec_text(name, args))
        for k in range(5):
            g = rng.standard_normal(N).astype("<f4")
            if k == 3:  # a part of the file, from an element inside chunk 1
                at = CHUNK // 4 + 10
                c.push(path, g[at:], offset=4 * at)
                ref.step(want, g[at:].astype(np.float64), slice(at, None))
            else:
                c.push(path, g)
                ref.step(want, g.astype(np.float64), slice(None))
        got = c.pull(path)
    assert relative_error(got, want) <= 1e-5, relative_error(got, want)


def test_a_compressed_push_steps_the_optimizer_with_the_decoded_gradient(cl: Cluster) -> None:
    """topk with error feedback on an SGD-momentum file: each step takes what the shards decoded
    (the pushed gradient and the residual, less what is left in the residual)."""
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal(N).astype("<f4")
    args: dict[str, float | bool] = {"learning_rate": 0.05, "momentum": 0.9}
    ref = Reference("sgd", args, N)
    want = w0.astype(np.float64)
    residual = np.zeros(N, np.float32)
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write("/coded", w0, chunk_size=CHUNK)
        c.set_update_op("/coded", spec_text("sgd", args))
        for _ in range(4):
            g = rng.standard_normal(N).astype("<f4")
            before = residual.copy()
            c.push("/coded", g, compress="topk:0.1", residual=residual)
            decoded = (g + before) - residual
            assert np.count_nonzero(decoded) < N // 2  # compressed indeed
            ref.step(want, decoded.astype(np.float64), slice(None))
        got = c.pull("/coded")
    assert relative_error(got, want) <= 1e-5, relative_error(got, want)


@pytest.mark.parametrize(("name", "args"), CONFIGS, ids=[spec_text(n, a) for n, a in CONFIGS])
def test_push_rows_steps_only_the_rows_pushed(cl: Cluster, name: str, args: dict[str, float | bool]) -> None:
    """The sparse path, every optimizer: the file's op on the rows pushed (duplicates summed
    first, then one step), state included over three pushes, other rows untouched."""
    rows, cols = 600, 64  # 256-byte rows, 256 to a chunk: rows in three chunks
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((rows, cols)).astype("<f4")
    ref = Reference(name, args, rows * cols)
    want = w0.astype(np.float64).reshape(-1)
    path = f"/emb-{name}-{len(args)}"
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write(path, w0, chunk_size=CHUNK)
        c.set_shape(path, (rows, cols))
        c.set_update_op(path, spec_text(name, args))
        for ids in (np.array([5, 300, 5, 599]), np.array([0, 5, 257]), np.array([257, 257, 299, 5])):
            grads = rng.standard_normal((len(ids), cols)).astype("<f4")
            c.push_rows(path, ids, grads)
            summed: dict[int, np.ndarray] = {}
            for i, r in zip(ids.tolist(), grads, strict=True):
                summed[i] = summed.get(i, np.zeros(cols)) + r.astype(np.float64)
            for i, g in summed.items():
                ref.step(want, g, slice(i * cols, (i + 1) * cols))
        got = c.pull(path, shape=(rows, cols))
    touched = [0, 5, 257, 299, 300, 599]
    untouched = np.setdiff1d(np.arange(rows), touched)
    assert np.array_equal(got[untouched], w0[untouched])
    assert relative_error(got.reshape(-1), want) <= 1e-5


def test_a_native_push_equals_a_write_through_the_mount(cl: Cluster, tmp_path: object) -> None:
    """The same gradients, one file pushed natively and one written through the mount (both
    under rmsprop with momentum): the same bytes, and a file under assign still has them added."""
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(N).astype("<f4")
    grads = [rng.standard_normal(N).astype("<f4") for _ in range(3)]
    spec = "rmsprop learning_rate=0.01 momentum=0.5"
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        for p in ("/viamount", "/pushed"):
            c.write(p, w0, chunk_size=CHUNK)
            c.set_update_op(p, spec)
        c.write("/plain", w0, chunk_size=CHUNK)  # assign: a push adds
        with mounted(cl.meta_url, f"{tmp_path}/m") as m:
            for g in grads:
                fd = os.open(os.path.join(m, "viamount"), os.O_WRONLY)
                try:
                    assert os.pwrite(fd, g.tobytes(), 0) == g.nbytes
                finally:
                    os.close(fd)  # close waits for the shards' acknowledgement
                c.push("/pushed", g)
                c.push("/plain", g)
        via_mount, native, plain = c.pull("/viamount"), c.pull("/pushed"), c.pull("/plain")
        assert c.stat("/plain").update_op in (None, "", "assign")
    assert not np.allclose(native, w0 + sum(grads)), "the raw gradients were added"
    assert np.array_equal(native, via_mount)
    assert np.allclose(plain, w0 + grads[0] + grads[1] + grads[2], rtol=1e-6, atol=1e-6)
