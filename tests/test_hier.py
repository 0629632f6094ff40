"""Host-local aggregation (irdma.train.hier.HostGroup): real processes (multiprocessing, spawn) summing
float32 arrays through shared memory; failures (a killed rank, a stuck rank, disagreeing ranks)
end in HostGroupError on every rank within the deadline; nothing is left in /dev/shm or the run
directory. Processes wait on events and queues with deadlines, never on sleeps."""

from __future__ import annotations

import fcntl
import functools
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from helpers import wait_until

from irdma._errors import IrdmaError
from irdma.train import _hier_wire as wire
from irdma.train.hier import HostGroup, HostGroupError, local_rank_and_size

SPAWN = mp.get_context("spawn")
RESULT_WAIT_S = 20.0  # the most any test waits for its processes to report


# ---- the program each rank runs ----

def _rank_main(name: str, rank: int, size: int, nbytes: int, run_dir: str, timeout: float,
               plan: list[tuple[Any, ...]], report: Any, start: Any, go: Any) -> None:
    """Join the group, then run ``plan``: ("allreduce"|"reduce_to_leader"|"broadcast", array),
    ("barrier",), ("wait_go",) (wait for the test's go event), ("block",) (never call again)."""
    report.send((rank, "ready", None))
    if not start.wait(RESULT_WAIT_S):
        report.send((rank, "error", ("Timeout", "the test never set start", None, 0.0)))
        return
    results: list[Any] = []
    t0 = time.monotonic()
    try:
        with HostGroup(name, rank, size, nbytes, timeout=timeout, run_dir=run_dir) as group:
            report.send((rank, "joined", None))
            for call, *args in plan:
                t0 = time.monotonic()
                if call == "wait_go":
                    assert go.wait(RESULT_WAIT_S), "the test never set go"
                elif call == "block":
                    threading.Event().wait(RESULT_WAIT_S)  # stuck: alive, in no call, until killed
                    return
                elif call == "barrier":
                    group.barrier()
                    results.append(None)
                else:
                    results.append(getattr(group, call)(*args))
            report.send((rank, "done", results))
    except Exception as exc:  # reported to the test process, which asserts on it
        report.send((rank, "error", (type(exc).__name__, str(exc), getattr(exc, "rank", None), time.monotonic() - t0)))


class Ranks:
    """The processes of one group, and what they reported (one pipe per rank: a killed rank
    cannot leave a lock shared with the others held, as it could with one multiprocessing.Queue)."""

    def __init__(self, pipes: dict[int, Any], start: Any, go: Any, procs: dict[int, Any]) -> None:
        self.pipes, self.start, self.go, self.procs = pipes, start, go, procs
        self.got: dict[tuple[int, str], Any] = {}

    def wait(self, kinds: tuple[str, ...], ranks: list[int],
             timeout: float = RESULT_WAIT_S) -> dict[int, tuple[str, Any]]:
        """Wait until each of ``ranks`` has reported one of ``kinds``; return rank -> (kind, payload)."""
        deadline = time.monotonic() + timeout
        while True:
            found = {r: (k, self.got[(r, k)]) for r in ranks for k in kinds if (r, k) in self.got}
            if len(found) == len(ranks):
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"ranks {sorted(set(ranks) - set(found))} did not report {kinds} in {timeout} s; "
                                     f"got {sorted(self.got)}")
            open_pipes = [p for p in self.pipes.values() if not p.closed]
            for pipe in multiprocessing.connection.wait(open_pipes, timeout=remaining):
                try:
                    rank, kind, payload = pipe.recv()
                except EOFError:
                    pipe.close()  # that rank exited
                    continue
                self.got[(rank, kind)] = payload

    def results(self) -> dict[int, Any]:
        """Every rank's results, failing on any rank's error."""
        out = self.wait(("done", "error"), sorted(self.procs))
        errors = {r: p for r, (k, p) in out.items() if k == "error"}
        assert not errors, f"ranks failed: {errors}"
        return {r: p for r, (_, p) in out.items()}


