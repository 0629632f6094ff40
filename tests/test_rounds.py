"""Synchronous rounds on the shards (issue 38; :mod:`irdma.server.rounds`): the pushes of a BSP
round's members are summed and the file's update op is applied once, to their mean, the
optimizer state included, on every replica. A real two-shard cluster with two replicas and two
native clients (the round's two members); every step checked against the float64 reference
optimizers (``tests/optim_ref.py``) taking one step on the mean gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio
from helpers import Cluster, running_cluster
from optim_ref import CONFIGS, Reference, relative_error, spec_text

import irdma
from irdma._errors import LocalProtocolError, RemoteProtocolError
from irdma.client.native import layout_of
from irdma.transport.base import ShardConnection
from irdma.wire import protocol as P
from irdma.wire.optimizers import parse_update
from irdma.wire.protocol import ROUND_SUM, Round, as_update

CHUNK = 64 << 10  # small chunks: a round's push is several chunks' parts
N = 3 * CHUNK // 4 + 1000  # float32 elements: four chunks, the last one partial
SERIES = 0x5EED


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path_factory.mktemp("rounds")), shards=2, capacity=64 << 20, replicas=2) as c:
        yield c


def contribute(c: Any, path: str, grad: np.ndarray, rnd: Round, lr: float | None = None) -> None:
    """Push ``grad`` into ``path`` as a contribution to ``rnd`` with the file's update op."""
    async def push(cl: Any) -> None:
        inode = await cl.meta.resolve(path)
        u = as_update(parse_update(inode.update_op))
        if lr is not None:
            u = dataclasses.replace(u, args=(lr, *u.args[1:]))
        await cl.write_from(layout_of(inode), 0, np.ascontiguousarray(grad, "<f4"), dataclasses.replace(u, round=rnd),
                            await cl.meta.chunk_map(inode.ino))

    c.submit(push).result(timeout=30)


