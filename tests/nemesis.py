"""A Jepsen-style nemesis for irdma (issue 20): a seeded schedule of shard faults, writers that
record what they were told, and a checker run on that history after recovery.

How it works:

- **Content.** The bytes of op ``n`` of writer ``stream`` are :func:`content` ``(seed, stream,
  n, length)``: the checker regenerates them, so a history holds no data.
- **History.** Every op is an :class:`Op` with what its writer was told: ``ok`` (acknowledged:
  through the mount ``fsync`` and ``close`` returned 0; natively ``write`` and ``flush``
  returned) or ``failed`` with the error (the bytes may or may not have landed, in part or whole).
- **Writers.** :class:`FuseWriter` writes through a real mount, :class:`NativeWriter` through
  :func:`irdma.connect` with ``assign``. Each owns a few *region files* (fixed size, cut in
  regions that straddle chunk boundaries; an op rewrites one region) and makes a new file per
  op now and then. Between writes each reads one of its regions or files back: a read may fail
  (EIO) while shards are down, but bytes it returns must be allowed by the history.
- **Allowed bytes.** For a region, the last acknowledged op's bytes or, byte by byte, those of
  an unacknowledged op after it (:func:`region_candidates`, :func:`judge`). An acknowledged
  new file must read back whole and exact.
- **Nemesis.** :func:`make_schedule` is a pure function of the seed: episodes of one shard
  killed (SIGKILL) or stopped (SIGSTOP/SIGCONT), two shards failing with overlapping
  windows (every replica of a chain, with 3 shards and 2 replicas) and brought back in either
  order (the stale one first included), a rolling restart (one back but not resynced when the
  other fails), and the whole cluster: ``irdma down``/``irdma up`` or SIGKILL of every shard
  (a power loss) with a restart by hand in a random order. Restarts are by hand on the shard's
  data directory (``irdma server --data-dir``) or by ``irdma up --dir``.
- **Recovery and checking.** :func:`heal` restarts what is down and waits, with a deadline,
  until every shard is up again; then every acknowledged byte is read back through a fresh
  native client and a fresh mount. A read that fails then is a *wedge*.

:func:`run_schedule` does it all for one seed and returns a :class:`Result`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import trio
from irdma.fs.mount import spawn_mount, unmount

import irdma
from irdma.meta import open_meta
from irdma.ops import cluster
from irdma.ops._proc import pid_alive, spawn_detached
from irdma.wire.auth import read_key_file

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 64 * KiB  # small chunks: a file of a few hundred KiB spans every chain
REGION = 48 * KiB  # regions straddle chunk boundaries: one op may touch two chains
REGIONS = 6
REGION_FILES = 3
TIMEOUT = 2.0  # every request's deadline, for the mounts and the native client
SHARDS = 3
REPLICAS = 2
CAPACITY = 128 * MiB
RECOVERY_S = 20.0  # after the schedule: every shard up again within this, else a wedge
FAIL_PAUSE = 0.05  # a writer's pause after a failed op (a client's backoff: no busy loop while all is down)
HANG_S = 30.0  # one op (or a writer's last one, after the schedule) longer than this is a wedge
EXPECTED_ERRNOS = {errno.EIO, errno.ENOSPC, errno.EBUSY, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR}
STREAMS = {"fuse": 1, "native": 2}


def content(seed: int, stream: int, n: int, length: int) -> bytes:
    """The bytes op ``n`` of writer ``stream`` writes in schedule ``seed`` (uniform random)."""
    return np.random.Generator(np.random.PCG64([seed, stream, n])).bytes(length)


# ------------------------------------------------------------------ the history
@dataclass
class Op:
    """One write (or read) and what its writer was told.

    ``kind``: ``region`` (rewrites region ``region`` of a region file; ``setup`` ops too),
    ``file`` (a new file per op), ``read``. ``outcome``: ``ok`` (acknowledged), ``failed``
    (``error`` says how; it may have landed), ``pending`` (never returned: a hang)."""

    stream: str
    n: int
    kind: str
    path: str
    offset: int
    length: int
    region: int | None = None
    outcome: str = "pending"
    error: str = ""
    t0: float = 0.0
    t1: float = 0.0

    def data(self, seed: int) -> bytes:
        return content(seed, STREAMS[self.stream], self.n, self.length)

    def __str__(self) -> str:
        told = self.outcome if not self.error else f"{self.outcome}: {self.error}"
        return f"{self.stream} op {self.n} ({self.kind} {self.path}@{self.offset}+{self.length}, {told})"


def region_candidates(ops: list[Op], path: str, region: int) -> tuple[list[Op], list[Op]]:
    """``(allowed, older)`` for one region, from its writer's ops in order: the last
    acknowledged write and every unacknowledged one after it; and the acknowledged ones before
    (to name a stale read)."""
    mine = [o for o in ops if o.kind == "region" and o.path == path and o.region == region and o.outcome != "pending"]
    last_ok = max((i for i, o in enumerate(mine) if o.outcome == "ok"), default=None)
    if last_ok is None:
        raise AssertionError(f"no acknowledged write of {path} region {region}: the setup must have made one")
    return mine[last_ok:], [o for o in mine[:last_ok] if o.outcome == "ok"]


def judge(got: bytes, allowed: list[Op], older: list[Op], seed: int) -> str | None:
    """None when every byte of ``got`` is that byte of one allowed op; else what is wrong.

    Args:
        got: what a read returned for the op's range (``allowed[0]``'s offset and length).
        allowed: the last acknowledged op first, then unacknowledged ones after it.
        older: acknowledged ops before it (a read equal to one of them is *stale*).
    """
    want = allowed[0]
    if len(got) != want.length:
        return f"{len(got)} bytes read before end of file, {want.length} expected (last acknowledged: {want})"
    g = np.frombuffer(got, np.uint8)
    cands = np.stack([np.frombuffer(o.data(seed), np.uint8) for o in allowed])
    bad = ~(cands == g).any(axis=0)
    if not bad.any():
        return None
    where = np.flatnonzero(bad)
    if not g[bad].any():
        what = "zeros"
    else:
        stale = [o for o in reversed(older) if np.array_equal(np.frombuffer(o.data(seed), np.uint8)[bad], g[bad])]
        what = f"the bytes of older {stale[0]}" if stale else "bytes no op wrote"
    others = f" or the unacknowledged {', '.join(str(o.n) for o in allowed[1:])}" if allowed[1:] else ""
    return (f"{where.size} of {want.length} bytes are {what}, first at +{where[0]}; "
            f"expected last acknowledged {want}{others}")


class History:
    """The ops of one writer, in the order it made them (a writer makes one at a time)."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.ops: list[Op] = []
        self._next = 0

    @property
    def next_n(self) -> int:
        """The number the next op will get."""
        return self._next

    def begin(self, kind: str, path: str, offset: int, length: int, region: int | None = None) -> Op:
        op = Op(self.stream, self._next, kind, path, offset, length, region, t0=time.monotonic())
        self._next += 1
        self.ops.append(op)
        return op

    @staticmethod
    def end(op: Op, error: BaseException | str | None = None) -> None:
        op.t1 = time.monotonic()
        if error is None:
            op.outcome = "ok"
        else:
            op.outcome = "failed"
            op.error = error if isinstance(error, str) else describe(error)

    def count(self, kind: str, outcome: str) -> int:
        return sum(1 for o in self.ops if o.outcome == outcome and (o.kind == kind or (kind == "write" and o.kind != "read")))


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------ the writers
class Writer(threading.Thread):
    """A writer's loop: rewrite a region, write a new file, or read one of its own back, until
    ``stop`` is set. Subclasses do the I/O; ``violations`` gets what a read during the faults
    returned wrong and every error no caller should see."""

    def __init__(self, stream: str, seed: int, stop: threading.Event, violations: list[str]) -> None:
        super().__init__(name=f"nemesis-{stream}", daemon=True)
        self.seed = seed
        self.hist = History(stream)
        self.stop = stop
        self.violations = violations
        self.rng = random.Random(f"{seed}-{stream}")
        self.reads_ok = 0
        self.reads_failed = 0
        self.dir = f"/{stream}"

    def region_files(self) -> list[str]:
        return [f"{self.dir}/r{k}" for k in range(REGION_FILES)]

    # the I/O of a subclass, each raising on failure (OSError or IrdmaError)
    def prepare(self) -> None:
        """Make the writer's directory."""

    def write(self, path: str, offset: int, data: bytes, new: bool) -> None:
        raise NotImplementedError

    def read(self, path: str, offset: int, length: int) -> bytes:
        raise NotImplementedError

    def unexpected(self, exc: BaseException) -> bool:
        """Whether no caller should ever see ``exc`` (not a deadline, EIO, ENOSPC or EBUSY)."""
        raise NotImplementedError

    def setup(self) -> None:
        """Write every region of every region file once (acknowledged, before any fault)."""
        self.prepare()
        for path in self.region_files():
            for r in range(REGIONS):
                op = self.hist.begin("region", path, r * REGION, REGION, r)
                self.write(path, op.offset, op.data(self.seed), new=(r == 0))
                self.hist.end(op)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                x = self.rng.random()
                if x < 0.45:
                    path, r = self.rng.choice(self.region_files()), self.rng.randrange(REGIONS)
                    self._do(self.hist.begin("region", path, r * REGION, REGION, r), new=False)
                elif x < 0.75:
                    path = f"{self.dir}/o{self.hist.next_n}"
                    self._do(self.hist.begin("file", path, 0, self.rng.randint(1, 160 * KiB)), new=True)
                else:
                    self._read_back()
        except BaseException as exc:  # a bug of this module: say so rather than stop writing silently
            self.violations.append(f"the {self.hist.stream} writer crashed: {describe(exc)}")
            raise

    def _slow(self, op: Op) -> None:
        if op.t1 - op.t0 > HANG_S:
            self.violations.append(f"wedge: {op} took {op.t1 - op.t0:.1f} s")

    def _do(self, op: Op, new: bool) -> None:
        try:
            self.write(op.path, op.offset, op.data(self.seed), new)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded; unexpected ones also flagged
            self.hist.end(op, exc)
            if self.unexpected(exc):
                self.violations.append(f"{op}: an error no caller should see")
            self.stop.wait(FAIL_PAUSE)
        else:
            self.hist.end(op)
        self._slow(op)

    def _read_back(self) -> None:
        files = [o for o in self.hist.ops if o.kind == "file" and o.outcome == "ok"]
        older: list[Op]
        if files and self.rng.random() < 0.3:
            allowed, older = [self.rng.choice(files)], []
        else:
            path, r = self.rng.choice(self.region_files()), self.rng.randrange(REGIONS)
            allowed, older = region_candidates(self.hist.ops, path, r)
        want = allowed[0]
        op = self.hist.begin("read", want.path, want.offset, want.length)
        try:
            got = self.read(want.path, want.offset, want.length)
        except Exception as exc:  # noqa: BLE001 - a read may fail while shards are down
            self.hist.end(op, exc)
            self._slow(op)
            self.reads_failed += 1
            if self.unexpected(exc):
                self.violations.append(f"{op}: an error no caller should see")
            self.stop.wait(FAIL_PAUSE)
            return
        self.hist.end(op)
        self._slow(op)
        self.reads_ok += 1
        why = judge(bytes(got), allowed, older, self.seed)
        if why is not None:
            self.violations.append(f"read during the faults of {want.path}@{want.offset}: {why}")


