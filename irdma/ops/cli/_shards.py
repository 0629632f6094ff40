"""The shard map: ``irdma shard add/list/drain/remove/resync`` and ``irdma rebalance``."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import click
import trio
from rich.table import Table

from ..._errors import IrdmaError
from ...units import format_size
from .. import cluster as _cluster
from ._common import META_OPTION, _key_ring, _redact, console, fail, friendly, out
from .health import _count


@click.group()
def shard() -> None:
    """Manage the shard map."""


async def _stats(meta_url: str) -> tuple[list[Any], tuple[int, int], int]:
    from ...client.native import Client

    async with Client.open(meta_url, transport="tcp") as client:
        stats = await client.shard_stats()  # notes each shard's incarnation first
        return stats, await client.meta.usage(), await client.meta.epoch()




async def _resync(meta_url: str, only: list[int] | None) -> int:
    """Resync the shards that are catching up (``only``: these), with a progress bar each
    (bytes of the chunks compared, rate, time left, chunks); returns how many failed."""
    from ...client.native import Client
    from ..progress import transfer_progress

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
    from ...client.fsck import readability
    from ...client.native import Client

    async with Client.open(meta_url, transport="tcp") as client:
        stats = await client.shard_stats()
        if not any(rec.shard_id == shard_id for rec, _, _ in stats):
            from ..._errors import NotFound

            raise NotFound(f"shard {shard_id} is not in the shard map", "`irdma shard list` shows the shards")
        _, waiting, _ = await readability(client, stats)
        return [u for u in waiting if shard_id in u.stale]


async def _force_resync(meta_url: str, shard_id: int) -> int:
    from ...client.native import Client
    from ..progress import transfer_progress

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
    from ...client.native import Client
    from ..progress import transfer_progress

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
    from ...client.native import Client

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
    from ...client.native import Client
    from ..progress import transfer_progress

    async with Client.open(meta_url, transport="tcp") as client:
        with transfer_progress("rebalance", console=console) as step:
            moves = await client.rebalance(step, tolerance)
        return moves, await client.shard_stats()


@click.command()
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

    from ..._errors import Exists, ShardUnavailable
    from ...meta import meta_path, meta_scheme, open_meta
    from ...transport import parse_address
    from ..probe import check_shard

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
