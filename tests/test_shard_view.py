"""Chain building and failover of :class:`irdma.client.view.ShardView` over a fake shard map: no
shard process, no metadata database, trio's MockClock for the deadlines."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import cast

import pytest
import trio
import trio.testing

from irdma import IrdmaError
from irdma._errors import Fenced, IsADirectory, ShardUnavailable
from irdma.client.view import ShardView, layout_of
from irdma.meta import Inode, ShardRecord
from irdma.meta.aio import AsyncMeta
from irdma.meta.sql_rows import NOT_CURRENT
from irdma.placement import MOVE_ALL, Layout, Move


class FakeShardMap:
    """The shard map calls a ShardView makes, in memory: each change of health moves the epoch on."""

    url = "fake://"

    def __init__(self, records: Iterable[ShardRecord], moves: Sequence[Move] = (), epoch: int = 1) -> None:
        self.records = {r.shard_id: r for r in records}
        self.moves = list(moves)
        self.epoch = epoch
        self.withdrawn: list[tuple[int, list[tuple[int, int]], int | None]] = []
        self.health_fails = False

    async def shard_view(self) -> tuple[int, list[ShardRecord], list[Move]]:
        return self.epoch, list(self.records.values()), list(self.moves)

    async def shards(self) -> list[ShardRecord]:
        return list(self.records.values())

    async def set_shard_health(self, shard_id: int, health: str) -> tuple[str, int]:
        if self.health_fails:
            raise IrdmaError("the metadata engine is away")
        old = self.records[shard_id].health
        if health == "up" and old in NOT_CURRENT:
            health = "syncing"  # the engine's rule (meta/sql_cluster.py): it may have missed updates
        if health != old:
            self.records[shard_id] = dataclasses.replace(self.records[shard_id], health=health)
            if health in NOT_CURRENT or old in NOT_CURRENT:  # chains change: a new view
                self.epoch += 1
        return health, self.epoch

    async def withdraw_replicas(self, ino: int, replicas: Sequence[tuple[int, int]], epoch: int | None = None) -> bool:
        if epoch != self.epoch:
            return False
        self.withdrawn.append((ino, list(replicas), epoch))
        return True


def _shards(*health: str) -> list[ShardRecord]:
    return [ShardRecord(k + 1, f"10.0.0.{k + 1}:7000", "up", 0, health=h) for k, h in enumerate(health)]


def _view(fake: FakeShardMap, timeout: float = 10.0) -> ShardView:
    view = ShardView(cast(AsyncMeta, fake), timeout)
    trio.run(view.refresh)
    return view


def _run(fn: object, *args: object) -> object:
    async def main() -> object:
        return await fn(*args)  # type: ignore[operator]

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# chunk 0 of file 3 over stripe (1, 2, 3): replicas 1, 2, 3 from (3 + 0) % 3 = shard 1, in order
LAYOUT = Layout(3, 1 << 20, (1, 2, 3), 3)


def test_chain_is_the_up_replicas_in_placement_order() -> None:
    view = _view(FakeShardMap(_shards("up", "up", "up")))
    reps, joining = view.placed(LAYOUT, 0)
    assert joining is None and sorted(reps) == [1, 2, 3]
    assert view.chain_of(LAYOUT, 0) == reps


def test_a_down_replica_leaves_the_chain_and_a_syncing_one_is_its_tail() -> None:
    reps, _ = _view(FakeShardMap(_shards("up", "up", "up"))).placed(LAYOUT, 0)
    health = {reps[0]: "syncing", reps[1]: "down", reps[2]: "up"}
    view = _view(FakeShardMap(_shards(*(health[s] for s in (1, 2, 3)))))
    assert view.chain_of(LAYOUT, 0) == (reps[2], reps[0])
    assert not view.in_view(reps[0]) and not view.in_view(reps[1]) and view.in_view(reps[2])


def test_no_up_to_date_replica_fails_the_chain_but_one_replica_is_always_used() -> None:
    view = _view(FakeShardMap(_shards("down", "syncing", "down")))
    with pytest.raises(ShardUnavailable, match="no up-to-date replica of chunk 0 of file 3"):
        view.chain_of(LAYOUT, 0)
    single = Layout(3, 1 << 20, (1, 2, 3), 1)
    assert view.chain_of(single, 0) == (single.shard_of(0),)


def test_a_move_target_joins_as_the_tail_unless_it_is_down() -> None:
    layout = Layout(3, 1 << 20, (1, 2), 2)
    drain = Move(1, 2, (4,), False, MOVE_ALL)
    records = [*_shards("up", "up"), ShardRecord(4, "10.0.0.4:7000", "up", 0, health="up")]
    view = _view(FakeShardMap(records, [drain]))
    reps, joining = view.placed(layout, 0)
    assert joining == 4 and reps[-1] == 4 and 2 in reps
    assert view.chain_of(layout, 0) == reps
    assert view.feeding(4) == [2, 4] and view.shards_of(layout) == {1, 2, 4}
    down = _view(FakeShardMap([*records[:2], dataclasses.replace(records[2], health="down")], [drain]))
    assert down.chain_of(layout, 0) == reps[:-1]


def test_drained_and_removed_shards_hold_nothing_of_a_file() -> None:
    records = [*_shards("up", "up"), ShardRecord(4, "10.0.0.4:7000", "up", 0, health="up")]
    records[1] = dataclasses.replace(records[1], state="drained")
    view = _view(FakeShardMap(records, [Move(1, 2, (4,), True, MOVE_ALL)]))
    assert view.shards_of(Layout(3, 1 << 20, (1, 2), 2)) == {1, 4}


def test_the_chain_message_carries_the_view_it_was_built_in() -> None:
    fake = FakeShardMap(_shards("up", "up", "up"), epoch=7)
    view = _view(fake, timeout=2.0)
    msg = view.chain(42, (2, 3))
    assert (msg.request_id, msg.view, msg.timeout_ms) == (42, 7, 1000)
    assert msg.successors == ((2, "10.0.0.2:7000"), (3, "10.0.0.3:7000"))
    assert view.chain(42, (), view=5).view == 5
    assert view.where(2) == "shard 2 at 10.0.0.2:7000" and view.where(9) == "shard 9"


def test_a_failed_replica_is_held_out_for_a_deadline_and_the_view_moves_on() -> None:
    fake = FakeShardMap(_shards("up", "up", "up"))
    view = _view(fake, timeout=5.0)

    async def main() -> None:
        reps = view.chain_of(LAYOUT, 0)
        await view.mark_down(reps[0])
        assert fake.epoch == 2 and view.epoch == 2  # the epoch moved: the view was read again
        assert view.chain_of(LAYOUT, 0) == reps[1:]
        assert not view.current(reps[0])
        # back and resynced elsewhere: the shard map says up, yet it is held out until the deadline
        fake.records[reps[0]] = dataclasses.replace(fake.records[reps[0]], health="up")
        view.health[reps[0]] = "up"
        assert view.in_view(reps[0]) and not view.current(reps[0])
        await trio.sleep(5.0)
        assert view.current(reps[0])

    _run(main)


def test_a_shard_seen_up_again_is_no_longer_held_out() -> None:
    fake = FakeShardMap(_shards("up", "up", "up"))
    view = _view(fake, timeout=5.0)

    async def main() -> None:
        await view.mark_down(1)
        assert 1 in view.down_until
        fake.records[1] = dataclasses.replace(fake.records[1], health="up")
        await view.refresh()
        assert 1 not in view.down_until and view.current(1)

    _run(main)


def test_health_unchanged_or_unrecordable_reads_nothing() -> None:
    fake = FakeShardMap(_shards("up", "up", "up"))
    view = _view(fake)

    async def main() -> None:
        await view.note_health(1, "up")  # as recorded: no call
        fake.health_fails = True
        await view.note_health(1, "down")  # logged, not raised
        assert view.health[1] == "up" and view.epoch == 1

    _run(main)


def test_replicas_a_chain_skips_are_withdrawn_once_per_view_and_fenced_when_it_moved_on() -> None:
    fake = FakeShardMap(_shards("up", "down", "up"))
    view = _view(fake)

    async def main() -> None:
        chain = view.chain_of(LAYOUT, 0)
        assert 2 not in chain
        await view.withdraw(LAYOUT, [0], chain, view.epoch)
        await view.withdraw(LAYOUT, [0], chain, view.epoch)  # once per replica and view
        assert fake.withdrawn == [(3, [(0, 2)], 1)]
        await view.withdraw(LAYOUT, [0], view.placed(LAYOUT, 0)[0], view.epoch)  # every replica: nothing
        assert len(fake.withdrawn) == 1
        fake.epoch = 2  # moved on elsewhere: a replica not yet withdrawn is refused, nothing recorded
        with pytest.raises(Fenced, match="moved on from view 1"):
            await view.withdraw(LAYOUT, [1], view.chain_of(LAYOUT, 1), 1)
        assert len(fake.withdrawn) == 1

    _run(main)


def test_layout_of_a_directory_is_refused() -> None:
    d = Inode(ino=5, mode=0o40755, uid=0, gid=0, size=0, nlink=2, atime_ns=0, mtime_ns=0, ctime_ns=0, chunk_size=None)
    with pytest.raises(IsADirectory):
        layout_of(d)