class FuseWriter(Writer):
    """Writes through a mount: open, pwrite, fsync, close; acknowledged when all returned."""

    def __init__(self, mountpoint: str, seed: int, stop: threading.Event, violations: list[str]) -> None:
        super().__init__("fuse", seed, stop, violations)
        self.mnt = mountpoint

    def prepare(self) -> None:
        os.mkdir(self.mnt + self.dir)
        os.setxattr(self.mnt + self.dir, "user.irdma.chunk_size", str(CHUNK).encode())

    def write(self, path: str, offset: int, data: bytes, new: bool) -> None:
        fd = os.open(self.mnt + path, os.O_WRONLY | (os.O_CREAT | os.O_EXCL if new else 0), 0o644)
        try:
            if os.pwrite(fd, data, offset) != len(data):
                raise OSError(errno.EIO, "short write")
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: str, offset: int, length: int) -> bytes:
        """As ``cat`` reads: on until ``length`` bytes, end of file (a short result) or an error."""
        fd = os.open(self.mnt + path, os.O_RDONLY)
        try:
            buf = b""
            while len(buf) < length:
                got = os.pread(fd, length - len(buf), offset + len(buf))
                if not got:
                    break
                buf += got
            return buf
        finally:
            os.close(fd)

    def unexpected(self, exc: BaseException) -> bool:
        return not (isinstance(exc, OSError) and exc.errno in EXPECTED_ERRNOS)


