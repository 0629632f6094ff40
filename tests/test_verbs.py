"""End to end on real RDMA verbs (run inside the Soft-RoCE VM: ``make test-verbs``).

Shard servers with transport ``verbs``, the native client on verbs, a FUSE mount on verbs,
synchronous rounds summed from staged pushes, and the errors a user meets where verbs cannot run.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import trio
from helpers import irdma_cli
from optim_ref import CONFIGS, Reference, relative_error, spec_text
from test_conformance import cancelled_after
from test_rounds import CHUNK, DIM, ROWS, SERIES, N, contribute, replicas_agree, rows_round, step_rows

import irdma
from irdma._errors import BadRequest
from irdma.ops import cluster as _cluster
from irdma.transport import make_transport
from irdma.wire.protocol import ROUND_ELASTIC, Round, UpdateOp

pytestmark = pytest.mark.verbs


@pytest.fixture(scope="module", autouse=True)
def _need_verbs(transport_name: str) -> None:
    if transport_name != "verbs":
        pytest.skip("verbs tests run inside the Soft-RoCE VM (make test-verbs)")


@pytest.fixture(scope="module")
def vcluster_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    d = str(tmp_path_factory.mktemp("vcluster"))
    # registering file-backed regions under TCG takes a while, longer on a loaded host: 180 s
    _cluster.up(d, 2, 64 << 20, transport="verbs", fresh=True, timeout=180)
    yield d
    _cluster.down(d)


@pytest.fixture(scope="module")
def vcluster(vcluster_dir: str) -> str:
    return _cluster.meta_url_of(vcluster_dir)


@pytest.fixture(scope="module")
def vkey(vcluster_dir: str):  # type: ignore[no-untyped-def]
    """The cluster key (shards serve only its holders)."""
    from irdma.wire import auth

    return auth.read_key_file(_cluster.key_file_of(vcluster_dir))


@pytest.fixture(scope="module")
def vshard(vcluster_dir: str) -> str:
    """The address of one verbs shard of the cluster."""
    return _cluster.read_state(vcluster_dir)[0].address


def test_auto_picks_verbs_and_says_so() -> None:
    assert make_transport("auto").name == "verbs"


def test_client_api_on_verbs_moves_bytes_one_sided(vcluster: str) -> None:
    async def main() -> None:
        async with irdma.Client.open(vcluster, transport="verbs") as c:
            data = os.urandom(5 * (1 << 20) + 17)
            await c.write("/v.bin", data, chunk_size=1 << 20)
            assert await c.read("/v.bin") == data
            conn = await c.connection(1)
            assert type(getattr(conn, "conn", conn)).__name__ == "VerbsConnection"  # under the metrics wrapper
            w = np.arange(300_000, dtype="<f4")
            await c.write("/w.f32", w, chunk_size=1 << 20)
            for _ in range(3):
                await c.push("/w.f32", np.ones(300_000, "<f4"))
            np.testing.assert_array_equal(await c.pull("/w.f32"), w + 3)
            # versions agree whichever transport asks
            layout = irdma.Layout(c.store.resolve("/w.f32").ino, 1 << 20, c.store.resolve("/w.f32").stripe)
            v_verbs = await (await c.connection(layout.shard_of(0))).read(layout.file_id, 0, 0, memoryview(bytearray(8)))
        async with irdma.Client.open(vcluster, transport="tcp") as t:
            v_tcp = await (await t.connection(layout.shard_of(0))).read(layout.file_id, 0, 0, memoryview(bytearray(8)))
            np.testing.assert_array_equal(await t.pull("/w.f32"), w + 3)
        assert v_verbs == v_tcp == 4  # one assign, three adds

    trio.run(main)


def test_sparse_rows_on_verbs_match_numpy_and_tcp(vcluster: str) -> None:
    """pull_rows/push_rows over verbs (batched RDMA READs; staged SCATTERs of whole chunks, a
    large chunk in pieces) agree with numpy and with what a TCP client reads."""
    rng = np.random.default_rng(4)

    async def main() -> None:
        async with irdma.Client.open(vcluster, transport="verbs") as c:
            table = (rng.integers(-100, 100, size=(4096, 250)) / 4).astype("<f4")  # rows cross chunks
            await c.write("/vrows", table, chunk_size=1 << 20)
            await c.set_shape("/vrows", table.shape)
            ids = rng.integers(0, 4096, size=3000)
            np.testing.assert_array_equal(await c.pull_rows("/vrows", ids), table[ids])
            delta = np.ones((len(ids), 250), "<f4")
            await c.push_rows("/vrows", ids, delta, op="add")
            np.add.at(table, ids, delta)
            await c.write("/vsmall", np.zeros(40_000, "<f4"), chunk_size=1 << 20)
            odd = np.arange(1, 40_000, 2)  # 20,000 rows of 4 bytes in one chunk: sent in several pieces
            await c.push_rows("/vsmall", odd, np.full((len(odd), 1), 0.5, "<f4"), op="add", row_len=1)
        async with irdma.Client.open(vcluster, transport="tcp") as t:
            np.testing.assert_array_equal(await t.pull("/vrows", shape=table.shape), table)
            want = np.zeros(40_000, "<f4")
            want[1::2] = 0.5
            np.testing.assert_array_equal(await t.pull("/vsmall"), want)

    trio.run(main)


def test_mount_on_verbs_write_and_read_back(vcluster: str, tmp_path: object) -> None:
    mnt = os.path.join(str(tmp_path), "m")
    os.makedirs(mnt)
    log = mnt + ".log"
    from irdma.fs.mount import spawn_mount, unmount

    spawn_mount(vcluster, mnt, transport="verbs", log_file=log, timeout=120)  # a mount starts slowly under TCG
    try:
        data = os.urandom(3 * (1 << 20) + 5)
        with open(os.path.join(mnt, "via-mount"), "wb") as f:
            f.write(data)
        with open(os.path.join(mnt, "via-mount"), "rb") as f:
            assert f.read() == data
        with irdma.connect(vcluster, transport="verbs") as c:
            assert c.read("/via-mount") == data
            c.write("/via-client", b"hello verbs")
        with open(os.path.join(mnt, "via-client"), "rb") as f:
            assert f.read() == b"hello verbs"
    finally:
        unmount(mnt)
    with open(log) as f:
        text = f.read()
    assert "picked verbs" in text or "transport verbs" in text, text
    assert "Traceback" not in text and "ERROR" not in text, text


def test_rdma_read_and_write_figures(vcluster: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Sanity figures only: under qemu TCG these are not performance numbers."""
    size = 16 << 20
    data = os.urandom(size)
    figures = {}
    for tr in ("verbs", "tcp"):
        with irdma.connect(vcluster, transport=tr) as c:
            t0 = time.perf_counter()
            c.write(f"/bench-{tr}", data, chunk_size=4 << 20)
            t1 = time.perf_counter()
            got = c.read(f"/bench-{tr}")
            t2 = time.perf_counter()
            assert got == data
            figures[tr] = (size / (t1 - t0) / 1e6, size / (t2 - t1) / 1e6)
            c.truncate(f"/bench-{tr}", 0)  # the module's cluster has 64 MiB shards: freed at once
            c.unlink(f"/bench-{tr}")
    with capsys.disabled():
        for tr, (w, r) in figures.items():
            print(f"\nFIGURE {tr}: 16 MiB push {w:.1f} MB/s, pull {r:.1f} MB/s"
                  f"{' (RDMA WRITE / RDMA READ)' if tr == 'verbs' else ''}")