@contextmanager
def spawn_group(name: str, plans: dict[int, list[tuple[Any, ...]]], *, nbytes: int, run_dir: str,
                timeout: float = 10.0, start: bool = True) -> Iterator[Ranks]:
    start_ev, go = SPAWN.Event(), SPAWN.Event()
    size = len(plans)
    pipes, procs = {}, {}
    for r, plan in plans.items():
        pipes[r], child_end = SPAWN.Pipe(duplex=False)
        procs[r] = SPAWN.Process(target=_rank_main, args=(name, r, size, nbytes, run_dir, timeout, plan, child_end,
                                                          start_ev, go), daemon=True)
        procs[r].start()
        child_end.close()
    ranks = Ranks(pipes, start_ev, go, procs)
    try:
        ranks.wait(("ready",), sorted(procs))  # all imported: the group forms within ms of start
        if start:
            start_ev.set()
        yield ranks
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(10)
        for pipe in pipes.values():
            pipe.close()


def _leftovers(name: str, run_dir: str) -> list[str]:
    prefix = f"irdma-hier-{os.getuid()}-{name}"
    return [f"/dev/shm/{f}" for f in os.listdir("/dev/shm") if f.startswith(prefix)] + \
        [os.path.join(run_dir, f) for f in os.listdir(run_dir)]


def _error(payload: Any) -> tuple[str, str, int | None, float]:
    kind, msg, rank, elapsed = payload
    return kind, msg, rank, elapsed


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="hier-", dir="/tmp")  # short: a socket path has at most 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    return f"t{os.getpid()}-{request.node.name[:40].replace('[', '-').replace(']', '')}"


def _arrays(rng: np.random.Generator, shape: tuple[int, ...], n: int) -> list[np.ndarray]:
    """float32 of magnitudes 1e-3 .. 1e3, so that the order of the additions shows in the bits."""
    return [np.asarray(rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape), dtype=np.float32)
            for _ in range(n)]


# ---- real processes ----

def test_allreduce_three_processes_bit_identical_rank_order(name: str, run_dir: str) -> None:
    rng = np.random.default_rng(12)
    shapes = [(40_000,), (3, 7), (), (1,), (257, 33)]  # (3, 7): 84 bytes, not a multiple of 8
    xs = {s: _arrays(rng, s, 3) for s in shapes}
    nbytes = max(4 * int(np.prod(s)) for s in shapes)
    plans = {r: [("allreduce", xs[s][r]) for s in shapes] for r in range(3)}
    with spawn_group(name, plans, nbytes=nbytes, run_dir=run_dir) as ranks:
        results = ranks.results()
    for step, s in enumerate(shapes):
        want = functools.reduce(np.add, xs[s])
        for r in range(3):
            got = results[r][step]
            assert got.dtype == np.float32 and got.shape == s
            assert np.array_equal(got, want), f"rank {r} step {step}"
            assert got.tobytes() == results[0][step].tobytes()
    backwards = functools.reduce(np.add, xs[(40_000,)][::-1])
    assert not np.array_equal(backwards, results[0][0]), "the data cannot tell one order of addition from another"
    assert _leftovers(name, run_dir) == []


def test_reduce_to_leader_broadcast_barrier(name: str, run_dir: str) -> None:
    rng = np.random.default_rng(3)
    xs = _arrays(rng, (5, 11), 3)
    w = rng.standard_normal((13,)).astype(np.float32)
    plans = {r: [("reduce_to_leader", xs[r]), ("barrier",), ("broadcast", w if r == 0 else None),
                 ("broadcast", w[::-1].copy() if r == 0 else np.zeros(13, np.float32))] for r in range(3)}
    with spawn_group(name, plans, nbytes=4 * 55, run_dir=run_dir) as ranks:
        results = ranks.results()
    assert np.array_equal(results[0][0], functools.reduce(np.add, xs))
    assert results[1][0] is None and results[2][0] is None
    for r in range(3):
        assert results[r][1] is None
        assert np.array_equal(results[r][2], w) and results[r][2].dtype == np.float32
        assert np.array_equal(results[r][3], w[::-1])
    assert _leftovers(name, run_dir) == []