class NativeWriter(Writer):
    """Writes through the native client: ``write(..., op="assign")`` then ``flush()``."""

    def __init__(self, meta_url: str, seed: int, stop: threading.Event, violations: list[str]) -> None:
        super().__init__("native", seed, stop, violations)
        self.client = irdma.connect(meta_url, transport="tcp", timeout=TIMEOUT)

    def prepare(self) -> None:
        self.client.makedirs(self.dir)

    def write(self, path: str, offset: int, data: bytes, new: bool) -> None:
        self.client.write(path, data, offset, op="assign", chunk_size=CHUNK)
        self.client.flush()

    def read(self, path: str, offset: int, length: int) -> bytes:
        return bytes(self.client.read(path, offset, length))

    def unexpected(self, exc: BaseException) -> bool:
        return not isinstance(exc, (irdma.ShardUnavailable, irdma.DataLost, irdma.NoSpace, irdma.Busy))

    def close(self) -> None:
        self.client.close()


# ------------------------------------------------------------------ the schedule
@dataclass(frozen=True)
class Step:
    """One act of the nemesis, then ``pause`` seconds (a fault's duration) before the next.

    ``action``: ``kill`` (SIGKILL), ``stop`` (SIGSTOP), ``cont`` (SIGCONT), ``restart`` (by
    hand on the shard's data directory), ``up`` (``irdma up --dir``: every dead shard),
    ``down`` (``irdma down --dir``), ``kill-all`` (SIGKILL every shard)."""

    action: str
    shard: int | None
    pause: float

    def __str__(self) -> str:
        return f"{self.action}{'' if self.shard is None else f' {self.shard}'} +{self.pause:.1f}s"


