"""The cut under load (issue 23): 4 writer processes push ``add`` of 1.0 into a directory of 3
two-chunk files (each push one request per chunk: a snapshot must take it whole), 2 through 2 real mounts (pwrite + fsync) and 2 through the native client, while the
test takes a snapshot of the directory every 50 ms. Each writer adds to its own element, so
a snapshot's element ``w`` of file ``f`` counts writer ``w``'s pushes into ``f`` that are in
it. Each snapshot must hold every push acknowledged before ``create`` was called and none
that started after it returned, and the snapshots must grow in order (a prefix of every
writer's pushes). Real shard processes, R=2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import trio
from helpers import mounted, running_cluster

import irdma
from irdma.transport.base import ShardConnection

FILES, PUSHES, CHUNK = 3, 150, 4096
SIZE = 2 * CHUNK  # a push is two requests, one per chunk (on the two shards): taken whole or not at all
WRITER = os.path.join(os.path.dirname(__file__), "snapshot_writer.py")


def test_every_snapshot_is_a_prefix_of_every_writer(tmp_path: str) -> None:
    d = str(tmp_path)
    with running_cluster(os.path.join(d, "c"), shards=2, replicas=2) as cl:
        async def setup() -> None:
            async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
                await c.makedirs("/d")
                for k in range(FILES):
                    await c.write(f"/d/f{k}", np.zeros(SIZE // 4, "<f4"), chunk_size=CHUNK)
                    await c.set_update_op(f"/d/f{k}", "add")

        trio.run(setup)
        with mounted(cl.meta_url, os.path.join(d, "m0")) as m0, mounted(cl.meta_url, os.path.join(d, "m1")) as m1:
            wheres = [f"mount:{m0}/d", f"mount:{m1}/d", f"native:{cl.meta_url}:/d", f"native:{cl.meta_url}:/d"]
            procs = [subprocess.Popen([sys.executable, WRITER, str(w), where, str(FILES), str(PUSHES), str(SIZE),
                                       os.path.join(d, f"w{w}.json")]) for w, where in enumerate(wheres)]
            snaps: list[tuple[str, float, float]] = []

            async def snapshotter() -> None:
                async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
                    deadline = time.monotonic() + 60
                    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                        name = f"s{len(snaps)}"
                        t0 = time.monotonic()
                        await c.snapshot("/d", name)
                        snaps.append((name, t0, time.monotonic()))
                        await trio.sleep(0.05)
                    await c.snapshot("/d", "final")  # after every writer is done: all of them
                    snaps.append(("final", time.monotonic(), time.monotonic()))

            trio.run(snapshotter)
            for p in procs:
                assert p.wait(timeout=60) == 0
        logs = []
        for w in range(len(wheres)):
            with open(os.path.join(d, f"w{w}.json")) as f:
                logs.append(json.load(f))

        async def read_all() -> tuple[dict[str, np.ndarray], list[str]]:
            async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
                got = {name: np.stack([await c.pull(f"/d/.snapshots/{name}/f{k}") for k in range(FILES)])
                       for name, _, _ in snaps}
                # every replica cloned at the same cut: each chunk's version and bytes agree on both shards
                differ = []
                for name, _, _ in snaps:
                    for k in range(FILES):
                        ino = (await c.stat(f"/d/.snapshots/{name}/f{k}")).ino
                        for idx in range(SIZE // CHUNK):
                            seen = {sid: await c.shard_call(sid, ShardConnection.checksum, ino, idx, c.view.epoch) for sid in (1, 2)}
                            if len(set(seen.values())) != 1:
                                differ.append(f"{name}/f{k} chunk {idx}: (version, checksum) by shard {seen}")
                return got, differ

        got, differ = trio.run(read_all)
        assert not differ, f"the replicas of snapshot chunks disagree: {differ[:3]}"
    assert len(snaps) >= 10, f"only {len(snaps)} snapshots were taken while the writers ran"
    previous = np.zeros((FILES, len(wheres)))
    for name, t_call, t_return in snaps:
        counts = got[name][:, : len(wheres)]  # element w of each file's first chunk
        second = got[name][:, CHUNK // 4 : CHUNK // 4 + len(wheres)]
        assert (second == counts).all(), (
            f"snapshot {name} holds part of a push: element w of chunk 0 counts {counts.tolist()} pushes,"
            f" of chunk 1 {second.tolist()}")
        for w, log in enumerate(logs):
            for k in range(FILES):
                acked = sum(1 for f, _, t1 in log if f == k and t1 < t_call)
                started = sum(1 for f, t0, _ in log if f == k and t0 < t_return)
                assert acked <= counts[k, w] <= started, (
                    f"snapshot {name}: writer {w} file f{k} holds {counts[k, w]} pushes; {acked} were acknowledged"
                    f" before create was called and {started} had started when it returned")
        assert (counts >= previous).all(), f"snapshot {name} lost pushes an earlier one had"
        rest = np.delete(got[name], np.r_[0 : len(wheres), CHUNK // 4 : CHUNK // 4 + len(wheres)], axis=1)
        assert not rest.any(), "bytes no writer wrote"
        previous = counts
    assert (got["final"][:, : len(wheres)] == PUSHES // FILES).all()


@pytest.fixture(autouse=True)
def _clock() -> None:
    assert time.get_clock_info("monotonic").implementation.startswith("clock_gettime"), \
        "the writers' and the test's times must come from one machine-wide monotonic clock"
