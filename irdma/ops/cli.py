"""The ``irdma`` command line: shard servers, local clusters, mounts and cluster status."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import socket
import sqlite3
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click
import trio
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .._errors import InvalidArgument, IrdmaError, TransportUnavailable
from ..transport import TRANSPORTS
from ..units import format_size, parse_size
from . import cluster as _cluster
from . import snapshot_cli


class _Messages(Console):
    """The console of messages (standard error): at a terminal a line wraps at its width; elsewhere
    (a pipe, a file, a script's capture) each message stays one line, whole, however long, for
    grep and for copying the paths and commands it names. Tables fit the width either way."""

    def __init__(self) -> None:
        super().__init__(stderr=True)
        self.soft_wrap = not self.is_terminal

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.is_terminal:
            kwargs.pop("soft_wrap", None)  # wrap at the terminal's width, whatever the caller asked
        super().print(*objects, **kwargs)


console = _Messages()
# results on standard output: one line each, however long (URLs, JSON); tables fit the terminal
out = Console(soft_wrap=True)


def _meta_default() -> str:
    return os.environ.get("IRDMA_META") or _cluster.meta_url_of(_cluster.default_dir())


def _meta_explicit() -> bool:
    """Whether ``--meta`` was given on the command line. Only it names the namespace against a
    path under a mount; ``$IRDMA_META``, a standing default as the default cluster is, yields to
    the mount's namespace."""
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source("meta_url") is ParameterSource.COMMANDLINE


def target(path: str, meta_url: str) -> Any:
    """The namespace and path that PATH names (:func:`irdma.ops.info.resolve_target`): a path
    under an irdma mount names that mount's namespace and the directory it shows, whatever
    ``$IRDMA_META`` or the default cluster is (logged at info when ``$IRDMA_META`` names another).

    Raises:
        InvalidArgument: PATH is under a mount of another namespace than the one --meta names.
        IrdmaError: which directory the mount shows is unknown.
    """
    from . import info as I

    explicit = _meta_explicit()
    where = I.resolve_target(path, meta_url, explicit)
    env = os.environ.get("IRDMA_META")
    if where.mount is not None and not explicit and env and I.namespace_key(env) != I.namespace_key(where.meta_url):
        logging.getLogger("irdma.ops").info("%s is under the mount on %s: its namespace %s, not $IRDMA_META's", path,
                                            where.mount, where.meta_url)
    return where


META_OPTION = click.option(
    "--meta", "meta_url", default=_meta_default, show_default="$IRDMA_META or the default cluster's",
    help="Metadata URL of the namespace (sqlite:///PATH/meta.db or postgresql://USER@HOST:PORT/DB).",
)
DIR_OPTION = click.option(
    "--dir", "cluster_dir", default=_cluster.default_dir, show_default="$IRDMA_HOME or ~/.irdma",
    type=click.Path(file_okay=False), help="Directory of the local cluster.",
)


METRICS_OPTION = click.option(
    "--metrics", "metrics_addr", default=None, metavar="HOST:PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: a free one); `irdma stats` shows them.",
)


def _size(ctx: Any, param: Any, value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _leaf(exc: BaseException) -> BaseException:
    """The one exception inside nested exception groups (trio's nurseries wrap), else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


#: What to do next after an OSError, by errno (the default: check the path named).
_OS_HINTS = {
    errno.EACCES: "check the permissions of that path",
    errno.EPERM: "check the permissions of that path",
    errno.ENOENT: "check that the path exists",
    errno.ENOTDIR: "check the path: a part of it is not a directory",
    errno.EROFS: "pick a path on a writable filesystem",
    errno.ENOSPC: "free some disk space",
    errno.EADDRINUSE: "pick another port, or stop the process that listens there",
    errno.EADDRNOTAVAIL: "pick an address of this machine",
    errno.ECONNREFUSED: "check that the server runs at that address",
    errno.ENOMEM: "ask for less memory",
}


def _error_line(exc: BaseException, verbose: int) -> tuple[str, int]:
    """The one-line message for an error that ends a command, and the exit code.

    Errors of the user's making (:class:`IrdmaError`, a system call that failed, the metadata
    database) say what happened and what to do; anything else is a bug in irdma.
    """
    if isinstance(exc, IrdmaError):
        return str(exc), 1
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc)
        where = " ".join(f"{f}" for f in (exc.filename, exc.filename2) if f is not None)
        hint = _OS_HINTS.get(exc.errno or 0, "check the path or address it names, then retry")
        return f"{what}{': ' + where if where else ''} ({hint})", 1
    if isinstance(exc, sqlite3.Error):
        return (f"metadata database: {exc} (check that --meta names the database `irdma up` made;"
                " rerun with -v for details)"), 1
    rerun = "see the traceback above" if verbose else "rerun with -v for the traceback"
    return f"unexpected {type(exc).__name__}: {exc} (a bug in irdma: {rerun} and report it)", 1


def _verbosity() -> int:
    ctx = click.get_current_context(silent=True)
    return int(ctx.find_root().params.get("verbose") or 0) if ctx is not None else 0


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: MESSAGE`` on stderr as one line (never wrapped) and exit with ``code``."""
    console.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)
    sys.exit(code)


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every error that ends a command into one line with what to do next, and exit 1.

    Click's own usage errors pass through (:class:`IrdmaCLI` prints them, exit 2). A bug shows
    its traceback only with ``-v``.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            leaf = _leaf(exc)
            if isinstance(leaf, click.ClickException | click.exceptions.Exit | click.Abort):
                raise leaf from None
            verbose = _verbosity()
            if verbose and not isinstance(leaf, IrdmaError | OSError | sqlite3.Error):
                console.print_exception()
            fail(*_error_line(leaf, verbose))
        except KeyboardInterrupt:
            fail("interrupted", 130)

    return wrapper


#: Click (8.2 and later) raises this for a group called without a command: it shows the help.
_NO_ARGS_IS_HELP: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


class IrdmaCLI(click.Group):
    """The ``irdma`` group: usage errors, too, are one line (``error: ... (see --help)``), exit 2."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:
            exc.show()  # `irdma shard` alone: the help, as click prints it
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            ctx = exc.ctx
            where = f"`{ctx.command_path} --help`" if ctx is not None else "`irdma --help`"
            fail(f"{exc.format_message()} (see {where})", exc.exit_code)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        except click.Abort:
            fail("aborted", 1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=IrdmaCLI)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug); tracebacks of bugs.")
@click.version_option(package_name="irdma")
def cli(verbose: int) -> None:
    """irdma: an RDMA parameter server exposed as a POSIX filesystem."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---------------------------------------------------------------- server
@cli.command()
@click.option("--listen", default="127.0.0.1:7700", show_default=True, help="HOST:PORT to serve (port 0 picks one).")
@click.option("--capacity", default=None, callback=lambda ctx, p, v: None if v is None else _size(ctx, p, v),
              help="Size of the memory region [default: 2GiB; with --data-dir, the directory's own].")
@click.option("--shard-id", type=click.IntRange(0), default=None,
              help="This shard's id in the shard map [default: the one --meta registers, else the one its --data-dir"
              " holds; a shard with none is an unregistered shard, id 0 in its replies].")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@click.option("--port-file", type=click.Path(dir_okay=False), help="Write the bound HOST:PORT here when ready.")
@click.option("--key-file", envvar="IRDMA_KEY_FILE", type=click.Path(dir_okay=False), default=None,
              help="The cluster's key file (0600): every connection must prove this key. [env: IRDMA_KEY_FILE]")
@click.option("--no-auth", is_flag=True, help="Serve anyone who connects, without a key (a trusted test bed only).")
@click.option("--max-connections", type=click.IntRange(1), default=4096, show_default=True,
              help="Most connections served at once.")
@click.option("--max-connections-per-peer", type=click.IntRange(1), default=1024, show_default=True,
              help="Most connections served at once from one peer address.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Keep the shard's chunks in this directory (memory-mapped files): a restart on it keeps them.")
@click.option("--durability", type=click.Choice(["fsync", "memory"]), default="fsync", show_default=True,
              help="With --data-dir: fsync/close wait for the disk (fsync), or only for the page cache (memory).")
@click.option("--meta", "meta_url", default=None,
              help="Register in this namespace's shard map (sqlite:// or postgresql:// URL): a new shard joins,"
              " a restarted one keeps its id (the one in --data-dir, or the one registered at its address).")
@click.option("--advertise", default=None,
              help="HOST:PORT clients reach this shard at, registered with --meta [default: --listen].")
@METRICS_OPTION
@friendly
def server(listen: str, capacity: int | None, shard_id: int | None, transport: str, port_file: str | None,
           key_file: str | None, no_auth: bool, max_connections: int, max_connections_per_peer: int,
           data_dir: str | None, durability: str, meta_url: str | None, advertise: str | None,
           metrics_addr: str | None = None) -> None:
    """Run one shard server in the foreground until SIGTERM or Ctrl-C.

    Every connection must prove the cluster key (--key-file; `irdma up` and `irdma format`
    make one) before any data op; --no-auth serves anyone, for a trusted test bed only.
    With --meta the shard registers itself (the same command on any host:
    `irdma server --listen ADDR --meta URL --data-dir DIR --key-file K`).
    """
    from irdma.server.serve import run_server
    from irdma.server.shard import PAGE, Region, Shard
    from irdma.server.store import ShardStore
    from irdma.wire.auth import KeySource

    from ..transport import parse_address

    logging.getLogger("irdma").setLevel(min(logging.getLogger().level, logging.INFO))
    try:
        host, port = parse_address(listen)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    if capacity is not None and capacity < PAGE:
        raise click.BadParameter(f"capacity must be at least {PAGE} bytes", param_hint="--capacity")
    if capacity is not None:
        capacity -= capacity % PAGE
    if key_file is None and not no_auth:
        raise InvalidArgument("a shard needs the cluster's key file, so that only key holders get in",
                              "pass --key-file PATH (`irdma format` or `irdma up` makes one), or --no-auth on a"
                              " trusted test bed")
    if key_file is not None and no_auth:
        raise click.BadParameter("--no-auth and --key-file exclude each other", param_hint="--no-auth")
    from .metrics import parse_metrics_address, shard_address

    if metrics_addr:
        parse_metrics_address(metrics_addr)  # a bad address fails before anything is registered
    keys = KeySource(key_file) if key_file is not None else None
    ring = keys.ring() if keys is not None else None
    sock = None
    if meta_url is not None:
        # listen first, then register: a client that finds the address in the shard map early
        # waits in the backlog instead of being refused (and marking the shard down)
        sock = _bind(listen)
        try:
            shard_id = _register_self(meta_url, advertise or listen, data_dir)
        except BaseException:
            sock.close()
            raise
    elif advertise is not None:
        raise click.BadParameter("--advertise is the address registered with --meta: pass --meta too",
                                 param_hint="--advertise")
    elif shard_id is None and data_dir is not None:
        from irdma.server.store import stored_shard_id

        shard_id = stored_shard_id(data_dir)
    name = None
    if shard_id is None:  # started by hand: `irdma shard add` registers it under the id the map gives
        shard_id, name = 0, "unregistered shard"
    metrics_addr = shard_address(metrics_addr, shard_id)  # also `irdma up --metrics` (its environment)
    store = None
    if data_dir is not None:
        store = ShardStore(data_dir, shard_id, capacity, durability, ring.cluster_hex if ring else None)
        capacity = store.capacity
        logging.getLogger("irdma.server").info(
            "shard %d: data in %s (%s, durability %s)", shard_id, store.path,
            "new" if store.fresh else "reopened with its chunks", durability)
    elif capacity is None:
        capacity = 2 << 30
    verbs = None
    if transport != "tcp":
        from ..transport import verbs_status

        ok, why = verbs_status()
        if transport == "auto":
            logging.getLogger("irdma.server").info("transport auto: %s (%s)", "verbs" if ok else "tcp", why)
        if ok or transport == "verbs":
            from irdma.server.verbs import VerbsShard

            if not ok:
                raise TransportUnavailable(f"RDMA verbs transport unavailable: {why}", "use --transport tcp")
            verbs = VerbsShard(shard_id, capacity, store=store)
    try:
        if verbs is not None:
            shard = verbs.shard
        elif store is not None:
            shard = Shard(shard_id, Region(capacity, buffer=memoryview(store.region)), memoryview(store.versions),
                          store=store)
        else:
            shard = Shard(shard_id, Region(capacity))
    except MemoryError as exc:
        raise IrdmaError(f"cannot allocate a memory region of {format_size(capacity)}", "pass a smaller --capacity") from exc
    except OSError as exc:
        raise IrdmaError(f"cannot allocate a memory region of {format_size(capacity)}: {exc.strerror}",
                         "pass a smaller --capacity") from exc
    if name is not None:
        shard.name = name
    try:
        trio.run(functools.partial(run_server, shard, host, port, port_file=port_file,
                                   keys=keys, verbs=verbs, max_connections=max_connections,
                                   max_per_peer=max_connections_per_peer, metrics=metrics_addr, sock=sock))
    except Exception as exc:
        err = _listen_error(_leaf(exc), listen)
        if err is None:
            raise
        raise err from exc
    finally:
        if verbs is not None:
            verbs.close()
        if store is not None:
            store.sync()
            store.close()