def _fault(rng: random.Random, shard: int) -> list[Step]:
    """A shard killed or stopped (short, or past the request deadline)."""
    if rng.random() < 0.5:
        return [Step("kill", shard, rng.uniform(0.2, 1.0))]
    return [Step("stop", shard, rng.choice([rng.uniform(0.2, 1.0), rng.uniform(TIMEOUT + 0.2, TIMEOUT + 0.6)]))]


def _recover(rng: random.Random, fault: Step, others_stopped: bool) -> Step:
    if fault.action == "stop":
        return Step("cont", fault.shard, rng.uniform(0.2, 0.8))
    # `irdma up` resyncs after the restart, which waits its deadline on a stopped shard: by hand then
    how = "restart" if others_stopped or rng.random() < 0.7 else "up"
    return Step(how, fault.shard if how == "restart" else None, rng.uniform(0.2, 0.8))


def _episode(kind: str, rng: random.Random, shards: list[int]) -> list[Step]:
    if kind == "one":
        f = _fault(rng, rng.choice(shards))
        return [*f, _recover(rng, f[0], False)]
    if kind == "chain":  # both replicas of a chain down at once, back in either order
        a, b = rng.sample(shards, 2)
        fa, fb = _fault(rng, a)[0], _fault(rng, b)[0]
        first, second = (fa, fb) if rng.random() < 0.5 else (fb, fa)
        r1 = _recover(rng, first, second.action == "stop")
        steps = [fa, fb, r1]
        if r1.action != "up" or second.action == "stop":  # `up` brought back every dead shard
            steps.append(_recover(rng, second, False))
        return steps
    if kind == "rolling":  # one back (not resynced yet) when the other fails
        a, b = rng.sample(shards, 2)
        fa = _fault(rng, a)[0]
        back = _recover(rng, fa, False)
        back = dataclasses.replace(back, pause=rng.uniform(0.0, 0.3))
        fb = _fault(rng, b)[0]
        return [fa, back, fb, _recover(rng, fb, False)]
    if kind == "down-up":
        return [Step("down", None, rng.uniform(0.2, 1.0)), Step("up", None, rng.uniform(0.2, 0.8))]
    assert kind == "power-loss"
    steps = [Step("kill-all", None, rng.uniform(0.2, 1.0))]
    if rng.random() < 0.5:
        return [*steps, Step("up", None, rng.uniform(0.2, 0.8))]
    return steps + [Step("restart", s, rng.uniform(0.0, 0.5)) for s in rng.sample(shards, len(shards))]


#: the episodes that fill a schedule after its first chain failure, by weight
EPISODES = {"one": 2, "chain": 2, "rolling": 2, "down-up": 1, "power-loss": 1}
WHOLE_CLUSTER = 0.3  # the share of schedules given a whole-cluster episode whatever their length


