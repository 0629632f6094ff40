"""What `fsck`, `status` and `gc` tell an operator, and that it is true: `fsck` and `status`
name every file that cannot be read and the shard it waits for (and `irdma shard resync
--force-from` is the way out they name); drained and removed shards are history, not failures;
a one-replica file on a shard catching up is readable; `gc --dry-run` reports exactly what `gc`
then frees.

Real shard processes, the real CLI in subprocesses, a real mount SIGKILLed mid-write.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import trio
from helpers import irdma_cli, running_cluster, wait_until

import irdma
from irdma.meta import open_meta
from irdma.ops import cluster as _cluster
from irdma.ops._proc import pid_alive
from irdma.ops.cluster import key_file_of
from irdma.transport.tcp import TcpTransport
from irdma.wire.auth import read_key_file

MB = 1 << 20


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10, f"process {pid} to die")


def _rows(meta_url: str, path: str) -> tuple[int, dict[int, dict[int, int]]]:
    with contextlib.closing(open_meta(meta_url)) as meta:
        ino = meta.resolve(path).ino
        return ino, meta.chunk_map(ino)


def _out(res: subprocess.CompletedProcess[str]) -> str:
    text = res.stdout + res.stderr
    assert "Traceback" not in text, text
    return text


def test_fsck_and_status_name_a_file_whose_only_in_sync_replica_is_on_a_down_shard(tmp_path: object) -> None:
    """3 shards, 2 replicas. Shard 2 is out of the in-sync set of every chunk of /after (it
    missed its updates: the chunk map holds it at incarnation 0) and shard 3 is SIGKILLed: the
    chunk of /after on shards 2 and 3 can be read from no one. `fsck` and `status` exit 2 naming
    /after, the shard it waits for (3) and the shard with an older copy (2); /before, readable
    from shard 2, is not named. `irdma shard resync --force-from 2` warns and asks, then adopts
    shard 2's copy; once shard 3 is back (`irdma up`), nothing is unreadable. A
    replica freed behind the namespace's back while another serves the chunk is reported
    missing (exit 1), not lost."""
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=3, replicas=2, capacity=64 * MB) as c:
        data = os.urandom(3 * MB)
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            cl.write("/before", data, chunk_size=MB)
            cl.write("/after", data[::-1], chunk_size=MB)
        ino, rows = _rows(c.meta_url, "/after")
        assert sorted(map(sorted, rows.values())) == [[1, 2], [1, 3], [2, 3]], rows
        stuck = next(i for i, r in rows.items() if set(r) == {2, 3})
        with contextlib.closing(open_meta(c.meta_url)) as meta:  # what the client records when
            meta._call(lambda self: self._db.execute(  # shard 2 misses updates of /after
                "UPDATE chunks SET incarnation=0 WHERE ino=? AND shard=2", (ino,)), (), {})
        assert irdma_cli("fsck", "--meta", c.meta_url).returncode == 0  # all up: still readable
        shard3 = next(s for s in c.shards if s.shard_id == 3)
        _kill(shard3.pid)

        res = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        text = _out(res)
        assert res.returncode == 2, text
        assert "/after" in text and "/before" not in text, text
        assert "unreadable files: 1 (0 lost, 1 waiting for a shard)" in text, text
        row = next(line for line in text.splitlines() if "/after" in line)
        assert re.search(rf"\b{stuck}\b.*\b3\b.*\b2\b", row), row  # chunk, waits for 3, older copy on 2
        assert "restart" in text and "--force-from 2" in text, text

        res = irdma_cli("status", "--meta", c.meta_url, check=False)
        text = _out(res)
        assert res.returncode == 2, text
        assert "unreadable" in text and "/after" in text and "/before" not in text, text
        assert "shard 3" in text and "--force-from 2" in text and "catching up" not in text, text
        res = irdma_cli("status", "--json", "--meta", c.meta_url, check=False)
        doc = json.loads(res.stdout)  # stdout is the document alone; the advice is on stderr
        assert (res.returncode, doc["exit_code"], doc["health"], doc["shards_up"]) == (2, 2, "unreadable", 2), doc
        assert [(f["path"], f["waits_for"], f["stale"]) for f in doc["waiting_files"]] == [("/after", [3], [2])], doc
        down = next(s for s in doc["shards"] if s["shard_id"] == 3)
        assert (down["health"], down["answering"], down["bytes_held"]) == ("down", False, None) and down["error"], doc
        assert "--force-from 2" in doc["advice"][0] and "--force-from 2" in res.stderr, doc
        # the operator's way out warns, names what it would adopt, and asks (no answer: nothing changes)
        res = irdma_cli("shard", "resync", "--force-from", "2", "--meta", c.meta_url, check=False)
        text = _out(res)
        assert res.returncode == 1 and "nothing changed" in text and "--yes" in text, text
        assert "warning" in text and "/after" in text and "lost for good" in text, text
        res = irdma_cli("shard", "resync", "1", "--force-from", "2", "--meta", c.meta_url, check=False)
        assert res.returncode == 2 and "not both" in res.stderr, _out(res)
        # taken: shard 2's copy serves /after while shard 3 is still down
        res = irdma_cli("shard", "resync", "--force-from", "2", "--yes", "--meta", c.meta_url, check=False)
        assert res.returncode == 0 and "shard 2 is up to date" in res.stderr, _out(res)
        res = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        assert "unreadable files: 0" in _out(res) and res.returncode == 1, _out(res)  # shard 3 not checked
        assert irdma_cli("status", "--meta", c.meta_url, check=False).returncode == 1
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            assert bytes(cl.read("/after")) == data[::-1]
        # an in-sync replica on a shard that answers but is catching up serves no read until resynced
        with contextlib.closing(open_meta(c.meta_url)) as meta:
            meta.set_shard_health(2, "syncing")
        res = irdma_cli("status", "--meta", c.meta_url, check=False)
        text = _out(res)
        assert res.returncode == 2 and "/after" in text and "`irdma shard resync 2`" in text, text
        irdma_cli("shard", "resync", "2", "--meta", c.meta_url)
        assert irdma_cli("status", "--meta", c.meta_url, check=False).returncode == 1  # shard 3 is down

        res = irdma_cli("up", "--dir", c.dir, check=False)  # restarts shard 3 on its data
        assert res.returncode == 0, _out(res)
        c.shards = _cluster.read_state(c.dir)
        res = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        assert "unreadable files: 0" in _out(res) and res.returncode in (0, 1), _out(res)
        assert irdma_cli("status", "--meta", c.meta_url, check=False).returncode in (0, 1)

        # one replica of a /before chunk freed on its shard: the other serves it
        ino_b, rows_b = _rows(c.meta_url, "/before")
        last = max(rows_b)
        victim = min(rows_b[last])
        address = next(s.address for s in c.shards if s.shard_id == victim)

        async def free() -> None:
            async with trio.open_nursery() as n:
                conn = await TcpTransport().connect(address, n, client_name="foreign",
                                                    key=read_key_file(key_file_of(c.dir)))
                await conn.free(ino_b, last)
                await conn.aclose()

        trio.run(free)
        res = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        text = _out(res)
        assert res.returncode == 1 and "replicas missing: 1" in text and "unreadable files: 0" in text, text
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            assert bytes(cl.read("/before")) == data


def test_status_and_info_json_say_what_was_written(tmp_path: object) -> None:
    """`irdma status --json` and `irdma info --json` are one JSON document on stdout each: the
    bytes in files are the sizes written, each shard's bytes held is what it reports (the
    table shows both); with a shard removed, `status --json` lists it as history."""
    sizes = {"/a": 1000, "/b": 70_000, "/c": MB + 5}
    with running_cluster(str(tmp_path), shards=3, replicas=2, capacity=64 * MB) as c:
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            for path, n in sizes.items():
                cl.write(path, os.urandom(n))
            held = {rec.shard_id: st.used for rec, st, _ in cl.shard_stats()}
        res = irdma_cli("status", "--json", "--meta", c.meta_url)
        doc = json.loads(res.stdout)
        assert (doc["health"], doc["exit_code"], doc["shards_up"], doc["replicas"]) == ("healthy", 0, 3, 2), doc
        assert doc["bytes_in_files"] == sum(sizes.values()) and doc["inodes"] == 4, doc
        assert {s["shard_id"]: s["bytes_held"] for s in doc["shards"]} == held, doc
        assert doc["bytes_held"] == sum(held.values()) >= 2 * sum(sizes.values()), doc  # 2 replicas at least
        assert all(s["bytes_held"] > 0 and s["state"] == "up" and s["answering"] for s in doc["shards"]), doc
        assert doc["capacity_bytes"] == 3 * 64 * MB and doc["chunks"] == 2 * 3, doc
        text = irdma_cli("status", "--meta", c.meta_url).stdout
        assert "bytes held" in text and f"({sum(sizes.values())} bytes; the shards hold" in text, text
        info = json.loads(irdma_cli("info", "/", "--json", "--meta", c.meta_url).stdout)
        assert info["totals"]["bytes_in_files"] == sum(sizes.values()), info
        assert info["totals"]["bytes_held"] == sum(s["allocated_bytes"] for s in info["totals"]["shards"]) > 0, info
        assert "bytes held" in irdma_cli("info", "/c", "--meta", c.meta_url).stdout

        irdma_cli("shard", "drain", "3", "--meta", c.meta_url)
        irdma_cli("shard", "remove", "3", "--meta", c.meta_url)
        doc = json.loads(irdma_cli("status", "--json", "--meta", c.meta_url).stdout)
        assert (doc["exit_code"], doc["shards_up"], doc["shards_in_service"], doc["shards_retired"]) == (0, 2, 2, 1)
        assert [s["state"] for s in doc["shards"] if s["shard_id"] == 3] == ["removed"], doc
        assert doc["bytes_in_files"] == sum(sizes.values()), doc


def test_removed_shards_are_history_not_failures(tmp_path: object) -> None:
    """After `irdma shard drain` and `irdma shard remove` (its process stopped), `fsck`, `gc
    --dry-run` and `status` of the healthy cluster exit 0, and `status` counts the shards in
    service only."""
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=3, replicas=2, capacity=64 * MB) as c:
        data = os.urandom(5 * MB)
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            cl.write("/f", data, chunk_size=MB)
        irdma_cli("shard", "drain", "2", "--meta", c.meta_url)
        irdma_cli("shard", "remove", "2", "--meta", c.meta_url)
        victim = next(s for s in c.shards if s.shard_id == 2)
        _kill(victim.pid)
        res = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        assert res.returncode == 0 and "clean" in res.stdout and "shards not checked: 0" in res.stdout, _out(res)
        assert "shard 2 not checked" not in _out(res)
        res = irdma_cli("gc", "--dry-run", "--meta", c.meta_url, check=False)
        assert res.returncode == 0 and "not collected" not in _out(res), _out(res)
        res = irdma_cli("status", "--meta", c.meta_url, check=False)
        assert res.returncode == 0 and "healthy" in res.stdout, _out(res)
        assert re.search(r"2 of 2 \(shard map epoch \d+; 1 drained or removed", res.stdout), res.stdout
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            assert bytes(cl.read("/f")) == data


def test_a_file_of_one_replica_on_a_shard_catching_up_is_readable(tmp_path: object) -> None:
    """Clients read the one copy of a one-replica file whatever its shard's health: `status`
    and `fsck` do not call it unreadable while the shard is catching up."""
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=1, capacity=64 * MB) as c:
        data = os.urandom(2 * MB)
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            cl.write("/f", data, chunk_size=MB)
        with contextlib.closing(open_meta(c.meta_url)) as meta:
            meta.set_shard_health(1, "syncing")
        res = irdma_cli("status", "--meta", c.meta_url, check=False)
        assert res.returncode == 1 and "catching up" in res.stderr, _out(res)
        res = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        assert res.returncode == 0 and "unreadable files: 0" in res.stdout, _out(res)
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            assert bytes(cl.read("/f")) == data


@pytest.mark.fuse
def test_gc_dry_run_reports_exactly_what_gc_frees_after_a_mount_is_killed_mid_write(tmp_path: object) -> None:
    """A mount SIGKILLed while a writer pushes 48 MiB it never closed: its chunks lie past the
    file's recorded size (0), held open by a dead session. `fsck` and `gc --dry-run` report the
    same leaked chunks and bytes that `gc` then frees, and a second dry run finds nothing."""
    from irdma.fs.mount import spawn_mount

    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=1, capacity=128 * MB) as c:
        def used() -> int:
            with irdma.connect(c.meta_url, transport="tcp") as cl:
                return sum(st.used for _, st, _ in cl.shard_stats() if st is not None)

        base = used()
        mnt = os.path.join(tmp, "victim")
        os.makedirs(mnt)
        pid = spawn_mount(c.meta_url, mnt, transport="tcp", log_file=mnt + ".log")
        writer = subprocess.Popen([sys.executable, "-c", (
            "import os, sys, time\n"
            "f = open(sys.argv[1], 'wb')\n"
            "for i in range(48): f.write(os.urandom(1 << 20))\n"
            "time.sleep(120)\n"), os.path.join(mnt, "dd")])
        try:
            wait_until(lambda: used() >= base + 16 * MB, 60, "the writer's chunks to reach the shards")
            _kill(pid)
        finally:
            writer.kill()
            writer.wait(10)
        irdma_cli("umount", mnt)

        def leaked(text: str) -> tuple[int, str]:
            m = re.search(r"(\d+) leaked chunks \(([^)]*)\)", text) or re.search(r"leaked chunks: (\d+) \(([^)]*)\)", text)
            assert m, text
            return int(m.group(1)), m.group(2)

        dry = irdma_cli("gc", "--dry-run", "--meta", c.meta_url)
        assert "would free: 1 dead sessions" in dry.stdout, dry.stdout
        found = leaked(dry.stdout)
        # 16 MiB or more on the shards: 3 whole 4 MiB chunks at least (the rest may be the extents
        # a growing chunk left, held until the shard's next sync)
        assert found[0] >= 3, dry.stdout
        fsck = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        assert fsck.returncode == 1 and leaked(fsck.stdout) == found, _out(fsck)
        assert "dead sessions: 1" in fsck.stdout, fsck.stdout
        run = irdma_cli("gc", "--meta", c.meta_url)
        assert "freed: 1 dead sessions" in run.stdout and leaked(run.stdout) == found, (dry.stdout, run.stdout)
        again = irdma_cli("gc", "--dry-run", "--meta", c.meta_url)
        assert "would free: 0 dead sessions, 0 orphaned files (0 B), 0 leaked chunks" in again.stdout, again.stdout
        assert used() == base
        assert irdma_cli("fsck", "--meta", c.meta_url).returncode == 0
