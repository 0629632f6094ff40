"""The cost model (irdma/train/costmodel.py) and `irdma tune`: answers worked out by hand, then the
orderings that must hold, then the command line end to end (click's CliRunner, in process)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from irdma.ops.cli import cli
from irdma.train import costmodel as cm
from irdma.train.costmodel import Config, ConfigError, best, predict, rank, ring_allreduce_time, wire_bytes
from irdma.units import parse_duration, parse_rate

GBIT = 125e6  # 1 Gbit/s in bytes/s
MB100 = 100_000_000

# VGG-16's tensors (float32 bytes; biases left out): 13 convolutions, then fully connected layers
# of 411 MB, 67 MB and 16 MB. Its compute is the other way round: the convolutions do nearly all
# of it (about 15 GFLOP of the 15.5), so the layer times are given, not taken from the bytes.
VGG = tuple(4 * n for n in (1728, 36864, 73728, 147456, 294912, 589824, 589824, 1179648, 2359296, 2359296,
                            2359296, 2359296, 2359296, 102760448, 16777216, 4096000))
VGG_TIMES = (0.030, 0.060, 0.030, 0.060, 0.030, 0.060, 0.060, 0.030, 0.060, 0.060, 0.015, 0.015, 0.015,
             0.004, 0.001, 0.0005)


# ---------------------------------------------------------------- known answers
def test_flat_one_worker_one_shard_by_hand() -> None:
    # 100 MB at 1 Gbit/s (125e6 B/s) is 0.8 s each way. With overlap none the pull follows the push
    # (it reads the update the push made), so full duplex does not help: 1 s compute + 0.8 s push
    # + 0.8 s pull = 2.6 s. Worker NIC and shard NIC both move 100 MB each way; ties name the worker.
    p = predict(Config(sizes=(MB100,), link_bytes_per_s=GBIT, compute_s=1.0))
    assert p.time_s == pytest.approx(2.6)
    assert (p.compute_s, p.comm_s, p.exposed_s) == pytest.approx((1.0, 1.6, 1.6))
    assert (p.push_bytes, p.pull_bytes, p.busiest_link_bytes) == (MB100, MB100, MB100)
    assert p.bound == "worker NIC" and p.busiest == "worker host"
    # 1 ms one-way latency: two round trips (push + ack, pull request + answer) add 4 ms; 25 slices
    # of 4 MB with 2 ms per request and a window of 5 add 25 * 2 ms / 5 = 10 ms per direction.
    p = predict(Config(sizes=(MB100,), link_bytes_per_s=GBIT, compute_s=1.0, latency_s=1e-3,
                       slice_bytes=4_000_000, overhead_s=2e-3, window=5))
    assert p.latency_s == pytest.approx(0.004 + 0.020)
    assert p.time_s == pytest.approx(2.624)


def test_hierarchical_two_hosts_of_two_workers_by_hand() -> None:
    # 4 workers on 2 hosts, 2 shards on hosts of their own, 100 MB, 1 Gbit/s, no latency, 1 s compute.
    # flat: a worker host sends 2 x 100 MB (0.2 GB: 1.6 s) and a shard host receives 4 x 100 MB / 2
    # shards (also 1.6 s); pulls the same way back: 1 + 1.6 + 1.6 = 4.2 s.
    base = Config(sizes=(MB100,), workers=4, hosts=2, shards=2, link_bytes_per_s=GBIT, compute_s=1.0,
                  mem_bytes_per_s=10e9)
    flat = predict(base)
    assert flat.time_s == pytest.approx(4.2)
    assert flat.busiest_link_bytes == 2 * MB100
    # hier: each host sums its 2 gradients (reads 2 x 100 MB, writes 100 MB) and later copies the
    # pulled 100 MB to 2 workers (the same 300 MB): 600 MB at 10 GB/s = 0.06 s. Then one push and
    # one pull of 100 MB per host: 0.8 s + 0.8 s. 1 + 0.06 + 1.6 = 2.66 s; inter-host bytes halve.
    hier = predict(dataclasses.replace(base, mode="hier"))
    assert hier.time_s == pytest.approx(2.66)
    assert hier.local_s == pytest.approx(0.06)
    assert hier.busiest_link_bytes == flat.busiest_link_bytes / 2
    assert hier.push_bytes == flat.push_bytes / 2  # a worker's share of its host's one push
    # K = 2: one step of 1.06 s (local sums only), one of 2.66 s: 1.86 s on average.
    k2 = predict(dataclasses.replace(base, mode="hier", sync_every=2))
    assert k2.time_s == pytest.approx(1.86)
    assert k2.busiest_link_bytes == flat.busiest_link_bytes / 4


def test_colocated_shards_keep_half_the_traffic_on_the_host() -> None:
    # 2 workers, 2 hosts, a shard on each: half of each push goes to the local shard, the other half
    # (50 MB) leaves while 50 MB of the other worker's push arrives: 0.4 s a way, 0.8 s in all.
    p = predict(Config(sizes=(MB100,), workers=2, hosts=2, shards=2, colocated=True, link_bytes_per_s=GBIT,
                       compute_s=0.5))
    assert p.time_s == pytest.approx(1.3)
    assert p.bound == "host NIC" and p.busiest == "host"
    assert p.busiest_link_bytes == MB100  # out: 50 MB of pushes + 50 MB of pull answers


def test_software_cap_bounds_below_the_link() -> None:
    # a 50 MB/s cap on a 1 Gbit/s link: 100 MB each way at 50 MB/s = 4 s.
    p = predict(Config(sizes=(MB100,), link_bytes_per_s=GBIT, cap_bytes_per_s=50e6, compute_s=1.0))
    assert p.time_s == pytest.approx(5.0)
    assert p.bound == "software cap"


def test_roofline_compute_and_bounds() -> None:
    # 2 TFLOP at 1 TFLOP/s = 2 s; memory: 3 x 100 MB at 10 GB/s = 0.03 s: arithmetic bounds it.
    c = Config(sizes=(MB100,), flops=2e12, peak_flops_per_s=1e12, link_bytes_per_s=10 * GBIT)
    assert c.compute_time_s() == pytest.approx(2.0)
    assert predict(c).bound == "compute"
    assert cm.roofline_time(1e9, 1e9, 1e12, 1e9) == pytest.approx(1.0)  # memory-bound
    lat = predict(Config(sizes=(4,), compute_s=0.0, latency_s=0.01))
    assert lat.bound == "latency"


def test_ring_allreduce_formula() -> None:
    # 2(N-1)/N * M/B + 2(N-1)*L with M = 100 MB, N = 4, B = 1 Gbit/s, L = 100 µs:
    # 1.5 * 0.8 s + 6 * 100 µs = 1.2006 s.
    assert ring_allreduce_time(MB100, 4, GBIT, 1e-4) == pytest.approx(1.2006)
    assert ring_allreduce_time(MB100, 1, GBIT, 1e-4) == 0.0


@pytest.mark.parametrize("n", [1024 * 1000, 1000, 1])
def test_compression_reduces_push_bytes_by_the_exact_wire_ratio(n: int) -> None:
    dense = 4 * n
    topk = 8 * math.ceil(0.01 * n)  # int32 index + float32 value per kept element
    sign = math.ceil(n / 8) + 4 * math.ceil(n / 1024)  # one bit per element, one float32 per 1024
    assert wire_bytes(dense, "topk:0.01") == topk
    assert wire_bytes(dense, "sign") == sign
    base = Config(sizes=(dense, dense), link_bytes_per_s=GBIT, compute_s=1.0)
    flat = predict(base)
    for mode, wire in (("topk:0.01", topk), ("sign", sign)):
        p = predict(dataclasses.replace(base, mode=mode))
        assert p.push_bytes == 2 * wire
        assert p.push_bytes / flat.push_bytes == wire / dense
        assert p.pull_bytes == flat.pull_bytes  # pulls stay dense
    if n == 1024 * 1000:  # the ratios of the issue: 1/50 and 33/1024
        assert topk / dense == pytest.approx(0.02) and sign / dense == pytest.approx(33 / 1024)


# ---------------------------------------------------------------- overlap
def test_one_tensor_every_overlap_gives_the_closed_form() -> None:
    # With one tensor nothing can overlap: the simulation must agree with overlap none exactly,
    # latency, per-request overheads, the local sums of hier and K included.
    for mode, k in (("flat", 1), ("hier", 1), ("hier", 3), ("sign", 1)):
        for colocated in (False, True):
            base = Config(sizes=(MB100,), workers=4, hosts=2, shards=2, colocated=colocated, mode=mode,
                          sync_every=k, link_bytes_per_s=GBIT, latency_s=5e-4, overhead_s=1e-4, slice_bytes=1 << 20,
                          window=2, compute_s=0.7)
            none = predict(base).time_s
            for overlap in ("fifo", "p3"):
                assert predict(dataclasses.replace(base, overlap=overlap)).time_s == pytest.approx(none, rel=1e-12)


def test_p3_beats_fifo_beats_none_on_a_vgg_like_model() -> None:
    base = Config(sizes=VGG, workers=4, hosts=4, shards=4, link_bytes_per_s=10 * GBIT, latency_s=1e-4,
                  overhead_s=2e-5, window=4, layer_compute_s=VGG_TIMES, slice_bytes=cm.P3_SLICE_BYTES)
    t = {o: predict(dataclasses.replace(base, overlap=o)) for o in cm.OVERLAPS}
    assert t["p3"].time_s < t["fifo"].time_s < t["none"].time_s
    for p in t.values():  # the same bytes whatever the order
        assert p.comm_s == pytest.approx(t["none"].comm_s) and p.exposed_s == pytest.approx(p.time_s - p.compute_s)
    # fifo: the last (411 MB) layer's pull comes first, so the forward pass waits for all pulls;
    # p3 starts it after the first layer's pull and hides the big pull behind the convolutions.
    assert t["fifo"].exposed_s - t["p3"].exposed_s > 0.1
    # compute proportional to bytes (the default) keeps the order too
    plain = dataclasses.replace(base, layer_compute_s=None, compute_s=sum(VGG_TIMES))
    p3, fifo, none = (predict(dataclasses.replace(plain, overlap=o)).time_s for o in ("p3", "fifo", "none"))
    assert p3 <= fifo < none


def test_priority_preempts_at_slice_boundaries() -> None:
    # layer 1's push (10 slices of 1 s) starts at 0; layer 0's (1 slice) is queued at 2.5 s. FIFO
    # finishes layer 1 first (10 s, then 11 s); priority lets layer 0 in once slice 3 ends (3 s -> 4 s).
    arrivals = [(0.0, cm._PUSH, 1), (2.5, cm._PUSH, 0)]
    durations = [[1.0, 1.0], [0.0, 0.0]]
    assert cm._serve(arrivals, [1, 10], durations, False, None) == {(0, 1): 10.0, (0, 0): 11.0}
    assert cm._serve(arrivals, [1, 10], durations, True, None) == {(0, 0): 4.0, (0, 1): 11.0}


def test_simulation_is_fast_and_deterministic() -> None:
    c = Config(sizes=VGG, workers=8, hosts=4, shards=4, colocated=True, layer_compute_s=VGG_TIMES, overlap="p3",
               slice_bytes=40_000, latency_s=1e-4, overhead_s=1e-5)  # 13,800 slices each way
    assert sum(c.slices()) > 10_000
    spent = []
    for _ in range(3):
        t0 = time.perf_counter()
        p = predict(c)
        spent.append(time.perf_counter() - t0)
        assert p == predict(c)
    assert min(spent) < 0.05


# ---------------------------------------------------------------- choosing
def test_best_and_rank() -> None:
    base = Config(sizes=VGG, workers=4, hosts=2, shards=2, link_bytes_per_s=GBIT, layer_compute_s=VGG_TIMES)
    configs = cm.grid(base, modes=("flat", "hier"), overlaps=("none", "p3"), slices=(0, cm.P3_SLICE_BYTES))
    assert len(configs) == 8
    ranked = rank(configs)
    assert [p.time_s for p in ranked] == sorted(p.time_s for p in ranked)
    assert best(configs) == ranked[0].config
    assert ranked[0].config.mode == "hier" and ranked[0].config.overlap == "p3"
    assert "faster than flat pushes with no overlap" in cm.explain(ranked)
    with pytest.raises(ValueError):
        best([])


@pytest.mark.parametrize("kwargs,field", [
    ({"workers": 3, "hosts": 2}, "hosts"),
    ({"sizes": ()}, "sizes"),
    ({"sizes": (0,)}, "sizes"),
    ({"mode": "zip"}, "mode"),
    ({"mode": "topk:0"}, "mode"),
    ({"mode": "flat", "sync_every": 2}, "sync_every"),
    ({"overlap": "lifo"}, "overlap"),
    ({"compute_s": None}, "compute_s"),
    ({"flops": 1e9}, "compute_s"),
    ({"link_bytes_per_s": 0}, "link_bytes_per_s"),
    ({"layer_compute_s": (1.0, 2.0), "compute_s": None}, "layer_compute_s"),
])
def test_bad_configs_name_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"sizes": (4,), "compute_s": 1.0, **kwargs}
    with pytest.raises(ConfigError) as info:
        Config(**args)  # type: ignore[arg-type]
    assert info.value.field == field


def test_parsers() -> None:
    assert parse_rate("1gbit") == GBIT and parse_rate("10gbit") == 10 * GBIT and parse_rate("125MB/s") == GBIT
    assert parse_duration("100us") == pytest.approx(1e-4) and parse_duration("1ms") == pytest.approx(1e-3)
    assert cm.parse_tensor_size("160KB") == 160_000 == cm.parse_tensor_size("40000f")
    for bad in ("fast", "1gb", "0gbit", "-1gbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    assert cm.sizes_from_layout([{"name": "k", "shape": [3, 4], "offset": 0, "dtype": "<f4"},
                                 {"name": "b", "shape": [4], "offset": 48, "dtype": "<f2"}]) == (48, 8)


# ---------------------------------------------------------------- the command line
def _tune(*args: str) -> Result:
    return CliRunner().invoke(cli, ["tune", *args], env={"COLUMNS": "200"})


def test_cli_prints_a_sorted_table_and_the_best(tmp_path: Path) -> None:
    layout = [{"name": f"v{i}", "shape": [n // 4], "offset": 0, "dtype": "<f4"} for i, n in enumerate(VGG)]
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    r = _tune("--layout", str(tmp_path / "layout.json"), "--compute", "1s", "--bandwidth", "10gbit")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "irdma tune: " in out and "4 workers on 2 hosts" in out and "10 Gbit/s" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 * 3 * 2  # modes x overlaps x slices
    assert [int(row[0]) for row in rows] == list(range(1, 25))
    best_line = next(line for line in out.splitlines() if line.startswith("best: "))
    assert "per iteration, bound by" in best_line and "faster than" in best_line
    assert "ring all-reduce" in out
    advice = next(line for line in out.splitlines() if line.startswith("in model.fit: "))
    assert "hvd.DistributedOptimizer(opt" in advice, advice

    r = _tune("--sizes", "4MB", "--mode", "topk:0.01", "--overlap", "p3", "--slice", "160KB")
    assert r.exit_code == 0, r.output
    assert "in model.fit: hvd.DistributedOptimizer(opt, overlap='p3', slice_elems=40000, compress='topk:0.01')" \
        in r.stdout, r.stdout
    r = _tune("--sizes", "4MB", "--mode", "hier", "--overlap", "none", "--sync-every", "4")
    assert r.exit_code == 0, r.output
    assert "in model.fit: hvd.DistributedOptimizer(opt, hierarchy=True, sync_every=4)" in r.stdout, r.stdout

    r = _tune("--sizes", "4MB,1MB,40000f", "--mode", "flat", "--mode", "hier", "--overlap", "p3",
              "--slice", "0", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["model_bytes"] == 5_160_000 and len(doc["predictions"]) == 2
    times = [p["time_s"] for p in doc["predictions"]]
    assert times == sorted(times) and doc["best"] == doc["predictions"][0]["label"]


@pytest.mark.parametrize("args,option,hint", [
    (["--sizes", "4MB", "--bandwidth", "fast"], "--bandwidth", "1gbit"),
    (["--sizes", "4MB", "--latency", "soon"], "--latency", "100us"),
    (["--sizes", "4MB", "--workers", "3"], "--hosts", "must divide"),
    (["--sizes", "4MB", "--mode", "topk:2"], "--mode", "topk:FRACTION"),
    (["--sizes", "4MB,lots"], "--sizes", "40000f"),
    (["--sizes", "4MB", "--slice", "-1"], "--slice", "whole tensors"),
    (["--sizes", "4MB", "--flops", "1e9"], "--peak", "peak"),
    ([], "--layout", "--sizes"),
])
def test_cli_bad_input_names_the_option(args: list[str], option: str, hint: str) -> None:
    r = _tune(*args)
    assert r.exit_code == 2
    err = r.stderr
    assert err.startswith("error: ") and option in err and hint in err and "Traceback" not in err
    assert r.stdout == ""


def test_cli_bad_layout(tmp_path: Path) -> None:
    bad = tmp_path / "layout.json"
    bad.write_text("{not json")
    r = _tune("--layout", str(bad))
    assert r.exit_code == 2 and "--layout" in r.stderr


def test_encoding_time_delays_compressed_pushes_only() -> None:
    # 100 MB, 1 GB/s link, C = 1 s, no overlap: topk:0.01 pushes 2 MB (8 bytes per kept element)
    # and pulls 100 MB; encoding at 1 ns per dense byte adds 0.1 s; a dense push has none to add
    base = cm.Config(sizes=(100_000_000,), link_bytes_per_s=1e9, compute_s=1.0, mode="topk:0.01")
    slow = dataclasses.replace(base, encode_s_per_byte=1e-9)
    assert cm.predict(slow).time_s == pytest.approx(cm.predict(base).time_s + 0.1)
    assert cm.predict(base).time_s == pytest.approx(1.0 + 0.002 + 0.1)
    flat = dataclasses.replace(slow, mode="flat")
    assert cm.predict(flat).time_s == pytest.approx(1.0 + 0.2)
    fifo = dataclasses.replace(slow, overlap="fifo")
    assert cm.predict(fifo).time_s > cm.predict(dataclasses.replace(base, overlap="fifo")).time_s
    with pytest.raises(cm.ConfigError) as err:
        dataclasses.replace(base, encode_s_per_byte=-1.0)
    assert err.value.field == "encode_s_per_byte"