def test_memlock_too_low_is_a_clear_error(tmp_path: object) -> None:
    def drop() -> None:  # an unprivileged user with a 64 KiB memlock limit
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
        os.setgid(65534)
        os.setuid(65534)

    res = subprocess.run([sys.executable, "-m", "irdma.ops.cli", "server", "--listen", "127.0.0.1:0",
                          "--capacity", "64MiB", "--transport", "verbs", "--no-auth"],
                         capture_output=True, text=True, preexec_fn=drop, timeout=120, cwd="/")
    assert res.returncode == 1, res.stderr
    assert "memlock" in res.stderr and "ulimit -l" in res.stderr


def test_tcp_shard_refuses_a_verbs_client_clearly(tmp_path: object) -> None:
    d = str(tmp_path)
    url = _cluster.up(d, 1, 8 << 20, transport="tcp", fresh=True)
    try:
        with pytest.raises(irdma.TransportUnavailable, match="--transport verbs"):
            with irdma.connect(url, transport="verbs") as c:
                c.write("/x", b"x")
        assert irdma_cli("shard", "list", "--meta", url).returncode == 0
    finally:
        _cluster.down(d)


def test_cancelled_posts_leak_no_slot_credit_or_buffer(vshard: str, vkey: object) -> None:
    """300 pushes and pulls cancelled at every point of their work (an assign posts an RDMA
    WRITE and a SEND, an add the same into a staging slot, a pull two RDMA READs); then a
    normal request completes, and once the connection is quiet everything lent is back."""
    chunk = 1 << 20

    async def main() -> None:
        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                c = await make_transport("verbs").connect(vshard, nursery, key=vkey)
                fid = 9_000_000 + os.getpid()
                ones = np.ones(1024, "<f4").tobytes()
                await c.write(fid, 0, chunk, 0, UpdateOp.ASSIGN, bytes(4096))
                calls = [
                    (c.write, fid, 0, chunk, 0, UpdateOp.ASSIGN, bytes(4096)),
                    (c.write, fid, 0, chunk, 0, UpdateOp.ADD, ones),
                    (c.read, fid, 0, 0, memoryview(bytearray(4096))),
                ]
                cancelled = 0
                for i in range(300):
                    afn, *args = calls[i % 3]
                    cancelled += not await cancelled_after(1 + i // 3 % 12, afn, *args)
                assert cancelled >= 100 and not c.broken
                with trio.fail_after(30):  # a normal request completes: nothing leaked
                    data = os.urandom(4096)
                    await c.write(fid, 1, chunk, 0, UpdateOp.ASSIGN, data)
                    await c.stat()  # every reply is in: credits and staging slots are back
                    out = bytearray(4096)
                    await c.read(fid, 1, 0, memoryview(out))  # every completion is in (RC order)
                    assert out == data
                ep = c._ep  # type: ignore[attr-defined]
                assert ep.idle
                for lender in (c._credits, c._staging, c._pool.lender):  # type: ignore[attr-defined]
                    assert lender.available == lender.size, lender.what
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_write_to_a_chunk_freed_by_another_client_locates_it_again(vshard: str, vkey: object) -> None:
    chunk = 1 << 20

    async def main() -> None:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                a = await make_transport("verbs").connect(vshard, nursery, key=vkey)
                b = await make_transport("verbs").connect(vshard, nursery, key=vkey)
                fid = 9_100_000 + os.getpid()
                await a.write(fid, 0, chunk, 0, UpdateOp.ASSIGN, b"first")  # a caches the chunk's place
                assert await b.free(fid, 0) == 1  # b frees it: a's place is stale
                await b.write(fid + 1, 0, chunk, 0, UpdateOp.ASSIGN, b"other")  # may take the old place
                assert await a.write(fid, 0, chunk, 0, UpdateOp.ASSIGN, b"second") == 1  # a fresh chunk
                out = bytearray(6)
                assert await b.read(fid, 0, 0, memoryview(out)) == 1
                assert out == b"second"
                with pytest.raises(BadRequest):  # a refusal that is not a stale place still raises
                    await a.write(fid, 0, 2 * chunk, 0, UpdateOp.ASSIGN, b"x")
                nursery.cancel_scope.cancel()

    trio.run(main)


class _StepCounter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


def test_an_assign_posts_its_write_then_its_commit_in_one_step(vshard: str, vkey: object) -> None:
    """RC queue pairs execute in order: the RDMA WRITE must be posted before the SEND that
    commits it, by the same task with no checkpoint in between."""
    from irdma.transport.verbs import e

    async def main() -> None:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                c = await make_transport("verbs").connect(vshard, nursery, key=vkey)
                fid = 9_200_000 + os.getpid()
                await c.write(fid, 0, 1 << 20, 0, UpdateOp.ASSIGN, b"located")  # LOCATE once
                ep = c._ep  # type: ignore[attr-defined]
                counter = _StepCounter()
                posted: list[tuple[int, int]] = []
                real = ep._post_one

                def spy(wr, release):  # type: ignore[no-untyped-def]
                    posted.append((wr[0], counter.steps))
                    return real(wr, release)

                ep._post_one = spy
                trio.lowlevel.add_instrument(counter)
                try:
                    for i in range(20):
                        posted.clear()
                        await c.write(fid, 0, 1 << 20, 4096 * i, UpdateOp.ASSIGN, os.urandom(4096))
                        assert [op for op, _ in posted] == [e.IBV_WR_RDMA_WRITE, e.IBV_WR_SEND]
                        assert posted[0][1] == posted[1][1]  # one task step: nothing ran in between
                finally:
                    trio.lowlevel.remove_instrument(counter)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_verbs_client_without_the_key_gets_no_rkey(vshard: str, vcluster_dir: str) -> None:
    """Memory addresses and rkeys come only in the VERBS_CONNECT reply, on an authenticated
    control connection: no key, or a wrong one, and there is no queue pair and no rkey."""
    import secrets

    from irdma._errors import AuthFailed
    from irdma.transport.verbs import VerbsTransport
    from irdma.wire import auth
    from irdma.wire import protocol as P

    ring = auth.read_key_file(_cluster.key_file_of(vcluster_dir))

    async def connect(key: auth.KeyRing | None) -> None:
        async with trio.open_nursery() as n:
            conn = await VerbsTransport().connect(vshard, n, key=key, timeout=10)
            assert conn.remote is not None and conn.remote.region_rkey  # the key holder gets its rkey
            await conn.aclose()

    trio.run(connect, ring)
    for key in (None, auth.KeyRing(ring.cluster_id, (secrets.token_bytes(32),))):
        with pytest.raises(BaseException) as info:
            trio.run(connect, key)
        leaves = info.value.exceptions if isinstance(info.value, BaseExceptionGroup) else [info.value]
        assert all(isinstance(e, AuthFailed) for e in leaves), leaves
    # VERBS_CONNECT before (or instead of) the handshake: refused, no rkey on the wire
    import socket

    host, port = vshard.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"".join(P.encode_request(P.VerbsConnect(1, 2, bytes(16)), 1)))
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    frame = P.parse_header(got[: P.HEADER_SIZE], 1 << 20, any_version=True)
    assert frame.status != P.Status.OK


