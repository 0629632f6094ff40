"""Prometheus metrics of shards and mounts, and the live view of ``irdma stats``.

Real shard processes (each serving its metrics on a port of its own), a real FUSE mount with
``--metrics``, a known workload, and then the byte counters must equal the bytes moved.
"""

from __future__ import annotations

import errno
import io
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import Samples, assert_clean_log, mounted, parse_samples, scrape, total, wait_until
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

import irdma
from irdma import metrics
from irdma._errors import InvalidArgument, IrdmaError
from irdma.meta import open_meta
from irdma.ops import stats
from irdma.wire.auth import create_key_file

#: A shard process as ``irdma server --metrics`` runs it (run_server with its metrics address).
SHARD = """
import functools, logging, sys, trio
from irdma.wire.auth import KeySource
from irdma.server.serve import run_server
from irdma.server.shard import Region, Shard
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
host, port = sys.argv[1].rsplit(":", 1)
try:
    trio.run(functools.partial(run_server, Shard(int(sys.argv[2]), Region(128 << 20)), host, int(port),
                               keys=KeySource(sys.argv[3]), metrics=sys.argv[4], port_file=sys.argv[5]))
except Exception as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(1)
"""

CAPACITY = 128 << 20  # the SHARD script's region


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MetricsCluster:
    """Two shard processes with metrics, a SQLite namespace with replicas=2, and its key."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.meta_url = f"sqlite://{directory}/meta.db"
        self.key = os.path.join(directory, "cluster.key")
        create_key_file(self.key)
        meta = open_meta(os.path.join(directory, "meta.db"), create=True)
        meta.set_replicas(2)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[str] = []
        self.metrics: dict[int, str] = {}  # shard id -> its metrics HOST:PORT
        try:
            for i in range(2):
                rec = meta.add_shard(f"127.0.0.1:{_free_port()}")
                log = os.path.join(directory, f"shard-{rec.shard_id}.log")
                port_file = os.path.join(directory, f"shard-{rec.shard_id}.port")
                self.logs.append(log)
                with open(log, "w") as out:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-c", SHARD, rec.address, str(rec.shard_id), self.key, "127.0.0.1:0",
                         port_file], stdout=out, stderr=subprocess.STDOUT))
                wait_until(lambda pf=port_file: os.path.exists(pf), 30, f"shard {i} to listen")
            with irdma.connect(self.meta_url, transport="tcp") as c:
                for rec, st, _ in c.shard_stats():
                    assert st is not None and st.metrics, f"shard {rec.shard_id} told no metrics address"
                    self.metrics[rec.shard_id] = st.metrics
        except BaseException:  # no fixture to stop them: stop what started (no process outlives the test)
            self.kill()
            raise
        finally:
            meta.close()

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=30)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=30)
        for log in self.logs:
            assert_clean_log(log)


@pytest.fixture(scope="module")
def mcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsCluster]:
    c = MetricsCluster(str(tmp_path_factory.mktemp("mcluster")))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def mmnt(mcluster: MetricsCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: FUSE tests cannot run (load the fuse module)")
    run_dir = str(tmp_path_factory.mktemp("run"))
    old = os.environ.get("IRDMA_RUN_DIR")
    os.environ["IRDMA_RUN_DIR"] = run_dir  # the mount process inherits it; so does stats here
    try:
        with mounted(mcluster.meta_url, str(tmp_path_factory.mktemp("mmnt") / "m"), direct_io=True,
                     metrics="127.0.0.1:0") as m:
            yield m
    finally:
        if old is None:
            os.environ.pop("IRDMA_RUN_DIR", None)
        else:
            os.environ["IRDMA_RUN_DIR"] = old


def local() -> Samples:
    from prometheus_client import generate_latest

    return parse_samples(generate_latest(metrics.REGISTRY).decode())


def shards_total(scrapes: list[Samples], name: str, **match: str) -> float:
    return sum(total(s, name, **match) for s in scrapes)


# ---------------------------------------------------------------- bad addresses
def test_bad_metrics_addresses_give_clear_errors(tmp_path: object) -> None:
    with pytest.raises(InvalidArgument, match="is not HOST:PORT"):
        metrics.serve("localhost")
    with pytest.raises(InvalidArgument, match="is not HOST:PORT"):
        metrics.serve("127.0.0.1:99999")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(IrdmaError, match=f"127.0.0.1:{port}: the address is already in use.*another --metrics"):
            metrics.serve(f"127.0.0.1:{port}")
        # a shard process refuses to start on it, saying so
        d = str(tmp_path)
        key = os.path.join(d, "cluster.key")
        create_key_file(key)
        res = subprocess.run([sys.executable, "-c", SHARD, f"127.0.0.1:{_free_port()}", "0", key,
                              f"127.0.0.1:{port}", os.path.join(d, "port")], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 1
        assert f"cannot serve metrics on 127.0.0.1:{port}: the address is already in use" in res.stderr
    with pytest.raises(InvalidArgument, match="no-such-host.invalid:9100|cannot serve metrics"):
        metrics.serve("no-such-host.invalid:9100")


def test_spawn_mount_refuses_a_bad_metrics_address(mcluster: MetricsCluster, tmp_path: object) -> None:
    from irdma.fs.mount import spawn_mount

    mnt = os.path.join(str(tmp_path), "m")
    os.makedirs(mnt)
    with pytest.raises(InvalidArgument, match="--metrics 'nope' is not HOST:PORT"):
        spawn_mount(mcluster.meta_url, mnt, transport="tcp", log_file=mnt + ".log", metrics="nope")
    assert not os.path.ismount(mnt)


def test_shard_address_from_irdma_up(monkeypatch: pytest.MonkeyPatch) -> None:
    assert metrics.shard_address("10.0.0.1:9000", 3) == "10.0.0.1:9000"
    assert metrics.shard_address(None, 3) is None
    monkeypatch.setenv(metrics.SHARD_METRICS_ENV, "127.0.0.1:9100")
    assert metrics.shard_address(None, 2) == "127.0.0.1:9102"
    monkeypatch.setenv(metrics.SHARD_METRICS_ENV, "127.0.0.1:0")
    assert metrics.shard_address(None, 2) == "127.0.0.1:0"


# ---------------------------------------------------------------- counters after a known workload
def test_native_client_bytes_equal_shard_counters(mcluster: MetricsCluster) -> None:
    n = 3 * (4 << 20) + 12345 * 4  # several chunks (4 MiB each) and a partial one
    data = np.arange(n // 4, dtype="<f4")
    addrs = list(mcluster.metrics.values())
    before = [scrape(a) for a in addrs]
    mine0 = local()
    with irdma.connect(mcluster.meta_url, transport="tcp") as c:
        c.write("/native.bin", data)
        c.flush()
        back = c.pull("/native.bin", shape=(n // 4,))
    assert np.array_equal(back, data)
    after = [scrape(a) for a in addrs]
    mine = local()

    def shard_delta(name: str, **match: str) -> float:
        return shards_total(after, name, **match) - shards_total(before, name, **match)

    def client_delta(name: str, **match: str) -> float:
        return total(mine, name, **match) - total(mine0, name, **match)

    # exactly the bytes moved, per op and direction, on both sides of the wire
    assert client_delta("irdma_client_bytes_total", op="write", direction="out") == n
    assert client_delta("irdma_client_bytes_total", op="read", direction="in") == n
    assert shard_delta("irdma_shard_bytes_total", op="write", transport="tcp", direction="in") == n
    assert shard_delta("irdma_shard_bytes_total", op="read", transport="tcp", direction="out") == n
    # replicas=2: every byte pushed to a head was forwarded once to the next replica
    assert shard_delta("irdma_shard_bytes_total", op="forward", transport="tcp", direction="in") == n
    # requests: at least one per chunk, all answered ok, and as many as the client sent
    writes = shard_delta("irdma_shard_requests_total", op="write", status="ok")
    assert writes >= 4
    assert writes == client_delta("irdma_client_requests_total", op="write", transport="tcp", status="ok")
    assert shard_delta("irdma_shard_requests_total", op="forward", status="ok") == writes
    assert shard_delta("irdma_shard_requests_total", op="sync", status="ok") >= 2
    assert shard_delta("irdma_shard_request_duration_seconds_count", op="write") == writes
    assert client_delta("irdma_client_request_duration_seconds_count", op="read", transport="tcp") >= 4
    assert shard_delta("irdma_shard_errors_total") == 0
    # replication: forwards acknowledged and timed; none pending once the writes returned
    assert shard_delta("irdma_shard_replication_forwards_total", status="ok") == writes
    assert shard_delta("irdma_shard_replication_forward_duration_seconds_count") == writes
    assert shards_total(after, "irdma_shard_replication_pending_forwards") == 0
    # gauges read at scrape time
    assert shards_total(after, "irdma_shard_capacity_bytes") == 2 * CAPACITY
    assert shards_total(after, "irdma_shard_chunks") >= 2 * 4
    assert shards_total(after, "irdma_shard_held_bytes") >= 2 * n
    assert shards_total(after, "irdma_shard_inflight_requests") == 0
    assert total(mine, "irdma_client_inflight_requests") == 0


def test_pulls_of_replicated_chunks_spread_over_both_replicas(mcluster: MetricsCluster) -> None:
    """With 2 shards and 2 replicas each shard holds every chunk; pulls of many small files
    and of a many-chunk file are served by both, about half each (each shard's read bytes).
    The replica used to be picked by the chain's own rotation: one shard served them all."""
    files = {f"/spread/f{i:02d}": np.full(1024 + i, i, "<f4") for i in range(24)}
    big = np.arange(8 * (1 << 20) // 4, dtype="<f4")  # 8 chunks of 1 MiB
    addrs = list(mcluster.metrics.values())
    with irdma.connect(mcluster.meta_url, transport="tcp") as c:
        c.makedirs("/spread")
        for path, data in files.items():
            c.write(path, data, chunk_size=1 << 16)  # (the module's shards hold 128 MiB)
        c.write("/spread/big", big, chunk_size=1 << 20)
        c.flush()
        before = [scrape(a) for a in addrs]
        for path, data in files.items():
            assert np.array_equal(c.pull(path, shape=data.shape), data)
        assert np.array_equal(c.pull("/spread/big", shape=big.shape), big)
        after = [scrape(a) for a in addrs]
        for path in [*files, "/spread/big"]:
            c.unlink(path)
    served = [total(a, "irdma_shard_bytes_total", op="read", direction="out")
              - total(b, "irdma_shard_bytes_total", op="read", direction="out") for a, b in zip(after, before, strict=True)]
    assert sum(served) == big.nbytes + sum(d.nbytes for d in files.values())
    assert min(served) >= 0.35 * sum(served), served


def test_mount_metrics_count_fuse_requests_and_bytes(mcluster: MetricsCluster, mmnt: str) -> None:
    target = stats.mount_target(mmnt)
    n = 5 * (1 << 20) + 777
    payload = os.urandom(n)
    addrs = list(mcluster.metrics.values())
    before = [scrape(a) for a in addrs]
    m0 = scrape(target.address)
    path = os.path.join(mmnt, "through-fuse.bin")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    got = bytearray()
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, 1 << 20):
            got += chunk
    finally:
        os.close(fd)
    assert bytes(got) == payload
    m1 = scrape(target.address)
    after = [scrape(a) for a in addrs]

    def md(name: str, **match: str) -> float:
        return total(m1, name, **match) - total(m0, name, **match)

    def sd(name: str, **match: str) -> float:
        return shards_total(after, name, **match) - shards_total(before, name, **match)

    # the mount's FUSE side: exactly the bytes the application moved (direct I/O)
    assert md("irdma_fuse_bytes_total", op="write") == n
    assert md("irdma_fuse_bytes_total", op="read") == n
    assert md("irdma_fuse_requests_total", op="write") >= n // (1 << 20)
    assert md("irdma_fuse_requests_total", op="fsync") == 1
    assert md("irdma_fuse_requests_total", op="create") == 1
    assert md("irdma_fuse_request_duration_seconds_count", op="write") == md("irdma_fuse_requests_total", op="write")
    # its client side and the shards agree, byte for byte
    assert md("irdma_client_bytes_total", op="write", direction="out") == n
    assert sd("irdma_shard_bytes_total", op="write", direction="in") == n
    pulled = md("irdma_client_bytes_total", op="read", direction="in")
    assert pulled >= n
    assert sd("irdma_shard_bytes_total", op="read", direction="out") == pulled
    assert md("irdma_client_requests_total", op="write", transport="tcp", status="ok") == \
        sd("irdma_shard_requests_total", op="write", status="ok")
    assert md("irdma_client_request_duration_seconds_count", op="write", transport="tcp") >= 1


# ---------------------------------------------------------------- the live view
def test_stats_run_shows_mount_and_shards(mcluster: MetricsCluster, mmnt: str) -> None:
    done = threading.Event()

    def workload() -> None:  # writes while the view measures, so write rows have rates
        with open(os.path.join(mmnt, "busy.bin"), "wb") as f:
            while not done.is_set():
                f.write(b"x" * 65536)
                f.flush()
                os.fsync(f.fileno())

    worker = threading.Thread(target=workload)
    worker.start()
    buf = io.StringIO()
    try:
        shown = stats.run(mountpoints=[mmnt], meta_url=mcluster.meta_url, interval=0.5, count=1,
                          console=Console(file=buf, width=220, color_system=None))
    finally:
        done.set()
        worker.join()
    assert shown == 1
    text = buf.getvalue()
    assert "irdma stats" in text
    for sid in mcluster.metrics:
        assert f"shard {sid}" in text
    assert f"mount {os.path.abspath(mmnt)}" in text
    # one block per endpoint: its name line, then per layer a total row (named by the layer)
    # and its op rows (indented)
    blocks = {b.splitlines()[0].split(":")[0]: b.splitlines() for b in text.split("\n\n")[1:]}
    mount = blocks[f"mount {os.path.abspath(mmnt)}"]
    for block, layers in ((blocks[f"shard {min(mcluster.metrics)}"], ("shard",)), (mount, ("client", "fuse"))):
        for layer in layers:
            assert any(ln.startswith(layer + " ") for ln in block), f"no {layer} total row:\n{text}"
        assert any(ln.startswith("  write ") for ln in block), f"no write row:\n{text}"
    assert "of 128M" in text  # held / capacity of a shard


def test_stats_run_names_an_endpoint_that_does_not_answer(tmp_path: object) -> None:
    port = _free_port()
    with pytest.raises(IrdmaError, match=f"no metrics from http://127.0.0.1:{port}/metrics.*--metrics"):
        stats.run(endpoints=[f"127.0.0.1:{port}"], interval=0.1, count=1, console=Console(file=io.StringIO()))
    with pytest.raises(IrdmaError, match="no mount on .* serves metrics.*irdma mount --metrics"):
        stats.run(mountpoints=[str(tmp_path)], count=1, console=Console(file=io.StringIO()))
    with pytest.raises(InvalidArgument, match="--count 0"):
        stats.run(endpoints=["127.0.0.1:1"], count=0)


def test_quantile_interpolates_within_a_bucket() -> None:
    b = {0.001: 0.0, 0.01: 50.0, 0.1: 100.0, float("inf"): 100.0}
    assert stats.quantile(0.5, b) == pytest.approx(0.01)
    assert stats.quantile(0.75, b) == pytest.approx(0.055)
    assert stats.quantile(0.5, {float("inf"): 0.0}) is None
    assert stats.quantile(0.99, {0.5: 1.0, float("inf"): 10.0}) == 0.5


def test_not_found_answers_are_requests_not_errors() -> None:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    m = metrics.FuseMetrics(reg)
    t0 = time.perf_counter()
    m.end(t0, "getxattr", errno.ENODATA)
    m.end(t0, "listxattr", errno.ENODATA)
    m.end(t0, "lookup", errno.ENOENT)
    m.end(t0, "getxattr", errno.EIO)
    m.end(t0, "read", errno.ENODATA)  # from any other request it is an error
    m.end(t0, "getattr", errno.ENOENT)
    assert reg.get_sample_value("irdma_fuse_requests_total", {"op": "getxattr"}) == 2
    assert reg.get_sample_value("irdma_fuse_requests_total", {"op": "lookup"}) == 1
    for op, name in (("getxattr", "ENODATA"), ("listxattr", "ENODATA"), ("lookup", "ENOENT")):
        assert reg.get_sample_value("irdma_fuse_errors_total", {"op": op, "errno": name}) is None
        assert reg.get_sample_value("irdma_fuse_not_found_total", {"op": op, "errno": name}) == 1
    assert reg.get_sample_value("irdma_fuse_errors_total", {"op": "getxattr", "errno": "EIO"}) == 1
    assert reg.get_sample_value("irdma_fuse_errors_total", {"op": "read", "errno": "ENODATA"}) == 1
    assert reg.get_sample_value("irdma_fuse_errors_total", {"op": "getattr", "errno": "ENOENT"}) == 1
    assert reg.get_sample_value("irdma_fuse_not_found_total", {"op": "getattr", "errno": "ENOENT"}) is None


def test_writes_and_absent_names_and_xattrs_count_no_fuse_errors(mcluster: MetricsCluster, mmnt: str) -> None:
    """The kernel asks ``getxattr security.capability`` before writes and looks every new name up
    before creating it; a missing attribute or name is an answer: requests and
    ``irdma_fuse_not_found_total`` go up, ``irdma_fuse_errors_total`` does not (error-rate alerts
    stay quiet)."""
    target = stats.mount_target(mmnt)
    m0 = scrape(target.address)
    path = os.path.join(mmnt, "no-xattrs")
    with open(path, "wb") as f:
        for _ in range(3):
            f.write(b"x" * 4096)
            f.flush()
    with pytest.raises(OSError) as exc:
        os.getxattr(path, "user.not-there")
    assert exc.value.errno == errno.ENODATA
    with pytest.raises(FileNotFoundError):
        os.stat(os.path.join(mmnt, "no-such-file"))
    m1 = scrape(target.address)
    full = os.path.join(mmnt, "not-empty")
    os.makedirs(os.path.join(full, "d"), exist_ok=True)
    with pytest.raises(OSError) as exc:
        os.rmdir(full)  # a real failure still counts
    assert exc.value.errno == errno.ENOTEMPTY
    m2 = scrape(target.address)

    def md(name: str, **match: str) -> float:
        return total(m1, name, **match) - total(m0, name, **match)

    assert md("irdma_fuse_requests_total", op="getxattr") >= 1
    assert md("irdma_fuse_not_found_total", op="getxattr", errno="ENODATA") >= 1
    assert md("irdma_fuse_not_found_total", op="lookup", errno="ENOENT") >= 1  # no-such-file (and no-xattrs)
    assert md("irdma_fuse_errors_total") == 0
    assert total(m2, "irdma_fuse_errors_total", op="rmdir", errno="ENOTEMPTY") - \
        total(m1, "irdma_fuse_errors_total", op="rmdir", errno="ENOTEMPTY") == 1


# ---------------------------------------------------------------- the conventions, and the dashboard
DASHBOARD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "grafana-irdma.json")
#: Unit words that may end a metric name (before ``_total``): Prometheus base units and suffixes.
UNITS = ("seconds", "bytes", "ratio", "info")
#: Words that name a unit that is not a base unit: never in a name.
NOT_BASE_UNITS = {"ms", "millis", "milliseconds", "us", "micros", "microseconds", "ns", "nanoseconds", "minutes",
                  "hours", "days", "kb", "mb", "gb", "kib", "mib", "gib", "kilobytes", "megabytes", "percent"}