def make_schedule(seed: int, seconds: float, shards: list[int]) -> list[Step]:
    """The nemesis's steps for ``seed`` (a pure function of the arguments): one episode that
    takes every replica of a chain away, for :data:`WHOLE_CLUSTER` of the seeds one of the whole
    cluster (``down``/``up`` or a power loss), and more episodes until their pauses add up to
    ``seconds``; in a random order."""
    rng = random.Random(f"irdma-nemesis-{seed}")
    plan = [_episode("chain", rng, shards)]
    if rng.random() < WHOLE_CLUSTER:
        # (`irdma down` with live mounts is slow: it waits out the shards' SIGTERM grace)
        plan.append(_episode(rng.choices(["down-up", "power-loss"], [1, 2])[0], rng, shards))
    while sum(s.pause for ep in plan for s in ep) < seconds:
        plan.append(_episode(rng.choices(list(EPISODES), list(EPISODES.values()))[0], rng, shards))
    rng.shuffle(plan)
    return [s for ep in plan for s in ep]


# ------------------------------------------------------------------ the cluster and its faults
def irdma_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "irdma.ops.cli", *args], capture_output=True, text=True, timeout=timeout)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


class LocalCluster:
    """A local cluster of ``irdma up`` whose shards this test may kill, stop and restart.

    Signals go only to pids that are shard servers of this cluster (their command line names
    its shard id and data directory: a reused pid is never signalled). :meth:`close` stops
    everything this cluster started, also after a failure, and is safe to call twice."""

    def __init__(self, directory: str, shards: int = SHARDS, capacity: int = CAPACITY, replicas: int = REPLICAS) -> None:
        self.dir = directory
        self.meta_url = cluster.up(directory, shards, capacity, fresh=True, replicas=replicas)
        self.ids = [s.shard_id for s in cluster.read_state(directory)]
        self.addresses = {s.shard_id: s.address for s in cluster.read_state(directory)}
        self.stopped: set[int] = set()
        self.started: set[int] = set()  # every shard pid ever seen here (for close)
        self.log: list[str] = []
        self._t0 = time.monotonic()
        self.pids()

    def note(self, msg: str) -> None:
        self.log.append(f"{time.monotonic() - self._t0:6.2f}s {msg}")

    def pids(self) -> dict[int, int]:
        """The live shard processes by shard id (from ``cluster.json``, checked)."""
        out = {}
        for s in cluster.read_state(self.dir):
            if self.is_shard(s.pid, s.shard_id):
                out[s.shard_id] = s.pid
                self.started.add(s.pid)
        return out

    def is_shard(self, pid: int, shard_id: int) -> bool:
        args = _cmdline(pid)
        return (pid_alive(pid) and "server" in args and "--shard-id" in args
                and args[args.index("--shard-id") + 1] == str(shard_id)
                and cluster.shard_dir(self.dir, shard_id) in args)

    def dead(self) -> list[int]:
        alive = self.pids()
        return [s for s in self.ids if s not in alive]

    def kill(self, shard_id: int) -> None:
        pid = self.pids().get(shard_id)
        if pid is None:
            self.note(f"kill {shard_id}: not running")
            return
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: not pid_alive(pid), 10, f"shard {shard_id} (pid {pid}) to die")
        self.stopped.discard(shard_id)
        self.note(f"killed shard {shard_id} (pid {pid})")

    def signal(self, shard_id: int, sig: signal.Signals) -> None:
        pid = self.pids().get(shard_id)
        if pid is None:
            self.note(f"{sig.name} {shard_id}: not running")
            return
        os.kill(pid, sig)
        (self.stopped.add if sig == signal.SIGSTOP else self.stopped.discard)(shard_id)
        self.note(f"{sig.name} to shard {shard_id} (pid {pid})")

    def cont_all(self) -> None:
        for sid in sorted(self.stopped):
            self.signal(sid, signal.SIGCONT)

    def restart(self, shard_id: int) -> int:
        """Start shard ``shard_id`` again by hand on its data directory, as an operator would
        (``irdma server --data-dir``), and record it in ``cluster.json`` for ``irdma up``/``down``.
        Returns at once: the shard answers within a second or two."""
        if shard_id in self.pids():
            self.note(f"restart {shard_id}: already running")
            return self.pids()[shard_id]
        log = os.path.join(self.dir, "logs", f"shard-{shard_id}.log")
        pid = spawn_detached(["-m", "irdma.ops.cli", "server", "--listen", self.addresses[shard_id],
                              "--shard-id", str(shard_id), "--transport", "tcp",
                              "--data-dir", cluster.shard_dir(self.dir, shard_id),
                              "--key-file", cluster.key_file_of(self.dir)], log)
        self.started.add(pid)
        procs = {s.shard_id: s for s in cluster.read_state(self.dir)}
        procs[shard_id] = cluster.ShardProc(shard_id, self.addresses[shard_id], pid, log)
        cluster._write_state(self.dir, [procs[k] for k in sorted(procs)])
        self.note(f"restarted shard {shard_id} by hand on its data directory (pid {pid})")
        return pid

    def wait_answering(self, shard_ids: list[int], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        key = read_key_file(cluster.key_file_of(self.dir))
        for sid in shard_ids:
            trio.run(cluster.wait_for_shard, self.addresses[sid], "tcp", deadline, self.pids().get(sid), key)

    def up(self) -> subprocess.CompletedProcess[str]:
        """``irdma up --dir``: starts every dead shard again (and resyncs)."""
        res = irdma_cli("up", "--dir", self.dir)
        self.pids()
        self.note(f"irdma up: exit {res.returncode}" + _tail(res))
        return res

    def down(self) -> subprocess.CompletedProcess[str]:
        """``irdma down --dir --force`` (stopped shards are continued first: they could not stop;
        --force: the writers' mounts stay live through the episode, which down refuses without it)."""
        self.cont_all()
        res = irdma_cli("down", "--dir", self.dir, "--force")
        self.note(f"irdma down: exit {res.returncode}" + _tail(res))
        return res

    def kill_all(self) -> None:
        for sid in self.ids:
            self.kill(sid)

    def apply(self, step: Step) -> None:
        self.note(f"step: {step}")
        if step.action == "kill":
            self.kill(step.shard)  # type: ignore[arg-type]
        elif step.action == "stop":
            self.signal(step.shard, signal.SIGSTOP)  # type: ignore[arg-type]
        elif step.action == "cont":
            self.signal(step.shard, signal.SIGCONT)  # type: ignore[arg-type]
        elif step.action == "restart":
            self.restart(step.shard)  # type: ignore[arg-type]
        elif step.action == "up":
            if self.dead():
                self.up()
        elif step.action == "down":
            self.down()
        elif step.action == "kill-all":
            self.kill_all()
        else:
            raise ValueError(f"unknown step {step}")

    def health(self) -> dict[int, str]:
        with contextlib.closing(open_meta(self.meta_url)) as m:
            return {r.shard_id: r.health for r in m.shards() if r.state != "removed"}

    def close(self) -> None:
        for pid in self.started:
            with contextlib.suppress(ProcessLookupError):
                if pid_alive(pid):
                    os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(Exception):
            cluster.down(self.dir)
        for pid in self.started:
            if pid_alive(pid) and "server" in _cmdline(pid) and self.dir in " ".join(_cmdline(pid)):
                os.kill(pid, signal.SIGKILL)
        self.started.clear()


def _tail(res: subprocess.CompletedProcess[str]) -> str:
    lines = [ln.strip() for ln in (res.stderr + res.stdout).splitlines() if "did not" in ln or "rror" in ln]
    return f" ({'; '.join(lines[-2:])})" if lines else ""


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def mounted(meta_url: str, mountpoint: str) -> Iterator[int]:
    """A real mount (request deadline :data:`TIMEOUT`) in a child process; unmounted on exit,
    its process killed if the unmount fails. Its log (``MOUNTPOINT.log``) is not judged here:
    faults make it warn."""
    os.makedirs(mountpoint, exist_ok=True)
    pid = spawn_mount(meta_url, mountpoint, transport="tcp", log_file=mountpoint.rstrip("/") + ".log",
                      request_timeout=TIMEOUT)
    try:
        yield pid
    finally:
        try:
            unmount(mountpoint, timeout=20)
        except Exception:  # noqa: BLE001 - a hung mount: end it, then detach the mountpoint
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True)
        _wait(lambda: not pid_alive(pid), 20, f"mount process {pid} to exit")