def test_killed_member_fails_the_others_naming_it(name: str, run_dir: str) -> None:
    # No deadline of the group's can end a call while this test waits for its ranks (a group's
    # timeout, 2 * RESULT_WAIT_S, is past the test's own wait), so an error naming the dead rank
    # can only come from the event itself: the kernel closing its socket (end of file).
    timeout = 2 * RESULT_WAIT_S
    x = np.ones(100, np.float32)
    plans = {0: [("wait_go",), ("allreduce", x)], 1: [("wait_go",), ("allreduce", x)], 2: [("block",)]}
    with spawn_group(name, plans, nbytes=400, run_dir=run_dir, timeout=timeout) as ranks:
        ranks.wait(("joined",), [0, 1, 2])
        ranks.procs[2].kill()
        ranks.procs[2].join(10)
        ranks.go.set()
        out = ranks.wait(("done", "error"), [0, 1])
    for r in (0, 1):
        kind, (etype, msg, bad_rank, _) = out[r][0], _error(out[r][1])
        assert kind == "error" and etype == "HostGroupError", out[r]
        assert "rank 2 left the group" in msg and bad_rank == 2, msg
    assert _leftovers(name, run_dir) == []


def test_stuck_member_times_out_on_every_rank(name: str, run_dir: str) -> None:
    timeout = 1.5  # members wait min(5, max(0.5, timeout / 4)) = 0.5 s more for the leader
    x = np.ones(10, np.float32)
    plans = {0: [("allreduce", x)], 1: [("allreduce", x)], 2: [("block",)]}
    with spawn_group(name, plans, nbytes=40, run_dir=run_dir, timeout=timeout) as ranks:
        out = ranks.wait(("done", "error"), [0, 1])
    for r in (0, 1):
        kind, (etype, msg, bad_rank, _) = out[r][0], _error(out[r][1])
        assert kind == "error" and etype == "HostGroupError", out[r]
        assert "rank 2 did not arrive at step 0 (allreduce) within 1.5 s" in msg and bad_rank == 2, msg
    assert _error(out[0][1])[3] >= timeout
    # Rank 1 waits 1.5 + 0.5 s for the leader, then fails on its own ("did not answer"): its error
    # being the leader's report shows that both ranks stopped within that deadline.
    assert "reported by the leader to rank 1" in _error(out[1][1])[1]
    assert _leftovers(name, run_dir) == []


@pytest.mark.parametrize("case", ["shape", "call"])
def test_disagreeing_ranks_fail_everywhere_without_hanging(name: str, run_dir: str, case: str) -> None:
    # As for a dead rank: no deadline of the group's can end a call within the test's wait, so
    # every rank failing with the disagreement shows that none waited for a deadline.
    timeout = 2 * RESULT_WAIT_S
    a, b = np.ones(12, np.float32), np.ones(10, np.float32)
    if case == "shape":
        plans = {0: [("allreduce", a)], 1: [("allreduce", b)], 2: [("allreduce", a)]}
        expect = "rank 0 shape (12,) (48 bytes); rank 1 shape (10,) (40 bytes); rank 2 shape (12,) (48 bytes)"
    else:
        plans = {0: [("allreduce", a)], 1: [("allreduce", a)], 2: [("barrier",)]}
        expect = "rank 2 called barrier, the leader allreduce"
    with spawn_group(name, plans, nbytes=48, run_dir=run_dir, timeout=timeout) as ranks:
        out = ranks.wait(("done", "error"), [0, 1, 2])
    for r in range(3):
        kind, (etype, msg, bad_rank, _) = out[r][0], _error(out[r][1])
        assert kind == "error" and etype == "HostGroupError", out[r]
        assert expect in msg and bad_rank == (1 if case == "shape" else 2), msg
    assert _leftovers(name, run_dir) == []