#: PromQL words that are not metric names: operators, modifiers and grouping clauses.
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "inf", "nan"}


def families(address: str) -> list[Any]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return list(text_string_to_metric_families(resp.read().decode()))


def series_names(fams: list[Any]) -> set[str]:
    """The names a PromQL query may use for ``fams``, with or without samples yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
    out = {s.name for f in fams for s in f.samples}
    for f in fams:
        out.update(f.name + x for x in suffixes.get(f.type, ("",)))
    return out


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (strings, label matchers, ranges, grouping
    label lists and function names left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, op) (rate(a_seconds_bucket{op!="x",b=~"c.*"}[$__rate_interval])))'
        " * on (job, instance) group_left (version) b_info + c_total offset 5m") == {"a_seconds_bucket", "b_info",
                                                                                      "c_total"}


def test_scrapes_follow_prometheus_conventions_and_serve_the_dashboard(mcluster: MetricsCluster, mmnt: str) -> None:
    """Every exporter (each shard, the mount), scraped over HTTP after real I/O: names by the
    Prometheus conventions, no ``_created``, process and platform collectors, ``irdma_build_info``;
    a getxattr of a missing attribute is no FUSE error; every metric the Grafana dashboard's
    queries read is served."""
    target = stats.mount_target(mmnt)
    path = os.path.join(mmnt, "conventions.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(3 << 20))
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        assert len(f.read()) == 3 << 20
    before = scrape(target.address)
    for name in ("user.missing", "security.capability"):
        with pytest.raises(OSError) as exc:
            os.getxattr(path, name)
        assert exc.value.errno == errno.ENODATA
    after = scrape(target.address)
    assert total(after, "irdma_fuse_requests_total", op="getxattr") - \
        total(before, "irdma_fuse_requests_total", op="getxattr") >= 2
    assert total(after, "irdma_fuse_errors_total") == total(before, "irdma_fuse_errors_total")

    scrapes = {f"shard {sid}": families(a) for sid, a in mcluster.metrics.items()}
    scrapes["mount"] = families(target.address)
    served: set[str] = set()
    for who, fams in scrapes.items():
        byname = {f.name: f for f in fams}
        for f in fams:
            where = f"{who}: {f.name}"
            assert not f.name.endswith("_created"), where
            assert all(not s.name.endswith("_created") for s in f.samples), where
            if f.type == "counter":
                assert all(s.name == f.name + "_total" for s in f.samples), where
            else:
                assert not f.name.endswith("_total"), f"{where}: _total on a {f.type}"
                assert all(not s.name.endswith("_total") for s in f.samples), where
            words = f.name.split("_")
            assert not NOT_BASE_UNITS & set(words), f"{where}: not a base unit"
            for unit in UNITS:  # a unit word only at the end, and there when the help names it
                assert unit not in words[:-1], f"{where}: {unit} not last"
                if unit in ("seconds", "bytes") and re.search(rf"\b{unit}\b", f.documentation, re.I):
                    assert words[-1] == unit, f"{where}: its help counts {unit}, its name does not end so"
            if f.name.endswith("_info"):
                assert f.type == "gauge" and all(s.value == 1 for s in f.samples), where
        for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_start_time_seconds",
                     "python_info", "irdma_build_info"):
            assert name in byname and byname[name].samples, f"{who}: no {name}"
        (info,) = byname["irdma_build_info"].samples
        assert info.value == 1
        assert info.labels["version"] == irdma.__version__
        assert info.labels["python"] == platform.python_version()
        assert info.labels["transport"] == "tcp", f"{who}: {info.labels}"
        served |= series_names(fams)
    assert "irdma_shard_held_bytes" in served and "irdma_shard_bytes_held" not in served

    import json

    with open(DASHBOARD) as f:
        board = json.load(f)
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 12
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, expr
        missing = names - served
        assert not missing, f"dashboard query {expr!r} reads {sorted(missing)}, which no exporter serves"


def test_metrics_code_never_fails_a_request() -> None:
    m = metrics.client_metrics()
    inflight = total(local(), "irdma_client_inflight_requests")
    t0 = m.begin()
    m.end(t0, "read", "tcp", "ok", nbytes=-1, direction="in")  # a counter refuses a negative: swallowed
    assert total(local(), "irdma_client_inflight_requests") == inflight


# ---------------------------------------------------------------- read-ahead that follows the reader
def test_read_ahead_follows_the_reader(mcluster: MetricsCluster, mmnt: str) -> None:
    """Bytes pulled from the shards per pattern, through a direct-I/O mount (the FUSE reads are
    the application's): random and strided 4 KiB reads pull exactly what they read (at most
    64 KiB each), a sequential scan pulls the file about once, in windows that grow."""
    n = 32 << 20
    data = np.random.default_rng(5).integers(0, 255, n, dtype=np.uint8)
    with irdma.connect(mcluster.meta_url, transport="tcp") as c:
        c.write("/ra.bin", data)
    addrs = list(mcluster.metrics.values())

    def pulled(fn: Any) -> float:
        before = shards_total([scrape(a) for a in addrs], "irdma_shard_bytes_total", op="read", direction="out")
        fn()
        return shards_total([scrape(a) for a in addrs], "irdma_shard_bytes_total", op="read",
                            direction="out") - before

    path = os.path.join(mmnt, "ra.bin")
    rng = np.random.default_rng(6)
    offsets = [int(o) * 4096 for o in rng.integers(0, n // 4096, 200)]

    def random_reads() -> None:
        with open(path, "rb", buffering=0) as f:
            for off in offsets:
                assert os.pread(f.fileno(), 4096, off) == data[off : off + 4096].tobytes()

    got = pulled(random_reads)
    assert got <= 200 * 64 * 1024, f"random 4 KiB reads pulled {got / 200 / 1024:.0f} KiB each"

    def strided_reads() -> None:
        with open(path, "rb", buffering=0) as f:
            for off in range(4096, n, 1 << 20):  # 4 KiB every MiB, never at a handle's start
                assert os.pread(f.fileno(), 4096, off) == data[off : off + 4096].tobytes()

    got = pulled(strided_reads)
    assert got <= 32 * 64 * 1024, f"strided 4 KiB reads pulled {got / 32 / 1024:.0f} KiB each"

    def sequential() -> None:
        with open(path, "rb", buffering=0) as f:
            out = bytearray()
            while chunk := f.read(1 << 20):
                out += chunk
        assert out == data.tobytes()

    got = pulled(sequential)
    assert n <= got <= n + (8 << 20), f"a sequential scan of {n} bytes pulled {got:.0f}"
    with irdma.connect(mcluster.meta_url, transport="tcp") as c:
        c.unlink("/ra.bin")  # the module's shards are small: leave room for the next test