def test_a_killed_verbs_shard_under_load_loses_nothing_with_two_replicas(tmp_path: object) -> None:
    """3 verbs shards, 2 replicas: a client adds a vector 60 times to one file while the head
    of its first chunk is SIGKILLed after 20, then drains another shard: no error, the sum is
    exact, a file written before reads bit-exact, on verbs all along."""
    import signal

    d = os.path.join(str(tmp_path), "c")
    # registering three file-backed regions under TCG takes a while: a deadline of 180 s
    meta = _cluster.up(d, 3, 32 << 20, transport="verbs", fresh=True, replicas=2, timeout=180)
    try:
        n = 1 << 18  # 1 MiB of float32 over four 256 KiB chunks
        vec = np.full(n, 1.5, dtype="<f4")
        before = os.urandom(3 << 20)
        with irdma.connect(meta, transport="verbs", timeout=20.0) as c:  # TCG is slow: a kill is seen by its reset
            c.write("/before", before, chunk_size=1 << 20)
            c.write("/sum", np.zeros(n, "<f4"), chunk_size=1 << 18)
            c.set_update_op("/sum", "add")
            inode = c.stat("/sum")
            head = irdma.Layout(inode.ino, inode.chunk_size, inode.stripe, inode.replicas).shard_of(0)
            for i in range(60):
                if i == 20:
                    proc = next(s for s in _cluster.read_state(d) if s.shard_id == head)
                    os.kill(proc.pid, signal.SIGKILL)
                c.push("/sum", vec)
                assert c.read("/before") == before
            np.testing.assert_array_equal(c.pull("/sum"), vec * 60)
        _cluster.up(d, 3, 32 << 20, transport="verbs", timeout=180)  # the killed shard back on its data
        other = next(s.shard_id for s in _cluster.read_state(d) if s.shard_id != head)
        irdma_cli("shard", "drain", str(other), "--meta", meta)
        with irdma.connect(meta, transport="verbs", timeout=20.0) as c:  # TCG is slow: a kill is seen by its reset
            np.testing.assert_array_equal(c.pull("/sum"), vec * 60)
            assert c.read("/before") == before
            c.push("/sum", vec)
            np.testing.assert_array_equal(c.pull("/sum"), vec * 61)
    finally:
        _cluster.down(d)