# ---- in one process: arguments, forming, closing ----

def test_bad_arguments_raise_value_error_before_anything_exists(name: str, run_dir: str) -> None:
    where = os.path.join(run_dir, "never")
    for args, kw in [((name, 3, 3, 8), {}), ((name, -1, 2, 8), {}), ((name, 0, 0, 8), {}), ((name, 0, 5000, 8), {}),
                     ((name, 0, 2, -1), {}), ((name, True, 2, 8), {}), ((name, 0, 2.0, 8), {}),
                     (("../x", 0, 1, 8), {}), (("", 0, 1, 8), {}), ((name, 0, 1, 8), {"timeout": 0}),
                     ((name, 0, 1, 8), {"timeout": float("nan")}), ((name, 0, 1, 8), {"run_dir": "/tmp/" + "d" * 120})]:
        kw.setdefault("run_dir", where)
        with pytest.raises(ValueError):
            HostGroup(*args, **kw)
    assert not os.path.exists(where)
    assert _leftovers(name, run_dir) == []


def test_single_rank_group_and_closed_group(name: str, run_dir: str) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]  # not contiguous: copied in C order
    with HostGroup(name, 0, 1, 64, timeout=2, run_dir=run_dir) as g:
        assert _leftovers(name, run_dir) == []  # formed: names already gone
        assert np.array_equal(g.allreduce(x), x)
        with pytest.raises(TypeError, match="float32"):
            g.allreduce(x.astype(np.float64))
        with pytest.raises(TypeError, match="float32"):
            g.allreduce(x.astype(">f4"))
        with pytest.raises(ValueError, match="nbytes=64"):
            g.allreduce(np.zeros(17, np.float32))
        with pytest.raises(TypeError, match="leader"):
            g.broadcast(None)
        assert g.step == 1  # refused calls changed nothing
        assert np.array_equal(g.reduce_to_leader(x), x)
        assert np.array_equal(g.broadcast(x), x)
        g.barrier()
    assert g.closed
    with pytest.raises(HostGroupError, match="is closed"):
        g.allreduce(x)
    g.close()  # twice is fine
    assert issubclass(HostGroupError, IrdmaError)


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc
    t = threading.Thread(target=main)
    t.start()
    return t, box


