"""The ``irdma`` command line: shard servers, local clusters, mounts and cluster status."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import click
import trio
from rich.console import Console
from rich.table import Table

from . import cluster as _cluster
from ._errors import IrdmaError, TransportUnavailable
from .transport import TRANSPORTS
from .units import format_size, parse_size

console = Console(stderr=True)
out = Console()


def _meta_default() -> str:
    return os.environ.get("IRDMA_META") or _cluster.meta_url_of(_cluster.default_dir())


META_OPTION = click.option(
    "--meta", "meta_url", default=_meta_default, show_default="$IRDMA_META or the default cluster's",
    help="Metadata URL of the namespace (sqlite:///PATH/meta.db).",
)
DIR_OPTION = click.option(
    "--dir", "cluster_dir", default=_cluster.default_dir, show_default="$IRDMA_HOME or ~/.irdma",
    type=click.Path(file_okay=False), help="Directory of the local cluster.",
)


def _size(ctx: Any, param: Any, value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Print an IrdmaError as one line with what to do next, and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except IrdmaError as exc:
            console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
            sys.exit(1)

    return wrapper


@click.group()
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.version_option(package_name="irdma")
def cli(verbose: int) -> None:
    """irdma: an RDMA parameter server exposed as a POSIX filesystem."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---------------------------------------------------------------- server
