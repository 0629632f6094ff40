"""``irdma run``: start N workers of a training script on one job, as ``horovodrun -np N`` and
``torchrun --nproc-per-node N`` do.

What the launcher does, in order:

1. The namespace: ``--meta URL`` (or ``$IRDMA_META``) names a running one; without it a local
   cluster is started in a temporary directory (``--shards`` shard processes, ``--capacity``
   each) and removed at the end (:func:`irdma.ops.cluster.up`).
2. The job directory ``/jobs/NAME`` (``--job``; a new name by default) with its settings as
   xattrs: ``user.irdma.workers`` = N and ``user.irdma.consistency`` (``--consistency``: bsp,
   ssp:K or asp; :mod:`irdma.train.coord`).
3. N worker processes of the command, each with in its environment:

   ============================  ==============================================================
   ``IRDMA_RANK``                this worker's rank, 0 .. N-1 (Horovod's ``rank()``)
   ``IRDMA_SIZE``                N (Horovod's ``size()``)
   ``IRDMA_LOCAL_RANK``/``_SIZE``  the same on one host
   ``IRDMA_META``                the metadata URL (:func:`irdma.connect`'s argument)
   ``IRDMA_JOB``                 the job directory's path in the namespace
   ``IRDMA_KEY_FILE``            the cluster's key file, when the launcher knows it
   ============================  ==============================================================

   Each line a worker prints goes to the launcher's stdout or stderr prefixed with ``[RANK]``.
4. Supervision: SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to every worker's
   process group (each worker runs in a session of its own, so a terminal's Ctrl-C reaches it
   once, through the launcher, and its own children too; a signal that comes while workers are
   starting stops the starting and reaches those started). Each worker gets SIGKILL if the
   launcher dies (``PR_SET_PDEATHSIG``, prctl(2)). When a worker exits (whatever its status),
   what is left of its process group (its children: a ``sleep``, data loaders) gets SIGTERM at
   once and SIGKILL ``--grace`` seconds later, so nothing it started in its group outlives it,
   re-parented to init (a process that left the worker's session with setsid(2), a daemon, is
   its own); its death is reported at once, after every line it wrote (its children may hold
   its pipes: their lines go on being copied). When a worker exits with a non-zero status,
   the launcher says which rank and how, stops the others (SIGTERM, then SIGKILL after
   ``--grace`` seconds) and exits with that worker's status (128 + N for a signal N, as a shell
   does). When every worker exits 0, so does the launcher, unless a signal stopped the job:
   then 128 + that signal (a preempted job is not a success). A signal that comes while the
   launcher stops the job (a second Ctrl-C, a SIGTERM during ``--grace``) kills whatever is
   left at once, as does any signal for what is left of a worker that exited: nothing of the
   workers' groups outlives the launcher.
5. ``IRDMA_RUN_ID``, new for every launch, names this run's barriers
   (:func:`irdma.keras.init`), so the arrivals of a killed earlier run of the same job never
   count for this one.
6. ``--elastic MIN:MAX`` (Horovod Elastic's ``--min-np``/``--max-np``, torchrun's ``--nnodes``
   range): the job directory gets ``user.irdma.elastic`` = ``MIN:MAX`` and ``user.irdma.workers``
   = MAX (:mod:`irdma.train.coord`: clock waits count only the live workers, never fewer than
   MIN). A worker that fails is started again with the same rank, up to ``--max-restarts``
   times in all (``IRDMA_RESTART`` counts its restarts); it rejoins the job at its current
   clock, epoch and weights (:mod:`irdma.train.distributed`) while the others go on. A worker
   that fails once the restarts are spent is left out: the others go on (while at least MIN
   live) and the launcher's exit status is that worker's.
7. ``--hosts HOST:SLOTS,...`` (horovodrun's ``-H``): ranks fill the hosts in order, each host
   up to its slots (``IRDMA_LOCAL_RANK``/``_SIZE`` count the ranks of one host). A worker on
   ``localhost`` starts as above; on another host through ``--rsh``: ``ssh`` (``ssh -o
   BatchMode=yes HOST 'cd CWD && env IRDMA_...=... COMMAND'``: the same paths on every host, a
   key-based login) or ``netns`` (``nsenter --net=/run/netns/HOST``: the network namespaces of
   :mod:`irdma.ops.testbed`, the same code path for tests). Every host must reach the
   namespace: ``--meta`` with a PostgreSQL URL (the launcher's local cluster serves this host
   only; keep its password in ``~/.pgpass``, not in the URL: the remote command line shows the
   URL), and the key file at the same path. ``ssh -tt`` gives the remote worker a terminal, so
   it gets SIGHUP when its ``ssh`` is stopped (a signal for the job, the launcher stopping the
   others); in a namespace the signal reaches it directly. An elastic job restarts no worker
   once another finished (exit 0): the job is ending.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import queue
import select
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from .._errors import InvalidArgument, IrdmaError

#: The environment variables a worker gets (see the module docstring).
RANK_ENV, SIZE_ENV, JOB_ENV, META_ENV = "IRDMA_RANK", "IRDMA_SIZE", "IRDMA_JOB", "IRDMA_META"
LOCAL_RANK_ENV, LOCAL_SIZE_ENV, KEY_FILE_ENV = "IRDMA_LOCAL_RANK", "IRDMA_LOCAL_SIZE", "IRDMA_KEY_FILE"
RUN_ID_ENV, RESTART_ENV = "IRDMA_RUN_ID", "IRDMA_RESTART"
#: Where job directories live in the namespace.
JOBS_DIR = "/jobs"
#: Signals forwarded to the workers.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


_prctl: Any
try:  # resolved here, in the launcher: the child between fork and exec only calls it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In the child: SIGKILL when the launcher dies (prctl(2) PR_SET_PDEATHSIG)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell's exit status: 128 + N for a signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    """``exited with status 3`` or ``was killed by SIGKILL``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