async def _resync_and_health(meta_url: str) -> dict[int, str]:
    async with irdma.Client.open(meta_url, transport="tcp", timeout=TIMEOUT) as c:
        await c.shard_stats()  # as `irdma shard resync`: a shard found answering is syncing
        await c.resync_all()
        return {r.shard_id: r.health for r in await c.meta.shards() if r.state != "removed"}


def heal(lc: LocalCluster, timeout: float = RECOVERY_S) -> str | None:
    """Continue stopped shards, restart dead ones (``irdma up --dir``), then resync (what
    ``irdma shard resync`` does; a live mount's heartbeat does it too) until every shard is up,
    at most ``timeout`` seconds.
    Returns None once recovered, else the shards' health at the deadline."""
    lc.cont_all()
    if lc.dead():
        lc.up()
    deadline = time.monotonic() + timeout
    health: dict[int, str] = {}
    while time.monotonic() < deadline:
        try:
            health = trio.run(_resync_and_health, lc.meta_url)
        except irdma.IrdmaError as exc:
            health = {-1: describe(exc)}
        if health and all(h == "up" for h in health.values()):
            lc.note("recovered: every shard up")
            return None
        time.sleep(0.2)
    return f"shards still not up after {timeout:g} s: {health}"


# ------------------------------------------------------------------ the checker
def check_history(ops: list[Op], seed: int, read: Callable[[str], bytes], via: str) -> tuple[list[str], int]:
    """Read every acknowledged byte of ``ops`` back with ``read(path)`` (the whole file);
    returns the violations and the bytes checked."""
    out: list[str] = []
    checked = 0
    by_path: dict[str, bytes | BaseException] = {}

    def whole(path: str) -> bytes | BaseException:
        if path not in by_path:
            try:
                by_path[path] = read(path)
            except Exception as exc:  # noqa: BLE001 - each failure is a violation below
                by_path[path] = exc
        return by_path[path]

    regions = sorted({(o.path, o.region) for o in ops if o.kind == "region" and o.region is not None})
    for path, region in regions:
        allowed, older = region_candidates(ops, path, region)  # type: ignore[arg-type]
        got = whole(path)
        if isinstance(got, BaseException):
            continue
        if region == 0 and len(got) != REGIONS * REGION:  # (said once per file)
            out.append(f"{via}: {path} is {len(got)} bytes long, {REGIONS * REGION} were acknowledged")
        want = allowed[0]
        why = judge(got[want.offset:want.offset + want.length], allowed, older, seed)
        checked += want.length
        if why is not None:
            out.append(f"{via}: {path} region {region}: {why}")
    for o in ops:
        if o.kind == "file" and o.outcome == "ok":
            got = whole(o.path)
            if isinstance(got, BaseException):
                continue
            checked += o.length
            if got != o.data(seed):
                why = judge(got, [o], [], seed) or "differs"
                out.append(f"{via}: acknowledged new file {o.path}: {why}")
        elif o.kind == "file" and o.outcome == "failed":
            # unacknowledged: absent, unreadable, or a prefix of its bytes (a size counts only
            # stored bytes), never zeros or bytes it did not write
            try:
                part = read(o.path)
            except Exception:  # noqa: BLE001 - it may have failed in any way
                continue
            if len(part) > o.length or part != o.data(seed)[:len(part)]:
                why = judge(part, [dataclasses.replace(o, length=len(part))], [], seed) or "longer than written"
                out.append(f"{via}: unacknowledged new file {o.path} holds what it was not given: {why}")
    for path, got in sorted(by_path.items()):
        if isinstance(got, BaseException):
            lost = isinstance(got, (FileNotFoundError, irdma.NotFound))
            kind = "lost: the acknowledged file is gone" if lost else "wedge: read failed after recovery"
            out.append(f"{via}: {kind}: {path}: {describe(got)}")
    return out, checked


