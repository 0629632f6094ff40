"""Gradient compression with error feedback (irdma.wire.compress, protocol 8).

The codecs alone (round trips, exact wire sizes and bytes, every malformed payload refused); then
real shard processes: what a shard applies is the decoded gradient (add and sgd), a malformed
payload is refused with the chunk unchanged, error feedback is exact over many steps (integer
gradients, so float32 arithmetic is exact), both replicas hold the same bytes, a lost reply is
applied once and a stale replica is replaced; and a real FUSE mount with the xattr on a
directory whose residual makes plain pwrite of gradients exact.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterator
from fractions import Fraction

import numpy as np
import pytest
import trio
from helpers import Cluster, mounted, running_cluster
from test_replication import LossyProxy, _chains, _chunk_on, _start_shard

import irdma
from irdma import metrics
from irdma._errors import BadRequest
from irdma.client.native import layout_of
from irdma.meta import open_meta
from irdma.ops.cluster import key_file_of
from irdma.transport.tcp import TcpTransport
from irdma.wire import compress as C
from irdma.wire import protocol as P
from irdma.wire.auth import read_key_file

TOPK = C.parse_compress("topk:0.05")
SIGN = C.parse_compress("sign")
CHUNK = 64 << 10  # small chunks: a push of a few hundred KB is several pieces on both shards


# ---------------------------------------------------------------- the codecs
def test_parse_and_format_normalize_and_refuse_with_a_hint() -> None:
    assert C.parse_compress(b" TopK:0.25\n") == C.Compression(P.Encoding.TOPK, 0.25)
    assert C.parse_compress("sign") == C.Compression(P.Encoding.SIGN, slice=C.SIGN_SLICE)
    assert C.parse_compress("sign:4").slice == 4
    assert not C.parse_compress("none")
    for text in ("none", "topk:0.01", "topk:1.0", "sign", "sign:64"):
        assert C.format_compress(C.parse_compress(text)) == text
    assert C.xattr_value(b"TOPK:.5 ") == "topk:0.5"
    for bad in ("topk", "topk:0", "topk:1.5", "topk:-0.1", "topk:nan", "topk:x", "sign:0", "gzip", "", "none:1"):
        with pytest.raises(ValueError, match="use none, topk:FRACTION"):
            C.parse_compress(bad)
    with pytest.raises(irdma.InvalidArgument, match="topk:FRACTION"):
        C.xattr_value(b"topk:2")


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1023, 1024, 1025, 100_003])
@pytest.mark.parametrize("c", [TOPK, C.parse_compress("topk:1"), SIGN, C.parse_compress("sign:3")],
                         ids=["topk5%", "topk100%", "sign", "sign3"])
def test_round_trip_and_wire_size(n: int, c: C.Compression) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype("<f4")
    payload, decoded = C.encode(x, c)
    assert len(payload) == C.wire_bytes(n, c)
    assert decoded.dtype == np.float32 and decoded.shape == (n,)
    np.testing.assert_array_equal(C.decode(payload, c.kind), decoded)
    if c.kind == P.Encoding.TOPK:
        k = C.topk_count(n, c.fraction)
        assert k == min(n, max(1, math.ceil(Fraction(repr(c.fraction)) * n)))
        kept = np.flatnonzero(decoded)
        assert len(kept) == k and np.array_equal(decoded[kept], x[kept])
        assert np.abs(x[kept]).min() >= np.delete(np.abs(x), kept).max(initial=0)  # the largest ones
    else:
        assert np.array_equal(np.signbit(decoded), x < 0)
        for j in range(0, n, c.slice):  # one scale per slice: the mean magnitude
            part = np.abs(decoded[j : j + c.slice])
            assert np.all(part == part[0]) and part[0] == np.float32(np.abs(x[j : j + c.slice]).astype(np.float64).mean())
    m = C.max_elements(len(payload), c)
    assert C.wire_bytes(m, c) <= len(payload) < C.wire_bytes(m + 1, c) and m >= n


def test_topk_bytes_are_exactly_the_documented_layout_and_ties_take_the_lowest_index() -> None:
    x = np.array([1, -3, 2, 3, 0, -3, 1, 0.5], dtype="<f4")
    payload, decoded = C.encode(x, C.Compression(P.Encoding.TOPK, 0.25))  # k = 2 of three magnitudes of 3
    want = (np.array([8, 2], "<u4").tobytes() + np.array([1, 3], "<u4").tobytes()
            + np.array([-3, 3], "<f4").tobytes())
    assert payload == want
    np.testing.assert_array_equal(decoded, [0, -3, 0, 3, 0, 0, 0, 0])


def test_sign_bytes_are_exactly_the_documented_layout() -> None:
    x = np.array([1, -3, 2, -2, 4, 0, -1, 5, -7], dtype="<f4")  # slices of 4: [1,-3,2,-2] [4,0,-1,5] [-7]
    payload, decoded = C.encode(x, C.Compression(P.Encoding.SIGN, slice=4))
    signs = 0b0100_1010 | 1 << 8  # element i is bit i; 1 where negative; pad bits 0
    want = (np.array([9, 4], "<u4").tobytes() + np.array([2, 2.5, 7], "<f4").tobytes()
            + signs.to_bytes(2, "little"))
    assert payload == want
    np.testing.assert_array_equal(decoded, [2, -2, 2, -2, 2.5, 2.5, -2.5, 2.5, -7])


def _topk_payload() -> bytearray:
    return bytearray(C.encode(np.arange(1, 11, dtype="<f4"), C.Compression(P.Encoding.TOPK, 0.3))[0])  # k=3


def _sign_payload() -> bytearray:
    return bytearray(C.encode(np.arange(-5, 6, dtype="<f4"), C.Compression(P.Encoding.SIGN, slice=4))[0])  # n=11


def _put(buf: bytearray, at: int, value: object, dtype: str) -> bytearray:
    raw = np.array([value], dtype=dtype).tobytes()
    buf[at : at + len(raw)] = raw
    return buf


MALFORMED = {  # name: (encoding, payload, what the message says)
    "short header": (P.Encoding.TOPK, bytearray(b"\x01\x00\x00"), "header"),
    "no element": (P.Encoding.TOPK, _put(_topk_payload(), 0, 0, "<u4"), "0 elements"),
    "k of 0": (P.Encoding.TOPK, _put(_topk_payload(), 4, 0, "<u4"), "k must be"),
    "k over n": (P.Encoding.TOPK, _put(_put(_topk_payload(), 0, 2, "<u4"), 4, 3, "<u4"), "k must be"),
    "topk truncated": (P.Encoding.TOPK, _topk_payload()[:-1], "needs"),
    "topk trailing bytes": (P.Encoding.TOPK, _topk_payload() + b"\x00", "needs"),
    "indices descending": (P.Encoding.TOPK, _put(_topk_payload(), 8, 9, "<u4"), "ascending"),
    "indices repeated": (P.Encoding.TOPK, _put(_topk_payload(), 12, 7, "<u4"), "ascending"),
    "index past n": (P.Encoding.TOPK, _put(_topk_payload(), 16, 10, "<u4"), "index 10"),
    "value NaN": (P.Encoding.TOPK, _put(_topk_payload(), 20, np.nan, "<f4"), "finite"),
    "value infinite": (P.Encoding.TOPK, _put(_topk_payload(), 24, np.inf, "<f4"), "finite"),
    "slice of 0": (P.Encoding.SIGN, _put(_sign_payload(), 4, 0, "<u4"), "slice"),
    "sign truncated": (P.Encoding.SIGN, _sign_payload()[:-1], "needs"),
    "sign trailing bytes": (P.Encoding.SIGN, _sign_payload() + b"\x00", "needs"),
    "scale NaN": (P.Encoding.SIGN, _put(_sign_payload(), 8, np.nan, "<f4"), "scales"),
    "scale infinite": (P.Encoding.SIGN, _put(_sign_payload(), 12, -np.inf, "<f4"), "scales"),
    "scale negative": (P.Encoding.SIGN, _put(_sign_payload(), 16, -1.0, "<f4"), "scales"),
    "pad bits set": (P.Encoding.SIGN, _sign_payload()[:-1] + b"\xff", "pad bits"),
    "unknown encoding": (3, _topk_payload(), "unknown"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_decode_refuses_every_malformed_payload(name: str) -> None:
    encoding, payload, what = MALFORMED[name]
    with pytest.raises(ValueError, match=what):
        C.decode(bytes(payload), encoding)


def test_decode_checks_the_room_before_allocating() -> None:
    huge = np.array([(1 << 32) - 1, 1], "<u4").tobytes() + np.array([5], "<u4").tobytes() + b"\0\0\0\0"
    with pytest.raises(ValueError, match="more than the 1000"):
        C.decode(huge, P.Encoding.TOPK, limit=1000)


def test_encode_refuses_what_it_cannot_carry() -> None:
    for bad, what in ((np.zeros(0, "<f4"), "elements"), (np.array([1, np.nan], "<f4"), "finite"),
                      (np.ones(3, "<f8"), "float32")):
        with pytest.raises(ValueError, match=what):
            C.encode(bad, TOPK)
    with pytest.raises(ValueError, match="not none"):
        C.encode(np.ones(3, "<f4"), C.NONE)


def _integer_gradients(rng: np.random.Generator, steps: int, n: int) -> list[np.ndarray]:
    return [rng.integers(-8, 9, size=n).astype("<f4") for _ in range(steps)]


@pytest.mark.parametrize("c", [TOPK, C.Compression(P.Encoding.SIGN, slice=4)], ids=["topk", "sign4"])
def test_error_feedback_loses_nothing_in_memory(c: C.Compression) -> None:
    """Sum of decoded + residual == sum of gradients, exactly. Integers below 2^24 keep top-k exact;
    for sign, slices of 4 (a power of two) keep every scale and residual a dyadic rational
    with 2 more fraction bits per step: 12 steps stay within float32's 24 bits."""
    grads = _integer_gradients(np.random.default_rng(1), 12, 5000)
    ef = C.ErrorFeedback(c)
    applied = np.zeros(5000, "<f4")
    for g in grads:
        applied += ef.step("w", g)[1]
    np.testing.assert_array_equal(applied + ef.residual("w", 5000), np.sum(grads, axis=0))
    assert np.abs(ef.residual("w", 5000)).sum() > 0  # something was held back
    assert ef.pop("w") is not None and ef.pop("w") is None