@dataclass
class Worker:
    """One worker process and its rank (``restart``: how many times this rank was restarted)."""

    rank: int
    proc: subprocess.Popen[bytes]
    readers: list[_Reader] = field(default_factory=list)
    restart: int = 0
    #: set once the worker exited and was reaped (``proc.returncode`` is its status); only its
    #: reaper thread reaps it, after signalling its group: the pid, the group's id, named only
    #: them until then. Held while a thread signals its group or reaps it.
    reaped: threading.Event = field(default_factory=threading.Event)
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: set once the worker was reaped and nothing is left of its process group
    group_gone: threading.Event = field(default_factory=threading.Event)


class _Output:
    """Lines from the workers, each prefixed with its rank, written whole (one lock per stream)."""

    def __init__(self, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.streams = {1: stdout, 2: stderr}
        self.lock = threading.Lock()

    def write(self, fd: int, data: bytes) -> None:
        """``data`` (whole lines) to the launcher's stream ``fd``; dropped when that stream is
        gone (``irdma run ... | head``, a closed terminal)."""
        with self.lock, contextlib.suppress(OSError, ValueError):
            self.streams[fd].write(data)
            self.streams[fd].flush()


class _Reader:
    """One pipe of a worker (its stdout or stderr, which its children may hold too), copied line
    by line to the launcher's stream, each line prefixed with the rank, by a thread of its own
    until every writer closed it. When the launcher's own output breaks the lines are dropped,
    but the pipe is still drained: a worker never blocks on a full pipe.

    :meth:`drain` copies what the pipe holds now: called once the worker exited, every line it
    wrote is out when it returns (its last words come before the verdict), whoever else still
    holds the pipe; no deadline is involved."""

    def __init__(self, out: _Output, rank: int, pipe: IO[bytes], fd: int) -> None:
        self.out, self.pipe, self.fd = out, pipe, fd
        self.prefix = f"[{rank}] ".encode()
        self.raw = pipe.fileno()
        os.set_blocking(self.raw, False)  # read only what is there: drain() must never block
        self.lock = threading.Lock()  # one reader of the pipe at a time, its lines in order
        self.partial = b""  # the start of a line whose end has not come yet
        self.closed = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"irdma-run-{rank}-{fd}")
        self.thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.raw, select.POLLIN)
        eof = False
        while not eof:
            poller.poll()  # no deadline: until the pipe has data or its last writer closed it
            with self.lock:
                eof = self._read() == 0
        with self.lock:
            self._flush()
            self.closed = True
            self.pipe.close()

    def drain(self) -> None:
        """Copy what the pipe holds now, and a last line without its newline (see the class):
        a bounded amount, however fast the worker's children go on writing."""
        with self.lock:
            if self.closed:
                return
            pending = struct.unpack("i", fcntl.ioctl(self.raw, termios.FIONREAD, b"\0" * 4))[0]
            while pending > 0:
                got = self._read(min(pending, 1 << 16))
                if got <= 0:
                    break
                pending -= got
            self._flush()

    def _read(self, limit: int = 1 << 16) -> int:
        """Copy the whole lines of one read of at most ``limit`` bytes; the bytes read (0: every
        writer closed the pipe; -1: it is empty now). Called with the lock held."""
        try:
            data = os.read(self.raw, limit)
        except BlockingIOError:
            return -1  # drain() took what the poll saw
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if lines:
            self.out.write(self.fd, b"".join(self.prefix + ln.removesuffix(b"\r") + b"\n" for ln in lines))
        return len(data)

    def _flush(self) -> None:
        """The partial line, unterminated (a worker's last line), as a whole line."""
        if self.partial:
            self.out.write(self.fd, self.prefix + self.partial.removesuffix(b"\r") + b"\n")
            self.partial = b""


