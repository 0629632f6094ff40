"""A local cluster on one machine: SQLite metadata in a directory and N shard processes.

``irdma up``, ``irdma down`` and ``irdma destroy`` are built on :func:`up`, :func:`down` and
:func:`destroy`. The directory holds ``meta.db`` (the namespace and the shard map),
``cluster.json`` (pids and addresses of the running shards), ``settings.json`` (how each shard
is started: see :class:`ShardSettings`), ``shards/ID/`` (each shard's data directory: its
chunks in memory-mapped files, see :mod:`irdma.server.store`) and ``logs/``. ``down`` stops
the shards and keeps everything; ``up`` on the same directory starts them again on their data
(every file comes back bit-exact) with the settings they had (metrics address, durability,
transport; an option given to that ``up`` replaces the setting and is remembered), and on a
running cluster restarts just the shards that died; ``destroy`` removes the data.

``up`` never destroys or replaces data: it restarts only shards it started (their data
directory is ``shards/ID/``), leaves alone every shard that answers the handshake (a shard
started by hand and added with ``irdma shard add`` included), and for a shard it did not start
that does not answer it names the exact command that starts it again (``hand_started.json``
keeps the command line of each such shard seen running). Processes are signalled only after
an identity check: the pid and the process start time recorded when it was started (a pid
reused by another process is never signalled).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import psutil
import trio

from .._errors import InvalidArgument, IrdmaError, ShardUnavailable
from .._proc import last_log_line, spawn_detached
from ..meta import open_meta
from ..wire.auth import KEY_FILE_ENV, KEY_FILE_NAME, create_key_file, read_key_file, set_security
from .probe import (  # noqa: F401  (irdma.ops.cluster's names before the probes had a module)
    HANDSHAKE_TIMEOUT,
    _answering,
    _free_port,
    _free_ports,
    check_shard,
    wait_for_shard,
)

STATE_FILE = "cluster.json"
#: How each shard ``irdma up`` started is started again (:class:`ShardSettings`), by shard id.
SETTINGS_FILE = "settings.json"
#: What ``up`` uses for a setting neither recorded nor given.
DEFAULT_TRANSPORT = "tcp"
DEFAULT_DURABILITY = "fsync"
#: A new cluster's capacity per shard when none is given (bytes).
DEFAULT_CAPACITY = 1 << 30
#: Command lines of shards started by hand (not by ``irdma up``) seen running, by shard id.
HAND_FILE = "hand_started.json"


@dataclass
class ShardProc:
    """A shard process ``irdma up`` started: ``create_time`` is its start time (``psutil``'s,
    seconds since the epoch), which with the pid identifies it (None: recorded by an older irdma)."""

    shard_id: int
    address: str
    pid: int
    log: str
    create_time: float | None = None


@dataclass
class ShardSettings:
    """How ``up`` starts a shard, kept in ``settings.json`` so that a restart (``irdma down``
    then ``irdma up``, or ``up`` after a crash) starts it as it was. Each is the ``irdma
    server`` option of the same name.

    Attributes:
        transport: ``tcp``, ``verbs`` or ``auto``.
        durability: ``fsync`` or ``memory``.
        metrics: ``HOST:PORT`` of its Prometheus endpoint (a fixed port, chosen when it was
            first started with one), or None for none.
        capacity: bytes of its memory region (fixed when its data directory was made: the
            directory's ``shard.json`` holds it too).
        data_dir: its data directory (absolute).
    """

    transport: str
    durability: str
    metrics: str | None
    capacity: int | None
    data_dir: str


def read_settings(cluster_dir: str) -> dict[int, ShardSettings]:
    """The recorded settings of the shards ``up`` started in ``cluster_dir``, by shard id
    (empty for a cluster made before they were recorded: ``up`` uses its defaults then).

    Raises:
        IrdmaError: ``settings.json`` is there but unreadable or not what ``up`` writes.
    """
    path = os.path.join(cluster_dir, SETTINGS_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
        return {int(k): ShardSettings(**v) for k, v in data["shards"].items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IrdmaError(f"cannot read the shards' settings {path}: {exc}",
                         f"remove {path}: `irdma up` then starts the shards with the options it is given") from None


def _write_settings(cluster_dir: str, settings: dict[int, ShardSettings]) -> None:
    tmp = os.path.join(cluster_dir, SETTINGS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "shards": {str(k): asdict(v) for k, v in sorted(settings.items())}}, f, indent=1)
    os.replace(tmp, os.path.join(cluster_dir, SETTINGS_FILE))


def _metrics_of(base: str | None, shard_id: int) -> str | None:
    """The metrics address shard ``shard_id`` gets from ``up --metrics base``: ``HOST:PORT+ID``,
    or a free port of HOST now (so that it is recorded and the same after a restart) when PORT
    is 0; None for ``off`` or None.

    Raises:
        InvalidArgument: ``base`` is not HOST:PORT, or PORT+ID is past 65535.
    """
    from ..metrics import format_host, parse_metrics_address

    if base is None or base == "off":
        return None
    host, port = parse_metrics_address(base)
    if port == 0:
        return format_host(f"{host}:{_free_port(host)}")
    if port + shard_id > 65535:
        raise InvalidArgument(f"shard {shard_id} would serve metrics on port {port + shard_id} (> 65535)",
                              "pass `irdma up --metrics` a lower port")
    return format_host(f"{host}:{port + shard_id}")


class ShardsNotStarted(IrdmaError):
    """``up`` started every shard it could, but some shard it did not start does not answer.

    Attributes:
        url: the metadata URL of the cluster (which runs, without those shards).
        shard_ids: the shards that do not answer.
    """

    def __init__(self, url: str, shard_ids: list[int], message: str, hint: str) -> None:
        super().__init__(message, hint)
        self.url = url
        self.shard_ids = shard_ids


class AlreadyUp(IrdmaError):
    """``up`` found every shard of the cluster running: nothing to start (not a failure).

    Attributes:
        url: the metadata URL of the cluster. shards: how many shards it has.
    """

    def __init__(self, url: str, shards: int, message: str, hint: str) -> None:
        super().__init__(message, hint)
        self.url = url
        self.shards = shards


def process_of(p: ShardProc) -> psutil.Process | None:
    """The process of shard ``p`` if it still runs and is the one ``up`` started: same pid and
    start time (or, recorded by an older irdma without one, an ``irdma server`` with its
    shard id). None when it exited, is a zombie, or the pid now belongs to another process."""
    try:
        proc = psutil.Process(p.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(p.pid, os.WNOHANG)  # our child (a start that failed): reaped
            return None
        if p.create_time is not None:
            if abs(proc.create_time() - p.create_time) > 0.05:
                return None
        else:
            cmd = proc.cmdline()
            if "server" not in cmd or "--shard-id" not in cmd or str(p.shard_id) not in cmd:
                return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def shard_running(p: ShardProc) -> bool:
    """Whether the shard process ``p`` that ``up`` started still runs (see :func:`process_of`)."""
    return process_of(p) is not None


def default_dir() -> str:
    return os.environ.get("IRDMA_HOME") or os.path.join(os.path.expanduser("~"), ".irdma")


def meta_url_of(cluster_dir: str) -> str:
    return f"sqlite://{os.path.abspath(os.path.join(cluster_dir, 'meta.db'))}"


def read_state(cluster_dir: str) -> list[ShardProc]:
    """The shard processes ``irdma up`` started in ``cluster_dir`` (empty when it started none).

    Raises:
        IrdmaError: ``cluster.json`` is there but unreadable or not what ``irdma up`` writes.
    """
    path = os.path.join(cluster_dir, STATE_FILE)
    try:
        with open(path) as f:
            return [ShardProc(**s) for s in json.load(f)["shards"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IrdmaError(f"cannot read the cluster state {path}: {exc}",
                         f"stop its shards by hand and remove {path}, or pick another --dir") from None


def check_up_args(cluster_dir: str, shards: int, capacity: int, host: str) -> None:
    """Validate the arguments of :func:`up` before anything is created or started.

    Raises:
        InvalidArgument: fewer than one shard, a capacity under one page, a host this machine
            cannot listen on, or a ``cluster_dir`` that cannot be a directory.
    """
    from irdma.server.shard import PAGE

    if not host.strip():
        raise InvalidArgument("the host is empty", "pass --host an address of this machine, such as 127.0.0.1")
    if shards < 1:
        raise InvalidArgument(f"a cluster needs at least one shard, not {shards}", "pass --shards 1 or more")
    if capacity < PAGE:
        raise InvalidArgument(f"a shard's capacity of {capacity} bytes is less than one page ({PAGE} bytes)",
                              "pass --capacity 64MiB or more")
    try:
        _free_port(host)
    except OSError as exc:
        raise InvalidArgument(f"cannot listen on host {host!r}: {exc.strerror or exc}",
                              "pass --host an address of this machine, such as 127.0.0.1") from None
    probe = os.path.abspath(cluster_dir)
    while not os.path.exists(probe):  # the nearest existing ancestor must be a writable directory
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        why = "is not a directory" if not os.path.isdir(probe) else "is not writable"
        raise InvalidArgument(f"cannot make the cluster directory {cluster_dir}: {probe} {why}",
                              "pass --dir a directory you can write, such as ~/.irdma")


def shard_dir(cluster_dir: str, shard_id: int) -> str:
    """The data directory of shard ``shard_id`` of the local cluster."""
    return os.path.abspath(os.path.join(cluster_dir, "shards", str(shard_id)))


def up(
    cluster_dir: str,
    shards: int,
    capacity: int | None = None,
    *,
    host: str = "127.0.0.1",
    transport: str | None = None,
    fresh: bool = False,
    durability: str | None = None,
    replicas: int | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    timeout: float = 60.0,
    security: str | None = None,
    metrics: str | None = None,
) -> str:
    """Start a local cluster, or start again the shards of one in ``cluster_dir`` that are not
    running (on their data); returns its metadata URL.

    Each shard's settings are recorded in ``settings.json`` (:class:`ShardSettings`); a shard
    started again gets its recorded ones, except those given here (not None), which replace
    them (and are recorded). Shards that run are left alone: what is given applies to them the
    next time ``up`` starts them. A new cluster takes what is given, else ``transport``
    :data:`DEFAULT_TRANSPORT`, ``durability`` :data:`DEFAULT_DURABILITY`, no metrics.

    ``capacity``: bytes per shard of a new cluster (None: :data:`DEFAULT_CAPACITY`); on a
    restart None, or the shards' own (fixed when their data directories were made).

    ``metrics``: ``HOST:PORT``: shard N serves Prometheus metrics at ``HOST:PORT+N`` (PORT 0:
    a free port each, chosen now and kept); ``off``: none from now on.

    ``security``: the level written in the cluster's key file (:data:`irdma.wire.auth.SECURITY_LEVELS`;
    None keeps the file's, ``integrity`` for a new one).

    ``replicas``: copies of each chunk of files created from now on (the namespace setting);
    a new cluster defaults to 2 when it has at least 2 shards, a restarted one keeps its own.

    Bad arguments are refused before anything is created; a new cluster that fails to start is
    taken down again (its shards stopped, its namespace and data removed, its logs kept).

    Raises:
        InvalidArgument: see :func:`check_up_args`.
        ShardsNotStarted: shards ``up`` did not start (started by hand) do not answer; every
            other shard runs (the message names the command that starts each of them).
        AlreadyUp: every shard of the cluster in ``cluster_dir`` already runs.
        IrdmaError: a shard did not start (the message names its log).
    """
    from ..metrics import parse_metrics_address

    check_up_args(cluster_dir, shards, DEFAULT_CAPACITY if capacity is None else capacity, host)
    if metrics is not None and metrics != "off":
        parse_metrics_address(metrics)  # a bad address fails before anything starts
    if replicas is not None and not 1 <= replicas <= min(8, shards):
        raise InvalidArgument(f"--replicas {replicas} must be 1 to {min(8, shards)} (at most --shards)",
                              "each replica of a chunk lives on a distinct shard")
    meta_path = os.path.join(cluster_dir, "meta.db")
    if os.path.exists(meta_path) and fresh:
        running = [s for s in read_state(cluster_dir) if shard_running(s)]
        if running:
            raise IrdmaError(f"a cluster runs in {cluster_dir}", f"irdma down --dir {cluster_dir} first")
        _remove_namespace(cluster_dir)
        shutil.rmtree(os.path.join(cluster_dir, "shards"), ignore_errors=True)
    if os.path.exists(meta_path):
        if replicas is not None:
            with contextlib.closing(open_meta(meta_path)) as m:
                m.set_replicas(replicas)
        given: dict[str, object] = {"transport": transport, "durability": durability, "capacity": capacity,
                                    "metrics": metrics}
        return _restart(cluster_dir, given, progress, timeout, security)
    capacity = DEFAULT_CAPACITY if capacity is None else capacity
    try:
        fresh_dir = not os.path.exists(cluster_dir)
        os.makedirs(os.path.join(cluster_dir, "logs"), exist_ok=True)
        if fresh_dir:
            os.chmod(cluster_dir, 0o700)  # the key, the namespace and the shards' data are private
    except OSError as exc:
        raise IrdmaError(f"cannot make the cluster directory {cluster_dir}: {exc.strerror}",
                         "pass --dir a directory you can write, such as ~/.irdma") from None
    key_file = _ensure_key(cluster_dir, progress, security)
    meta = open_meta(meta_path, create=True)
    procs: list[ShardProc] = []
    try:
        meta.set_replicas(replicas if replicas is not None else min(2, shards))
        settings: dict[int, ShardSettings] = {}
        for port in _free_ports(host, shards):
            address = f"{host}:{port}"
            rec = meta.add_shard(address)
            st = settings[rec.shard_id] = ShardSettings(
                transport or DEFAULT_TRANSPORT, durability or DEFAULT_DURABILITY, _metrics_of(metrics, rec.shard_id),
                capacity, shard_dir(cluster_dir, rec.shard_id))
            procs.append(_spawn(cluster_dir, rec.shard_id, address, st, capacity))
            progress(f"started shard {procs[-1].shard_id} on {address} (pid {procs[-1].pid}{_described(st)})")
        _write_settings(cluster_dir, settings)
        _write_state(cluster_dir, procs)
        _wait_all(procs, timeout, progress, key_file)
    except BaseException:
        _stop(procs, 10.0)
        meta.close()
        _remove_namespace(cluster_dir)
        shutil.rmtree(os.path.join(cluster_dir, "shards"), ignore_errors=True)
        raise
    meta.close()
    return meta_url_of(cluster_dir)


def key_file_of(cluster_dir: str) -> str:
    """The key file of the local cluster in ``cluster_dir``: ``$IRDMA_KEY_FILE`` when set, else
    ``cluster.key`` beside its metadata."""
    return os.path.abspath(os.environ.get(KEY_FILE_ENV) or os.path.join(cluster_dir, KEY_FILE_NAME))


def _ensure_key(cluster_dir: str, progress: Callable[[str], None], security: str | None = None) -> str:
    """The cluster's key file, made when missing; ``security``: set its level (None: keep it)."""
    path = key_file_of(cluster_dir)
    if os.path.exists(path):
        ring = read_key_file(path)  # refuse a bad or world-readable one now
    else:
        ring = create_key_file(path)
        progress(f"made the cluster key {path} (mode 0600, cluster {ring.cluster_hex})")
    if security is not None and security != ring.security:
        set_security(path, security)
        progress(f"security level {security!r} set in {path} (connections opened from now on use it)")
    return path


def _described(st: ShardSettings) -> str:
    """``, durability memory, metrics HOST:PORT``: what ``up`` says of a shard it starts."""
    return f", transport {st.transport}, durability {st.durability}" + (f", metrics {st.metrics}" if st.metrics else "")


def _spawn(cluster_dir: str, shard_id: int, address: str, st: ShardSettings, capacity: int | None) -> ShardProc:
    """Start ``irdma server`` for shard ``shard_id`` with settings ``st`` (``capacity``: for a
    new data directory; None: the directory's own)."""
    log = os.path.abspath(os.path.join(cluster_dir, "logs", f"shard-{shard_id}.log"))
    args = ["-m", "irdma.ops.cli", "server", "--listen", address, "--shard-id", str(shard_id),
            "--transport", st.transport, "--data-dir", st.data_dir, "--durability", st.durability,
            "--key-file", key_file_of(cluster_dir)]  # the path only: the key is never on a command line
    if capacity is not None:
        args += ["--capacity", str(capacity)]
    if st.metrics:
        args += ["--metrics", st.metrics]
    pid = spawn_detached(args, log)
    try:
        started: float | None = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:  # it exited at once: _wait_all says why
        started = None
    return ShardProc(shard_id, address, pid, log, started)


def _wait_all(procs: list[ShardProc], timeout: float, progress: Callable[[str], None], key_file: str) -> None:
    deadline = time.monotonic() + timeout
    key = read_key_file(key_file)
    for p in procs:
        try:
            trio.run(wait_for_shard, p.address, "tcp", deadline, p.pid, key)
        except ShardUnavailable as exc:
            raise IrdmaError(f"shard {p.shard_id} did not start ({exc.args[0]}): {last_log_line(p.log)}",
                             f"its log is {p.log}") from None
        progress(f"shard {p.shard_id} answers on {p.address}")


def _restart(cluster_dir: str, given: dict[str, object], progress: Callable[[str], None],
             timeout: float, security: str | None = None) -> str:
    """Start again every shard of the shard map that ``up`` started and that is not running, on
    its data directory, with its recorded settings and those ``given`` (not None) instead;
    leave alone every shard that answers; name the command for the others."""
    meta_url = meta_url_of(cluster_dir)
    meta = open_meta(os.path.join(cluster_dir, "meta.db"))
    try:
        records = [r for r in meta.shards() if r.state != "removed"]  # (removed: out of the cluster)
    finally:
        meta.close()
    running = {s.shard_id: s for s in read_state(cluster_dir) if shard_running(s)}
    key_file = _ensure_key(cluster_dir, progress, security)
    others = [r for r in records if r.shard_id not in running]
    answering = trio.run(_answering, [r.address for r in others], read_key_file(key_file))
    ours = {r.shard_id for r in records if os.path.exists(os.path.join(shard_dir(cluster_dir, r.shard_id), "shard.json"))}
    hand = _read_hand(cluster_dir)
    for r in others:
        if r.address in answering:  # started by hand (or by another `up`): not ours to touch
            progress(f"shard {r.shard_id} at {r.address} runs (not started by this `irdma up`): left alone")
            if r.shard_id not in ours:
                _note_hand(cluster_dir, hand, r.shard_id, r.address)
    dead = [r for r in others if r.address not in answering and r.shard_id in ours]
    lost = [r for r in others if r.address not in answering and r.shard_id not in ours]
    if not dead and not lost:
        raise AlreadyUp(meta_url, len(records), f"the cluster in {cluster_dir} already runs ("
                        + ("its shard answers" if len(records) == 1 else f"all {len(records)} shards answer")
                        + "): nothing to start",
                        f"`irdma status --meta {meta_url}` checks it; `irdma down --dir {cluster_dir}` stops it")
    settings = read_settings(cluster_dir)
    new = {r.shard_id: _settings_for(cluster_dir, r.shard_id, settings.get(r.shard_id), given) for r in dead}
    if any(given[k] is not None for k in ("transport", "durability", "metrics")):
        for sid in sorted(running):  # kept for their next start
            new[sid] = _settings_for(cluster_dir, sid, settings.get(sid), given)
            progress(f"shard {sid} runs: left as it is (the options given apply when `irdma up` starts it again)")
    os.makedirs(os.path.join(cluster_dir, "logs"), exist_ok=True)
    procs: list[ShardProc] = []
    try:
        for r in dead:
            st = new[r.shard_id]
            procs.append(_spawn(cluster_dir, r.shard_id, r.address, st, None))
            progress(f"restarted shard {r.shard_id} on {r.address} from {st.data_dir}"
                     f" (pid {procs[-1].pid}{_described(st)})")
        _write_state(cluster_dir, sorted([*running.values(), *procs], key=lambda p: p.shard_id))
        _wait_all(procs, timeout, progress, key_file)
    except BaseException:
        _stop(procs, 10.0)
        raise
    settings.update(new)  # once they run: a setting that kept a shard from starting is not kept
    _write_settings(cluster_dir, settings)
    if lost:
        commands = "; ".join(f"shard {r.shard_id}: `{start_command(cluster_dir, r.shard_id, r.address, hand)}`"
                             for r in lost)
        raise ShardsNotStarted(
            meta_url, [r.shard_id for r in lost],
            f"shards {[r.shard_id for r in lost]} do not answer and were not started by `irdma up` (their data is"
            f" not in {os.path.join(cluster_dir, 'shards')}): the cluster runs without them",
            f"start each again on its own data directory: {commands}")
    return meta_url


def _read_hand(cluster_dir: str) -> dict[str, dict[str, object]]:
    try:
        with open(os.path.join(cluster_dir, HAND_FILE)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _listener(address: str) -> psutil.Process | None:
    """The process of this host listening on ``address``'s port, if any (and visible to us)."""
    from ..transport import parse_address

    try:
        _, port = parse_address(address)
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return psutil.Process(c.pid)
    except (ValueError, psutil.Error, OSError):
        pass
    return None


def _note_hand(cluster_dir: str, hand: dict[str, dict[str, object]], shard_id: int, address: str) -> None:
    """Record the command line of the shard started by hand at ``address`` (if it runs on this
    host), so that ``up`` can name it once the shard is gone."""
    proc = _listener(address)
    if proc is None:
        return
    try:
        argv, cwd = proc.cmdline(), proc.cwd()
    except psutil.Error:
        return
    if "server" not in argv:
        return
    hand[str(shard_id)] = {"address": address, "argv": argv, "cwd": cwd}
    tmp = os.path.join(cluster_dir, HAND_FILE + ".tmp")
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(hand, f, indent=1)
        os.replace(tmp, os.path.join(cluster_dir, HAND_FILE))


def note_hand_started(cluster_dir: str, shard_id: int, address: str) -> None:
    """Record the command line of a shard started by hand (``irdma shard add`` on a local
    cluster's namespace calls this) for :func:`up` to name if it is ever found down."""
    if os.path.exists(os.path.join(cluster_dir, "meta.db")) and os.path.isdir(os.path.join(cluster_dir, "shards")):
        _note_hand(cluster_dir, _read_hand(cluster_dir), shard_id, address)


def start_command(cluster_dir: str, shard_id: int, address: str,
                  hand: dict[str, dict[str, object]] | None = None) -> str:
    """The command that starts shard ``shard_id`` (started by hand) again: its own command
    line when it was seen running (the port it was given, such as 0 with ``--port-file``,
    replaced by the address it registered), else the ``irdma server`` line with the data
    directory left to fill in."""
    rec = (hand if hand is not None else _read_hand(cluster_dir)).get(str(shard_id))
    argv = rec.get("argv") if rec else None
    if isinstance(argv, list) and all(isinstance(a, str) for a in argv) and rec is not None:
        args = list(argv)
        if len(args) > 2 and args[1:3] == ["-m", "irdma.ops.cli"]:
            args = ["irdma", *args[3:]]
        elif args and os.path.basename(args[0]).startswith("python") and len(args) > 1 \
                and os.path.basename(args[1]) == "irdma":
            args = ["irdma", *args[2:]]
        elif args and os.path.basename(args[0]) == "irdma":
            args = ["irdma", *args[1:]]
        for i, a in enumerate(args[:-1]):
            if a == "--listen" and args[i + 1].endswith(":0"):
                args[i + 1] = address
        line = shlex.join(args)
        cwd = rec.get("cwd")
        relative = any(args[i] in ("--data-dir", "--key-file", "--port-file") and not os.path.isabs(args[i + 1])
                       for i in range(len(args) - 1))
        return f"cd {shlex.quote(str(cwd))} && {line}" if relative and isinstance(cwd, str) else line
    return (f"irdma server --listen {address} --meta {meta_url_of(cluster_dir)} --key-file"
            f" {key_file_of(cluster_dir)} --data-dir ITS_DATA_DIR")


def _stored_capacity(data_dir: str) -> int | None:
    """The capacity (bytes) the shard's data directory was made with (its ``shard.json``, see
    :mod:`irdma.server.store`), or None when it has none or it cannot be read (the shard says why
    when it starts)."""
    try:
        with open(os.path.join(data_dir, "shard.json")) as f:
            return int(json.load(f)["capacity"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _settings_for(cluster_dir: str, shard_id: int, recorded: ShardSettings | None,
                  given: dict[str, object]) -> ShardSettings:
    """The settings shard ``shard_id`` restarts with: ``recorded`` (or the defaults, for a
    cluster made before settings were recorded), with what is ``given`` (not None) instead.

    Raises:
        InvalidArgument: a capacity given that is not the shard's own (its data directory was
            made with it); a bad metrics address.
    """
    from irdma.server.shard import PAGE

    st = recorded or ShardSettings(DEFAULT_TRANSPORT, DEFAULT_DURABILITY, None, None, shard_dir(cluster_dir, shard_id))
    st = ShardSettings(**asdict(st))
    own = _stored_capacity(st.data_dir)
    if own is not None:
        st.capacity = own
    cap = given.get("capacity")
    if isinstance(cap, int) and own is not None and cap - cap % PAGE != own:
        raise InvalidArgument(f"shard {shard_id} holds {own} bytes of capacity (its data directory {st.data_dir} was"
                              f" made so), not {cap}", "leave out --capacity: a shard restarts with its own")
    if given.get("transport") is not None:
        st.transport = str(given["transport"])
    if given.get("durability") is not None:
        st.durability = str(given["durability"])
    if given.get("metrics") is not None:
        st.metrics = _metrics_of(str(given["metrics"]), shard_id)
    return st


def _remove_namespace(cluster_dir: str) -> None:
    for name in ("meta.db", "meta.db-wal", "meta.db-shm", STATE_FILE, KEY_FILE_NAME, HAND_FILE, SETTINGS_FILE):
        path = os.path.join(cluster_dir, name)
        if os.path.exists(path):
            os.unlink(path)


def _write_state(cluster_dir: str, procs: list[ShardProc]) -> None:
    tmp = os.path.join(cluster_dir, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"meta_url": meta_url_of(cluster_dir), "shards": [asdict(p) for p in procs]}, f, indent=1)
    os.replace(tmp, os.path.join(cluster_dir, STATE_FILE))


def _stop(procs: list[ShardProc], timeout: float) -> None:
    """SIGTERM the processes of ``procs`` that are still the ones ``up`` started (never a pid
    another process took since), SIGKILL those still running after ``timeout`` seconds."""
    live = [proc for proc in map(process_of, procs) if proc is not None]
    for proc in live:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()  # psutil checks the identity (pid and start time) first
    _, left = psutil.wait_procs(live, timeout=timeout)
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(left, timeout=5.0)


def down(cluster_dir: str, *, keep: bool = True, progress: Callable[[str], None] = lambda msg: None) -> int:
    """Stop the shards of the cluster in ``cluster_dir``. The namespace and every shard's data
    stay (``up`` starts them again); :func:`destroy` removes them. ``keep`` is accepted for
    compatibility and ignored.

    Returns:
        How many shard processes were stopped.

    Raises:
        IrdmaError: no cluster in ``cluster_dir``.
    """
    procs = read_state(cluster_dir)
    if not procs and not os.path.exists(os.path.join(cluster_dir, STATE_FILE)):
        raise IrdmaError(f"no cluster in {cluster_dir}", "pass the --dir given to `irdma up`")
    alive = [p for p in procs if shard_running(p)]
    _note_hand_started_running(cluster_dir, {p.shard_id for p in procs})
    _stop(alive, 10.0)
    for p in alive:
        progress(f"stopped shard {p.shard_id} (pid {p.pid})")
    os.unlink(os.path.join(cluster_dir, STATE_FILE))
    return len(alive)


def _note_hand_started_running(cluster_dir: str, ours: set[int]) -> None:
    """Record the command lines of the shards of the namespace that ``up`` did not start and
    that run on this host (``down`` leaves them running; ``up`` names them if they stop)."""
    path = os.path.join(cluster_dir, "meta.db")
    if not os.path.exists(path):
        return
    try:
        with contextlib.closing(open_meta(path)) as meta:
            records = [r for r in meta.shards() if r.state != "removed"]
    except IrdmaError:
        return
    hand = _read_hand(cluster_dir)
    for r in records:
        if r.shard_id not in ours and not os.path.exists(os.path.join(shard_dir(cluster_dir, r.shard_id),
                                                                      "shard.json")):
            _note_hand(cluster_dir, hand, r.shard_id, r.address)


def live_mounts(cluster_dir: str) -> list[str]:
    """The mountpoints of the irdma mounts of this host (its mount table) whose namespace is the
    cluster's in ``cluster_dir``; reads only the mount table."""
    from .mountpath import mount_table, namespace_key

    key = namespace_key(meta_url_of(cluster_dir))
    return [m.mountpoint for m in mount_table() if m.meta_url is not None and namespace_key(m.meta_url) == key]


def dir_of(meta_url: str) -> str:
    """The directory of the local cluster whose metadata URL is ``meta_url`` (where ``irdma up``
    made it: the SQLite database's directory).

    Raises:
        InvalidArgument: ``meta_url`` is no SQLite URL (a PostgreSQL namespace is no local
            cluster: its shards are stopped where they run), or a malformed URL.
    """
    from ..meta import meta_path, meta_scheme, redact

    if meta_scheme(meta_url) != "sqlite":
        raise InvalidArgument(f"{redact(meta_url)} is no local cluster of `irdma up` (those keep SQLite metadata)",
                              "stop its shards where they run (`irdma server` processes), or pass --dir of a local"
                              " cluster")
    return os.path.dirname(meta_path(meta_url))


#: What ``up`` makes in a cluster's directory besides :func:`_remove_namespace`'s files:
#: directories, and files matched by prefix and suffix (mount logs of ``irdma mount``).
_MADE_DIRS = ("shards", "logs")
_MADE_FILES = (("mount-", ".log"), (SETTINGS_FILE + ".", ".tmp"), (STATE_FILE + ".", ".tmp"), (HAND_FILE + ".", ".tmp"))


def destroy(cluster_dir: str, *, progress: Callable[[str], None] = lambda msg: None) -> list[str]:
    """Stop the cluster in ``cluster_dir`` if it runs, and remove its namespace, data and logs,
    then the directory itself when nothing else is left in it.

    Returns:
        The names left in ``cluster_dir`` that irdma did not make (the directory is kept for
        them); empty when the directory is gone.

    Raises:
        IrdmaError: no cluster in ``cluster_dir``.
    """
    has = any(os.path.exists(os.path.join(cluster_dir, n)) for n in ("meta.db", STATE_FILE, "shards"))
    if not has:
        raise IrdmaError(f"no cluster in {cluster_dir}", "pass the --dir given to `irdma up`")
    alive = [p for p in read_state(cluster_dir) if shard_running(p)]
    _stop(alive, 10.0)
    for p in alive:
        progress(f"stopped shard {p.shard_id} (pid {p.pid})")
    _remove_namespace(cluster_dir)
    for name in _MADE_DIRS:
        shutil.rmtree(os.path.join(cluster_dir, name), ignore_errors=True)
    left = []
    for name in sorted(os.listdir(cluster_dir)):
        if any(name.startswith(a) and name.endswith(b) for a, b in _MADE_FILES):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(cluster_dir, name))
        else:
            left.append(name)
    if not left:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(cluster_dir)
        progress(f"removed {cluster_dir}: the namespace, the shards' data and the logs")
    else:
        progress(f"removed the namespace, the shards' data and the logs in {cluster_dir}; kept the directory for"
                 f" what irdma did not make there: {', '.join(left[:5])}{' ...' if len(left) > 5 else ''}")
    return left


def register_self(meta_url: str, address: str, data_dir: str | None) -> int:
    """The shard id a shard started by hand with ``irdma server --meta`` serves as.

    A data directory that holds a shard keeps its id (a restart: the shard map must have it, at
    this address); otherwise a shard already registered at ``address`` keeps its id (a restart
    on a new, empty directory or on memory: clients tell its chunks are gone by its new
    incarnation, never read them as zeros); otherwise the address is registered as a new shard,
    which bumps the shard map's epoch so every client sees it.

    Args:
        meta_url: the namespace's metadata URL (``sqlite://`` or ``postgresql://``).
        address: ``HOST:PORT`` clients reach the shard at (what is registered).
        data_dir: the shard's ``--data-dir``, or None.

    Returns:
        The shard id.

    Raises:
        IrdmaError: the directory holds a shard the namespace does not have, one that was
            removed, or one registered at another address (each message says what to do);
            the metadata errors of :func:`irdma.meta.open_meta`.
    """
    from irdma.server.store import stored_shard_id

    sid: int | None = stored_shard_id(data_dir) if data_dir is not None else None
    with contextlib.closing(open_meta(meta_url)) as meta:
        records = meta.shards()
        if sid is not None:
            rec = next((r for r in records if r.shard_id == sid), None)
            if rec is None:
                raise IrdmaError(f"{data_dir} holds shard {sid}, which the shard map of {meta.url} does not have",
                                 "pass the --meta of the namespace it belongs to, or an empty --data-dir to join"
                                 " as a new shard")
            if rec.state == "removed":
                raise IrdmaError(f"shard {sid} (in {data_dir}) was removed from the shard map",
                                 "start it on an empty --data-dir to join as a new shard")
            if rec.address != address:
                raise IrdmaError(f"shard {sid} (in {data_dir}) is registered at {rec.address}, not {address}",
                                 f"start it with --listen (or --advertise) {rec.address}")
            return sid
        same = [r for r in records if r.address == address and r.state != "removed"]
        if same:
            return same[0].shard_id
        return meta.add_shard(address).shard_id