# ------------------------------------------------------------------ one schedule, end to end
@dataclass
class Result:
    seed: int
    seconds: float
    steps: list[Step]
    violations: list[str] = field(default_factory=list)
    writers: list[Writer] = field(default_factory=list)
    bytes_checked: int = 0
    log: list[str] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    workdir: str = ""

    def summary(self) -> str:
        parts = []
        for w in self.writers:
            h = w.hist
            parts.append(f"{h.stream}: {h.count('write', 'ok')} writes acked, {h.count('write', 'failed')} failed"
                         f"{', ' + str(h.count('write', 'pending')) + ' hung' if h.count('write', 'pending') else ''}"
                         f", reads during faults {w.reads_ok} ok / {w.reads_failed} failed")
        t = ", ".join(f"{k} {v:.1f}s" for k, v in self.times.items())
        return (f"nemesis seed {self.seed} ({self.seconds:g} s of faults, {len(self.steps)} steps): "
                f"{'; '.join(parts)}; {self.bytes_checked / MiB:.1f} MiB of acknowledged bytes checked; "
                f"{len(self.violations)} violations; {t}")

    def report(self, limit: int | None = 40) -> str:
        env = f"NEMESIS_SEED={self.seed} NEMESIS_SECONDS={self.seconds:g}"
        return "\n".join([
            self.summary(),
            f"reproduce: {env} .venv/bin/python -m pytest -q tests/test_nemesis.py -k test_nemesis_schedule",
            "schedule: " + ", ".join(str(s) for s in self.steps),
            "violations:", *(f"  seed {self.seed}: {v}" for v in self.violations[:limit]),
            *([f"  ... and {len(self.violations) - limit} more (all in report.txt)"]
              if limit is not None and len(self.violations) > limit else []),
            "what the nemesis did:", *(f"  {line}" for line in self.log),
            *([f"cluster, mounts and logs kept in {self.workdir}"] if self.violations else []),
        ])