# ---------------------------------------------------------------- real shards
@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two shard processes, every chunk on both (2 replicas)."""
    with running_cluster(str(tmp_path_factory.mktemp("comp")), shards=2, capacity=64 << 20, replicas=2) as c:
        yield c


def _bytes_out() -> float:
    return metrics.REGISTRY.get_sample_value("irdma_client_bytes_total", {"op": "write", "direction": "out"}) or 0.0


@pytest.mark.parametrize("c", [TOPK, C.Compression(P.Encoding.SIGN, slice=4)], ids=["topk", "sign4"])
def test_error_feedback_is_exact_through_the_shards(replicated: Cluster, c: C.Compression) -> None:
    """12 compressed pushes of integer gradients (four pieces each, over both replicas): what the
    shards added plus the residual is the sum of the gradients, bit for bit; the bytes sent are
    the payloads' (a quarter of the dense bytes or less)."""
    n = 4 * CHUNK // 4 - 10  # four chunks, the last one partly
    grads = _integer_gradients(np.random.default_rng(2), 12, n)
    path = f"/ef-{c.kind.name.lower()}"
    with irdma.connect(replicated.meta_url, transport="tcp") as client:
        client.write(path, np.zeros(n, "<f4"), chunk_size=CHUNK)
        client.set_update_op(path, "add")
        residual = np.zeros(n, "<f4")
        before = _bytes_out()
        for g in grads:
            client.push(path, g, compress=c, residual=residual)
        sent = _bytes_out() - before
        got = client.pull(path)
        np.testing.assert_array_equal(got + residual, np.sum(grads, axis=0))
        assert np.abs(residual).sum() > 0
        pieces = [CHUNK // 4] * 3 + [n - 3 * CHUNK // 4]
        assert sent == len(grads) * sum(C.wire_bytes(k, c) for k in pieces) < len(grads) * 4 * n / 3
        # the same through ErrorFeedback, piece by piece: the same bytes landed
        ef = C.ErrorFeedback(c)
        want = np.zeros(n, "<f4")
        for g in grads:
            for j, k in enumerate(pieces):
                want[j * CHUNK // 4 : j * CHUNK // 4 + k] += ef.step(j, g[j * CHUNK // 4 : j * CHUNK // 4 + k])[1]
        np.testing.assert_array_equal(got, want)
        client.unlink(path)


def test_sgd_applies_the_decoded_gradient(replicated: Cluster) -> None:
    rng = np.random.default_rng(3)
    n = 30_000
    w = rng.standard_normal(n).astype("<f4")
    with irdma.connect(replicated.meta_url, transport="tcp") as client:
        client.write("/sgd", w, chunk_size=CHUNK)
        client.set_update_op("/sgd", "sgd learning_rate=0.25")
        for c in (TOPK, SIGN):
            g = rng.standard_normal(n).astype("<f4")
            client.write("/sgd", g, compress=c)  # the file's op
            pieces = [g[j : j + CHUNK // 4] for j in range(0, n, CHUNK // 4)]
            w -= np.concatenate([C.encode(p, c)[1] for p in pieces]) * np.float32(0.25)
            np.testing.assert_array_equal(client.pull("/sgd"), w)
        client.unlink("/sgd")


def test_large_pieces_are_compressed_off_the_event_loop_alike(replicated: Cluster) -> None:
    """Pieces of 2^18 elements (compressed in worker threads, side by side) land as the same
    decoded vectors as one at a time."""
    from irdma.client.native import ENCODE_IN_THREAD

    per = (1 << 20) // 4
    assert per >= ENCODE_IN_THREAD
    n = 2 * per + 1000
    g = np.random.default_rng(9).standard_normal(n).astype("<f4")
    with irdma.connect(replicated.meta_url, transport="tcp") as client:
        client.write("/big", np.zeros(n, "<f4"), chunk_size=1 << 20)
        residual = np.zeros(n, "<f4")
        client.push("/big", g, compress=SIGN, residual=residual)
        want = np.concatenate([C.encode(g[j : j + per], SIGN)[1] for j in range(0, n, per)])
        np.testing.assert_array_equal(client.pull("/big"), want)
        np.testing.assert_array_equal(residual, g - want)
        client.unlink("/big")


async def _direct(c: Cluster, address: str, fn: object) -> object:
    async with trio.open_nursery() as nursery:
        conn = await TcpTransport().connect(address, nursery, client_name="test", key=read_key_file(key_file_of(c.dir)))
        try:
            return await fn(conn)  # type: ignore[operator]
        finally:
            await conn.aclose()


@pytest.mark.parametrize("name", ["index past n", "value NaN", "scale negative", "pad bits set", "sign truncated"])
def test_a_shard_refuses_a_malformed_payload_and_changes_nothing(replicated: Cluster, name: str) -> None:
    encoding, payload, what = MALFORMED[name]
    fid = 1 << 40  # no file: straight to one shard
    base = np.arange(64, dtype="<f4")

    async def main(conn: object) -> None:
        await conn.write(fid, 0, CHUNK, 0, P.UpdateOp.ASSIGN, base.tobytes())  # type: ignore[attr-defined]
        with pytest.raises(BadRequest, match=what):
            await conn.write(fid, 0, CHUNK, 0, P.Update(P.UpdateOp.ADD, encoding=encoding),  # type: ignore[attr-defined]
                             bytes(payload))
        out = np.empty(64, "<f4")
        assert await conn.read(fid, 0, 0, memoryview(out).cast("B")) == 1  # type: ignore[attr-defined]
        np.testing.assert_array_equal(out, base)
        await conn.free(fid, 0)  # type: ignore[attr-defined]

    trio.run(_direct, replicated, replicated.shards[0].address, main)


def _replica_copies(c: Cluster, path: str, chunks: int) -> list[list[tuple[int, bytes]]]:
    """Per chunk, (version, bytes) of its copy on each replica."""
    ino, chains, addresses = _chains(c.meta_url, path, chunks)
    key = read_key_file(key_file_of(c.dir))
    out = []
    for i, chain in enumerate(chains):
        copies = [trio.run(_chunk_on, addresses[s], ino, i, CHUNK // 4, key) for s in chain]
        out.append([(v, buf.tobytes()) for v, buf in copies])
    return out


def test_both_replicas_decode_to_the_same_bytes(replicated: Cluster) -> None:
    rng = np.random.default_rng(4)
    n = 3 * CHUNK // 4
    with irdma.connect(replicated.meta_url, transport="tcp") as client:
        client.write("/rep", np.zeros(n, "<f4"), chunk_size=CHUNK, op="assign")
        client.set_update_op("/rep", "add")
        residual = np.zeros(n, "<f4")
        for c in (TOPK, SIGN, TOPK):
            client.push("/rep", rng.standard_normal(n).astype("<f4"), compress=c, residual=residual)
        for copies in _replica_copies(replicated, "/rep", 3):
            assert len(copies) == 2 and copies[0] == copies[1] and copies[0][0] == 4
        client.unlink("/rep")


def test_a_stale_replica_is_replaced_after_an_encoded_forward(replicated: Cluster) -> None:
    """The tail took an update the head never saw (its version is ahead): the head's encoded
    forward is answered STALE and the head sends its whole chunk, so both hold the head's bytes."""
    rng = np.random.default_rng(5)
    n = CHUNK // 4
    with irdma.connect(replicated.meta_url, transport="tcp") as client:
        client.write("/stale", np.ones(n, "<f4"), chunk_size=CHUNK, op="assign")
        client.set_update_op("/stale", "add")
        ino, [chain], addresses = _chains(replicated.meta_url, "/stale", 1)

        async def stray(conn: object) -> None:  # an update only the tail applies
            await conn.write(ino, 0, CHUNK, 0, P.UpdateOp.ADD, np.full(n, 100, "<f4").tobytes())  # type: ignore[attr-defined]

        trio.run(_direct, replicated, addresses[chain[1]], stray)
        g = rng.standard_normal(n).astype("<f4")
        client.push("/stale", g, compress=TOPK)
        want = np.ones(n, "<f4") + C.encode(g, TOPK)[1]
        [copies] = _replica_copies(replicated, "/stale", 1)
        assert copies[0] == copies[1] and copies[0][0] == 2
        np.testing.assert_array_equal(np.frombuffer(copies[0][1], "<f4"), want)
        client.unlink("/stale")


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_compressed_push_whose_reply_was_lost_is_applied_once(tmp_path: object, replicas: int) -> None:
    """The retry carries the same payload and request id: applied once on every replica."""
    tmp = str(tmp_path)
    (p1, a1), (p2, a2) = _start_shard(tmp, 1), _start_shard(tmp, 2)
    proxy = LossyProxy(a1)
    try:
        meta = open_meta(os.path.join(tmp, "meta.db"), create=True)
        meta.add_shard(proxy.address)
        meta.add_shard(a2)
        meta.set_replicas(replicas)
        meta.close()
        n = 50_000
        g = np.random.default_rng(6).standard_normal(n).astype("<f4")

        async def main() -> tuple[int, np.ndarray, np.ndarray]:
            async with irdma.Client.open(f"sqlite://{tmp}/meta.db", transport="tcp", timeout=5) as c:
                for name in ("/g0", "/g1", "/g2"):  # one of them has its first chunk headed by shard 1
                    await c.write(name, np.zeros(n, dtype="<f4"))
                    inode = await c.stat(name)
                    if layout_of(inode).shard_of(0) == 1:
                        break
                assert layout_of(inode).shard_of(0) == 1
                await c.set_update_op(name, "add")
                residual = np.zeros(n, "<f4")
                proxy.armed.set()
                await c.push(name, g, compress="sign", residual=residual)
                assert proxy.dropped == 1
                return inode.ino, await c.pull(name), residual

        ino, got, residual = trio.run(main)
        decoded = C.encode(g, SIGN)[1]
        np.testing.assert_array_equal(got, decoded)  # added once, not twice
        np.testing.assert_array_equal(residual, g - decoded)
        copies = [trio.run(_chunk_on, a, ino, 0, n) for a in ([a1, a2] if replicas == 2 else [a1])]
        for _, buf in copies:
            np.testing.assert_array_equal(buf, decoded)
        assert len({v for v, _ in copies}) == 1
    finally:
        proxy.close()
        for p in (p1, p2):
            p.terminate()
            p.wait(10)


# ---------------------------------------------------------------- the mount
@pytest.mark.fuse
def test_pwrite_through_the_mount_compresses_with_a_residual_per_inode(replicated: Cluster,
                                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The directory says topk; pwrite of integer gradients into an add file (over two opens):
    the shards hold what ErrorFeedback computes for the same writes, so the mount's residual
    made the sum exact; an assign file in the same directory is not compressed; a bad value is
    EINVAL and stores nothing."""
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: FUSE tests cannot run (load the fuse module)")
    n = 20_000  # one write, one piece
    grads = _integer_gradients(np.random.default_rng(7), 10, n)
    with mounted(replicated.meta_url, str(tmp_path_factory.mktemp("mnt") / "m")) as m:
        d = os.path.join(m, "grads")
        os.mkdir(d)
        with pytest.raises(OSError) as info:
            os.setxattr(d, "user.irdma.compress", b"topk:2")
        assert info.value.errno == errno.EINVAL
        with pytest.raises(OSError):
            os.getxattr(d, "user.irdma.compress")
        os.setxattr(d, "user.irdma.compress", b" TOPK:0.05\n")
        assert os.getxattr(d, "user.irdma.compress") == b"topk:0.05"
        path = os.path.join(d, "sum")
        with open(path, "wb") as f:
            f.write(bytes(4 * n))
        os.setxattr(path, "user.irdma.update", b"add")
        for half in (grads[:5], grads[5:]):  # the residual outlives a close
            fd = os.open(path, os.O_WRONLY)
            try:
                for g in half:
                    assert os.pwrite(fd, g.tobytes(), 0) == 4 * n
                os.fsync(fd)
            finally:
                os.close(fd)
        with open(path, "rb") as f:
            got = np.frombuffer(f.read(), "<f4")
        ef = C.ErrorFeedback(TOPK)
        want = np.sum([ef.step("sum", g)[1] for g in grads], axis=0)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got + ef.residual("sum", n), np.sum(grads, axis=0))
        plain = os.path.join(d, "weights")  # assign: never compressed
        data = np.random.default_rng(8).standard_normal(n).astype("<f4").tobytes()
        with open(plain, "wb") as f:
            f.write(data)
        with open(plain, "rb") as f:
            assert f.read() == data