def test_a_clients_rkeys_stop_working_when_its_connection_ends(vshard: str, vkey: object) -> None:
    """Every client gets registrations (rkeys) of its own, deregistered when its connection
    ends: another connection that borrows them reads while the first is open, and is refused
    by the device once the shard has seen the first one close (within a deadline)."""
    import dataclasses

    from irdma._errors import IrdmaError
    from irdma.transport.verbs import VerbsTransport

    fid = 9_300_000 + os.getpid()
    data = os.urandom(4096)

    async def borrow_read(n: trio.Nursery, keys: object) -> bytes:
        """Read the chunk on a fresh connection that uses ``keys``' rkeys instead of its own."""
        b = await VerbsTransport().connect(vshard, n, key=vkey, timeout=10)
        try:
            assert b.remote is not None
            b.remote = dataclasses.replace(b.remote, region_rkey=keys.region_rkey,  # type: ignore[attr-defined]
                                           versions_rkey=keys.versions_rkey)  # type: ignore[attr-defined]
            buf = bytearray(4096)
            await b.read(fid, 0, 0, memoryview(buf))
            return bytes(buf)
        finally:
            await b.aclose()

    async def main() -> None:
        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                a = await VerbsTransport().connect(vshard, n, key=vkey, timeout=10)
                assert a.remote is not None
                await a.write(fid, 0, 1 << 20, 0, UpdateOp.ASSIGN, data)
                keys = a.remote
                assert await borrow_read(n, keys) == data  # a's keys work while a is connected
                await a.aclose()
                refused = False
                with trio.move_on_after(20):
                    while not refused:
                        try:
                            got = await borrow_read(n, keys)
                        except IrdmaError:
                            refused = True
                        else:
                            assert got == data
                            await trio.sleep(0.1)  # the shard has not seen a's close yet
                assert refused, "a closed connection's rkeys still read the shard's memory after 20 s"
                c = await VerbsTransport().connect(vshard, n, key=vkey, timeout=10)
                assert c.remote is not None and c.remote.region_rkey != keys.region_rkey
                await c.free(fid, 0)
                await c.aclose()
                n.cancel_scope.cancel()

    trio.run(main)