def test_join_timeouts_name_the_missing_rank(name: str, run_dir: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(HostGroupError, match=r"ranks 1, 2 of 3 did not join within 0.3 s") as info:
        HostGroup(name, 0, 3, 8, timeout=0.3, run_dir=run_dir)
    assert info.value.rank == 1 and time.monotonic() - t0 < 2
    with pytest.raises(HostGroupError, match=r"no leader \(rank 0\)"):
        HostGroup(name, 1, 2, 8, timeout=0.2, run_dir=run_dir)
    assert _leftovers(name, run_dir) == []


def test_members_disagree_on_nbytes_at_join(name: str, run_dir: str) -> None:
    t, box = _in_thread(lambda: HostGroup(name, 0, 2, 64, timeout=5, run_dir=run_dir))
    with pytest.raises(HostGroupError, match="rank 1 .* has size=2 nbytes=32, the leader size=2 nbytes=64"):
        HostGroup(name, 1, 2, 32, timeout=5, run_dir=run_dir)
    t.join(10)
    assert isinstance(box.get("error"), HostGroupError)
    assert _leftovers(name, run_dir) == []


def test_stale_leftovers_are_removed_and_a_live_leader_is_refused(name: str, run_dir: str) -> None:
    shm = f"/dev/shm/irdma-hier-{os.getuid()}-{name}"
    with open(shm, "wb") as f:
        f.write(b"left by a leader killed while its group formed")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(os.path.join(run_dir, f"{name}.sock"))
    dead.close()  # a socket file nobody listens on
    with HostGroup(name, 0, 1, 8, timeout=2, run_dir=run_dir) as g:
        g.barrier()
    assert _leftovers(name, run_dir) == []

    lock = os.open(os.path.join(run_dir, f"{name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a live leader forming a group of this name does
        with pytest.raises(HostGroupError, match="another leader"):
            HostGroup(name, 0, 1, 8, timeout=2, run_dir=run_dir)
    finally:
        os.close(lock)
        os.unlink(os.path.join(run_dir, f"{name}.lock"))


def test_run_dir_open_to_others_is_refused(name: str, run_dir: str) -> None:
    os.chmod(run_dir, 0o755)
    with pytest.raises(HostGroupError, match="chmod 700"):
        HostGroup(name, 0, 1, 8, timeout=1, run_dir=run_dir)
    assert os.listdir(run_dir) == []


def test_local_rank_and_size() -> None:
    assert local_rank_and_size({}) == (0, 1)
    assert local_rank_and_size({"IRDMA_LOCAL_RANK": "1", "IRDMA_LOCAL_SIZE": " 4 "}) == (1, 4)
    for env, match in [({"IRDMA_LOCAL_RANK": "1"}, "IRDMA_LOCAL_SIZE is not"),
                       ({"IRDMA_LOCAL_SIZE": "2"}, "IRDMA_LOCAL_RANK is not"),
                       ({"IRDMA_LOCAL_RANK": "x", "IRDMA_LOCAL_SIZE": "2"}, "IRDMA_LOCAL_RANK='x'"),
                       ({"IRDMA_LOCAL_RANK": "-1", "IRDMA_LOCAL_SIZE": "2"}, "IRDMA_LOCAL_RANK='-1'"),
                       ({"IRDMA_LOCAL_RANK": "2", "IRDMA_LOCAL_SIZE": "2"}, "not below"),
                       ({"IRDMA_LOCAL_RANK": "0", "IRDMA_LOCAL_SIZE": "0"}, "IRDMA_LOCAL_SIZE='0'")]:
        with pytest.raises(ValueError, match=match):
            local_rank_and_size(env)


def test_one_call_at_a_time(name: str, run_dir: str) -> None:
    t, box = _in_thread(lambda: HostGroup(name, 0, 2, 8, timeout=5, run_dir=run_dir))
    member = HostGroup(name, 1, 2, 8, timeout=5, run_dir=run_dir)
    t.join(10)
    leader = box["value"]
    with leader, member:
        t, box = _in_thread(leader.barrier)  # blocks until the member calls
        wait_until(lambda: leader._busy.locked() or not t.is_alive(), 10, "the leader's barrier to start")
        assert t.is_alive(), box
        with pytest.raises(HostGroupError, match="called while another call runs"):
            leader.barrier()
        member.barrier()
        t.join(10)
        assert "error" not in box and leader.step == member.step == 1


def test_wire_round_trip_and_malformed_messages() -> None:
    for shape in (None, (), (3, 7), (2**40, 1)):
        msg = wire.pack(wire.Kind.REQ, wire.Op.ALLREDUCE, 2, shape, 7, b"tail", extra=9)
        assert wire.unpack(msg) == (wire.Kind.REQ, wire.Op.ALLREDUCE, 2, shape, 7, 9, b"tail")
    err = wire.unpack(wire.pack_error("x" * 5000, "hint", None, None))
    assert err[2] == wire.NONE and err[4] == wire.NO_STEP and len(err[6]) == wire.MAX_TEXT
    good = wire.pack(wire.Kind.DONE, wire.Op.BARRIER, 0, (4,), 1)
    for bad in (good[:31], b"XXXX" + good[4:], good[:4] + bytes([2]) + good[5:], good[:5] + bytes([9]) + good[6:],
                good[:-1]):
        with pytest.raises(ValueError):
            wire.unpack(bad)