def _redact(url: str) -> str:
    """``url`` with any password in it shown as ``***``."""
    from ..meta import redact

    return redact(url)


def _bind(listen: str) -> socket.socket:
    """A stdlib socket bound to ``listen`` and listening; errors as the CLI's one line."""
    from ..transport import parse_address

    host, port = parse_address(listen)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        err = _listen_error(exc, listen)
        if err is None:
            raise
        raise err from None
    return sock


def _register_self(meta_url: str, address: str, data_dir: str | None) -> int:
    """`irdma server --meta`: check the address clients will use, then register (see
    :func:`irdma.ops.cluster.register_self`); returns the shard id."""
    from ..transport import parse_address

    try:
        host, port = parse_address(address)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--advertise") from None
    if port == 0 or host in ("0.0.0.0", "::", ""):
        raise click.BadParameter(f"{address} is no address a client can reach: with --meta, listen on a fixed port"
                                 " of one address, or pass --advertise HOST:PORT", param_hint="--listen")
    sid = _cluster.register_self(meta_url, address, data_dir)
    logging.getLogger("irdma.server").info("shard %d at %s: registered in the shard map", sid, address)
    return sid


def _listen_error(exc: BaseException, listen: str) -> IrdmaError | None:
    """An error of binding ``listen`` as an :class:`IrdmaError` that names the address, else None."""
    port = listen.rpartition(":")[2]
    if isinstance(exc, socket.gaierror):
        return InvalidArgument(f"cannot listen on {listen}: {exc.strerror}", "pass --listen HOST:PORT with a HOST"
                               " of this machine, such as 127.0.0.1")
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return IrdmaError(f"cannot listen on {listen}: the address is already in use",
                          f"pick another port, 0 for a free one, or stop what listens there:"
                          f" `ss -ltnp 'sport = :{port}'` names it")
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
        return IrdmaError(f"cannot listen on {listen}: {exc.strerror}",
                          "pass --listen an address of this machine, and a port above 1023 unless root")
    return None


# ---------------------------------------------------------------- local cluster
@cli.command()
@DIR_OPTION
@click.option("--shards", "-n", default=2, show_default=True, help="Number of shard processes.")
@click.option("--capacity", default=None, callback=lambda ctx, p, v: None if v is None else _size(ctx, p, v),
              help="Memory region per shard [default: 1GiB; a restarted shard: its own].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the shards listen on.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default=None,
              help="[default: auto; a restarted shard: its own]")
@click.option("--fresh", is_flag=True, help="Wipe the namespace and data of a stopped cluster in --dir first.")
@click.option("--durability", type=click.Choice(["fsync", "memory"]), default=None,
              help="fsync/close wait until the bytes are on disk (fsync) or in the page cache only (memory)."
                   " [default: fsync; a restarted shard: its own]")
@click.option("--replicas", "-r", type=click.IntRange(1, 8), default=None,
              help="Copies of each chunk, on distinct shards (new clusters: 2 with 2 or more shards, else 1).")
@click.option("--metrics", "metrics_addr", default=None, metavar="HOST:PORT",
              help="Shard N serves Prometheus metrics on HOST:PORT+N (HOST:0: a free port each, kept across"
                   " restarts; off: none); see `irdma stats --meta`. [default: none; a restarted shard: its own]")
@click.option("--security", type=click.Choice(["integrity", "auth"]), default=None,
              help="What frame tags cover (kept in the key file; a new cluster: integrity): integrity, every"
                   " byte; auth, every header and control field but not tensor payloads (trusted fabrics;"
                   " faster). See SECURITY.md.")
@friendly
def up(cluster_dir: str, shards: int, capacity: int | None, host: str, transport: str | None, fresh: bool,
       durability: str | None, replicas: int | None, metrics_addr: str | None = None,
       security: str | None = None) -> None:
    """Start a local cluster: SQLite metadata in --dir and N shard processes keeping their
    chunks in --dir/shards/ID. On a stopped cluster's --dir, start it again on its data; on a
    running one, restart just the shards that died and resync them (they missed updates).

    Each shard is started again as it was first started (--metrics, --durability,
    --transport, kept in --dir/settings.json); an option given here replaces the shard's
    setting and is kept for the next restarts."""
    if metrics_addr and metrics_addr != "off":
        from .metrics import parse_metrics_address

        parse_metrics_address(metrics_addr)
    if transport is None and (fresh or not os.path.exists(os.path.join(cluster_dir, "meta.db"))):
        transport = "auto"  # a new cluster; a restarted shard keeps its own
    with console.status(f"starting shards in {cluster_dir}") as status:

        def progress(msg: str) -> None:
            console.print(msg, highlight=False)
            status.update(msg)

        missing: _cluster.ShardsNotStarted | None = None
        already: _cluster.AlreadyUp | None = None
        try:
            url = _cluster.up(cluster_dir, shards, capacity, host=host, transport=transport, fresh=fresh,
                              durability=durability, replicas=replicas, progress=progress, security=security,
                              metrics=metrics_addr)
        except _cluster.ShardsNotStarted as exc:  # the rest runs: resync it, then say what is missing
            missing, url = exc, exc.url
        except _cluster.AlreadyUp as exc:  # nothing to start: not a failure
            already, url = exc, exc.url
    trio.run(_resync, url, None)
    out.print(url, highlight=False)
    if missing is not None:
        fail(str(missing), 1)
    if already is not None:
        console.print(f"{already}.", highlight=False)
        return
    console.print(
        f"cluster up. Next: [bold]irdma mount {url} MOUNTPOINT[/], [bold]irdma status --meta {url}[/],"
        f" and [bold]irdma down --dir {cluster_dir}[/] to stop it.", highlight=False,
    )


_LOCAL_DIR_OPTION = click.option(
    "--dir", "cluster_dir", default=None, type=click.Path(file_okay=False),
    help="Directory of the local cluster. [default: the one --meta or $IRDMA_META names, else $IRDMA_HOME or ~/.irdma]",
)
_LOCAL_META_OPTION = click.option(
    "--meta", "meta_url", default=None, help="The local cluster whose metadata URL this is (sqlite:///DIR/meta.db).")


def _local_dir(cluster_dir: str | None, meta_url: str | None) -> str:
    """The directory of the local cluster a command names: --dir; else the one --meta or
    $IRDMA_META names (the cluster the other commands act on); else the default one.

    Raises:
        InvalidArgument: --dir and --meta name different clusters; the URL is no local cluster's.
    """
    if cluster_dir is not None:
        if meta_url is not None and os.path.realpath(_cluster.dir_of(meta_url)) != os.path.realpath(cluster_dir):
            raise InvalidArgument(f"--dir {cluster_dir} and --meta {_redact(meta_url)} name different clusters",
                                  "give one of them")
        return cluster_dir
    url = meta_url or os.environ.get("IRDMA_META")
    if url:
        return _cluster.dir_of(url)
    return _cluster.default_dir()


def _check_mounts(cluster_dir: str, what: str, force: bool) -> None:
    """Refuse (unless ``force``, or the user says so at a terminal) to stop a cluster that live
    mounts of this host use: their reads and writes would fail until it is up again.

    Raises:
        IrdmaError: there are live mounts, no --force, and no terminal to ask at (or the answer was no).
    """
    mounts = _cluster.live_mounts(cluster_dir)
    if not mounts or force:
        return
    shown = ", ".join(mounts[:5]) + (" ..." if len(mounts) > 5 else "")
    said = f"{_count(len(mounts), 'live mount')} of the cluster in {cluster_dir} ({shown})"
    if sys.stdin.isatty() and click.confirm(f"{said} will fail every read and write (EIO); {what} anyway?",
                                            err=True):
        return
    raise IrdmaError(f"{said} would fail every read and write (EIO): nothing {'stopped' if what == 'stop' else 'removed'}",
                     f"unmount {'it' if len(mounts) == 1 else 'them'} first (`irdma umount {mounts[0]}`), or pass"
                     " --force")


@cli.command()
@_LOCAL_DIR_OPTION
@_LOCAL_META_OPTION
@click.option("--force", is_flag=True, help="Stop it even while mounts of it are live (their I/O fails until `irdma up`).")
@click.option("--keep", is_flag=True, hidden=True, help="Accepted for compatibility: the data is always kept.")
@friendly
def down(cluster_dir: str | None, meta_url: str | None, force: bool, keep: bool) -> None:
    """Stop the local cluster started by `irdma up` (its namespace and data stay): the one in
    --dir, else the one --meta or $IRDMA_META names, else the default one. A cluster with live
    mounts on this host is stopped only with --force (or when you say so at a terminal)."""
    cluster_dir = _local_dir(cluster_dir, meta_url)
    if os.path.exists(os.path.join(cluster_dir, _cluster.STATE_FILE)):
        _check_mounts(cluster_dir, "stop", force)
    n = _cluster.down(cluster_dir, keep=keep, progress=lambda m: console.print(m, highlight=False))
    console.print(f"cluster in {cluster_dir} stopped ({n} shard processes); `irdma up --dir {cluster_dir}` starts it"
                  f" again on its data, `irdma destroy --dir {cluster_dir}` removes it.", highlight=False)


@cli.command()
@_LOCAL_DIR_OPTION
@_LOCAL_META_OPTION
@click.option("--yes", is_flag=True, help="Do not ask.")
@click.option("--force", is_flag=True, help="Remove it even while mounts of it are live (their files are gone).")
@friendly
def destroy(cluster_dir: str | None, meta_url: str | None, yes: bool, force: bool) -> None:
    """Stop the local cluster and remove its namespace, every shard's data, its logs and its
    directory (kept, with what else it holds, when it holds files irdma did not make): the
    cluster in --dir, else the one --meta or $IRDMA_META names, else the default one. A
    cluster with live mounts on this host is removed only with --force (or when you say so)."""
    cluster_dir = _local_dir(cluster_dir, meta_url)
    if any(os.path.exists(os.path.join(cluster_dir, n)) for n in ("meta.db", _cluster.STATE_FILE)):
        _check_mounts(cluster_dir, "remove it", force)
    if not yes and not click.confirm(f"remove every file of the cluster in {cluster_dir}?", err=True):
        raise IrdmaError("nothing removed", "pass --yes to remove without asking")
    left = _cluster.destroy(cluster_dir, progress=lambda m: console.print(m, highlight=False))
    if left:
        console.print(f"cluster in {cluster_dir} removed; the directory stays: it holds {len(left)} {'entry' if len(left) == 1 else 'entries'}"
                      f" irdma did not make ({', '.join(left[:5])}{' ...' if len(left) > 5 else ''}).", highlight=False)
    else:
        console.print(f"cluster in {cluster_dir} removed, with its directory.", highlight=False)


# ---------------------------------------------------------------- training jobs
@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--np", "workers", type=int, required=True, help="Number of worker processes.")
@click.option("--meta", "meta_url", envvar="IRDMA_META", default=None, show_default="$IRDMA_META",
              help="Metadata URL of a running namespace; without it a local cluster is started for the job"
                   " and removed after it.")
@click.option("--job", default=None, help="Job name: its directory is /jobs/NAME; with --meta, a run again of the"
                                          " job resumes from the weights its shards hold. [default: a new name]")
@click.option("--consistency", default=None, metavar="bsp|ssp:K|asp",
              help="The job's consistency model (user.irdma.consistency). [default: the namespace's, asp]")
@click.option("--shards", default=2, show_default=True, help="Shards of the local cluster (without --meta).")
@click.option("--capacity", default="1GiB", show_default=True, callback=_size,
              help="Memory region per shard of the local cluster (without --meta).")
@click.option("--grace", default=10.0, show_default=True, type=click.FloatRange(0, 3600),
              help="Seconds the other workers get to stop (SIGTERM) after one failed, before SIGKILL.")
@click.option("--elastic", default=None, metavar="MIN:MAX",
              help="An elastic job: it goes on with MIN to MAX live workers; a failed worker is restarted and"
                   " rejoins at the job's current clock and weights.")
@click.option("--max-restarts", default=3, show_default=True, type=click.IntRange(0, 1000),
              help="With --elastic: restarts of failed workers, in all.")
@click.option("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
              help="Where the workers run: ranks fill the hosts in order (needs --meta with a PostgreSQL URL"
                   " that every host reaches). [default: all on this host]")
