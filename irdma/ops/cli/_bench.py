"""``irdma bench`` (a mount's or the native client's bandwidth and latency) and ``irdma tune`` (the cost
model's predictions of a training iteration)."""

from __future__ import annotations

from typing import Any

import click
import trio
from rich.table import Table

from ...transport import TRANSPORTS
from ...units import format_size
from ._common import _redact, _size, console, friendly, out


@click.command()
@click.option("--meta", "meta_url", default=None, help="Benchmark the native client against this namespace.")
@click.option("--mount", "mountpoint", type=click.Path(file_okay=False), help="Benchmark through this mount.")
@click.option("--size", default="256MiB", show_default=True, callback=_size, help="Test file size.")
@click.option("--chunk-size", default="4MiB", show_default=True, callback=_size)
@click.option("--block", default="4MiB", show_default=True, callback=_size, help="Bytes per request.")
@click.option("--concurrency", "-c", default=4, show_default=True, help="Requests in flight.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@click.option("--tests", default="push-assign,pull,push-add,latency", show_default=True,
              help="Comma-separated: push-assign, pull, push-assign-existing (assign again, onto the chunks"
                   " push-assign made: no fresh shard memory), push-add, latency.")
@click.option("--latency-ops", default=1000, show_default=True, help="4 KiB reads timed for p50/p99.")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON on stdout.")
@click.option("--page-cache", is_flag=True, help="Through a mount: use the page cache (default: direct I/O).")
@click.option("--path", default="/.irdma-bench", show_default=True, help="Test file, removed at the end.")
@friendly
def bench(meta_url: str | None, mountpoint: str | None, size: int, chunk_size: int, block: int, concurrency: int,
          transport: str, tests: str, latency_ops: int, as_json: bool, page_cache: bool, path: str) -> None:
    """Sequential pull/push bandwidth and 4 KiB read latency (like ib_write_bw or fio)."""
    import json

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from ...client.native import Client
    from .. import bench as B

    if (meta_url is None) == (mountpoint is None):
        raise click.UsageError("give exactly one of --meta (native client) or --mount (through FUSE)")
    wanted = tuple(t.strip() for t in tests.split(",") if t.strip())
    bad = set(wanted) - {"push-assign", "pull", "push-assign-existing", "push-add", "latency"}
    if bad:
        raise click.BadParameter(f"unknown tests {sorted(bad)}", param_hint="--tests")
    cfg = B.BenchConfig(size=size, chunk_size=chunk_size, block=block, concurrency=concurrency,
                        latency_ops=latency_ops, tests=wanted, direct_io=not page_cache, path=path)
    with Progress(TextColumn("{task.description:>16}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=total)
            bar.update(tasks[name], completed=done)

        if meta_url is not None:
            async def run() -> list[B.BenchResult]:
                async with Client.open(meta_url, transport=transport) as client:
                    return await B.bench_native(client, cfg, progress)

            results = trio.run(run)
            where = f"native client ({transport}) on {_redact(meta_url)}"
        else:
            assert mountpoint is not None
            results = B.bench_mount(mountpoint, cfg, progress)
            where = f"mount {mountpoint}"
    if as_json:
        out.print_json(json.dumps({"where": where, "config": vars(cfg), "results": B.as_dicts(results)}, default=str))
        return
    table = Table(title=f"irdma bench: {where}, {format_size(size)} file, {format_size(chunk_size)} chunks,"
                        f" {format_size(block)} requests x {concurrency}")
    for col in ("test", "bytes", "seconds", "MB/s", "p50 µs", "p99 µs"):
        table.add_column(col, justify="left" if col == "test" else "right")
    for r in results:
        table.add_row(r.name, format_size(r.bytes), f"{r.seconds:.3f}", f"{r.mb_s:.1f}",
                      "-" if r.p50_us is None else f"{r.p50_us:.0f}", "-" if r.p99_us is None else f"{r.p99_us:.0f}")
    out.print(table)


# ---------------------------------------------------------------- the cost model
def _rate(ctx: Any, param: Any, value: str) -> float:
    from ...units import parse_rate

    try:
        return parse_rate(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _cap(ctx: Any, param: Any, value: str) -> float | None:
    return None if value.strip().lower() in ("none", "off", "") else _rate(ctx, param, value)


def _duration(ctx: Any, param: Any, value: str) -> float:
    from ...units import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _slices(ctx: Any, param: Any, values: tuple[str, ...]) -> tuple[int, ...]:
    from ...train.costmodel import parse_tensor_size

    try:
        return tuple(0 if v.strip() == "0" else parse_tensor_size(v) for v in values)
    except ValueError as exc:
        raise click.BadParameter(f"{exc} (0: whole tensors)") from None


def _modes(ctx: Any, param: Any, values: tuple[str, ...]) -> tuple[str, ...]:
    from ...train.costmodel import ConfigError, parse_mode

    try:
        for v in values:
            parse_mode(v)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    return values


def _tensor_sizes(layout: str | None, sizes: str | None) -> tuple[int, ...]:
    """The tensor bytes of ``--layout`` (a layout.json) or ``--sizes`` (comma-separated)."""
    import json

    from ...train.costmodel import parse_tensor_size, sizes_from_layout

    if (layout is None) == (sizes is None):
        raise click.UsageError("give exactly one of --layout (a Keras job's layout.json) or --sizes")
    if sizes is not None:
        try:
            parsed = tuple(parse_tensor_size(s) for s in sizes.split(",") if s.strip())
        except ValueError as exc:
            raise click.BadParameter(f"{exc}: write sizes like 4MB,1MB,40000f (f: a count of float32)",
                                     param_hint="--sizes") from None
        if not parsed:
            raise click.BadParameter("no sizes: write sizes like 4MB,1MB,40000f", param_hint="--sizes")
        return parsed
    assert layout is not None
    try:
        with open(layout) as f:
            entries = json.load(f)
        if not isinstance(entries, list):
            raise ValueError("it is not a list of tensors")
        return sizes_from_layout(entries)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise click.BadParameter(f"{layout}: {exc} (irdma.train.keras writes it: a list of {{name, shape, offset,"
                                 " dtype}})", param_hint="--layout") from None


#: The option of `irdma tune` that sets each field of a costmodel.Config.
_TUNE_OPTIONS = {"sizes": "--sizes", "workers": "--workers", "hosts": "--hosts", "shards": "--shards",
                 "window": "--window", "sync_every": "--sync-every", "compute_s": "--compute",
                 "flops": "--flops", "peak_flops_per_s": "--peak", "backward_fraction": "--backward-fraction",
                 "mode": "--mode", "slice_bytes": "--slice", "overlap": "--overlap"}


@click.command()
@click.option("--layout", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Keras job's layout.json (list of {name, shape, offset, dtype}, see irdma.train.keras).")
@click.option("--sizes", default=None, metavar="LIST",
              help="Tensor sizes in forward order instead of --layout: 4MB,1MB,40000f (f: float32 count).")
@click.option("--workers", type=click.IntRange(1), default=4, show_default=True, help="Data-parallel workers.")
@click.option("--hosts", type=click.IntRange(1), default=2, show_default=True,
              help="Hosts the workers run on (must divide --workers).")
@click.option("--shards", type=click.IntRange(1), default=2, show_default=True, help="Shard servers.")
@click.option("--colocated", is_flag=True, help="Shards run on the worker hosts (else each on a host of its own).")
@click.option("--bandwidth", default="1gbit", show_default=True, callback=_rate,
              help="Each host NIC's rate, each way: 1gbit, 10gbit, 125MB/s.")
@click.option("--latency", default="100us", show_default=True, callback=_duration,
              help="One-way latency between hosts: 100us, 1ms.")
@click.option("--cap", default="none", show_default=True, callback=_cap,
              help="Bytes/s each way the processes of one host can move (a software limit): 400MB/s, or none.")
@click.option("--overhead", default="50us", show_default=True, callback=_duration,
              help="Fixed cost of one request (one slice).")
@click.option("--window", type=click.IntRange(1), default=4, show_default=True, help="Requests in flight per shard.")
@click.option("--compute", default="1s", show_default=True, callback=_duration,
              help="Compute seconds of one iteration of one worker (forward + back-prop).")
@click.option("--flops", type=click.FloatRange(min=0), default=None,
              help="FLOPs of one iteration instead of --compute (roofline with --peak and --mem-bandwidth).")
@click.option("--peak", type=click.FloatRange(min=0, min_open=True), default=None, help="Peak FLOP/s (with --flops).")
@click.option("--mem-bandwidth", default="10GB/s", show_default=True, callback=_rate,
              help="Memory bandwidth: the roofline, and the local sums of hier.")
@click.option("--slice", "slices", multiple=True, default=("0", "160KB"), show_default=True, callback=_slices,
              help="Slice size (repeat for several; 0: whole tensors; 40000f = 40,000 float32).")
@click.option("--mode", "modes", multiple=True, default=("flat", "hier", "topk:0.01", "sign"), show_default=True,
              callback=_modes, help="flat, hier, topk:FRACTION or sign (repeat for several).")
@click.option("--overlap", "overlaps", multiple=True, type=click.Choice(["none", "fifo", "p3"]),
              default=("none", "fifo", "p3"), show_default=True, help="Overlap of communication with compute (repeat).")
@click.option("--sync-every", type=click.IntRange(1), default=1, show_default=True,
              help="hier: synchronise across hosts every K steps.")
@click.option("--backward-fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=2 / 3,
              show_default="2/3", help="Share of the compute spent in back-prop.")
@click.option("--json", "as_json", is_flag=True, help="Print every prediction as JSON on stdout.")
@friendly
def tune(layout: str | None, sizes: str | None, workers: int, hosts: int, shards: int, colocated: bool,
         bandwidth: float, latency: float, cap: float | None, overhead: float, window: int, compute: float,
         flops: float | None, peak: float | None, mem_bandwidth: float, slices: tuple[int, ...],
         modes: tuple[str, ...], overlaps: tuple[str, ...], sync_every: int, backward_fraction: float,
         as_json: bool) -> None:
    """Predict the time of a training iteration for every mode, overlap and slice size; pick the best.

    The model (irdma/train/costmodel.py) prices pushes and pulls on the busiest NIC, latency and request
    overheads, and how much of that back-prop and the forward pass hide (FIFO or P3 priority).
    """
    import json

    from ...train.costmodel import Config, ConfigError, explain, grid, rank, ring_allreduce_time
    from ...units import format_duration, format_rate

    tensors = _tensor_sizes(layout, sizes)
    roofline = flops is not None
    try:
        base = Config(sizes=tensors, workers=workers, hosts=hosts, shards=shards, colocated=colocated,
                      link_bytes_per_s=bandwidth, latency_s=latency, cap_bytes_per_s=cap, overhead_s=overhead,
                      window=window, compute_s=None if roofline else compute, flops=flops, peak_flops_per_s=peak,
                      mem_bytes_per_s=mem_bandwidth, sync_every=sync_every, backward_fraction=backward_fraction,
                      mode="hier" if sync_every > 1 else "flat")  # grid() sets the mode of each row
        ranked = rank(grid(base, modes, overlaps, slices))
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=_TUNE_OPTIONS.get(exc.field, exc.field)) from None
    ring = base.compute_time_s() + ring_allreduce_time(base.model_bytes, workers, base.rate_bytes_per_s, latency)
    reason = explain(ranked)
    if as_json:
        out.print_json(json.dumps({"model_bytes": base.model_bytes, "tensors": len(tensors), "ring_allreduce_s": ring,
                                   "best": ranked[0].config.label, "reason": reason,
                                   "predictions": [p.as_dict() for p in ranked]}))
        return
    from rich import box

    table = Table(title=f"irdma tune: {format_size(base.model_bytes)} in {len(tensors)} tensors, {workers} workers on"
                        f" {hosts} hosts, {shards} shards{' (colocated)' if colocated else ''},"
                        f" {format_rate(bandwidth)}{f' capped at {format_rate(cap)}' if cap else ''},"
                        f" {format_duration(latency)} latency,"
                        f" compute {format_duration(base.compute_time_s())} per iteration", box=box.SIMPLE,
                  collapse_padding=True, pad_edge=False)
    for col in ("#", "mode", "overlap", "slice", "time", "comm", "exposed", "busiest link", "bound"):
        table.add_column(col, justify="left" if col in ("mode", "overlap", "bound") else "right")
    for k, p in enumerate(ranked, 1):
        c = p.config
        table.add_row(str(k), c.mode + (f" K={c.sync_every}" if c.sync_every > 1 else ""), c.overlap,
                      format_size(c.slice_bytes) if c.slice_bytes else "whole", format_duration(p.time_s),
                      format_duration(p.comm_s), format_duration(p.exposed_s), format_size(p.busiest_link_bytes),
                      p.bound)
    out.print(table)
    out.print(f"ring all-reduce, for reference (dense, no overlap): {format_duration(ring)} per iteration",
              highlight=False, soft_wrap=True)
    out.print(f"best: {reason}", highlight=False, soft_wrap=True)
    # the best row DistributedOptimizer runs as ranked (the hierarchy sums whole steps: no overlap)
    k, runnable = next(((k, p) for k, p in enumerate(ranked, 1) if not (p.config.mode == "hier"
                                                                     and p.config.overlap != "none")),
                       (1, ranked[0]))
    out.print(f"in model.fit: {_keras_args(runnable.config)}" + (f" (row {k}: the best model.fit runs)" if k > 1
                                                                  else ""), highlight=False, soft_wrap=True)


def _keras_args(c: Any) -> str:
    """How to train in configuration ``c`` (a costmodel Config) with irdma.keras."""
    args = ["opt"]
    if c.mode == "hier":
        args.append("hierarchy=True")
        if c.sync_every > 1:
            args.append(f"sync_every={c.sync_every}")
    if c.overlap != "none":
        args.append(f"overlap={c.overlap!r}")
        if c.overlap == "p3" and c.slice_bytes:
            args.append(f"slice_elems={c.slice_bytes // 4}")
    if c.mode not in ("flat", "hier"):
        args.append(f"compress={c.mode!r}")
    return f"hvd.DistributedOptimizer({', '.join(args)}) with hvd.BroadcastInitialWeights(0) (import irdma.keras as hvd)"