def run_schedule(seed: int, seconds: float, workdir: str) -> Result:
    """Run schedule ``seed`` against a new local cluster in ``workdir`` and check its history.

    Everything started is stopped on return, also on an error. With violations, the report is
    also written to ``workdir/report.txt``, and every op of the history (start and end in
    seconds from the start, what its writer was told) to ``workdir/history.txt``."""
    t0 = time.monotonic()
    res = Result(seed, seconds, [], workdir=workdir)
    lc = LocalCluster(os.path.join(workdir, "c"))
    stop = threading.Event()
    try:
        res.steps = make_schedule(seed, seconds, lc.ids)
        with mounted(lc.meta_url, os.path.join(workdir, "m")) as mount_pid:
            fw = FuseWriter(os.path.join(workdir, "m"), seed, stop, res.violations)
            nw = NativeWriter(lc.meta_url, seed, stop, res.violations)
            res.writers = [fw, nw]
            try:
                for w in res.writers:
                    w.setup()
                res.times["setup"] = time.monotonic() - t0
                t1 = time.monotonic()
                for w in res.writers:
                    w.start()
                for step in res.steps:
                    lc.apply(step)
                    time.sleep(step.pause)  # the fault's duration
                res.times["faults"] = time.monotonic() - t1
            finally:
                stop.set()
                for w in res.writers:
                    if w.is_alive():
                        w.join(HANG_S)
                    if w.is_alive():
                        pending = [o for o in w.hist.ops if o.outcome == "pending"]
                        res.violations.append(f"wedge: the {w.hist.stream} writer did not return from "
                                              f"{pending[-1] if pending else 'its last op'} in {HANG_S:g} s")
                nw.close()
            if not pid_alive(mount_pid):
                res.violations.append("the writers' mount process died")
            t2 = time.monotonic()
            why = heal(lc)  # with the writers' mount still up: its heartbeat resyncs as well
            res.times["recovery"] = time.monotonic() - t2
            if why is not None:
                res.violations.append(f"wedge: {why}")
        t3 = time.monotonic()
        with irdma.connect(lc.meta_url, transport="tcp", timeout=TIMEOUT) as c:
            for w in res.writers:
                bad, n = check_history(w.hist.ops, seed, lambda p: bytes(c.read(p)), "native client")
                res.violations += bad
                res.bytes_checked += n
        fresh = os.path.join(workdir, "fresh")
        with mounted(lc.meta_url, fresh):
            for w in res.writers:
                def read(p: str) -> bytes:
                    with open(fresh + p, "rb") as f:
                        return f.read()
                bad, n = check_history(w.hist.ops, seed, read, "fresh mount")
                res.violations += bad
                res.bytes_checked += n
        res.times["check"] = time.monotonic() - t3
    finally:
        stop.set()
        lc.close()
        res.log = lc.log
        res.times["total"] = time.monotonic() - t0
    if res.violations:
        with open(os.path.join(workdir, "report.txt"), "w") as f:
            f.write(res.report(limit=None) + "\n")
        with open(os.path.join(workdir, "history.txt"), "w") as f:  # every op, as its writer was told
            for w in res.writers:
                f.writelines(f"{o.t0 - t0:8.3f} {o.t1 - t0:8.3f} {o}\n" for o in w.hist.ops)
    return res