@click.option("--rsh", type=click.Choice(["ssh", "netns"]), default="ssh", show_default=True,
              help="How a worker starts on another host: ssh HOST, or nsenter into network namespace HOST"
                   " (the test bed's hosts).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@friendly
def run(workers: int, meta_url: str | None, job: str | None, consistency: str | None, shards: int, capacity: int,
        grace: float, elastic: str | None, max_restarts: int, hosts: str | None, rsh: str,
        command: tuple[str, ...]) -> None:
    """Run N workers of COMMAND on one training job (as horovodrun and torchrun do).

    \b
    irdma run -n 4 -- python train.py --epochs 5
    irdma run -n 2 --meta $URL --job digits --consistency ssp:2 -- python train.py
    irdma run -n 4 --elastic 2:4 --consistency bsp -- python train.py
    irdma run -n 4 -H node1:2,node2:2 --meta postgresql://... -- python train.py

    Each worker gets IRDMA_RANK, IRDMA_SIZE, IRDMA_META and IRDMA_JOB (the job's directory in
    the namespace) in its environment; its output lines are prefixed with [RANK]. Ctrl-C and
    SIGTERM reach every worker; when one fails the others are stopped and `irdma run` exits
    with its status, naming its rank (with --elastic: it is restarted and the others go on).
    """
    from . import launch

    bounds = launch.check_args(workers, command, consistency, elastic)
    where = launch.parse_hosts(hosts, workers)
    remote = sorted({h for h in where if h not in launch.LOCALHOSTS})
    if remote and meta_url is None:
        raise InvalidArgument(f"--hosts {hosts}: workers on {', '.join(remote)} cannot reach a local cluster",
                              "start a cluster with PostgreSQL metadata that every host reaches and pass"
                              " --meta postgresql://... (docs/deploy.md)")
    name = job or launch.new_job_name()
    with contextlib.ExitStack() as stack:
        if meta_url is None:
            with console.status(f"starting a local cluster of {shards} shards") as status:
                def progress(msg: str) -> None:
                    status.update(msg)

                local = stack.enter_context(launch.local_cluster(shards, capacity, progress))
            meta_url, key_file = local.meta_url, local.key_file
        else:
            key_file = os.environ.get("IRDMA_KEY_FILE")
        the_job = launch.prepare_job(meta_url, name, workers, consistency, key_file, bounds)
        console.print(f"job {the_job.path} on {_redact(meta_url)}: {workers} worker(s)"
                      f"{f', elastic {elastic}' if bounds else ''}", highlight=False)
        status_code = launch.supervise(the_job, workers, command, grace=grace, log=lambda m: console.print(
            f"irdma run: {m}", highlight=False, soft_wrap=True), elastic=bounds is not None, max_restarts=max_restarts,
            hosts=where, rsh=rsh)
    if status_code:
        sys.exit(status_code)


# ---------------------------------------------------------------- jobs under /jobs
@cli.group()
def job() -> None:
    """The jobs `irdma run` made: their directories /jobs/NAME in the namespace (weights,
    optimizer state, clocks), kept after a run so that a run again of the job resumes."""


async def _jobs(meta_url: str) -> list[dict[str, Any]]:
    from .._errors import NoAttribute, NotFound
    from ..client.native import Client
    from ..train.coord import XATTR_CONSISTENCY, XATTR_ELASTIC, XATTR_WORKERS
    from .launch import JOBS_DIR

    async with Client.open(meta_url, transport="tcp") as client:
        try:
            top = await client.meta.resolve(JOBS_DIR)
        except NotFound:
            return []
        found = []
        for name, inode in sorted(await client.meta.readdir(top.ino)):
            if not inode.is_dir:
                continue
            got: dict[str, Any] = {"name": name.decode(errors="replace"), "path": f"{JOBS_DIR}/{name.decode()}",
                                   "mtime_ns": inode.mtime_ns}
            for key_, xattr in (("workers", XATTR_WORKERS), ("consistency", XATTR_CONSISTENCY),
                                ("elastic", XATTR_ELASTIC)):
                try:
                    got[key_] = (await client.meta.getxattr(inode.ino, xattr)).decode(errors="replace")
                except NoAttribute:
                    got[key_] = None
            files = size = 0
            todo = [inode.ino]
            while todo:
                with contextlib.suppress(NotFound):
                    for _, child in await client.meta.readdir(todo.pop()):
                        if child.is_dir:
                            todo.append(child.ino)
                        else:
                            files, size = files + 1, size + child.size
            got.update(files=files, bytes=size)
            found.append(got)
        return found


@job.command("list")
@META_OPTION
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout (sizes in bytes, times in ns).")
@friendly
def job_list(meta_url: str, as_json: bool) -> None:
    """The jobs under /jobs: name, workers, consistency, files, bytes, last change."""
    import json
    from datetime import datetime

    jobs = trio.run(_jobs, meta_url)
    if as_json:
        out.print_json(json.dumps(jobs))
        return
    if not jobs:
        console.print(f"no jobs in {_redact(meta_url)} (`irdma run --job NAME` makes /jobs/NAME)", highlight=False)
        return
    table = Table(title=f"jobs of {_redact(meta_url)}")
    for col in ("name", "workers", "consistency", "files", "size", "changed"):
        table.add_column(col, justify="right" if col in ("workers", "files", "size") else "left")
    for j in jobs:
        workers = j["workers"] or "-"
        table.add_row(escape(j["name"]), workers + (f" ({j['elastic']})" if j["elastic"] else ""),
                      escape(j["consistency"] or "asp"), str(j["files"]), format_size(j["bytes"]),
                      datetime.fromtimestamp(j["mtime_ns"] / 1e9).strftime("%Y-%m-%d %H:%M:%S"))
    out.print(table)


async def _remove_job(meta_url: str, name: str) -> tuple[int, int]:
    """Remove /jobs/NAME and everything in it (files' chunks freed now, as `rm -r` through a
    mount does); returns (files, directories) removed."""
    from .._errors import NotEmpty
    from ..client.native import Client
    from .launch import JOBS_DIR

    async with Client.open(meta_url, transport="tcp") as client:
        top = await client.meta.resolve(JOBS_DIR)
        job_dir = await client.meta.resolve(f"{JOBS_DIR}/{name}")
        if not job_dir.is_dir:
            raise InvalidArgument(f"{JOBS_DIR}/{name} is no job directory", "`irdma job list` names the jobs")
        counts = [0, 0]

        async def remove(parent: int, entry: bytes, ino: int) -> None:
            for child_name, child in await client.meta.readdir(ino):
                if child.is_dir:
                    await remove(ino, child_name, child.ino)
                else:
                    gone = await client.meta.unlink(ino, child_name)
                    counts[0] += 1
                    if gone.nlink <= 0:
                        await client.destroy_if_unused(gone.ino, grace=False)
            try:
                await client.meta.rmdir(parent, entry)
            except NotEmpty:
                raise IrdmaError(f"{JOBS_DIR}/{name}: a directory in it is not empty after its entries were removed"
                                 " (snapshots of it?)", f"`irdma snapshot list {JOBS_DIR}/{name}` lists them; delete"
                                 " them, then run this again") from None
            counts[1] += 1

        await remove(top.ino, name.encode(), job_dir.ino)
        return counts[0], counts[1]


@job.command("remove")
@click.argument("name")
@META_OPTION
@click.option("--yes", is_flag=True, help="Do not ask.")
@friendly
def job_remove(name: str, meta_url: str, yes: bool) -> None:
    """Remove job NAME: its directory /jobs/NAME and every file in it (their chunks are freed).
    Stop its workers first: a run of the job after this starts afresh."""
    if not name or "/" in name or name in (".", ".."):
        raise InvalidArgument(f"{name!r} is no job name (one path component)", "`irdma job list` names the jobs")
    if not yes and not click.confirm(f"remove /jobs/{name} and every file in it?", err=True):
        raise IrdmaError("nothing removed", "pass --yes to remove without asking")
    files, dirs = trio.run(_remove_job, meta_url, name)
    console.print(f"removed job {name}: /jobs/{name}, {_count(files, 'file')} and {dirs} director{'y' if dirs == 1 else 'ies'}",
                  highlight=False)


# ---------------------------------------------------------------- mounts
def _cache_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    from irdma.fs.mount import check_cache_seconds

    try:
        return None if value is None else check_cache_seconds((param.name or "").replace("_", " "), value)
    except IrdmaError as exc:
        raise click.BadParameter(str(exc)) from None


@cli.command()
@click.argument("meta_url")
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@click.option("--foreground", "-f", is_flag=True, help="Serve in this process until unmounted.")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Log of the background mount process.")
@click.option("--direct-io", is_flag=True, help="Direct I/O for every file (else per file: xattr user.irdma.io).")
@click.option("--allow-other", is_flag=True, help="Let every user use the mount; the kernel checks file modes.")
@click.option("--nonempty", is_flag=True, help="Mount over a directory that holds files (hidden until unmounted).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds each request to a shard and each metadata lock wait may take (EIO or EBUSY after)"
              " [default: 10].")
@click.option("--sync-timeout", type=click.FloatRange(min=0, min_open=True, max=86400), default=None,
              help="Seconds a barrier or lock wait of MOUNTPOINT/.irdma may take (ETIMEDOUT after) [default: 60].")
@click.option("--read-only", is_flag=True, help="Refuse every change (EROFS); the kernel mounts it ro.")
@click.option("--subdir", metavar="PATH", help="Mount this directory of the namespace (/jobs/x) as the root.")
@click.option("--attr-cache", type=float, callback=_cache_seconds, metavar="SECONDS",
              help="Seconds the kernel caches attributes (0 to 3600) [default: 1].")
@click.option("--entry-cache", type=float, callback=_cache_seconds, metavar="SECONDS",
              help="Seconds the kernel caches names (0 to 3600; unlinked files stay openable twice as long)"
              " [default: 1].")
@METRICS_OPTION
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Keep chunks read in this directory (the disk tier of the local read cache; docs/cache.md).")
@click.option("--cache-size", default=None, callback=lambda c, p, v: v if v is None else str(_size(c, p, v)),
              help="Bytes of the disk tier, such as 10G [default: 10GiB].")
@click.option("--cache-memory", default=None, callback=lambda c, p, v: v if v is None else str(_size(c, p, v)),
              help="Bytes of the memory tier [default: 256MiB with --cache-dir, else 0: off].")
@friendly
def mount(meta_url: str, mountpoint: str, transport: str, foreground: bool, log_file: str | None,
          direct_io: bool, allow_other: bool, timeout: float | None, metrics_addr: str | None = None,
          nonempty: bool = False, sync_timeout: float | None = None,
          cache_dir: str | None = None, cache_size: str | None = None, cache_memory: str | None = None,
          **view: Any) -> None:
    """Mount the namespace at META_URL on MOUNTPOINT with FUSE (sqlite:///PATH/meta.db, or
    postgresql://USER@HOST:PORT/DB with the password in ~/.pgpass or $PGPASSFILE, never in the URL:
    it would show in `ps`). `-o ro,subdir=/x,...` takes an fstab line's options (docs/deploy.md)."""
    from irdma.fs.mount import check_mountpoint, resolve_subdir, serve_mount, spawn_mount

    from ..meta import meta_path, meta_scheme, open_meta

    meta = open_meta(meta_url)  # fail here, clearly, if there is no namespace
    shown = meta.url
    try:
        if view["subdir"] is not None:
            resolve_subdir(meta, view["subdir"])  # --read-only, --subdir, --attr-cache, --entry-cache
    finally:
        meta.close()
    view = {k: v for k, v in view.items() if v is not None}
    extra: dict[str, Any] = {} if timeout is None else {"request_timeout": timeout}
    extra.update({} if sync_timeout is None else {"sync_timeout": sync_timeout})
    caching: dict[str, Any] = {"cache_dir": cache_dir, "cache_size": cache_size, "cache_memory": cache_memory}
    if foreground:
        logging.getLogger("irdma").setLevel(logging.INFO)
        timeouts: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        timeouts.update({} if sync_timeout is None else {"sync_timeout": sync_timeout})
        from ..client.cache import make_cache

        timeouts["cache"] = make_cache(cache_dir, cache_size, cache_memory)
        trio.run(functools.partial(serve_mount, meta_url, check_mountpoint(mountpoint, nonempty=nonempty),
                                   transport=transport, direct_io=direct_io, allow_other=allow_other,
                                   metrics=metrics_addr, **timeouts, **view))
        return
    name = f"mount-{os.path.basename(os.path.abspath(mountpoint))}.log"
    if log_file is None and meta_scheme(meta_url) == "sqlite":
        log_file = os.path.join(os.path.dirname(meta_path(meta_url)), name)
    elif log_file is None:
        os.makedirs(_cluster.default_dir(), mode=0o700, exist_ok=True)
        log_file = os.path.join(_cluster.default_dir(), name)
    with console.status(f"mounting {shown} on {mountpoint}"):
        pid = spawn_mount(meta_url, mountpoint, transport=transport, log_file=log_file, direct_io=direct_io,
                          allow_other=allow_other, metrics=metrics_addr, nonempty=nonempty, **extra, **view,
                          **caching)
    console.print(f"mounted on {os.path.abspath(mountpoint)} (pid {pid}, log {log_file}); `irdma umount {mountpoint}` to stop.",
                  highlight=False, soft_wrap=True)


@cli.command("stats")
@click.argument("mountpoints", nargs=-1, type=click.Path(file_okay=False))
@click.option("--meta", "meta_url", default=None, help="Show every shard of this namespace (metadata URL).")
@click.option("--endpoint", "endpoints", multiple=True, metavar="HOST:PORT",
              help="Also show the metrics served at HOST:PORT (repeatable).")
@click.option("--interval", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--count", type=click.IntRange(1), default=None, help="Stop after N refreshes [default: until Ctrl-C].")
@friendly
def stats_cmd(mountpoints: tuple[str, ...], meta_url: str | None, endpoints: tuple[str, ...], interval: float,
              count: int | None) -> None:
    """Show mounts' and shards' metrics live (as `juicefs stats`): per endpoint its cpu, memory
    and bytes held, and per layer and op: ops/s, MiB/s pulled and pushed, p50/p99 latency in
    ms, errors/s, requests in flight. Fits 80 columns; wider terminals show more. The
    processes must run with --metrics."""
    from . import stats as stats_mod

    if not (mountpoints or meta_url or endpoints):
        meta_url = _meta_default()
    stats_mod.run(mountpoints=mountpoints, meta_url=meta_url, endpoints=endpoints, interval=interval, count=count,
                  console=out)


@cli.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--threads", "-p", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Files read at once.")
@click.option("--meta", "meta_url", default=None,
              help="PATHS are namespace paths of this metadata URL (else paths on a mount); needs --cache-dir.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="With --meta: the disk cache to fill (a mount with the same --cache-dir uses it).")
@click.option("--cache-size", default=None, callback=lambda c, p, v: v if v is None else str(_size(c, p, v)),
              help="With --meta: bytes of that disk cache [default: 10GiB].")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@friendly
def warmup(paths: tuple[str, ...], threads: int, meta_url: str | None, cache_dir: str | None,
           cache_size: str | None, transport: str) -> None:
    """Fill the local read cache with files, ahead of their reads (as `juicefs warmup`): PATHS on
    a mount started with --cache-dir or --cache-memory, or namespace PATHS with --meta URL
    --cache-dir DIR. Directories are read whole. See docs/cache.md."""
    from . import warmup as W
    from .progress import transfer_progress

    if (meta_url is None) != (cache_dir is None):
        raise click.UsageError("--meta and --cache-dir go together (namespace paths into a disk cache);"
                               " without them PATHS are on a mount")
    done = [0, 0]
    totals: list[int | None] = [None, None]
    with transfer_progress("warmup", unit="files", console=console) as step:

        def tick(n: int, files: int) -> None:
            done[0] += n
            done[1] += files
            step(done[0], totals[0], done[1], totals[1])

        def sized(total_bytes: int, total_files: int) -> None:
            totals[:] = [total_bytes, total_files]
            step(0, total_bytes, 0, total_files)

        if meta_url is None:
            files = W.mount_files(paths)
            sized(sum(size for _, size in files), len(files))
            result = W.warm_mount(files, threads, tick)
        else:
            assert cache_dir is not None
            result = trio.run(W.warm_namespace, meta_url, paths, cache_dir, cache_size, threads, transport, tick, sized)
    rate = result.bytes / result.seconds if result.seconds > 0 else 0.0
    console.print(f"warmed {result.files} files, {format_size(result.bytes)} in {result.seconds:.1f} s"
                  f" ({format_size(rate)}/s)", highlight=False)


@cli.command()
@click.argument("mountpoint", type=click.Path(file_okay=False))
@friendly
def umount(mountpoint: str) -> None:
    """Unmount an irdma mount (waits for its writes to be on the shards); cleans a dead one."""
    from irdma.fs.mount import MountState, unmount

    was = unmount(mountpoint)
    if was is MountState.LIVE:
        console.print(f"unmounted {os.path.abspath(mountpoint)}", highlight=False, soft_wrap=True)
    else:
        why = "its process had exited" if was is MountState.DEAD else "its process did not answer"
        console.print(f"cleaned the {was.value} mount on {os.path.abspath(mountpoint)} ({why}); writes it had not"
                      " flushed are lost. Mount it again with `irdma mount`.", highlight=False, soft_wrap=True)


# ---------------------------------------------------------------- shards and status
@cli.group()
def shard() -> None:
    """Manage the shard map."""


async def _stats(meta_url: str) -> tuple[list[Any], tuple[int, int], int]:
    from ..client.native import Client

    async with Client.open(meta_url, transport="tcp") as client:
        stats = await client.shard_stats()  # notes each shard's incarnation first
        return stats, await client.meta.usage(), await client.meta.epoch()


@dataclasses.dataclass
class _StatusView:
    """What `irdma status` reads: the shards, the namespace's use, and every file that cannot be read."""

    stats: list[Any]
    usage: tuple[int, int]
    epoch: int
    damaged: list[Any]
    waiting: list[Any]
    under_replicated: int
    moving: list[Any]


async def _status(meta_url: str) -> _StatusView:
    from ..client.native import Client
    from .fsck import readability

    async with Client.open(meta_url, transport="tcp") as client:
        stats = await client.shard_stats()  # notes each shard's incarnation first
        _, _, moves = await client.meta.shard_view()
        damaged, waiting, _ = await readability(client, stats)
        return _StatusView(stats, await client.meta.usage(), await client.meta.epoch(), damaged, waiting,
                           await client.meta.under_replicated(), [m for m in moves if not m.done])


async def _resync(meta_url: str, only: list[int] | None) -> int:
    """Resync the shards that are catching up (``only``: these), with a progress bar each
    (bytes of the chunks compared, rate, time left, chunks); returns how many failed."""
    from ..client.native import Client
    from .progress import transfer_progress

    failed = 0
    async with Client.open(meta_url, transport="tcp") as client:
        stats = await client.shard_stats()
        # a shard named explicitly is compared even when up: a replica it holds that is out of
        # its chunk's in-sync set (under-replicated in `irdma status`) is copied back in
        todo = [rec.shard_id for rec, st, _ in stats if st is not None and rec.state not in ("drained", "removed")
                and (rec.health == "syncing" if only is None else rec.shard_id in only)]
        for sid in todo:
            with transfer_progress(f"resync shard {sid}", console=console) as step:
                try:
                    copied = await client.resync_shard(sid, step)
                except IrdmaError as exc:
                    failed += 1
                    console.print(f"[red]resync of shard {sid} did not finish:[/] {exc}", highlight=False,
                                  soft_wrap=True)
                    continue
            console.print(f"shard {sid} is up to date: {format_size(copied)} copied", highlight=False)
    return failed


async def _adoptable(meta_url: str, shard_id: int) -> list[Any]:
    """The files with chunks waiting for a shard of which ``shard_id`` holds an older copy."""
    from ..client.native import Client
    from .fsck import readability

    async with Client.open(meta_url, transport="tcp") as client:
        stats = await client.shard_stats()
        if not any(rec.shard_id == shard_id for rec, _, _ in stats):
            from .._errors import NotFound

            raise NotFound(f"shard {shard_id} is not in the shard map", "`irdma shard list` shows the shards")
        _, waiting, _ = await readability(client, stats)
        return [u for u in waiting if shard_id in u.stale]


async def _force_resync(meta_url: str, shard_id: int) -> int:
    from ..client.native import Client
    from .progress import transfer_progress

    async with Client.open(meta_url, transport="tcp") as client:
        with transfer_progress(f"resync shard {shard_id} (forced)", console=console) as step:
            return await client.resync_shard(shard_id, step, force=True)


@shard.command("resync")
@click.argument("shard_ids", nargs=-1, type=int)
@META_OPTION
@click.option("--force-from", "force_from", type=int, default=None, metavar="SHARD",
              help="For chunks whose in-sync replicas are lost for good: adopt SHARD's older copies as the"
              " in-sync ones (the updates only the lost replicas had are lost).")
@click.option("--yes", is_flag=True, help="With --force-from: do not ask.")
@friendly
def shard_resync(shard_ids: tuple[int, ...], meta_url: str, force_from: int | None, yes: bool) -> None:
    """Bring shards that are back after being down (state syncing) level with their chains:
    copy the chunks whose version or checksum differs from the chain head's, then mark them up.
    Mounts do this on their own every few seconds; this does it now, with progress.
    Default: every syncing shard; a shard named is compared with its chains even when up (what
    `irdma status` reports as under-replicated chunks is copied back).

    With --force-from SHARD, for a chunk whose in-sync replicas are all on shards that do not
    answer (`irdma status` lists these files and the shards they wait for) and whose data is
    gone for good: SHARD's copy becomes the in-sync one, and the others are resynced from it.
    What only the lost replicas held (the updates SHARD missed) is lost. Restarting the
    shards they wait for loses nothing: do that whenever they can come back."""
    if force_from is not None:
        if shard_ids:
            raise click.UsageError("give either SHARD_IDS or --force-from SHARD, not both")
        files = trio.run(_adoptable, meta_url, force_from)
        waits = sorted({s for u in files for s in u.waits_for})
        console.print(
            f"[yellow]warning:[/] --force-from {force_from} makes shard {force_from}'s copies the in-sync replicas"
            + (f" of {_count(sum(len(u.chunks) for u in files), 'chunk')} of {_count(len(files), 'file')} that wait"
               f" for shards {', '.join(map(str, waits))}" if files
               else " of the chunks whose in-sync replicas do not answer")
            + ": the updates only those replicas had are lost for good, and if they come back they are resynced"
            f" from shard {force_from}. Restarting them instead loses nothing.", highlight=False, soft_wrap=True)
        for u in files[:20]:
            console.print(f"  {u.path or '(no name)'} (inode {u.ino}): chunks {', '.join(map(str, u.chunks[:8]))}"
                          + (" ..." if len(u.chunks) > 8 else ""), highlight=False, soft_wrap=True)
        try:
            if not yes and not click.confirm(f"adopt shard {force_from}'s copies?", err=True):
                raise click.Abort
        except click.Abort:
            raise IrdmaError("nothing changed", f"pass --yes to adopt shard {force_from}'s copies without asking")\
                from None
        copied = trio.run(_force_resync, meta_url, force_from)
        console.print(f"shard {force_from} is up to date and its copies are in sync: {format_size(copied)} copied",
                      highlight=False)
        return
    if trio.run(_resync, meta_url, list(shard_ids) or None):
        fail("some shards were not resynced", 1)


async def _drain(meta_url: str, shard_id: int) -> int:
    from ..client.native import Client
    from .progress import transfer_progress

    async with Client.open(meta_url, transport="tcp") as client:
        with transfer_progress(f"drain shard {shard_id}", console=console) as step:
            return await client.drain_shard(shard_id, step)


@shard.command("drain")
@click.argument("shard_id", type=int)
@META_OPTION
@friendly
def shard_drain(shard_id: int, meta_url: str) -> None:
    """Move every chunk off shard SHARD_ID to the other shards in service, with training going
    on: the chunks stay readable and writable throughout. Then no file uses the shard and
    `irdma shard remove` can take it out. Run it again to resume one that failed."""
    copied = trio.run(_drain, meta_url, shard_id)
    console.print(f"shard {shard_id} is drained: {format_size(copied)} copied to the other shards; remove it with"
                  f" `irdma shard remove {shard_id}`", highlight=False, soft_wrap=True)


async def _remove(meta_url: str, shard_id: int, force: bool) -> list[tuple[int, int]]:
    from ..client.native import Client

    async with Client.open(meta_url, transport="tcp") as client:
        return await client.remove_shard(shard_id, force)


@shard.command("remove")
@click.argument("shard_id", type=int)
@META_OPTION
@click.option("--force", is_flag=True, help="Remove it even if it was not drained: chunks only it holds are lost.")
@friendly
def shard_remove(shard_id: int, meta_url: str, force: bool) -> None:
    """Take shard SHARD_ID out of the cluster once drained (`irdma shard drain`). With --force, a
    shard in any state (e.g. one whose machine is gone): its replicas are copied again from the
    others, and chunks it alone held are declared lost (they read as EIO, never zeros)."""
    lost = trio.run(_remove, meta_url, shard_id, force)
    if lost:
        console.print(f"[red]shard {shard_id} removed; {len(lost)} chunks it alone held are lost[/] (`irdma status`"
                      " lists the files)", highlight=False, soft_wrap=True)
    else:
        console.print(f"shard {shard_id} removed; nothing was lost. Its process can be stopped.", highlight=False,
                      soft_wrap=True)


async def _rebalance(meta_url: str, tolerance: float) -> tuple[list[tuple[int, int, int]], list[Any]]:
    from ..client.native import Client
    from .progress import transfer_progress

    async with Client.open(meta_url, transport="tcp") as client:
        with transfer_progress("rebalance", console=console) as step:
            moves = await client.rebalance(step, tolerance)
        return moves, await client.shard_stats()


@cli.command()
@META_OPTION
@click.option("--tolerance", default=0.1, show_default=True, type=click.FloatRange(min=0),
              help="Leave a shard alone while it holds at most (1 + this) times the mean.")
@friendly
def rebalance(meta_url: str, tolerance: float) -> None:
    """Even out the bytes held by the shards in service (after `irdma shard add`, say): each
    shard over the mean moves the excess share of its chunks to the shards under it, with
    training going on (chunks stay readable and writable). Run it again to finish one that failed."""
    moves, stats = trio.run(_rebalance, meta_url, tolerance)
    for sid, copied, _ in moves:
        console.print(f"moved {format_size(copied)} off shard {sid}", highlight=False)
    if not moves:
        console.print("the shards are even already (within the tolerance): nothing moved", highlight=False)
    table = Table(title="bytes held per shard")
    for col in ("id", "state", "used", "chunks"):
        table.add_column(col, justify="left" if col == "state" else "right")
    for rec, st, _ in stats:
        if st is not None and rec.state == "up":
            table.add_row(str(rec.shard_id), rec.state, format_size(st.used), str(st.chunks))
    out.print(table)


@shard.command("list")
@META_OPTION
@friendly
def shard_list(meta_url: str) -> None:
    """Every shard: id, address, state, capacity, used, chunks."""
    stats, _, epoch = trio.run(_stats, meta_url)
    table = Table(title=f"shards of {_redact(meta_url)} (epoch {epoch})")
    for col in ("id", "address", "state", "capacity", "used", "chunks"):
        table.add_column(col, justify="right" if col in ("id", "capacity", "used", "chunks") else "left")
    for rec, st, _why in stats:
        if rec.state in ("drained", "removed"):
            table.add_row(str(rec.shard_id), rec.address, rec.state, *(
                ("-", "-", "-") if st is None else (format_size(st.capacity), format_size(st.used), str(st.chunks))))
        elif st is None:
            table.add_row(str(rec.shard_id), rec.address, "[red]down[/]", "-", "-", "-")
        else:
            state = ("[yellow]syncing[/]" if rec.health == "syncing" else
                     "[yellow]draining[/]" if rec.state == "draining" else "[green]up[/]")
            table.add_row(str(rec.shard_id), rec.address, state, format_size(st.capacity),
                          format_size(st.used), str(st.chunks))
    out.print(table)
    for rec, st, why in stats:
        if st is None and rec.state not in ("drained", "removed"):
            console.print(f"shard {rec.shard_id} at {rec.address}: {why}", highlight=False, soft_wrap=True)


@shard.command("add")
@click.argument("address")
@META_OPTION
@click.option("--force", is_flag=True, help="Register it even if no shard answers at ADDRESS now.")
@click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds to wait for the shard's handshake.")
@friendly
def shard_add(address: str, meta_url: str, force: bool, timeout: float) -> None:
    """Register the shard server at ADDRESS (HOST:PORT) in the shard map.

    The shard must be running and answer the irdma handshake (unless --force): new files are
    striped over every registered shard at once.
    """
    import contextlib

    from .._errors import Exists, ShardUnavailable
    from ..meta import meta_path, meta_scheme, open_meta
    from ..transport import parse_address
    from .cluster import check_shard

    try:
        _, port = parse_address(address)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="ADDRESS") from None
    if port == 0:
        raise click.BadParameter("port 0 names no shard: give the port the shard listens on", param_hint="ADDRESS")
    with contextlib.closing(open_meta(meta_url)) as meta:
        same = [r for r in meta.shards() if r.address == address]
        if same:
            raise Exists(f"shard {same[0].shard_id} at {address} is already registered",
                         "`irdma shard list` shows the shard map")
        if not force:
            try:
                trio.run(functools.partial(check_shard, address, timeout, key=_key_ring(meta_url)))
            except ShardUnavailable as exc:
                raise ShardUnavailable(
                    f"no irdma shard answers at {address}: {exc.args[0]}",
                    f"start it first with `irdma server --listen {address}`, check the address, or pass --force"
                    " to register it anyway",
                ) from None
        rec = meta.add_shard(address)
    if meta_scheme(meta_url) == "sqlite":
        # a shard started by hand joins a local cluster: `irdma up` names its command if it stops
        _cluster.note_hand_started(os.path.dirname(meta_path(meta_url)), rec.shard_id, address)
    if force:
        console.print(f"registered shard {rec.shard_id} at {address} without checking it; start it with"
                      f" `irdma server --listen {address} --shard-id {rec.shard_id}` if it is not running.",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"registered shard {rec.shard_id} at {address}; it answers. `irdma status` shows the cluster.",
                      highlight=False, soft_wrap=True)


@dataclasses.dataclass(frozen=True)
class Health:
    """How `irdma status` sums the cluster up, and the exit code it ends with."""

    word: str
    style: str
    exit_code: int
    advice: str = ""


#: Shard states whose shards serve no chain any more: history, never failures.
RETIRED = ("drained", "removed")


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def cluster_health(stats: list[Any], damaged: list[Any] | None = None, under_replicated: int = 0,
                   moving: list[Any] | None = None, waiting: list[Any] | None = None) -> Health:
    """The cluster's health from :meth:`Client.shard_stats` (``(record, stats or None, why)`` each),
    the files with chunks lost (``damaged``, :class:`~irdma.meta.DamagedFile`) or waiting for a
    shard that does not answer (``waiting``, :class:`irdma.ops.fsck.Unreadable`), the count of
    under-replicated chunks and the moves in progress.

    The exit codes of ``irdma status``: 0 healthy (every shard in service answers and is up to
    date, every chunk has all its replicas), 1 degraded (a shard is down or catching up, chunks
    are under-replicated, chunks are moving, or no shard is in service), 2 a file cannot be read
    (its chunks are lost, or wait for a shard that does not answer). Drained and removed shards
    are history: they count for nothing.
    """
    if damaged or waiting:
        advice = []
        if damaged:
            n = sum(len(d.lost_chunks) for d in damaged)
            advice.append(f"{_count(n, 'chunk')} of {_count(len(damaged), 'file')} {'is' if n == 1 else 'are'} lost"
                          " (no in-sync replica is left: a shard restarted on empty memory or was removed, or the"
                          " chunk was freed behind the namespace's back): reads of them fail with EIO; rewrite those"
                          " files or restore them from a checkpoint, `irdma fsck` lists them.")
        if waiting:
            catching = sorted({s for u in waiting for s in u.catching_up})
            waits = sorted({s for u in waiting for s in u.waits_for} - set(catching))
            stale = sorted({s for u in waiting for s in u.stale})
            one = len(waits) == 1
            named = f"shard{'' if one else 's'} {', '.join(map(str, waits))}"
            behind = f"shard{'' if len(catching) == 1 else 's'} {', '.join(map(str, catching))}"
            text = f"{_count(len(waiting), 'file')} cannot be read until " + " or ".join(
                ([f"{named} answer{'s' if one else ''} again"] if waits else [])
                + ([f"{behind} {'is' if len(catching) == 1 else 'are'} resynced"] if catching else []))
            text += " (they hold the only in-sync copies)"
            if waits:
                text += (f": restart {named} (`irdma up --dir D` restarts the shards of a local"
                         " cluster; else run `irdma server` again on its data directory)")
            if catching:
                text += (f"{'; ' if waits else ': '}`irdma shard resync {' '.join(map(str, catching))}` brings"
                         f" {behind} up now (mounts do within seconds) or says what {'it waits' if len(catching) == 1 else 'they wait'} for")
            if waits and stale:  # only where an older copy exists (never with one replica)
                text += (f". If {named if one else 'one of them'} is lost for good, `irdma shard resync --force-from"
                         f" {stale[0] if stale else 'SHARD'}` adopts the older copies "
                         + (f"shard{'s' if len(stale) > 1 else ''} {', '.join(map(str, stale))}"
                            f" hold{'' if len(stale) > 1 else 's'}" if stale else "a shard that answers holds")
                         + f", losing the updates only {named} had")
            advice.append(text + ".")
        return Health("data lost" if damaged else "unreadable", "bold red", 2, " ".join(advice))
    live = [x for x in stats if x[0].state not in RETIRED]
    if not live:
        return Health("degraded", "red", 1,
                      "the shard map is empty: `irdma shard add HOST:PORT` registers a shard." if not stats else
                      "no shard is in service (all were drained or removed): `irdma shard add HOST:PORT` registers one.")
    draining = [str(rec.shard_id) for rec, _, _ in live if rec.state == "draining"]
    dead = [(rec.shard_id, rec.address) for rec, st, _ in live if st is None]
    if dead:
        one = len(dead) == 1
        return Health("degraded", "red", 1,
                      f"shard{'' if one else 's'} {', '.join(f'{sid} at {addr}' for sid, addr in dead)}"
                      f" {'is' if one else 'are'} down: restart {'it' if one else 'them'} (`irdma up --dir D`"
                      " restarts the dead shards of a local cluster; else run `irdma server` again on"
                      f" {'its data directory' if one else 'their data directories'}).")
    # a shard the map records down that answers again is catching up too: it is up to date
    # only once a resync marked it up (a client that reaches it first records it syncing)
    syncing = [str(rec.shard_id) for rec, _, _ in live if rec.health in ("syncing", "down")]
    if draining:
        return Health("degraded", "yellow", 1, f"shard {', '.join(draining)} is draining: finish it with"
                      f" `irdma shard drain {draining[0]}`.")
    if moving:
        return Health("degraded", "yellow", 1, f"chunks of shard {moving[0].shard_id} are moving (a rebalance that"
                      " did not finish): finish it with `irdma rebalance`.")
    if syncing or under_replicated:
        return Health("degraded", "yellow", 1,
                      f"{under_replicated} chunks have fewer replicas than asked"
                      + (f"; shards {', '.join(syncing)} are catching up" if syncing else "")
                      + ": mounts resync them within seconds, `irdma shard resync` does it now.")
    return Health("healthy", "green", 0)


@cli.command()
@META_OPTION
@friendly
def status(meta_url: str) -> None:
    """The cluster at a glance: shards up, capacity, used, files.

    Exits 0 when the cluster is healthy, 1 when it is degraded (a shard is down or catching
    up), 2 when a file cannot be read: its chunks are lost, or their in-sync replicas are all
    on shards that do not answer (the files, and the shards they wait for, are listed).
    Drained and removed shards are history: they are not counted.
    """
    v = trio.run(_status, meta_url)
    live = [(rec, st, why) for rec, st, why in v.stats if rec.state not in RETIRED]
    retired = [rec for rec, _, _ in v.stats if rec.state in RETIRED]
    up_ = [st for _, st, _ in live if st is not None]
    cap = sum(st.capacity for st in up_)
    used = sum(st.used for st in up_)
    chunks = sum(st.chunks for st in up_)
    health = cluster_health(v.stats, v.damaged, v.under_replicated, v.moving, v.waiting)
    table = Table(title="irdma status", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("metadata", _redact(meta_url))
    tier_code, tier_advice = 0, []  # type: tuple[int, list[str]]
    if meta_url.startswith(("postgresql://", "postgres://")):
        tier_code, tier_advice = _metadata_tier(table, meta_url)
    table.add_row("health", f"[{health.style}]{health.word}[/]" if not tier_code or health.exit_code
                  else "[yellow]degraded[/] (the metadata tier)")
    table.add_row("shards up", f"{len(up_)} of {len(live)} (shard map epoch {v.epoch}"
                  + (f"; {len(retired)} drained or removed, not counted" if retired else "") + ")")
    table.add_row("capacity", format_size(cap))
    table.add_row("used", f"{format_size(used)} ({100 * used / cap:.1f}%)" if cap else "-")
    table.add_row("chunks", str(chunks))
    syncing = [str(rec.shard_id) for rec, st, _ in live if st is not None and rec.health in ("syncing", "down")]
    table.add_row("under-replicated chunks",
                  str(v.under_replicated) + (f" (shards {', '.join(syncing)} syncing)" if syncing else ""))
    table.add_row("inodes", str(v.usage[0]))
    table.add_row("bytes in files", format_size(v.usage[1]))
    if v.damaged or v.waiting:
        table.add_row("unreadable files", f"{len(v.damaged) + len(v.waiting)} ({len(v.damaged)} lost,"
                      f" {len(v.waiting)} waiting for a shard)")
    out.print(table)
    if v.damaged:
        _print_damaged(v.damaged)
    if v.waiting:
        _print_waiting(v.waiting)
    if health.advice:
        console.print(health.advice, highlight=False, soft_wrap=True)
    for line in tier_advice:
        console.print(line, highlight=False, soft_wrap=True)
    sys.exit(max(health.exit_code, tier_code))


def _metadata_tier(table: Any, meta_url: str) -> tuple[int, list[str]]:
    """Rows for the PostgreSQL servers of ``meta_url`` (each host of a multi-host URL: role,
    sync state, replay lag); returns (1 if a server is down or no standby is synchronous, else
    0; the advice for each problem)."""
    from ..meta.postgres import tier_status

    members = tier_status(meta_url)
    advice: list[str] = []
    for m in members:
        if m.role == "standby":
            lag = "lag unknown (grant pg_monitor to the irdma role to see it)" if m.lag_bytes is None \
                else f"lag {format_size(m.lag_bytes)}"
            what = f"standby, {m.sync or 'not replicating from the primary'}, {lag}"
        elif m.role == "down":
            what = f"[red]down[/]: {escape(m.error)}"
            advice.append(f"metadata server {m.server} does not answer: bring its host back (Patroni rejoins it as a"
                          " standby, rewinding an old primary); `patronictl -c /etc/patroni/config.yml list` shows"
                          " the members, `patronictl reinit SCOPE MEMBER` rebuilds one that cannot rejoin")
        else:
            what = "[green]primary[/]"
        table.add_row("metadata server" if len(members) == 1 else f"metadata {m.server}", what)
    up = [m for m in members if m.role != "down"]
    primaries = [m for m in up if m.role == "primary"]
    if len(members) > 1 and not primaries:
        advice.append("no metadata server is the primary: a failover is under way (Patroni's ttl) or the etcd"
                      " majority is lost (`etcdctl endpoint health`); calls wait up to failover_timeout")
    if len(members) > 1 and primaries and not any(m.sync in ("sync", "quorum") for m in up):
        advice.append("no standby is synchronous: a commit is not on a second server until one is (Patroni's"
                      " synchronous_mode names one when a standby streams); check the standbys' logs")
    return (1 if advice else 0), advice


def _print_damaged(damaged: list[Any], limit: int = 50) -> None:
    table = Table(title="files with lost chunks")
    for col in ("inode", "path", "lost chunks", "on shards"):
        table.add_column(col)
    for d in damaged[:limit]:
        idx = ", ".join(map(str, d.lost_chunks[:8])) + (" ..." if len(d.lost_chunks) > 8 else "")
        table.add_row(str(d.ino), d.path or "(no name)", idx, ", ".join(map(str, d.shards)))
    out.print(table, soft_wrap=True)
    if len(damaged) > limit:
        out.print(f"... and {len(damaged) - limit} more (`irdma fsck` lists every one)")


def _print_waiting(waiting: list[Any], limit: int = 50) -> None:
    table = Table(title="files that cannot be read until a shard answers")
    for col in ("inode", "path", "chunks", "waits for shards", "older copies on"):
        table.add_column(col)
    for u in waiting[:limit]:
        idx = ", ".join(map(str, u.chunks[:8])) + (" ..." if len(u.chunks) > 8 else "")
        table.add_row(str(u.ino), u.path or "(no name)", idx, ", ".join(map(str, u.waits_for)),
                      ", ".join(map(str, u.stale)) or "-")
    out.print(table, soft_wrap=True)
    if len(waiting) > limit:
        out.print(f"... and {len(waiting) - limit} more (`irdma fsck` lists every one)")


@cli.command()
@META_OPTION
@friendly
def fsck(meta_url: str) -> None:
    """Check the namespace against the shards: every written chunk's in-sync replicas (present,
    with a version, on shards that answer), missing and leaked chunks.

    Lists files that cannot be read: chunks lost (no in-sync replica left, or freed behind the
    namespace's back) and chunks whose in-sync replicas are all on shards that do not answer
    (with the shards they wait for); in-sync replicas missing on their shard; chunks no file
    owns, dead sessions and orphans. Changes nothing (`irdma gc` collects exactly what it
    reports). Drained and removed shards are history: not checked. Exits 0 when clean, 1 when
    there is garbage, a replica is missing or a shard in service could not be checked, 2 when
    a file cannot be read.
    """
    from ..client.native import Client
    from .fsck import scan

    async def run() -> Any:
        async with Client.open(meta_url, transport="tcp") as client:
            with console.status("checking") as st:
                return await scan(client, progress=lambda msg: st.update(msg))

    rep = trio.run(run)
    missing = sorted(rep.missing.items())
    if rep.damaged:
        _print_damaged(rep.damaged, limit=len(rep.damaged))  # every one
    if rep.waiting:
        _print_waiting(rep.waiting, limit=len(rep.waiting))
    if missing:
        table = Table(title="in-sync replicas missing on their shard (the other replicas serve them)")
        for col in ("inode", "chunks (shard)"):
            table.add_column(col)
        for ino, lst in missing[:50]:
            table.add_row(str(ino), ", ".join(f"{i} ({s})" for i, s in lst[:8]) + (" ..." if len(lst) > 8 else ""))
        out.print(table, soft_wrap=True)
    out.print(f"unreadable files: {len(rep.damaged) + len(rep.waiting)} ({len(rep.damaged)} lost,"
              f" {len(rep.waiting)} waiting for a shard); replicas missing: {sum(len(x) for _, x in missing)};"
              f" leaked chunks: {len(rep.leaked)} ({format_size(rep.leaked_bytes)}); dead sessions:"
              f" {len(rep.sessions)}; orphans: {len(rep.orphans)}; abandoned snapshots: {len(rep.abandoned)};"
              f" shards not checked: {len(rep.unreachable)}",
              highlight=False, soft_wrap=True)
    for sid, why in rep.unreachable:
        console.print(f"shard {sid} not checked: {why}", highlight=False, soft_wrap=True)
    if rep.unreadable:
        health = cluster_health([], rep.damaged, waiting=rep.waiting)
        console.print(health.advice, highlight=False, soft_wrap=True)
        sys.exit(2)
    if rep.garbage or rep.unreachable or missing:
        if rep.garbage:
            console.print("`irdma gc` frees the leaked chunks, dead sessions, orphans and abandoned snapshots.",
                          highlight=False)
        if rep.unreachable:
            console.print("restart the shards not checked (`irdma shard list` names them), then check again.",
                          highlight=False)
        sys.exit(1)
    out.print("clean")


#: How `irdma info` shows a shard's health and a chunk's state.
_HEALTH_STYLE = {"up": "green", "down": "red", "syncing": "yellow", "unknown": "yellow", "drained": "dim",
                 "removed": "dim"}
_CHUNK_STYLE = {"ok": "green", "under-replicated": "yellow", "waiting": "bold red", "lost": "bold red", "hole": "dim"}


def _styled(word: str, styles: dict[str, str]) -> str:
    style = styles.get(word)
    return f"[{style}]{escape(word)}[/]" if style else escape(word)


@cli.command("info")
@click.argument("path")
@META_OPTION
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout (sizes in bytes; keys in irdma/ops/info.py).")
@click.option("--recursive", "-r", is_flag=True, help="A directory: sum up its whole tree (else its own entries).")
@click.option("--chunks", "max_chunks", type=click.IntRange(0), default=64, show_default=True,
              help="Chunks a file's table shows (--json lists every one).")
@friendly
def info_cmd(path: str, meta_url: str, as_json: bool, recursive: bool, max_chunks: int) -> None:
    """Where PATH's bytes live (as `juicefs info`): for a file its size, update op, chunk size,
    replicas and I/O mode, and per chunk its replicas in placement order (the first one up heads
    the chain): each one's shard, the shard's health, the replica's state in the chunk map and
    the chunk's version on the shard; then each shard's share. For a directory: its files, directories, bytes and chunks, and each
    shard's share (--recursive: its whole tree).

    PATH is a path in the namespace (/jobs/x/w), or a path under an irdma mount (/mnt/ps/jobs/x/w):
    then the mount's namespace and the directory it shows (--subdir) are used ($IRDMA_META yields),
    and a --meta that names another namespace is an error. Exits 2 when a chunk under PATH cannot be read (it waits for a shard,
    or is lost), 1 when one has fewer replicas than asked, else 0 (as `irdma status`).
    """
    import json
    import stat as stat_
    from datetime import datetime

    from ..client.native import Client
    from . import info as I

    where_ = target(path, meta_url)
    ns_path, mount, meta_url = where_.path, where_.mount, where_.meta_url

    async def run() -> Any:
        async with Client.open(meta_url, transport="tcp") as client:
            return await I.path_info(client, ns_path, recursive=recursive)

    got = trio.run(run)
    if as_json:
        out.print_json(json.dumps({**I.as_dict(got), "mount": mount}))
        sys.exit(got.totals.exit_code)
    where = ns_path + (f" (under the mount on {mount})" if mount else "")
    table = Table(title=f"irdma info {escape(ns_path)}", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("path", escape(where))
    table.add_row("inode", str(got.ino))
    t = got.totals
    if isinstance(got, I.DirInfo):
        table.add_row("type", "directory, " + ("its whole tree" if got.recursive
                                               else "its own entries (--recursive: the whole tree)"))
        table.add_row("files", str(got.files))
        table.add_row("directories", str(got.dirs))
        if got.others:
            table.add_row("other entries", f"{got.others} (symbolic links, FIFOs, sockets, devices)")
        table.add_row("bytes in files", f"{format_size(got.bytes)} ({got.bytes} bytes)")
        table.add_row("new files get", f"chunk size {format_size(got.chunk_size) if got.chunk_size else 'inherited'},"
                      f" update op {got.update_op or 'inherited'}")
    else:
        table.add_row("type", got.kind)
        table.add_row("size", f"{format_size(got.size)} ({got.size} bytes)")
    table.add_row("mode", f"{stat_.filemode(got.mode)} ({got.mode & 0o7777:04o}), owner {got.uid}:{got.gid}")
    table.add_row("modified", datetime.fromtimestamp(got.mtime_ns / 1e9).astimezone().isoformat(timespec="seconds"))
    if isinstance(got, I.FileInfo) and got.kind == "file":
        table.add_row("update op", got.update_op)
        table.add_row("chunk size", format_size(got.chunk_size or 0))
        table.add_row("replicas", f"{got.replicas} (striped over shards {', '.join(map(str, got.stripe))})")
        table.add_row("I/O mode", got.io)
    own_rows = {"user.irdma.update", "user.irdma.chunk_size"}  # rows of their own above
    if isinstance(got, I.FileInfo) and got.kind == "file":
        own_rows.add("user.irdma.io")
    for name, value in sorted(got.xattrs.items()):
        if name not in own_rows:
            table.add_row(escape(name), escape(value))
    table.add_row("chunks", f"{t.chunks} ({t.written} written, {t.holes} holes); {t.replicas_held} in-sync replicas")
    health = ("[green]ok[/]" if not t.exit_code else
              ", ".join(f"[{'bold red' if n != 'under-replicated' else 'yellow'}]{c} {n}[/]"
                        for c, n in ((t.under_replicated, "under-replicated"), (t.waiting, "waiting for a shard"),
                                     (t.lost, "lost")) if c))
    table.add_row("chunk health", health)
    out.print(table)
    if isinstance(got, I.FileInfo) and got.chunks:
        shown = got.chunks[:max_chunks]
        width = max(len(c.replicas) for c in shown) if shown else 0
        ct = Table(title=f"chunks of {escape(ns_path)}: replicas in placement order (the first that is up heads the"
                         " chain), each as shard, its health, state in the chunk map, version")
        for col in ("chunk", "bytes", "state"):
            ct.add_column(col, justify="right" if col == "chunk" else "left")
        for k in range(width):
            ct.add_column(f"replica {k + 1}")
        for c in shown:
            cells = [f"{r.shard_id} {_styled(r.health, _HEALTH_STYLE)} {escape(r.state)}"
                     f" {'-' if r.version is None else f'v{r.version}'}{' (joining)' if r.joining else ''}"
                     for r in c.replicas]
            ct.add_row(str(c.index), f"{format_size(c.offset)} +{format_size(c.length)}",
                       _styled(c.state, _CHUNK_STYLE), *cells, *([""] * (width - len(cells))))
        out.print(ct)
        if len(got.chunks) > len(shown):
            out.print(f"... and {len(got.chunks) - len(shown)} more (--json lists all)", highlight=False)
    if t.shards:
        st = Table(title=f"shards holding {escape(ns_path)} (in-sync replicas)")
        for col in ("shard", "address", "health", "chunks", "bytes", "allocated", "share"):
            st.add_column(col, justify="left" if col in ("address", "health") else "right")
        for sh in t.shards:
            st.add_row(str(sh.shard_id), escape(sh.address), _styled(sh.health, _HEALTH_STYLE), str(sh.chunks),
                       format_size(sh.bytes), format_size(sh.allocated_bytes), f"{sh.share_pct:.1f}%")
        out.print(st)
    if t.lost:
        console.print(f"{_count(t.lost, 'chunk')} under {ns_path} {'is' if t.lost == 1 else 'are'} lost (no in-sync"
                      " replica is left): reads of them fail with EIO; rewrite the files or restore them from a"
                      " checkpoint, `irdma fsck` lists every one.", highlight=False, soft_wrap=True)
    if t.waiting:
        console.print(f"{_count(t.waiting, 'chunk')} under {ns_path} cannot be read until a shard that holds an"
                      " in-sync replica answers again or is resynced: restart the shards down (`irdma up --dir D`"
                      " for a local cluster), `irdma shard resync` for one catching up; `irdma status` names them.",
                      highlight=False, soft_wrap=True)
    if t.under_replicated:
        console.print(f"{_count(t.under_replicated, 'chunk')} under {ns_path} {'has' if t.under_replicated == 1 else 'have'}"
                      " fewer replicas than asked: restart the shards down; mounts resync them within seconds,"
                      " `irdma shard resync` does it now.", highlight=False, soft_wrap=True)
    sys.exit(t.exit_code)


@cli.command()
@META_OPTION
@click.option("--dry-run", is_flag=True, help="Report what would be freed; change nothing.")
@friendly
def gc(meta_url: str, dry_run: bool) -> None:
    """Free what no file needs: dead sessions, orphans (files with no name that no live
    session holds open), leaked chunks (no file's, or past the end of a file no live
    session holds open: a crashed writer's), and snapshots left 'creating' for 10 minutes by
    a creator that died. --dry-run reports exactly what a run frees."""
    from ..client.native import Client
    from .fsck import collect_garbage
    from .progress import transfer_progress

    async def run() -> Any:
        async with Client.open(meta_url, transport="tcp") as client:
            # the scan's phases as the label; then bytes and items (orphaned files, leaked chunks) freed
            with transfer_progress("gc: collecting", unit="items", console=console, final_line=not dry_run) as step:
                return await collect_garbage(client, dry_run=dry_run, progress=lambda msg: step.describe(f"gc: {msg}"),
                                             step=step)

    rep = trio.run(run)
    verb = "would free" if dry_run else "freed"
    out.print(f"{verb}: {len(rep.sessions)} dead sessions, {len(rep.orphans)} orphaned files"
              f" ({format_size(rep.orphan_bytes)}), {len(rep.leaked)} leaked chunks ({format_size(rep.leaked_bytes)}),"
              f" {len(rep.abandoned)} abandoned snapshots", highlight=False)
    for snap in rep.abandoned:
        out.print(f"  snapshot {snap.name.decode(errors='replace')!r} of directory inode {snap.dir}: left 'creating'"
                  " by a creator that died", highlight=False)
    for sid, why in rep.unreachable:
        console.print(f"shard {sid} not collected: {why}", highlight=False, soft_wrap=True)
    if rep.unreachable:
        sys.exit(1)


@cli.command()
@click.option("--meta", "meta_url", default=None, help="Benchmark the native client against this namespace.")
@click.option("--mount", "mountpoint", type=click.Path(file_okay=False), help="Benchmark through this mount.")
@click.option("--size", default="256MiB", show_default=True, callback=_size, help="Test file size.")
@click.option("--chunk-size", default="4MiB", show_default=True, callback=_size)
@click.option("--block", default="4MiB", show_default=True, callback=_size, help="Bytes per request.")
@click.option("--concurrency", "-c", default=4, show_default=True, help="Requests in flight.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@click.option("--tests", default="push-assign,pull,push-add,latency", show_default=True,
              help="Comma-separated: push-assign, pull, push-add, latency.")
@click.option("--latency-ops", default=1000, show_default=True, help="4 KiB reads timed for p50/p99.")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON on stdout.")
@click.option("--page-cache", is_flag=True, help="Through a mount: use the page cache (default: direct I/O).")
@click.option("--path", default="/.irdma-bench", show_default=True, help="Test file, removed at the end.")
@friendly
def bench(meta_url: str | None, mountpoint: str | None, size: int, chunk_size: int, block: int, concurrency: int,
          transport: str, tests: str, latency_ops: int, as_json: bool, page_cache: bool, path: str) -> None:
    """Sequential pull/push bandwidth and 4 KiB read latency (like ib_write_bw or fio)."""
    import json

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from ..client.native import Client
    from . import bench as B

    if (meta_url is None) == (mountpoint is None):
        raise click.UsageError("give exactly one of --meta (native client) or --mount (through FUSE)")
    wanted = tuple(t.strip() for t in tests.split(",") if t.strip())
    bad = set(wanted) - {"push-assign", "pull", "push-add", "latency"}
    if bad:
        raise click.BadParameter(f"unknown tests {sorted(bad)}", param_hint="--tests")
    cfg = B.BenchConfig(size=size, chunk_size=chunk_size, block=block, concurrency=concurrency,
                        latency_ops=latency_ops, tests=wanted, direct_io=not page_cache, path=path)
    with Progress(TextColumn("{task.description:>16}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=total)
            bar.update(tasks[name], completed=done)

        if meta_url is not None:
            async def run() -> list[B.BenchResult]:
                async with Client.open(meta_url, transport=transport) as client:
                    return await B.bench_native(client, cfg, progress)

            results = trio.run(run)
            where = f"native client ({transport}) on {_redact(meta_url)}"
        else:
            assert mountpoint is not None
            results = B.bench_mount(mountpoint, cfg, progress)
            where = f"mount {mountpoint}"
    if as_json:
        out.print_json(json.dumps({"where": where, "config": vars(cfg), "results": B.as_dicts(results)}, default=str))
        return
    table = Table(title=f"irdma bench: {where}, {format_size(size)} file, {format_size(chunk_size)} chunks,"
                        f" {format_size(block)} requests x {concurrency}")
    for col in ("test", "bytes", "seconds", "MB/s", "p50 µs", "p99 µs"):
        table.add_column(col, justify="left" if col == "test" else "right")
    for r in results:
        table.add_row(r.name, format_size(r.bytes), f"{r.seconds:.3f}", f"{r.mb_s:.1f}",
                      "-" if r.p50_us is None else f"{r.p50_us:.0f}", "-" if r.p99_us is None else f"{r.p99_us:.0f}")
    out.print(table)


@cli.command("format")
@click.argument("url", required=False)
@META_OPTION
@click.option("--replicas", "-r", type=click.IntRange(1, 8), default=None,
              help="Copies of each chunk of new files [default: 2 once there are 2 shards or more, else 1].")
@friendly
def format_(url: str | None, meta_url: str, replicas: int | None) -> None:
    """Make an empty namespace by hand in the database at URL (a new SQLite file, or an empty
    PostgreSQL database: postgresql://USER@HOST:PORT/DB) and the cluster key file.

    The key goes to --key-file / $IRDMA_KEY_FILE (required for PostgreSQL: copy it, mode 0600,
    to every host), else cluster.key beside a SQLite file. An existing key file is kept. Then on
    each host: `irdma server --listen ADDR --meta URL --data-dir DIR --key-file K`, and
    `irdma mount URL MNT --key-file K`.
    """
    import contextlib

    from .._errors import Exists, NotFound
    from ..meta import meta_path, meta_scheme, open_meta
    from ..wire.auth import KEY_FILE_ENV, KEY_FILE_NAME, create_key_file, read_key_file

    meta_url = url or meta_url
    key_file = os.environ.get(KEY_FILE_ENV)
    if meta_scheme(meta_url) == "sqlite":
        path = meta_path(meta_url)
        if os.path.exists(path):
            raise Exists(f"a namespace already exists at {path}", "use it, or pick another URL")
        key_file = key_file or os.path.join(os.path.dirname(path), KEY_FILE_NAME)
        meta_url = f"sqlite://{path}"
    else:
        if not key_file:
            raise InvalidArgument("where should the cluster key go? a PostgreSQL namespace has no directory of its own",
                                  "pass --key-file PATH (or set IRDMA_KEY_FILE), then copy that file to every host")
        try:
            with contextlib.closing(open_meta(meta_url)):
                pass
        except (InvalidArgument, NotFound):
            pass  # an empty database: what format is for
        else:
            raise Exists("the database already holds an irdma namespace", "use it, or pick another database")
    ring = read_key_file(key_file) if os.path.exists(key_file) else create_key_file(key_file)
    with contextlib.closing(open_meta(meta_url, create=True)) as meta:
        meta.set_replicas(replicas or 2)
        shown = meta.url
    console.print(f"namespace {shown}; cluster key {key_file} (cluster {ring.cluster_hex}): start shards"
                  f" with `irdma server --listen HOST:PORT --meta URL --data-dir DIR --key-file {key_file}`",
                  highlight=False, soft_wrap=True)


# ---------------------------------------------------------------- metadata backup and migration
_PROGRESS_OPTION = click.option("--progress/--no-progress", default=None,
                                help="Progress bars on standard error [default: when it is a terminal].")
_QUIET_OPTION = click.option("--quiet", "-q", is_flag=True, help="No progress and no summary line.")


@cli.command("dump")
@click.argument("meta_url")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@_PROGRESS_OPTION
@_QUIET_OPTION
@friendly
def dump_cmd(meta_url: str, file: str, progress: bool | None, quiet: bool) -> None:
    """Back up the metadata at META_URL to FILE (JSON; - for standard output; .gz: gzipped).

    One consistent snapshot of every persistent table (namespace, xattrs, symlinks, chunk
    maps, shard map, settings, job coordination state, id counters), streamed; writers may go
    on. Not in a dump: the shards' bytes, the cluster key file, sessions. Restore or migrate
    with `irdma load URL FILE` (SQLite <-> PostgreSQL either way).
    """
    from .dumpload import dump_file

    dump_file(meta_url, file, progress=progress, quiet=quiet, console=console)


@cli.command("load")
@click.argument("meta_url")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@_PROGRESS_OPTION
@_QUIET_OPTION
@friendly
def load_cmd(meta_url: str, file: str, progress: bool | None, quiet: bool) -> None:
    """Restore the metadata `irdma dump` wrote to FILE (- for standard input) into META_URL.

    META_URL must hold no namespace yet: a new SQLite file (made here), an empty PostgreSQL
    database, or a namespace `irdma format` just made; anything else is refused, unchanged.
    The load is one transaction: on any error nothing is changed. Then start the shards on
    their data directories with --meta META_URL and the cluster's key file.
    """
    from .dumpload import load_file

    load_file(meta_url, file, progress=progress, quiet=quiet, console=console)


# ---------------------------------------------------------------- the cost model
def _rate(ctx: Any, param: Any, value: str) -> float:
    from ..units import parse_rate

    try:
        return parse_rate(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _cap(ctx: Any, param: Any, value: str) -> float | None:
    return None if value.strip().lower() in ("none", "off", "") else _rate(ctx, param, value)


def _duration(ctx: Any, param: Any, value: str) -> float:
    from ..units import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _slices(ctx: Any, param: Any, values: tuple[str, ...]) -> tuple[int, ...]:
    from ..train.costmodel import parse_tensor_size

    try:
        return tuple(0 if v.strip() == "0" else parse_tensor_size(v) for v in values)
    except ValueError as exc:
        raise click.BadParameter(f"{exc} (0: whole tensors)") from None


def _modes(ctx: Any, param: Any, values: tuple[str, ...]) -> tuple[str, ...]:
    from ..train.costmodel import ConfigError, parse_mode

    try:
        for v in values:
            parse_mode(v)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    return values


def _tensor_sizes(layout: str | None, sizes: str | None) -> tuple[int, ...]:
    """The tensor bytes of ``--layout`` (a layout.json) or ``--sizes`` (comma-separated)."""
    import json

    from ..train.costmodel import parse_tensor_size, sizes_from_layout

    if (layout is None) == (sizes is None):
        raise click.UsageError("give exactly one of --layout (a Keras job's layout.json) or --sizes")
    if sizes is not None:
        try:
            parsed = tuple(parse_tensor_size(s) for s in sizes.split(",") if s.strip())
        except ValueError as exc:
            raise click.BadParameter(f"{exc}: write sizes like 4MB,1MB,40000f (f: a count of float32)",
                                     param_hint="--sizes") from None
        if not parsed:
            raise click.BadParameter("no sizes: write sizes like 4MB,1MB,40000f", param_hint="--sizes")
        return parsed
    assert layout is not None
    try:
        with open(layout) as f:
            entries = json.load(f)
        if not isinstance(entries, list):
            raise ValueError("it is not a list of tensors")
        return sizes_from_layout(entries)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise click.BadParameter(f"{layout}: {exc} (irdma.train.keras writes it: a list of {{name, shape, offset,"
                                 " dtype}})", param_hint="--layout") from None


#: The option of `irdma tune` that sets each field of a costmodel.Config.
_TUNE_OPTIONS = {"sizes": "--sizes", "workers": "--workers", "hosts": "--hosts", "shards": "--shards",
                 "window": "--window", "sync_every": "--sync-every", "compute_s": "--compute",
                 "flops": "--flops", "peak_flops_per_s": "--peak", "backward_fraction": "--backward-fraction",
                 "mode": "--mode", "slice_bytes": "--slice", "overlap": "--overlap"}


@cli.command()
@click.option("--layout", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Keras job's layout.json (list of {name, shape, offset, dtype}, see irdma.train.keras).")
@click.option("--sizes", default=None, metavar="LIST",
              help="Tensor sizes in forward order instead of --layout: 4MB,1MB,40000f (f: float32 count).")
@click.option("--workers", type=click.IntRange(1), default=4, show_default=True, help="Data-parallel workers.")
@click.option("--hosts", type=click.IntRange(1), default=2, show_default=True,
              help="Hosts the workers run on (must divide --workers).")
@click.option("--shards", type=click.IntRange(1), default=2, show_default=True, help="Shard servers.")
@click.option("--colocated", is_flag=True, help="Shards run on the worker hosts (else each on a host of its own).")
@click.option("--bandwidth", default="1gbit", show_default=True, callback=_rate,
              help="Each host NIC's rate, each way: 1gbit, 10gbit, 125MB/s.")
@click.option("--latency", default="100us", show_default=True, callback=_duration,
              help="One-way latency between hosts: 100us, 1ms.")
@click.option("--cap", default="none", show_default=True, callback=_cap,
              help="Bytes/s each way the processes of one host can move (a software limit): 400MB/s, or none.")
@click.option("--overhead", default="50us", show_default=True, callback=_duration,
              help="Fixed cost of one request (one slice).")
@click.option("--window", type=click.IntRange(1), default=4, show_default=True, help="Requests in flight per shard.")
@click.option("--compute", default="1s", show_default=True, callback=_duration,
              help="Compute seconds of one iteration of one worker (forward + back-prop).")
@click.option("--flops", type=click.FloatRange(min=0), default=None,
              help="FLOPs of one iteration instead of --compute (roofline with --peak and --mem-bandwidth).")
@click.option("--peak", type=click.FloatRange(min=0, min_open=True), default=None, help="Peak FLOP/s (with --flops).")
@click.option("--mem-bandwidth", default="10GB/s", show_default=True, callback=_rate,
              help="Memory bandwidth: the roofline, and the local sums of hier.")
@click.option("--slice", "slices", multiple=True, default=("0", "160KB"), show_default=True, callback=_slices,
              help="Slice size (repeat for several; 0: whole tensors; 40000f = 40,000 float32).")
@click.option("--mode", "modes", multiple=True, default=("flat", "hier", "topk:0.01", "sign"), show_default=True,
              callback=_modes, help="flat, hier, topk:FRACTION or sign (repeat for several).")
@click.option("--overlap", "overlaps", multiple=True, type=click.Choice(["none", "fifo", "p3"]),
              default=("none", "fifo", "p3"), show_default=True, help="Overlap of communication with compute (repeat).")
@click.option("--sync-every", type=click.IntRange(1), default=1, show_default=True,
              help="hier: synchronise across hosts every K steps.")
@click.option("--backward-fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=2 / 3,
              show_default="2/3", help="Share of the compute spent in back-prop.")
@click.option("--json", "as_json", is_flag=True, help="Print every prediction as JSON on stdout.")
@friendly
def tune(layout: str | None, sizes: str | None, workers: int, hosts: int, shards: int, colocated: bool,
         bandwidth: float, latency: float, cap: float | None, overhead: float, window: int, compute: float,
         flops: float | None, peak: float | None, mem_bandwidth: float, slices: tuple[int, ...],
         modes: tuple[str, ...], overlaps: tuple[str, ...], sync_every: int, backward_fraction: float,
         as_json: bool) -> None:
    """Predict the time of a training iteration for every mode, overlap and slice size; pick the best.

    The model (irdma/train/costmodel.py) prices pushes and pulls on the busiest NIC, latency and request
    overheads, and how much of that back-prop and the forward pass hide (FIFO or P3 priority).
    """
    import json

    from ..train.costmodel import Config, ConfigError, explain, grid, rank, ring_allreduce_time
    from ..units import format_duration, format_rate

    tensors = _tensor_sizes(layout, sizes)
    roofline = flops is not None
    try:
        base = Config(sizes=tensors, workers=workers, hosts=hosts, shards=shards, colocated=colocated,
                      link_bytes_per_s=bandwidth, latency_s=latency, cap_bytes_per_s=cap, overhead_s=overhead,
                      window=window, compute_s=None if roofline else compute, flops=flops, peak_flops_per_s=peak,
                      mem_bytes_per_s=mem_bandwidth, sync_every=sync_every, backward_fraction=backward_fraction,
                      mode="hier" if sync_every > 1 else "flat")  # grid() sets the mode of each row
        ranked = rank(grid(base, modes, overlaps, slices))
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=_TUNE_OPTIONS.get(exc.field, exc.field)) from None
    ring = base.compute_time_s() + ring_allreduce_time(base.model_bytes, workers, base.rate_bytes_per_s, latency)
    reason = explain(ranked)
    if as_json:
        out.print_json(json.dumps({"model_bytes": base.model_bytes, "tensors": len(tensors), "ring_allreduce_s": ring,
                                   "best": ranked[0].config.label, "reason": reason,
                                   "predictions": [p.as_dict() for p in ranked]}))
        return
    from rich import box

    table = Table(title=f"irdma tune: {format_size(base.model_bytes)} in {len(tensors)} tensors, {workers} workers on"
                        f" {hosts} hosts, {shards} shards{' (colocated)' if colocated else ''},"
                        f" {format_rate(bandwidth)}{f' capped at {format_rate(cap)}' if cap else ''},"
                        f" {format_duration(latency)} latency,"
                        f" compute {format_duration(base.compute_time_s())} per iteration", box=box.SIMPLE,
                  collapse_padding=True, pad_edge=False)
    for col in ("#", "mode", "overlap", "slice", "time", "comm", "exposed", "busiest link", "bound"):
        table.add_column(col, justify="left" if col in ("mode", "overlap", "bound") else "right")
    for k, p in enumerate(ranked, 1):
        c = p.config
        table.add_row(str(k), c.mode + (f" K={c.sync_every}" if c.sync_every > 1 else ""), c.overlap,
                      format_size(c.slice_bytes) if c.slice_bytes else "whole", format_duration(p.time_s),
                      format_duration(p.comm_s), format_duration(p.exposed_s), format_size(p.busiest_link_bytes),
                      p.bound)
    out.print(table)
    out.print(f"ring all-reduce, for reference (dense, no overlap): {format_duration(ring)} per iteration",
              highlight=False, soft_wrap=True)
    out.print(f"best: {reason}", highlight=False, soft_wrap=True)
    # the best row DistributedOptimizer runs as ranked (the hierarchy sums whole steps: no overlap)
    k, runnable = next(((k, p) for k, p in enumerate(ranked, 1) if not (p.config.mode == "hier"
                                                                     and p.config.overlap != "none")),
                       (1, ranked[0]))
    out.print(f"in model.fit: {_keras_args(runnable.config)}" + (f" (row {k}: the best model.fit runs)" if k > 1
                                                                  else ""), highlight=False, soft_wrap=True)


def _keras_args(c: Any) -> str:
    """How to train in configuration ``c`` (a costmodel Config) with irdma.keras."""
    args = ["opt"]
    if c.mode == "hier":
        args.append("hierarchy=True")
        if c.sync_every > 1:
            args.append(f"sync_every={c.sync_every}")
    if c.overlap != "none":
        args.append(f"overlap={c.overlap!r}")
        if c.overlap == "p3" and c.slice_bytes:
            args.append(f"slice_elems={c.slice_bytes // 4}")
    if c.mode not in ("flat", "hier"):
        args.append(f"compress={c.mode!r}")
    return f"hvd.DistributedOptimizer({', '.join(args)}) with hvd.BroadcastInitialWeights(0) (import irdma.keras as hvd)"


# ---------------------------------------------------------------- keys
def _key_ring(meta_url: str | None) -> Any:
    from ..wire.auth import KeySource, default_key_file

    return KeySource(default_key_file(meta_url)).ring()


@cli.group()
def key() -> None:
    """The cluster key: every connection to a shard proves it (see SECURITY.md)."""


@key.command("rotate")
@click.option("--dir", "cluster_dir", default=None, type=click.Path(file_okay=False),
              help="The local cluster whose key to rotate (its cluster.key). [default: $IRDMA_KEY_FILE]")
@click.option("--finish", is_flag=True, help="Stop accepting the previous key (once every process has the new one).")
@friendly
def key_rotate(cluster_dir: str | None, finish: bool) -> None:
    """Put a new key in the key file without stopping anything.

    Shards and clients read the file again when it changes: new connections prove the new key,
    shards still accept the previous one (and open connections keep their session keys) until
    `irdma key rotate --finish`. A key file on several hosts must be copied to each of them.
    """
    from ..wire.auth import KEY_FILE_ENV, rotate_key_file

    path = os.environ.get(KEY_FILE_ENV) if cluster_dir is None else _cluster.key_file_of(cluster_dir)
    if not path:
        raise InvalidArgument("which key file? pass --dir D of the cluster, or --key-file / IRDMA_KEY_FILE")
    ring = rotate_key_file(path, drop_old=finish)
    if finish:
        console.print(f"{path}: only the current key is accepted now (cluster {ring.cluster_hex})", highlight=False)
    else:
        console.print(f"{path}: new key in use; the previous one is still accepted until"
                      f" `irdma key rotate --finish` (cluster {ring.cluster_hex})", highlight=False)


@key.command("security")
@click.argument("level", type=click.Choice(["integrity", "auth"]), required=False)
@click.option("--dir", "cluster_dir", default=None, type=click.Path(file_okay=False),
              help="The local cluster whose key file to change (its cluster.key). [default: $IRDMA_KEY_FILE]")
@friendly
def key_security(level: str | None, cluster_dir: str | None) -> None:
    """Show or set the cluster's security level (kept in the key file, so every shard and
    client that reads it agrees; a shard and a client at different levels refuse each other).

    integrity (the default): every byte of every frame is authenticated (GMAC). auth: the
    headers and control fields are, tensor payloads are not (faster; for trusted fabrics).
    Connections opened after the change use the new level; open ones keep theirs (remount and
    restart clients to move them). See SECURITY.md.
    """
    from ..wire.auth import KEY_FILE_ENV, read_key_file, set_security

    path = os.environ.get(KEY_FILE_ENV) if cluster_dir is None else _cluster.key_file_of(cluster_dir)
    if not path:
        raise InvalidArgument("which key file? pass --dir D of the cluster, or --key-file / IRDMA_KEY_FILE")
    ring = set_security(path, level) if level is not None else read_key_file(path)
    console.print(f"{path}: security level {ring.security}" + (" (new connections use it)" if level else ""),
                  highlight=False)


def _set_key_file(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    from ..wire.auth import KEY_FILE_ENV

    if value:
        os.environ[KEY_FILE_ENV] = os.path.abspath(value)  # what every client and `irdma up` read


def _add_key_file_options(group: click.Group) -> None:
    """Give every command ``--key-file`` (the server has its own)."""
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            _add_key_file_options(cmd)
        elif name != "server" and not any(p.name == "key_file" for p in cmd.params):
            cmd.params.append(click.Option(
                ["--key-file"], type=click.Path(dir_okay=False), expose_value=False, is_eager=True,
                callback=_set_key_file, help="The cluster's key file [default: $IRDMA_KEY_FILE, else cluster.key"
                " beside the metadata]."))


_add_key_file_options(cli)


def fstab_args(argv: list[str]) -> list[str] | None:
    """``irdma URL MOUNTPOINT [-o OPTIONS]``, as mount.fuse3 runs the program of an fstab line of
    type ``fuse.irdma``, as the arguments of `irdma mount` (:func:`irdma.ops.fstab.mount_args`),
    and ``irdma mount ... -o OPTIONS`` with the options as flags; None for any other command line.

    Raises:
        MountOptionError: an option irdma does not know.
    """
    from .fstab import mount_args

    if argv[:1] == ["mount"] and "-o" in argv[1:-1]:
        rest, flags = [], []
        for i, arg in enumerate(argv):
            if arg == "-o" and i + 1 < len(argv):
                flags += mount_args("", "", argv[i + 1])[3:]
            elif i == 0 or argv[i - 1] != "-o":
                rest.append(arg)
        return rest + flags
    if len(argv) < 2 or ("://" not in argv[0] and not argv[0].endswith(".db")) or argv[0].startswith("-"):
        return None
    options = [argv[i + 1] for i in range(2, len(argv) - 1) if argv[i] == "-o"]
    return mount_args(argv[0], argv[1], ",".join(options))


cli.add_command(snapshot_cli.group(META_OPTION, friendly, console, out, target))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = fstab_args(argv) or argv
    except IrdmaError as exc:
        console.print(f"error: {escape(str(exc))}", highlight=False)
        sys.exit(1)
    cli.main(args=args, prog_name="irdma")


if __name__ == "__main__":
    main()
