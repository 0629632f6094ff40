"""How ``irdma status`` (and ``fsck``) sum a cluster up: healthy, degraded, or a file that cannot
be read, with the exit code and the advice (:func:`cluster_health`). No I/O: it reads what
:meth:`irdma.client.native.Client.shard_stats` and :mod:`irdma.client.fsck` found."""

from __future__ import annotations

import dataclasses
from typing import Any


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
    shard that does not answer (``waiting``, :class:`irdma.client.fsck.Unreadable`), the count of
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