#: How a worker starts on another host (``--rsh``).
RSH = ("ssh", "netns")
LOCALHOSTS = ("localhost", "127.0.0.1")


def parse_hosts(text: str | None, n: int) -> list[str]:
    """The host of each rank 0 .. n-1 from ``HOST:SLOTS,...`` (ranks fill the hosts in order);
    every rank on ``localhost`` when ``text`` is None.

    Raises:
        InvalidArgument: a malformed entry, or fewer slots than workers.
    """
    if text is None:
        return ["localhost"] * n
    out: list[str] = []
    for entry in text.split(","):
        host, colon, slots = entry.strip().rpartition(":")
        if not colon:
            host, slots = entry.strip(), "1"
        if not host or not slots.isdigit() or int(slots) < 1 or any(c.isspace() or c in "'\"" for c in host):
            raise InvalidArgument(f"--hosts entry {entry!r}", "write HOST:SLOTS, e.g. --hosts node1:2,node2:2")
        out += [host] * int(slots)
    if len(out) < n:
        raise InvalidArgument(f"-n {n} but --hosts {text} has {len(out)} slots", "add slots or hosts, or lower -n")
    return out[:n]


def local_ranks(hosts: list[str]) -> list[tuple[int, int]]:
    """``(local rank, local size)`` of each rank: its place among the ranks of its host."""
    seen: dict[str, int] = {}
    out = []
    for h in hosts:
        out.append(seen.get(h, 0))
        seen[h] = seen.get(h, 0) + 1
    return [(r, seen[h]) for r, h in zip(out, hosts, strict=True)]


def remote_argv(rsh: str, host: str, env: dict[str, str], command: Sequence[str]) -> list[str]:
    """The command that runs ``command`` on ``host`` with ``env`` added to its environment
    (see the module docstring)."""
    assign = [f"{k}={v}" for k, v in sorted(env.items())]
    if rsh == "netns":
        return ["nsenter", f"--net=/run/netns/{host}", "--", "env", *assign, *command]
    remote = f"cd {shlex.quote(os.getcwd())} && {shlex.join(['env', *assign, *command])}"
    # -tt: a terminal on the remote side, so that the worker gets SIGHUP when its ssh ends
    # (a signal for the job, the launcher stopping it); its stderr then comes with its stdout
    return ["ssh", "-tt", "-o", "BatchMode=yes", host, remote]


@dataclass
class Job:
    """Where the workers of one run train: the namespace and the job directory in it."""

    meta_url: str
    path: str
    key_file: str | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


