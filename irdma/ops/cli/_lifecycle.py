"""The local cluster's life: ``irdma up``, ``irdma down``, ``irdma destroy``."""

from __future__ import annotations

import os
import sys

import click
import trio

from ..._errors import InvalidArgument, IrdmaError
from ...transport import TRANSPORTS
from .. import cluster as _cluster
from ._common import DIR_OPTION, _redact, _size, console, fail, friendly, out
from ._shards import _resync
from .health import _count


@click.command()
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
        from ...metrics import parse_metrics_address

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


@click.command()
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


@click.command()
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