def test_snapshots_copy_on_write_on_verbs(vcluster: str) -> None:
    """fsx with snapshots on verbs: pushes are staged (no in-place RDMA WRITE can reach a chunk a
    snapshot shares), the live file's cached one-sided places stay right through copy-on-write,
    and shared chunks are never cached (tests/test_snapshots.py)."""
    from test_snapshots import fsx_with_snapshots

    assert fsx_with_snapshots(vcluster, "verbs", seed=2) >= 5



@pytest.fixture(scope="module")
def members(vcluster: str) -> Iterator[tuple[irdma.SyncClient, irdma.SyncClient]]:
    """Two verbs clients of the cluster: a round's members (connected once: under TCG each
    connection registers the shards' memory again)."""
    with irdma.connect(vcluster, transport="verbs") as a, irdma.connect(vcluster, transport="verbs") as b:
        yield a, b


@pytest.mark.parametrize(("name", "args"), [CONFIGS[0], CONFIGS[2]], ids=[spec_text(*CONFIGS[k]) for k in (0, 2)])
def test_a_round_of_verbs_pushes_applies_one_step_to_the_mean(members: tuple[irdma.SyncClient, irdma.SyncClient],
                                                              name: str, args: dict[str, float | bool]) -> None:
    """Two verbs clients are a round's members (tests/test_rounds.py on TCP): their pushes, staged
    REMOTE_WRITEs, are summed on each chunk's head and the optimizer takes one step on their mean,
    on both replicas; a round's first push changes nothing, one sent again counts once."""
    a, b = members
    rng = np.random.default_rng(21)
    w0 = rng.standard_normal(N).astype("<f4")
    path = f"/vround-{name}"
    ref = Reference(name, args, N)
    want = w0.astype(np.float64)
    a.write(path, w0, chunk_size=CHUNK)
    a.set_update_op(path, spec_text(name, args))
    now = w0
    for k in range(2):
        g0, g1 = rng.standard_normal(N).astype("<f4"), rng.standard_normal(N).astype("<f4")
        contribute(a, path, g0, Round(SERIES, k, 0, 2))
        assert np.array_equal(b.pull(path), now), "a round's first push changed the weights"
        contribute(a, path, g0, Round(SERIES, k, 0, 2))  # sent again: counts once
        contribute(b, path, g1, Round(SERIES, k, 1, 2))
        ref.step(want, (g0.astype(np.float64) + g1) / 2, slice(None))
        got = a.pull(path)
        assert relative_error(got, want) <= 1e-5, (k, relative_error(got, want))
        now = got
    assert replicas_agree(a, path), "the replicas hold other bytes than the head"