def check_args(n: int, command: Sequence[str], consistency: str | None,
               elastic: str | None = None) -> tuple[int, int] | None:
    """Refuse bad arguments before anything starts; the parsed ``--elastic`` range (or None).

    Raises:
        InvalidArgument: N below 1, no command, a consistency model or elastic range that does
            not parse, N outside the elastic range.
    """
    if n < 1:
        raise InvalidArgument(f"-n {n}: a job needs at least one worker", "pass -n N with N >= 1")
    bounds = None
    if elastic is not None:
        from ..train.coord import parse_elastic

        bounds = parse_elastic(elastic)
        if not bounds[0] <= n <= bounds[1]:
            raise InvalidArgument(f"-n {n} is outside --elastic {elastic}", f"start between {bounds[0]} and"
                                  f" {bounds[1]} workers, or widen the range")
    if not command:
        raise InvalidArgument("no command to run", "irdma run -n 2 -- python train.py")
    if consistency is not None:
        from ..train.coord import parse_consistency

        try:
            parse_consistency(consistency)
        except ValueError as exc:
            raise InvalidArgument(f"--consistency {consistency}: {exc}", "pass bsp, ssp:K or asp") from None
    return bounds


def new_job_name() -> str:
    """A job name unique on this host: ``job-YYYYmmdd-HHMMSS-PID``."""
    return time.strftime("job-%Y%m%d-%H%M%S-") + str(os.getpid())


def prepare_job(meta_url: str, name: str, workers: int, consistency: str | None, key_file: str | None,
                elastic: tuple[int, int] | None = None) -> Job:
    """Make ``/jobs/NAME`` (kept if it exists: a job run again resumes in it, with its clocks
    and membership reset) and write its ``user.irdma.workers`` (MAX of an elastic job), ``user.irdma.elastic`` (removed when not
    elastic) and, when given, ``user.irdma.consistency``.

    Raises:
        InvalidArgument: a name with a slash; IrdmaError: the namespace cannot be reached.
    """
    if not name or "/" in name or name in (".", ".."):
        raise InvalidArgument(f"--job {name!r}: a job name is one path component", "pass --job NAME, e.g. digits")
    import stat

    from .._errors import NoAttribute, NotFound
    from ..meta import open_meta
    from ..train.coord import XATTR_CONSISTENCY, XATTR_ELASTIC, XATTR_WORKERS

    path = f"{JOBS_DIR}/{name}"
    with contextlib.closing(open_meta(meta_url)) as meta:
        ino = 1
        for part in path.strip("/").split("/"):
            try:
                ino = meta.lookup(ino, part.encode()).ino
            except NotFound:
                ino = meta.create(ino, part.encode(), stat.S_IFDIR | 0o755, os.getuid(), os.getgid()).ino
        from ..meta.sql import SqlMeta

        assert isinstance(meta, SqlMeta)  # every engine open_meta makes
        meta.clock_reset(ino)  # a new run: its workers join afresh (the weights stay: it resumes)
        meta.setxattr(ino, XATTR_WORKERS, str(elastic[1] if elastic else workers).encode())
        if elastic is not None:
            meta.setxattr(ino, XATTR_ELASTIC, f"{elastic[0]}:{elastic[1]}".encode())
        else:
            with contextlib.suppress(NoAttribute):
                meta.removexattr(ino, XATTR_ELASTIC)
        if consistency is not None:
            meta.setxattr(ino, XATTR_CONSISTENCY, consistency.encode())
    return Job(meta_url, path, key_file)


@contextlib.contextmanager
def local_cluster(shards: int, capacity: int, progress: Callable[[str], None]) -> Iterator[Job]:
    """A cluster of ``shards`` local shard processes in a temporary directory, removed at the
    end (also on failure); yields a :class:`Job` with its URL and key file (path unset)."""
    from . import cluster

    parent = tempfile.mkdtemp(prefix="irdma-run-")
    where = os.path.join(parent, "cluster")
    try:
        url = cluster.up(where, shards, capacity, durability="memory", replicas=1, progress=progress)
        yield Job(url, "", cluster.key_file_of(where))
    finally:
        with contextlib.suppress(Exception):
            cluster.destroy(where)
        import shutil

        shutil.rmtree(parent, ignore_errors=True)