def replicas_agree(c: Any, path: str) -> bool:
    """Every chunk of ``path`` has the same version and CRC-32 on both shards."""
    async def check(cl: Any) -> bool:
        inode = await cl.meta.resolve(path)
        seen = []
        for idx in range(-(-(await cl.meta.resolve(path)).size // CHUNK)):
            seen.append({await cl.shard_call(sid, ShardConnection.checksum, inode.ino, idx, cl.view.epoch)
                         for sid in (1, 2)})
        return all(len(s) == 1 for s in seen)

    return bool(c.submit(check).result(timeout=30))


@pytest.mark.parametrize(("name", "args"), CONFIGS, ids=[spec_text(n, a) for n, a in CONFIGS])
def test_a_round_applies_one_step_to_the_mean_of_its_members_pushes(cl: Cluster, name: str,
                                                                   args: dict[str, float | bool]) -> None:
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(N).astype("<f4")
    path = f"/r-{name}-{len(args)}"
    ref = Reference(name, args, N)
    want = w0.astype(np.float64)
    with irdma.connect(cl.meta_url, transport="tcp") as a, irdma.connect(cl.meta_url, transport="tcp") as b:
        a.write(path, w0, chunk_size=CHUNK)
        a.set_update_op(path, spec_text(name, args))
        now = w0
        for k in range(3):
            g0, g1 = rng.standard_normal(N).astype("<f4"), rng.standard_normal(N).astype("<f4")
            contribute(a, path, g0, Round(SERIES, k, 0, 2))
            assert np.array_equal(b.pull(path), now), "a round's first push changed the weights"
            contribute(a, path, g0, Round(SERIES, k, 0, 2))  # sent again: counts once
            contribute(b, path, g1, Round(SERIES, k, 1, 2))
            ref.step(want, (g0.astype(np.float64) + g1) / 2, slice(None))
            got = a.pull(path)
            assert relative_error(got, want) <= 1e-5, (k, relative_error(got, want))
            contribute(b, path, g1, Round(SERIES, k, 1, 2))  # sent again after its round: nothing changes
            assert np.array_equal(a.pull(path), got)
            now = got
        assert replicas_agree(a, path), "the replicas hold other bytes than the head"


def test_a_sum_round_applies_the_sum_and_three_members_their_mean(cl: Cluster) -> None:
    rng = np.random.default_rng(4)
    w0 = rng.standard_normal(N).astype("<f4")
    gs = [rng.standard_normal(N).astype("<f4") for _ in range(3)]
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write("/r-sum", w0, chunk_size=CHUNK)
        c.set_update_op("/r-sum", "sgd learning_rate=0.5")
        for m in range(2):
            contribute(c, "/r-sum", gs[m], Round(SERIES, 0, m, 2, ROUND_SUM))
        after_sum = w0.astype(np.float64) - 0.5 * (gs[0].astype(np.float64) + gs[1])
        assert relative_error(c.pull("/r-sum"), after_sum) <= 1e-6
        for m in range(3):
            contribute(c, "/r-sum", gs[m], Round(SERIES, 1, m, 3))
        want = after_sum - 0.5 * (gs[0].astype(np.float64) + gs[1] + gs[2]) / 3
        assert relative_error(c.pull("/r-sum"), want) <= 1e-6
        # an add file's round adds the mean (a step's weight decay goes this way), Client.push's round=
        c.write("/r-add", w0, chunk_size=CHUNK)
        c.set_update_op("/r-add", "add")
        for m in range(2):  # through the public push
            c.push("/r-add", gs[m], round=Round(SERIES, 0, m, 2))
        assert relative_error(c.pull("/r-add"), w0.astype(np.float64) + (gs[0].astype(np.float64) + gs[1]) / 2) <= 1e-6


def test_a_push_that_disagrees_with_its_round_is_refused_and_changes_nothing(cl: Cluster) -> None:
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(N).astype("<f4")
    g = rng.standard_normal(N).astype("<f4")
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write("/r-bad", w0, chunk_size=CHUNK)
        c.set_update_op("/r-bad", "adam learning_rate=0.01")
        contribute(c, "/r-bad", g, Round(SERIES, 0, 0, 2))
        with pytest.raises(irdma.IrdmaError, match="disagrees with the round"):
            contribute(c, "/r-bad", g, Round(SERIES, 0, 1, 2), lr=0.02)  # another learning rate
        with pytest.raises(irdma.IrdmaError, match="disagrees with the round"):
            contribute(c, "/r-bad", g, Round(SERIES, 0, 1, 3))  # another member count
        assert np.array_equal(c.pull("/r-bad"), w0)
        contribute(c, "/r-bad", g, Round(SERIES, 0, 1, 2))  # the round completes as it should
        ref = Reference("adam", {"learning_rate": 0.01}, N)
        want = w0.astype(np.float64)
        ref.step(want, g.astype(np.float64), slice(None))
        assert relative_error(c.pull("/r-bad"), want) <= 1e-5


def test_a_new_run_never_adds_into_a_round_a_dead_run_left(cl: Cluster) -> None:
    """Member 0 of a run pushed round 4 and its run died; the next run (another series) starts at
    round 0 with one member: its push is applied alone, the dead run's sum dropped."""
    rng = np.random.default_rng(6)
    w0 = rng.standard_normal(N).astype("<f4")
    dead, g = rng.standard_normal(N).astype("<f4"), rng.standard_normal(N).astype("<f4")
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write("/r-new", w0, chunk_size=CHUNK)
        c.set_update_op("/r-new", "sgd learning_rate=1.0")
        contribute(c, "/r-new", dead, Round(SERIES, 4, 0, 2))
        contribute(c, "/r-new", g, Round(SERIES + 1, 4, 0, 1))
        assert relative_error(c.pull("/r-new"), w0.astype(np.float64) - g) <= 1e-6


def test_a_round_goes_only_with_float32_updates_and_a_member_inside_it() -> None:
    """A round on an assign, or a member past the round's count, is refused by the encoder and,
    hand-made on the wire, by the decoder: never taken for a plain push."""
    with pytest.raises(LocalProtocolError, match="only with add or an optimizer"):
        P.encode_request(P.Write(1, 0, 4096, 0, P.Update(P.UpdateOp.ASSIGN, round=Round(1, 0, 0, 2)), b"abcd"), 1)
    with pytest.raises(LocalProtocolError, match="member 2 of 2"):
        P.encode_request(P.Write(1, 0, 4096, 0, P.Update(P.UpdateOp.ADD, round=Round(1, 0, 2, 2)), b"abcd"), 1)
    good = b"".join(P.encode_request(P.Write(1, 0, 4096, 0, P.Update(P.UpdateOp.ADD, round=Round(1, 0, 1, 2)),
                                             b"abcd"), 1))
    opv_at = P.HEADER_SIZE + P.Write.LAYOUT.size - 4  # the op byte, then 3 pad bytes
    assert good[opv_at] == P.UpdateOp.ADD | P.ROUND_BIT
    bad = bytearray(good)
    bad[opv_at] = P.UpdateOp.ASSIGN | P.ROUND_BIT
    dec = P.FrameDecoder()
    dec.feed(bytes(bad))
    frame = dec.next_frame()
    assert frame is not None
    with pytest.raises(RemoteProtocolError, match="only with add or an optimizer"):
        P.decode_request(frame)


def test_compressed_contributions_are_decoded_then_summed(cl: Cluster) -> None:
    """Members' encoded pushes (topk keeping every element: the decoded gradient is the pushed
    one) are decoded on the shard and their mean applied once."""
    rng = np.random.default_rng(8)
    w0 = rng.standard_normal(N).astype("<f4")
    gs = [rng.standard_normal(N).astype("<f4") for _ in range(2)]
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write("/r-topk", w0, chunk_size=CHUNK)
        c.set_update_op("/r-topk", "sgd learning_rate=0.5")
        c.push("/r-topk", gs[0], compress="topk:1.0", round=Round(SERIES, 0, 0, 2))
        assert np.array_equal(c.pull("/r-topk"), w0)
        c.push("/r-topk", gs[1], compress="topk:1.0", round=Round(SERIES, 0, 1, 2))
        want = w0.astype(np.float64) - 0.5 * (gs[0].astype(np.float64) + gs[1]) / 2
        assert relative_error(c.pull("/r-topk"), want) <= 1e-6


ROWS, DIM = 2048, 32  # a table of four 64 KiB chunks


def rows_round(c: Any, path: str, ids: np.ndarray, grad: np.ndarray, rnd: Round, lr: float | None = None) -> None:
    """Push rows ``ids`` of ``path`` as a contribution to ``rnd`` with the file's update op."""
    u = as_update(parse_update(c.stat(path).update_op))
    if lr is not None:
        u = dataclasses.replace(u, args=(lr, *u.args[1:]))
    c.push_rows(path, ids, grad, op=dataclasses.replace(u, round=rnd))


def step_rows(ref: Reference, want: np.ndarray, grad: np.ndarray, rows: np.ndarray) -> None:
    """The reference's lazy step on ``rows`` (distinct) of the flat table ``want``."""
    for r in np.unique(rows).tolist():
        sl = slice(r * DIM, (r + 1) * DIM)
        ref.step(want, grad[sl], sl)


@pytest.mark.parametrize(("name", "args"), [CONFIGS[1], CONFIGS[2], CONFIGS[3]],
                         ids=[spec_text(*CONFIGS[k]) for k in (1, 2, 3)])
def test_a_round_of_sparse_rows_applies_one_step_to_the_mean_of_the_rows_pushed(
        cl: Cluster, name: str, args: dict[str, float | bool]) -> None:
    """Two members push rows of a table (hvd.Embedding's SCATTER): a row both push is their sum
    over two, a row one pushes its value over two, rows nobody pushed (a whole chunk of them)
    keep weights and state; duplicates within a push are summed first. One step per round on
    every replica; a push sent again counts once; a member with no rows still ends the round."""
    rng = np.random.default_rng(9)
    w0 = rng.standard_normal(ROWS * DIM).astype("<f4")
    path = f"/rows-{name}-{len(args)}"
    ref = Reference(name, args, ROWS * DIM)
    want = w0.astype(np.float64)
    with irdma.connect(cl.meta_url, transport="tcp") as a, irdma.connect(cl.meta_url, transport="tcp") as b:
        a.write(path, w0, chunk_size=CHUNK)
        a.set_shape(path, [ROWS, DIM])
        a.set_update_op(path, spec_text(name, args))
        now = w0
        for k in range(3):
            ids_a = np.r_[rng.integers(0, 1024, 40), [5, 5]]  # chunks 0 and 1, a duplicate
            ids_b = np.r_[ids_a[:10], rng.integers(1536, 2048, 30)]  # ten rows shared, chunk 3; chunk 2 untouched
            ga = rng.standard_normal((len(ids_a), DIM)).astype("<f4")
            gb = rng.standard_normal((len(ids_b), DIM)).astype("<f4")
            rows_round(a, path, ids_a, ga, Round(SERIES, k, 0, 2))
            assert np.array_equal(b.pull(path), now), "a round's first rows changed the table"
            rows_round(a, path, ids_a, ga, Round(SERIES, k, 0, 2))  # sent again: counts once
            rows_round(b, path, ids_b, gb, Round(SERIES, k, 1, 2))
            mean = np.zeros(ROWS * DIM)
            for ids, g in ((ids_a, ga), (ids_b, gb)):
                for r, row in zip(ids.tolist(), g.astype(np.float64), strict=True):
                    mean[r * DIM : (r + 1) * DIM] += row / 2
            step_rows(ref, want, mean, np.r_[ids_a, ids_b])
            got = a.pull(path)
            assert relative_error(got, want) <= 1e-5, (k, relative_error(got, want))
            assert np.array_equal(got[2 * CHUNK // 4 : 3 * CHUNK // 4], w0[2 * CHUNK // 4 : 3 * CHUNK // 4])
            now = got
        # a member with no rows this round: its empty contribution ends the round
        ids = np.array([3, 700])
        g = rng.standard_normal((2, DIM)).astype("<f4")
        rows_round(b, path, ids, g, Round(SERIES, 3, 1, 2))
        rows_round(a, path, np.zeros(0, np.int64), np.zeros((0, DIM), "<f4"), Round(SERIES, 3, 0, 2))
        mean = np.zeros(ROWS * DIM)
        for r, row in zip(ids.tolist(), g.astype(np.float64), strict=True):
            mean[r * DIM : (r + 1) * DIM] = row / 2
        step_rows(ref, want, mean, ids)
        assert relative_error(a.pull(path), want) <= 1e-5
        assert replicas_agree(a, path), "the replicas hold other bytes than the head"


def test_sparse_rows_that_disagree_with_their_round_are_refused_and_change_nothing(cl: Cluster) -> None:
    rng = np.random.default_rng(10)
    w0 = rng.standard_normal(ROWS * DIM).astype("<f4")
    g = rng.standard_normal((3, DIM)).astype("<f4")
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write("/rows-bad", w0, chunk_size=CHUNK)
        c.set_shape("/rows-bad", [ROWS, DIM])
        c.set_update_op("/rows-bad", "sgd learning_rate=0.5")
        rows_round(c, "/rows-bad", np.array([1, 2, 3]), g, Round(SERIES, 0, 0, 2))
        with pytest.raises(irdma.IrdmaError, match="disagree with the round"):
            rows_round(c, "/rows-bad", np.array([1, 2, 3]), g, Round(SERIES, 0, 1, 2), lr=0.1)
        assert np.array_equal(c.pull("/rows-bad"), w0)
        rows_round(c, "/rows-bad", np.array([2]), g[:1], Round(SERIES, 0, 1, 2))
        want = w0.astype(np.float64)
        want[DIM : 4 * DIM] -= 0.5 * g.reshape(-1).astype(np.float64) / 2
        want[2 * DIM : 3 * DIM] -= 0.5 * g[0].astype(np.float64) / 2
        assert relative_error(c.pull("/rows-bad"), want) <= 1e-6


def test_an_elastic_round_whose_member_died_completes_with_those_that_pushed_when_closed(cl: Cluster) -> None:
    """An elastic job's round of 3 expected members: members 0 and 2 push (dense and rows), 1 died.
    Nothing is applied until a member closes the run's rounds; then each range takes one step on
    the mean over the 2 that pushed, on every replica, and the close says ranges were short. A second close and the dead member's late push change nothing."""
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal(N).astype("<f4")
    t0 = rng.standard_normal(ROWS * DIM).astype("<f4")
    gs = [rng.standard_normal(N).astype("<f4") for _ in range(3)]
    rows = [rng.standard_normal((2, DIM)).astype("<f4") for _ in range(3)]
    ids = np.array([7, 1500])  # chunks 0 and 2 of the table
    with irdma.connect(cl.meta_url, transport="tcp") as c:
        c.write("/e-dense", w0, chunk_size=CHUNK)
        c.set_update_op("/e-dense", "sgd learning_rate=0.5")
        c.write("/e-rows", t0, chunk_size=CHUNK)
        c.set_shape("/e-rows", [ROWS, DIM])
        c.set_update_op("/e-rows", "sgd learning_rate=0.5")
        for m in (0, 2):
            contribute(c, "/e-dense", gs[m], Round(SERIES, 5, m, 3, P.ROUND_ELASTIC))
            rows_round(c, "/e-rows", ids, rows[m], Round(SERIES, 5, m, 3, P.ROUND_ELASTIC))
        assert np.array_equal(c.pull("/e-dense"), w0) and np.array_equal(c.pull("/e-rows"), t0)
        short = c.run(c.client.close_round, Round(SERIES, 5, 0, 1, P.ROUND_ELASTIC))
        assert short > 0, "the close says rounds were short of members"
        want = w0.astype(np.float64) - 0.5 * (gs[0].astype(np.float64) + gs[2]) / 2
        assert relative_error(c.pull("/e-dense"), want) <= 1e-6
        table = t0.astype(np.float64).reshape(ROWS, DIM)
        table[ids] -= 0.5 * (rows[0].astype(np.float64) + rows[2]) / 2
        assert relative_error(c.pull("/e-rows"), table.reshape(-1)) <= 1e-6
        assert c.run(c.client.close_round, Round(SERIES, 5, 2, 1, P.ROUND_ELASTIC)) == 0
        contribute(c, "/e-dense", gs[1], Round(SERIES, 5, 1, 3, P.ROUND_ELASTIC))  # the dead member's, late
        assert relative_error(c.pull("/e-dense"), want) <= 1e-6
        assert replicas_agree(c, "/e-dense"), "the replicas hold other bytes than the head"
        # all members in: the round completes at once, no close needed
        for m in range(3):
            contribute(c, "/e-dense", gs[m], Round(SERIES, 6, m, 3, P.ROUND_ELASTIC))
        want -= 0.5 * (gs[0].astype(np.float64) + gs[1] + gs[2]) / 3
        assert relative_error(c.pull("/e-dense"), want) <= 1e-6


def test_a_members_rows_with_their_extents_staged_are_one_contribution() -> None:
    """Verbs (protocol 13): a member's rows of one chunk that take more extents than a SEND
    carries come as one staged SCATTER, its extents in the staging buffer ahead of the rows
    (FLAG_STAGED_EXTENTS). The shard reads them from there: one contribution, the round's mean
    added once. Extents that leave the buffer, or come over TCP, are refused and change nothing.
    Driven through the dispatcher, frame by frame (tests/test_verbs.py on real verbs)."""
    from irdma.server.serve import ShardServer
    from irdma.server.shard import Region, Shard
    from test_admit import _frame, _reply

    shard = Shard(1, Region(1 << 20))
    server = ShardServer(shard)
    staging = memoryview(bytearray(1 << 20))
    rng = np.random.default_rng(12)
    ids = [rng.choice(CHUNK // (4 * DIM), 500, replace=False), np.array([3, 9])]  # 500 rows: 500 extents
    grads = [rng.standard_normal((len(i), DIM)).astype("<f4") for i in ids]

    def push(member: int, soff: int, rid: int, stage_extents: bool, buffer: memoryview | None = staging) -> P.Reply:
        ext = P.extents(np.zeros(len(ids[member])), ids[member] * 4 * DIM, np.full(len(ids[member]), 4 * DIM))
        blob = (ext.tobytes() if stage_extents else b"") + grads[member].tobytes()
        if soff + len(blob) <= len(staging):  # what the client's RDMA WRITE puts there
            staging[soff : soff + len(blob)] = blob
        op = P.Update(P.UpdateOp.ADD, round=Round(SERIES, 0, member, 2))
        msg = (P.Scatter(7, CHUNK, ext[:0], op, staged=True, staging_offset=soff, staged_extents=len(ext))
               if stage_extents else P.Scatter(7, CHUNK, ext, op, staged=True, staging_offset=soff))
        return trio.run(_reply, server.handle(_frame(msg, rid), buffer, "verbs"))

    assert push(0, 4096, 1, True) == P.VersionReply(0)
    bad = push(0, len(staging) - 64, 2, True)  # its extents leave the buffer
    assert isinstance(bad, P.ErrorReply) and "leave" in bad.message
    bad = push(0, 0, 3, True, None)  # a TCP connection: no staging buffer
    assert isinstance(bad, P.ErrorReply) and bad.status == P.Status.BAD_REQUEST
    assert push(0, 8192, 4, True) == P.VersionReply(0)  # sent again: counts once
    assert push(1, 0, 5, False) == P.VersionReply(1)  # the round's last contribution: applied
    want = np.zeros((CHUNK // (4 * DIM), DIM))
    for i, g in zip(ids, grads, strict=True):
        want[i] += g.astype(np.float64) / 2
    got = np.frombuffer(shard.read(7, 0, 0, CHUNK)[1], "<f4").reshape(-1, DIM)  # type: ignore[arg-type]
    assert relative_error(got, want) <= 1e-6