@cli.command()
@click.option("--listen", default="127.0.0.1:7700", show_default=True, help="HOST:PORT to serve (port 0 picks one).")
@click.option("--capacity", default="2GiB", show_default=True, callback=_size, help="Size of the memory region.")
@click.option("--shard-id", type=int, default=0, show_default=True, help="This shard's id in the shard map.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@click.option("--port-file", type=click.Path(dir_okay=False), help="Write the bound HOST:PORT here when ready.")
@click.option("--auth-token", envvar="IRDMA_AUTH_TOKEN", default="", help="Clients must present this token.")
@friendly
def server(listen: str, capacity: int, shard_id: int, transport: str, port_file: str | None, auth_token: str) -> None:
    """Run one shard server in the foreground until SIGTERM or Ctrl-C."""
    from irdma.server.serve import run_server
    from irdma.server.shard import PAGE, Region, Shard

    from .transport import parse_address

    logging.getLogger("irdma").setLevel(min(logging.getLogger().level, logging.INFO))
    try:
        host, port = parse_address(listen)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    if capacity < PAGE:
        raise click.BadParameter(f"capacity must be at least {PAGE} bytes", param_hint="--capacity")
    capacity -= capacity % PAGE
    verbs = None
    if transport != "tcp":
        from .transport import verbs_status

        ok, why = verbs_status()
        if transport == "auto":
            logging.getLogger("irdma.server").info("transport auto: %s (%s)", "verbs" if ok else "tcp", why)
        if ok or transport == "verbs":
            from irdma.server.verbs import VerbsShard

            if not ok:
                raise TransportUnavailable(f"RDMA verbs transport unavailable: {why}", "use --transport tcp")
            verbs = VerbsShard(shard_id, capacity)
    shard = verbs.shard if verbs is not None else Shard(shard_id, Region(capacity))
    try:
        trio.run(functools.partial(run_server, shard, host, port, port_file=port_file,
                                   credentials=auth_token.encode(), verbs=verbs))
    finally:
        if verbs is not None:
            verbs.close()


# ---------------------------------------------------------------- local cluster
@cli.command()
@DIR_OPTION
@click.option("--shards", "-n", default=2, show_default=True, help="Number of shard processes.")
@click.option("--capacity", default="1GiB", show_default=True, callback=_size, help="Memory region per shard.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the shards listen on.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@click.option("--fresh", is_flag=True, help="Wipe the namespace of a stopped cluster in --dir.")
@friendly
def up(cluster_dir: str, shards: int, capacity: int, host: str, transport: str, fresh: bool) -> None:
    """Start a local cluster: SQLite metadata in --dir and N shard processes."""
    with console.status(f"starting {shards} shards in {cluster_dir}") as status:

        def progress(msg: str) -> None:
            console.log(msg)
            status.update(msg)

        url = _cluster.up(cluster_dir, shards, capacity, host=host, transport=transport, fresh=fresh, progress=progress)
    out.print(url, highlight=False)
    console.print(
        f"cluster up. Next: [bold]irdma mount {url} MOUNTPOINT[/], [bold]irdma status --meta {url}[/],"
        f" and [bold]irdma down --dir {cluster_dir}[/] to stop it.", highlight=False,
    )


@cli.command()
@DIR_OPTION
@click.option("--keep", is_flag=True, help="Keep the namespace (its data is gone with the shards).")
@friendly
def down(cluster_dir: str, keep: bool) -> None:
    """Stop the local cluster started by `irdma up`."""
    n = _cluster.down(cluster_dir, keep=keep, progress=console.log)
    console.print(f"cluster in {cluster_dir} stopped ({n} shard processes).")


# ---------------------------------------------------------------- mounts
@cli.command()
@click.argument("meta_url")
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@click.option("--foreground", "-f", is_flag=True, help="Serve in this process until unmounted.")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Log of the background mount process.")
@click.option("--direct-io", is_flag=True, help="Direct I/O for every file (else per file: xattr user.irdma.io).")
@click.option("--allow-other", is_flag=True, help="Let every user use the mount; the kernel checks file modes.")
@friendly
def mount(meta_url: str, mountpoint: str, transport: str, foreground: bool, log_file: str | None,
          direct_io: bool, allow_other: bool) -> None:
    """Mount the namespace at META_URL on MOUNTPOINT with FUSE."""
    from irdma.fs.mount import serve_mount, spawn_mount

    from .meta import open_meta

    open_meta(meta_url).close()  # fail here, clearly, if there is no namespace
    if foreground:
        logging.getLogger("irdma").setLevel(logging.INFO)
        trio.run(functools.partial(serve_mount, meta_url, os.path.abspath(mountpoint), transport=transport,
                                   direct_io=direct_io, allow_other=allow_other))
        return
    log_file = log_file or os.path.join(
        os.path.dirname(meta_url.removeprefix("sqlite://")) or ".", f"mount-{os.path.basename(os.path.abspath(mountpoint))}.log"
    )
    with console.status(f"mounting {meta_url} on {mountpoint}"):
        pid = spawn_mount(meta_url, mountpoint, transport=transport, log_file=log_file, direct_io=direct_io,
                          allow_other=allow_other)
    console.print(f"mounted on {os.path.abspath(mountpoint)} (pid {pid}, log {log_file}); `irdma umount {mountpoint}` to stop.",
                  highlight=False)


@cli.command()
@click.argument("mountpoint", type=click.Path(file_okay=False))
@friendly
def umount(mountpoint: str) -> None:
    """Unmount an irdma mount (waits for its writes to be on the shards)."""
    from irdma.fs.mount import unmount

    unmount(mountpoint)
    console.print(f"unmounted {os.path.abspath(mountpoint)}", highlight=False)


# ---------------------------------------------------------------- shards and status
@cli.group()
def shard() -> None:
    """Manage the shard map."""


async def _stats(meta_url: str) -> tuple[list[Any], tuple[int, int], int]:
    from .client import Client

    async with Client.open(meta_url, transport="tcp") as client:
        return await client.shard_stats(), await client.meta.usage(), await client.meta.epoch()


@shard.command("list")
@META_OPTION
@friendly
def shard_list(meta_url: str) -> None:
    """Every shard: id, address, state, capacity, used, chunks."""
    stats, _, epoch = trio.run(_stats, meta_url)
    table = Table(title=f"shards of {meta_url} (epoch {epoch})")
    for col in ("id", "address", "state", "capacity", "used", "chunks"):
        table.add_column(col, justify="right" if col in ("id", "capacity", "used", "chunks") else "left")
    for rec, st, _why in stats:
        if st is None:
            table.add_row(str(rec.shard_id), rec.address, "[red]down[/]", "-", "-", "-")
        else:
            table.add_row(str(rec.shard_id), rec.address, "[green]up[/]", format_size(st.capacity),
                          format_size(st.used), str(st.chunks))
    out.print(table)
    for rec, st, why in stats:
        if st is None:
            console.print(f"shard {rec.shard_id} at {rec.address}: {why}", highlight=False)


@shard.command("add")
@click.argument("address")
@META_OPTION
@friendly
def shard_add(address: str, meta_url: str) -> None:
    """Register the shard server at ADDRESS (HOST:PORT) in the shard map."""
    from .meta import open_meta
    from .transport import parse_address

    parse_address(address)
    rec = open_meta(meta_url).add_shard(address)
    console.print(f"registered shard {rec.shard_id} at {address}; start it with"
                  f" `irdma server --listen {address} --shard-id {rec.shard_id}` if it is not running.")


@cli.command()
@META_OPTION
@friendly
def status(meta_url: str) -> None:
    """The cluster at a glance: shards up, capacity, used, files."""
    stats, (inodes, file_bytes), epoch = trio.run(_stats, meta_url)
    up_ = [st for _, st, _ in stats if st is not None]
    cap = sum(st.capacity for st in up_)
    used = sum(st.used for st in up_)
    chunks = sum(st.chunks for st in up_)
    table = Table(title="irdma status", show_header=False)
    table.add_column("what")
    table.add_column("value")
    health = "[green]healthy[/]" if len(up_) == len(stats) and stats else "[red]degraded[/]"
    table.add_row("metadata", meta_url)
    table.add_row("health", health)
    table.add_row("shards up", f"{len(up_)} of {len(stats)} (shard map epoch {epoch})")
    table.add_row("capacity", format_size(cap))
    table.add_row("used", f"{format_size(used)} ({100 * used / cap:.1f}%)" if cap else "-")
    table.add_row("chunks", str(chunks))
    table.add_row("inodes", str(inodes))
    table.add_row("bytes in files", format_size(file_bytes))
    out.print(table)
    if len(up_) != len(stats):
        console.print("some shards are down: `irdma shard list` names them; restart them or the cluster.")


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

    from . import bench as B
    from .client import Client

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
            where = f"native client ({transport}) on {meta_url}"
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


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="irdma")


if __name__ == "__main__":
    main()