def worker_env(job: Job, rank: int, size: int, base: dict[str, str] | None = None, restart: int = 0,
               local: tuple[int, int] | None = None) -> dict[str, str]:
    """The environment of worker ``rank`` (see the module docstring; ``local``: its local rank
    and size, all ranks on this host by default)."""
    env = dict(os.environ if base is None else base)
    local_rank, local_size = local or (rank, size)
    env.update({RANK_ENV: str(rank), SIZE_ENV: str(size), LOCAL_RANK_ENV: str(local_rank),
                LOCAL_SIZE_ENV: str(local_size), META_ENV: job.meta_url, JOB_ENV: job.path, RUN_ID_ENV: job.run_id,
                RESTART_ENV: str(restart), "PYTHONUNBUFFERED": "1"})
    if job.key_file:
        env[KEY_FILE_ENV] = job.key_file
    return env


def supervise(job: Job, n: int, command: Sequence[str], *, grace: float = 10.0,
              stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None,
              log: Callable[[str], None] = lambda msg: None, elastic: bool = False, max_restarts: int = 3,
              hosts: list[str] | None = None, rsh: str = "ssh") -> int:
    """Run ``n`` workers of ``command`` on ``job`` until they all end (see the module
    docstring; ``elastic``: a failed worker is restarted, up to ``max_restarts`` times in all,
    and the others go on; ``hosts``: each rank's host, started there with ``rsh``); returns the
    launcher's exit status.

    Must run in the main thread (it installs the signal handlers that forward to the workers;
    the previous handlers are put back at the end).

    Raises:
        IrdmaError: the command cannot be started (not found, not executable); the workers
            already started are stopped first.
    """
    out = _Output(stdout or sys.stdout.buffer, stderr or sys.stderr.buffer)
    ended: queue.Queue[Worker] = queue.Queue()
    workers: list[Worker] = []
    received: list[tuple[int, int]] = []  # (signal, how many workers it reached)
    stopping = threading.Event()  # the launcher is stopping the workers: a signal now stops them at once

    def forward(signum: int, frame: object) -> None:
        """The first signal goes to every running worker's group; what is left of the group of
        a worker that exited (told to stop then) is killed. A signal while the launcher stops
        the job (a second Ctrl-C, a SIGTERM during --grace) kills whatever is left at once."""
        now = bool(received) or stopping.is_set()
        received.append((signum, len(workers)))
        for w in list(workers):
            if now or w.reaped.is_set():
                _kill(w)
            else:
                _signal(w, signum)

    where = hosts or ["localhost"] * n
    locals_ = local_ranks(where)

    def start(rank: int, restart: int) -> None:
        env = worker_env(job, rank, n, restart=restart, local=locals_[rank])
        argv = list(command)
        if where[rank] not in LOCALHOSTS:  # only what the launcher sets goes with it
            argv = remote_argv(rsh, where[rank], {k: v for k, v in env.items() if k.startswith("IRDMA_")
                                                  or k == "PYTHONUNBUFFERED"}, command)
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:
            stopping.set()
            _stop(workers, grace, log)
            raise IrdmaError(f"cannot start {argv[0]!r}: {exc.strerror}",
                             "check the command after `--` (a path, or a program on PATH)"
                             + ("" if argv[0] == command[0] else f", and that {argv[0]} is installed")) from None
        w = Worker(rank, proc, restart=restart)
        assert proc.stdout is not None and proc.stderr is not None
        w.readers = [_Reader(out, rank, proc.stdout, 1), _Reader(out, rank, proc.stderr, 2)]
        threading.Thread(target=_reap, args=(w, ended, grace), daemon=True, name=f"irdma-run-{rank}").start()
        workers.append(w)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        for rank in range(n):
            if received:  # told to stop while starting: start no more
                break
            start(rank, 0)
        for signum, reached in list(received):  # a signal that came while workers were starting
            for w in workers[reached:]:
                _signal(w, signum)
        log(f"started {len(workers)} worker(s) of job {job.path}: {' '.join(command)}")
        status, restarts, running, finished = 0, 0, len(workers), 0
        while running:
            # no deadline: a job runs as long as it trains; the forwarded signals' handler runs meanwhile
            w = ended.get()
            running -= 1
            for r in w.readers:  # its last lines before the verdict (its children may hold its pipes)
                r.drain()
            code = w.proc.returncode
            if code == 0:
                finished += 1
                continue
            if status:
                continue
            if elastic and not received:  # the others go on
                if finished:  # the job is ending: a worker that finished leaves nothing to rejoin
                    log(f"rank {w.rank} {describe(code)} after {finished} worker(s) finished; not restarted")
                    status = exit_status(code)
                elif restarts < max_restarts:
                    restarts += 1
                    log(f"rank {w.rank} {describe(code)}; restarting it (restart {restarts} of {max_restarts})")
                    start(w.rank, w.restart + 1)
                    running += 1
                else:
                    log(f"rank {w.rank} {describe(code)}; no restarts left ({max_restarts} used): the job goes on"
                        " without it")
                    status = exit_status(code)
                continue
            status = exit_status(code)
            stopping.set()
            log(f"rank {w.rank} {describe(code)}; stopping the other workers")
            _stop(workers, grace, log)  # the job cannot go on without it
    finally:
        stopping.set()
        try:  # the handlers stay meanwhile: a signal now kills what is left, none of it outlives the launcher
            _stop(workers, grace, log)
            for w in workers:  # the last lines of what ended meanwhile
                for r in w.readers:
                    r.drain()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    if received and status == 0:
        status = 128 + received[0][0]  # stopped by a signal: not a success, even if the workers exited 0
    return status