def test_a_round_of_sparse_rows_on_verbs_applies_one_step_to_the_mean_of_the_rows(
        members: tuple[irdma.SyncClient, irdma.SyncClient]) -> None:
    """Staged SCATTERs as a round's contributions (Adam, lazy per row): rows both members push are
    their sum over two, a chunk nobody pushed keeps its weights; a member's rows of one chunk are
    one contribution even when they take more extents than one SEND carries (SCATTER_EXTENTS:
    their extents then travel in the staging slot); a member with no rows ends the round with
    its empty contribution."""
    from irdma.transport.verbs import SCATTER_EXTENTS

    a, b = members
    name, args = CONFIGS[2]
    rng = np.random.default_rng(22)
    w0 = rng.standard_normal(ROWS * DIM).astype("<f4")
    path = "/vround-rows"
    ref = Reference(name, args, ROWS * DIM)
    want = w0.astype(np.float64)
    per_chunk = CHUNK // (4 * DIM)
    many = min(per_chunk, SCATTER_EXTENTS + 64)
    assert many > SCATTER_EXTENTS, "chunk 0's rows must take more extents than one SEND carries"
    a.write(path, w0, chunk_size=CHUNK)
    a.set_shape(path, [ROWS, DIM])
    a.set_update_op(path, spec_text(name, args))
    ids_a = np.r_[rng.choice(per_chunk, many, replace=False), rng.integers(per_chunk, 2 * per_chunk, 20), [600, 600]]
    ids_b = np.r_[ids_a[:10], ids_a[-30:], rng.integers(3 * per_chunk, 4 * per_chunk, 30)]  # chunk 2 untouched
    ga = rng.standard_normal((len(ids_a), DIM)).astype("<f4")
    gb = rng.standard_normal((len(ids_b), DIM)).astype("<f4")
    rows_round(a, path, ids_a, ga, Round(SERIES, 0, 0, 2))
    assert np.array_equal(b.pull(path), w0), "a round's first rows changed the table"
    rows_round(a, path, ids_a, ga, Round(SERIES, 0, 0, 2))  # sent again: counts once
    rows_round(b, path, ids_b, gb, Round(SERIES, 0, 1, 2))
    mean = np.zeros(ROWS * DIM)
    for ids, g in ((ids_a, ga), (ids_b, gb)):
        for r, row in zip(ids.tolist(), g.astype(np.float64), strict=True):
            mean[r * DIM : (r + 1) * DIM] += row / 2
    step_rows(ref, want, mean, np.r_[ids_a, ids_b])
    got = a.pull(path)
    assert relative_error(got, want) <= 1e-5, relative_error(got, want)
    untouched = slice(2 * CHUNK // 4, 3 * CHUNK // 4)
    assert np.array_equal(got[untouched], w0[untouched])
    # a member with no rows this round: its empty contribution ends the round
    ids, g = np.array([3, 700]), rng.standard_normal((2, DIM)).astype("<f4")
    rows_round(b, path, ids, g, Round(SERIES, 1, 1, 2))
    rows_round(a, path, np.zeros(0, np.int64), np.zeros((0, DIM), "<f4"), Round(SERIES, 1, 0, 2))
    mean = np.zeros(ROWS * DIM)
    for r, row in zip(ids.tolist(), g.astype(np.float64), strict=True):
        mean[r * DIM : (r + 1) * DIM] = row / 2
    step_rows(ref, want, mean, ids)
    assert relative_error(a.pull(path), want) <= 1e-5
    assert replicas_agree(a, path), "the replicas hold other bytes than the head"


def test_an_elastic_round_on_verbs_completes_with_the_members_that_pushed_when_closed(
        members: tuple[irdma.SyncClient, irdma.SyncClient]) -> None:
    """An elastic round of 3 expected members over verbs: members 0 and 2 push (dense and rows),
    member 1 died. Nothing is applied until member 0 closes the run's rounds (a ROUND_CLOSE
    REMOTE_WRITE without payload to each shard); then one step on the mean of the 2, on both
    replicas. A second close and the dead member's late push change nothing."""
    a, b = members
    rng = np.random.default_rng(23)
    w0 = rng.standard_normal(N).astype("<f4")
    t0 = rng.standard_normal(ROWS * DIM).astype("<f4")
    gs = [rng.standard_normal(N).astype("<f4") for _ in range(3)]
    rows = [rng.standard_normal((2, DIM)).astype("<f4") for _ in range(3)]
    ids = np.array([7, 1500])  # chunks 0 and 2 of the table
    a.write("/ve-dense", w0, chunk_size=CHUNK)
    a.set_update_op("/ve-dense", "sgd learning_rate=0.5")
    a.write("/ve-rows", t0, chunk_size=CHUNK)
    a.set_shape("/ve-rows", [ROWS, DIM])
    a.set_update_op("/ve-rows", "sgd learning_rate=0.5")
    for c, m in ((a, 0), (b, 2)):
        contribute(c, "/ve-dense", gs[m], Round(SERIES, 5, m, 3, ROUND_ELASTIC))
        rows_round(c, "/ve-rows", ids, rows[m], Round(SERIES, 5, m, 3, ROUND_ELASTIC))
    assert np.array_equal(b.pull("/ve-dense"), w0) and np.array_equal(b.pull("/ve-rows"), t0)
    assert a.run(a.client.close_round, Round(SERIES, 5, 0, 1, ROUND_ELASTIC)) > 0, "the close says rounds were short"
    want = w0.astype(np.float64) - 0.5 * (gs[0].astype(np.float64) + gs[2]) / 2
    assert relative_error(b.pull("/ve-dense"), want) <= 1e-6
    table = t0.astype(np.float64).reshape(ROWS, DIM)
    table[ids] -= 0.5 * (rows[0].astype(np.float64) + rows[2]) / 2
    assert relative_error(b.pull("/ve-rows"), table.reshape(-1)) <= 1e-6
    assert b.run(b.client.close_round, Round(SERIES, 5, 2, 1, ROUND_ELASTIC)) == 0
    contribute(b, "/ve-dense", gs[1], Round(SERIES, 5, 1, 3, ROUND_ELASTIC))  # the dead member's, late
    assert relative_error(a.pull("/ve-dense"), want) <= 1e-6
    assert replicas_agree(a, "/ve-dense") and replicas_agree(a, "/ve-rows"), "the replicas disagree"
