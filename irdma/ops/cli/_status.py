"""``irdma status`` (the cluster at a glance; its verdict is :mod:`.health`'s), ``irdma fsck``
and ``irdma gc``."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import click
import trio
from rich.markup import escape
from rich.table import Table

from ...units import format_size
from ._common import META_OPTION, _redact, console, friendly, out, times_in_files
from .health import RETIRED, cluster_health

#: The ``irdma status --json`` document's version: bumped when a key changes meaning or goes away.
STATUS_JSON_VERSION = 1


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
    replicas: int


async def _status(meta_url: str) -> _StatusView:
    from ...client.fsck import readability
    from ...client.native import Client

    async with Client.open(meta_url, transport="tcp") as client:
        stats = await client.shard_stats()  # notes each shard's incarnation first
        _, _, moves = await client.meta.shard_view()
        damaged, waiting, _ = await readability(client, stats)
        return _StatusView(stats, await client.meta.usage(), await client.meta.epoch(), damaged, waiting,
                           await client.meta.under_replicated(), [m for m in moves if not m.done],
                           await client.meta.replicas())


def _shard_doc(rec: Any, st: Any, why: str) -> dict[str, Any]:
    """One shard of ``irdma status --json``: its record in the shard map and what its STAT said
    (``answering`` false, and the sizes null, when it did not answer; ``error`` says why)."""
    return {"shard_id": rec.shard_id, "address": rec.address, "state": rec.state,
            "health": rec.health if st is not None or rec.state in RETIRED else "down",
            "answering": st is not None, "incarnation": rec.incarnation,
            "capacity_bytes": None if st is None else st.capacity, "bytes_held": None if st is None else st.used,
            "chunks": None if st is None else st.chunks, "error": "" if st is not None else str(why or "")}


def status_doc(v: _StatusView, meta_url: str, health: str, tier: list[Any], advice: list[str],
               exit_code: int) -> dict[str, Any]:
    """The JSON document of ``irdma status --json``: the facts of the table, keys in snake_case
    with their unit (sizes ``_bytes``, in bytes), documented in docs/operations.md. ``health``:
    the word the table shows (``healthy``, ``degraded``, ``unreadable``, ``data lost``).

    ``capacity_bytes``, ``bytes_held`` and ``chunks`` sum the shards in service that answer (as
    the table); ``bytes_in_files`` is the sum of the files' sizes in the metadata (every inode,
    snapshots' included); ``shards`` lists every shard of the map, drained and removed ones too
    (``state`` says which); ``metadata_servers`` is empty but for a PostgreSQL URL."""
    live = [(rec, st) for rec, st, _ in v.stats if rec.state not in RETIRED]
    up_ = [st for _, st in live if st is not None]
    return {
        "version": STATUS_JSON_VERSION,
        "metadata": _redact(meta_url),
        "health": health,
        "exit_code": exit_code,
        "advice": advice,
        "shard_map_epoch": v.epoch,
        "shards_up": len(up_),
        "shards_in_service": len(live),
        "shards_retired": len(v.stats) - len(live),
        "capacity_bytes": sum(st.capacity for st in up_),
        "bytes_held": sum(st.used for st in up_),
        "bytes_in_files": v.usage[1],
        "chunks": sum(st.chunks for st in up_),
        "under_replicated_chunks": v.under_replicated,
        "replicas": v.replicas,
        "inodes": v.usage[0],
        "moves": [{"seq": m.seq, "shard_id": m.shard_id, "targets": list(m.targets), "share": m.share}
                  for m in v.moving],
        "shards": [_shard_doc(rec, st, why) for rec, st, why in v.stats],
        "lost_files": [{"ino": d.ino, "path": d.path, "chunks": list(d.lost_chunks), "shards": list(d.shards)}
                       for d in v.damaged],
        "waiting_files": [{"ino": u.ino, "path": u.path, "chunks": list(u.chunks), "waits_for": list(u.waits_for),
                           "stale": list(u.stale), "catching_up": list(u.catching_up)} for u in v.waiting],
        "metadata_servers": [dataclasses.asdict(m) for m in tier],
    }


def _in_files(used: int, in_files: int) -> str:
    """The "bytes in files" row: the files' bytes, and how many times that the shards hold
    (replicas, whole chunks and snapshots' copies: the overhead)."""
    times = times_in_files(used, in_files)
    return f"{format_size(in_files)} ({in_files} bytes" + (f"; the shards hold {times})" if times else ")")


@click.command()
@META_OPTION
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout (sizes in bytes; keys in docs/operations.md).")
@friendly
def status(meta_url: str, as_json: bool) -> None:
    """The cluster at a glance: shards up, capacity, bytes held on the shards and bytes in
    files, chunks, files that cannot be read.

    Exits 0 when the cluster is healthy, 1 when it is degraded (a shard is down or catching
    up), 2 when a file cannot be read: its chunks are lost, or their in-sync replicas are all
    on shards that do not answer (the files, and the shards they wait for, are listed).
    Drained and removed shards are history: they are not counted. --json prints the same
    facts, and every shard, as one JSON document on stdout (advice still goes to stderr) and
    exits the same way.
    """
    v = trio.run(_status, meta_url)
    live = [(rec, st, why) for rec, st, why in v.stats if rec.state not in RETIRED]
    retired = [rec for rec, _, _ in v.stats if rec.state in RETIRED]
    up_ = [st for _, st, _ in live if st is not None]
    cap = sum(st.capacity for st in up_)
    used = sum(st.used for st in up_)
    chunks = sum(st.chunks for st in up_)
    health = cluster_health(v.stats, v.damaged, v.under_replicated, v.moving, v.waiting)
    tier: list[Any] = []
    tier_code, tier_advice = 0, []  # type: tuple[int, list[str]]
    if meta_url.startswith(("postgresql://", "postgres://")):
        tier, tier_code, tier_advice = _metadata_tier(meta_url)
    advice = ([health.advice] if health.advice else []) + tier_advice
    code = max(health.exit_code, tier_code)
    if as_json:
        word = health.word if not tier_code or health.exit_code else "degraded"
        out.print_json(json.dumps(status_doc(v, meta_url, word, tier, advice, code)))
        for line in advice:
            console.print(line, highlight=False, soft_wrap=True)
        sys.exit(code)
    table = Table(title="irdma status", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("metadata", _redact(meta_url))
    for server, what in _tier_rows(tier):
        table.add_row(server, what)
    table.add_row("health", f"[{health.style}]{health.word}[/]" if not tier_code or health.exit_code
                  else "[yellow]degraded[/] (the metadata tier)")
    table.add_row("shards up", f"{len(up_)} of {len(live)} (shard map epoch {v.epoch}"
                  + (f"; {len(retired)} drained or removed, not counted" if retired else "") + ")")
    table.add_row("capacity", format_size(cap))
    table.add_row("bytes held", f"{format_size(used)} ({100 * used / cap:.1f}% of capacity)" if cap else "-")
    table.add_row("bytes in files", _in_files(used, v.usage[1]))
    table.add_row("chunks", str(chunks))
    table.add_row("replicas", f"{v.replicas} (of each chunk of a new file)")
    syncing = [str(rec.shard_id) for rec, st, _ in live if st is not None and rec.health in ("syncing", "down")]
    table.add_row("under-replicated chunks",
                  str(v.under_replicated) + (f" (shards {', '.join(syncing)} syncing)" if syncing else ""))
    table.add_row("inodes", str(v.usage[0]))
    if v.damaged or v.waiting:
        table.add_row("unreadable files", f"{len(v.damaged) + len(v.waiting)} ({len(v.damaged)} lost,"
                      f" {len(v.waiting)} waiting for a shard)")
    out.print(table)
    if v.damaged:
        _print_damaged(v.damaged)
    if v.waiting:
        _print_waiting(v.waiting)
    for line in advice:
        console.print(line, highlight=False, soft_wrap=True)
    sys.exit(code)


def _metadata_tier(meta_url: str) -> tuple[list[Any], int, list[str]]:
    """The PostgreSQL servers of ``meta_url`` (each host of a multi-host URL: role, sync state,
    replay lag: :class:`irdma.meta.postgres.TierMember`); 1 if a server is down or no standby
    is synchronous, else 0; the advice for each problem."""
    from ...meta.postgres import tier_status

    members = tier_status(meta_url)
    advice: list[str] = []
    for m in members:
        if m.role == "down":
            advice.append(f"metadata server {m.server} does not answer: bring its host back (Patroni rejoins it as a"
                          " standby, rewinding an old primary); `patronictl -c /etc/patroni/config.yml list` shows"
                          " the members, `patronictl reinit SCOPE MEMBER` rebuilds one that cannot rejoin")
    up = [m for m in members if m.role != "down"]
    primaries = [m for m in up if m.role == "primary"]
    if len(members) > 1 and not primaries:
        advice.append("no metadata server is the primary: a failover is under way (Patroni's ttl) or the etcd"
                      " majority is lost (`etcdctl endpoint health`); calls wait up to failover_timeout")
    if len(members) > 1 and primaries and not any(m.sync in ("sync", "quorum") for m in up):
        advice.append("no standby is synchronous: a commit is not on a second server until one is (Patroni's"
                      " synchronous_mode names one when a standby streams); check the standbys' logs")
    return members, (1 if advice else 0), advice


def _tier_rows(members: list[Any]) -> list[tuple[str, str]]:
    """The status table's rows for the metadata servers :func:`_metadata_tier` found."""
    rows = []
    for m in members:
        if m.role == "standby":
            lag = "lag unknown (grant pg_monitor to the irdma role to see it)" if m.lag_bytes is None \
                else f"lag {format_size(m.lag_bytes)}"
            what = f"standby, {m.sync or 'not replicating from the primary'}, {lag}"
        elif m.role == "down":
            what = f"[red]down[/]: {escape(m.error)}"
        else:
            what = "[green]primary[/]"
        rows.append(("metadata server" if len(members) == 1 else f"metadata {m.server}", what))
    return rows


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


@click.command()
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
    from ...client.fsck import scan
    from ...client.native import Client

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


@click.command()
@META_OPTION
@click.option("--dry-run", is_flag=True, help="Report what would be freed; change nothing.")
@friendly
def gc(meta_url: str, dry_run: bool) -> None:
    """Free what no file needs: dead sessions, orphans (files with no name that no live
    session holds open), leaked chunks (no file's, or past the end of a file no live
    session holds open: a crashed writer's), and snapshots left 'creating' for 10 minutes by
    a creator that died. --dry-run reports exactly what a run frees."""
    from ...client.fsck import collect_garbage
    from ...client.native import Client
    from ..progress import transfer_progress

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