def _signal(w: Worker, signum: int) -> None:
    """``signum`` to worker ``w``'s process group (its session: its own children too), unless
    it was reaped: its pid may name another process then."""
    with w.lock:
        if not w.reaped.is_set():
            _signal_group(w.proc.pid, signum)


def _kill(w: Worker) -> None:
    """SIGKILL to whatever is left of worker ``w``'s process group: the worker if it runs, its
    children if it exited (nothing once that group is gone: its id may name another then)."""
    with w.lock:
        if not w.reaped.is_set() or not w.group_gone.is_set():
            _signal_group(w.proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member (one we may not signal counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, signum: int) -> None:
    """``signum`` to what is left of process group ``pgid`` (none left: nothing)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _reap(w: Worker, ended: queue.Queue[Worker], grace: float) -> None:
    """Wait for worker ``w`` to exit; SIGTERM what is left of its process group (its children)
    at once, reap it, hand it to the launcher (``ended``); SIGKILL the group if anything of it
    is still there ``grace`` s later. Only this thread reaps ``w`` (the others wait on
    ``w.reaped``), and it signals the group while the worker is a zombie, not yet reaped: its
    pid, the group's id, cannot name another process then, nor later while a member of the
    group lives. (Left: a group that empties between a check and the SIGKILL, its id taken at
    that moment by a new group leader: that needs the pids to wrap around within 50 ms.)"""
    pgid = w.proc.pid
    with contextlib.suppress(ChildProcessError):  # reaped already: by nothing of the launcher
        os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOWAIT)
    with w.lock:
        _signal_group(pgid, signal.SIGTERM)
        w.proc.wait()
        w.reaped.set()
    ended.put(w)
    deadline = time.monotonic() + grace
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)  # a thread of the launcher, not a test: the group has no exit to wait on
    with w.lock:
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        w.group_gone.set()


def _stop(workers: list[Worker], grace: float, log: Callable[[str], None] = lambda msg: None) -> None:
    """SIGTERM every worker still running (its process group), SIGKILL those still running
    ``grace`` s later; a worker that does not die within 10 s more (stuck in the kernel) is
    named and left. What is left of the group of a worker that exited (its children, told to
    stop when it exited) gets SIGKILL by the same deadline: none outlives the launcher."""
    live = [w for w in workers if not w.reaped.is_set()]
    for w in live:
        _signal(w, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for w in live:
        if not w.reaped.wait(timeout=max(0.0, deadline - time.monotonic())):
            _signal(w, signal.SIGKILL)
            if not w.reaped.wait(timeout=10.0):
                log(f"rank {w.rank} (pid {w.proc.pid}) did not die after SIGKILL: it is stuck in the kernel"
                    " (a dead mount?); `cat /proc/PID/stack` shows where")
    for w in workers:
        if w.reaped.is_set() and not w.group_gone.wait(timeout=max(0.0, deadline - time.monotonic())):
            _kill(w)
