"""``irdma info`` (where a path's bytes live) and ``irdma stats`` (live metrics of mounts and shards)."""

from __future__ import annotations

import sys
from typing import Any

import click
import trio
from rich.markup import escape
from rich.table import Table

from ...units import format_size
from ._common import META_OPTION, _meta_default, console, friendly, out, target, times_in_files
from .health import _count

#: How `irdma info` shows a shard's health and a chunk's state.
_HEALTH_STYLE = {"up": "green", "down": "red", "syncing": "yellow", "unknown": "yellow", "drained": "dim",
                 "removed": "dim"}
_CHUNK_STYLE = {"ok": "green", "under-replicated": "yellow", "waiting": "bold red", "lost": "bold red", "hole": "dim"}


def _styled(word: str, styles: dict[str, str]) -> str:
    style = styles.get(word)
    return f"[{style}]{escape(word)}[/]" if style else escape(word)


@click.command("info")
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

    from ...client.native import Client
    from .. import info as I

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
    times = times_in_files(t.bytes_held, I.bytes_in_files(got))
    table.add_row("bytes held", f"{format_size(t.bytes_held)} (whole chunks"
                  + (f"; {times} the bytes in files)" if times else ")"))
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


@click.command("stats")
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
    from .. import stats as stats_mod

    if not (mountpoints or meta_url or endpoints):
        meta_url = _meta_default()
    stats_mod.run(mountpoints=mountpoints, meta_url=meta_url, endpoints=endpoints, interval=interval, count=count,
                  console=out)
