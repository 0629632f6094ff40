"""The operator CLI of issue 24: `irdma up` restarts each shard as it was first started
(metrics endpoint, durability), `irdma stats` is readable at 80 columns, and the long
commands that move data (drain, gc) report bytes and chunks, on a terminal and off one.

Real shard processes (`irdma up`), a real FUSE mount and the CLI run as a user runs it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from helpers import irdma_cli, mounted, running_cluster, wait_until
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

import irdma
from irdma._errors import InvalidArgument
from irdma.meta import open_meta
from irdma.ops import cluster
from irdma.ops.progress import transfer_progress

MB = 1 << 20


def scrape(address: str) -> dict[str, float]:
    """Every sample of the exporter at ``address``, summed by name."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def up_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A cluster started by `irdma up` with metrics and durability memory (the restart test
    leaves it running with durability fsync); always taken down."""
    d = str(tmp_path_factory.mktemp("up") / "c")
    irdma_cli("up", "--dir", d, "--shards", "2", "--capacity", "64MiB", "--transport", "tcp",
              "--durability", "memory", "--metrics", "127.0.0.1:0")
    try:
        yield d
    finally:
        if os.path.exists(os.path.join(d, cluster.STATE_FILE)):
            irdma_cli("down", "--dir", d, check=False)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _durabilities(log: str) -> list[str]:
    """The durability each start of a shard logged, in order."""
    with open(log) as f:
        return re.findall(r"durability (\w+)\)", f.read())


def test_up_restarts_each_shard_with_its_settings(up_cluster: str) -> None:
    d = up_cluster
    settings = cluster.read_settings(d)
    assert len(settings) == 2
    addresses = {sid: st.metrics for sid, st in settings.items()}
    for st in settings.values():
        assert st.durability == "memory" and st.transport == "tcp" and st.capacity == 64 * MB
        assert st.metrics is not None and not st.metrics.endswith(":0")  # the port chosen is kept
        assert scrape(st.metrics)["irdma_shard_capacity_bytes"] == 64 * MB
    logs = {p.shard_id: p.log for p in cluster.read_state(d)}

    irdma_cli("down", "--dir", d)
    irdma_cli("up", "--dir", d)  # no options: each shard as it was
    for sid, address in addresses.items():
        assert address is not None
        assert scrape(address)["irdma_shard_capacity_bytes"] == 64 * MB  # the same port answers again
        assert _durabilities(logs[sid]) == ["memory", "memory"]
    meta_url = cluster.meta_url_of(d)
    with irdma.connect(meta_url, transport="tcp") as c:
        assert {rec.shard_id: st.metrics for rec, st, _ in c.shard_stats() if st is not None} == addresses

    # an option given replaces the setting ...
    irdma_cli("down", "--dir", d)
    irdma_cli("up", "--dir", d, "--durability", "fsync")
    assert all(st.durability == "fsync" for st in cluster.read_settings(d).values())

    # (a capacity the shards were not made with is refused, and nothing starts or changes)
    irdma_cli("down", "--dir", d)
    before = _read(os.path.join(d, cluster.SETTINGS_FILE))
    with pytest.raises(InvalidArgument, match="leave out --capacity"):
        cluster.up(d, 2, 128 * MB)
    assert not any(cluster.shard_running(p) for p in cluster.read_state(d))
    assert _read(os.path.join(d, cluster.SETTINGS_FILE)) == before

    # ... and is remembered
    irdma_cli("up", "--dir", d)
    for sid, address in addresses.items():
        assert _durabilities(logs[sid]) == ["memory", "memory", "fsync", "fsync"]
        assert address is not None and scrape(address)["irdma_shard_capacity_bytes"] == 64 * MB


def test_stats_fits_80_columns(up_cluster: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: FUSE tests cannot run (load the fuse module)")
    monkeypatch.setenv("IRDMA_RUN_DIR", os.path.join(str(tmp_path), "run"))  # the mount inherits it
    meta_url = cluster.meta_url_of(up_cluster)
    with mounted(meta_url, os.path.join(str(tmp_path), "m"), direct_io=True, metrics="127.0.0.1:0") as mnt:
        done = threading.Event()

        def workload() -> None:  # writes while stats measures, so the write rows have rates
            with open(os.path.join(mnt, "busy.bin"), "wb") as f:
                while not done.is_set():
                    f.write(b"x" * 65536)
                    f.flush()
                    os.fsync(f.fileno())

        worker = threading.Thread(target=workload)
        worker.start()
        try:
            res = irdma_cli("stats", mnt, "--meta", meta_url, "--interval", "0.5", "--count", "1",
                            env={**os.environ, "COLUMNS": "80"})
        finally:
            done.set()
            worker.join()
    text = res.stdout
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, text
    assert "…" not in text and "..." not in text, text
    for header in ("ops/s", "pull MiB/s", "push MiB/s", "p50 ms", "p99 ms", "err/s"):
        assert header in text, text
    assert f"mount {os.path.abspath(mnt)}"[:60] in text.replace("\n", "")
    assert "shard 1: held" in text and "of 64M" in text, text  # bytes held of the capacity
    assert re.search(r"cpu \d+%, mem [\d.]+[KMG]", text), text
    # the mount pushed: its fuse write row has a rate of requests and of bytes
    write_rows = [ln.split() for ln in lines if ln.startswith("  write ")]
    assert write_rows and any(row[1] != "0" and row[3] != "0" for row in write_rows), text

    # a wider terminal shows more columns (the count of requests), still whole
    res = irdma_cli("stats", "--meta", meta_url, "--interval", "0.2", "--count", "1",
                    env={**os.environ, "COLUMNS": "120"})
    assert " ops" in res.stdout.splitlines()[3] and max(map(len, res.stdout.splitlines())) <= 120, res.stdout


def test_transfer_progress_off_a_terminal_prints_bytes_rate_and_count() -> None:
    buf = io.StringIO()
    con = Console(file=buf, width=80, color_system=None)
    with transfer_progress("drain shard 1", console=con, interval=0.0) as step:
        step(0, 8 * MB, 0, 2)
        step(4 * MB, 8 * MB, 1, 2)
        step.describe("drain shard 1 (finishing)")
        step(8 * MB, 8 * MB, 2, 2)
    lines = buf.getvalue().splitlines()
    assert re.fullmatch(r"drain shard 1: 1/2 chunks, 4\.0 MiB/8\.0 MiB, [\d.]+ [KMGT]?i?B/s, \d+ s left", lines[1]), lines
    assert lines[-1].startswith("drain shard 1 (finishing): 2/2 chunks, 8.0 MiB/8.0 MiB")


def test_transfer_progress_on_an_80_column_terminal_keeps_the_numbers_whole() -> None:
    buf = io.StringIO()
    con = Console(file=buf, width=80, force_terminal=True, color_system=None)
    with transfer_progress("resync shard 12 (forced)", console=con) as step:
        step(0, 20000 * MB, 0, 5000)
        step(1000 * MB, 20000 * MB, 250, 5000)
        time.sleep(0.2)  # (rich measures the rate between updates, over time that passed)
        step(8000 * MB, 20000 * MB, 2000, 5000)
        wait_until(lambda: "2000/5000" in buf.getvalue(), 5, "the bar to be drawn")
    frames = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f) for f in buf.getvalue().replace("\r", "\n").split("\n")]
    drawn = [f for f in frames if "2000/5000 chunks" in f]
    assert drawn and all(len(f) <= 80 for f in frames), frames
    assert "7.8/19.5 GiB" in drawn[-1] and "GiB/s" in drawn[-1] and "resync shard" in drawn[-1]


def test_drain_and_gc_report_bytes_and_chunks(tmp_path: object) -> None:
    with running_cluster(str(tmp_path / "c"), shards=3, replicas=1) as c:  # type: ignore[operator]
        with irdma.connect(c.meta_url, transport="tcp") as client:
            client.write("/a.bin", os.urandom(6 * MB), chunk_size=MB)  # 6 chunks over 3 shards
            victim = next(rec.shard_id for rec, st, _ in client.shard_stats() if st is not None and st.chunks)
            chunks = next(st.chunks for rec, st, _ in client.shard_stats() if rec.shard_id == victim)
        res = irdma_cli("shard", "drain", str(victim), "--meta", c.meta_url)  # stderr is not a terminal
        want = f"drain shard {victim}: {chunks}/{chunks} chunks, {chunks}.0 MiB/{chunks}.0 MiB, "
        assert want in res.stderr, res.stderr
        assert "MiB/s" in res.stderr and f"{chunks}.0 MiB copied" in res.stderr, res.stderr
        # 4 chunks past the end of a file no session holds open (a crashed writer's): gc frees them
        with irdma.connect(c.meta_url, transport="tcp") as client:
            client.write("/b.bin", os.urandom(4 * MB), chunk_size=MB)
        with contextlib.closing(open_meta(c.meta_url)) as meta:
            meta.setattr(meta.resolve("/b.bin").ino, size=0)
        res = irdma_cli("gc", "--meta", c.meta_url)
        assert "4 leaked chunks (4.0 MiB)" in res.stdout, res.stdout
        assert re.search(r"^gc: .*: 4/4 items, 4\.0 MiB/4\.0 MiB, ", res.stderr, re.M), res.stderr
