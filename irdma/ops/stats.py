"""``irdma stats``: a live view of shards' and mounts' metrics in the terminal (as ``juicefs stats``).

Where the numbers come from: every shard started with ``irdma server --metrics HOST:PORT`` (or
``irdma up --metrics HOST:PORT``) and every mount started with ``irdma mount --metrics
HOST:PORT`` serves Prometheus metrics at ``http://HOST:PORT/metrics`` (:mod:`irdma.metrics`).
:func:`run` scrapes them every ``interval`` seconds and shows per-second rates computed from the
difference of two scrapes: requests/s by op, MiB/s pulled and pushed, p50 and p99 latency (from
the histogram buckets that filled in between, as Prometheus's ``histogram_quantile`` of a
``rate`` does), errors/s, requests in flight, bytes held and capacity.

Discovery (how ``irdma stats`` finds the endpoints):

* ``irdma stats MNT``: a mount serving metrics records its address in a small JSON file keyed by
  the mountpoint's absolute path (:func:`irdma.metrics.mount_state_file`: under
  ``$IRDMA_RUN_DIR``, else ``$XDG_RUNTIME_DIR/irdma``, else ``/tmp/irdma-UID``), written once the
  mount is up and removed when it ends. So it works for mounts of the same user on this host.
* ``irdma stats --meta URL``: each shard tells its metrics address in its STAT reply (the
  ``metrics`` field of :class:`irdma.wire.protocol.StatReply`), which the client fetches from every
  shard of the shard map (:meth:`irdma.Client.shard_stats`). Works across hosts, as long as the
  shards' ``--metrics`` address is reachable from where ``irdma stats`` runs (not 127.0.0.1 then).
* ``--endpoint HOST:PORT`` (repeatable): any exporter, named by hand (another user's mount,
  a mount on another host).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .._errors import InvalidArgument, IrdmaError
from ..meta import redact
from ..metrics import format_host, mount_state_file, parse_metrics_address

#: The layers a process may expose, their metric prefixes, and which byte direction is a pull.
_LAYERS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("shard", "irdma_shard", {"out": "pull", "in": "push"}),
    ("client", "irdma_client", {"in": "pull", "out": "push"}),
    ("fuse", "irdma_fuse", {}),
)
#: Most op rows shown per layer of one endpoint (the busiest first).
MAX_OP_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Target:
    """One metrics endpoint: ``name`` (what it is: ``shard 1``, ``mount /mnt/ps``) and
    ``address`` (``HOST:PORT``)."""

    name: str
    address: str

    @property
    def url(self) -> str:
        return f"http://{format_host(self.address)}/metrics"


@dataclasses.dataclass
class Scrape:
    """One scrape of a target: when (``time.monotonic``, s) and its samples, by sample name,
    as ``(labels, value)`` pairs."""

    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]]


# ---------------------------------------------------------------- discovery
def mount_target(mountpoint: str) -> Target:
    """The metrics endpoint of the mount on ``mountpoint``, from its state file.

    Raises:
        IrdmaError: no mount with metrics recorded there, or the process that recorded it is
            gone (the message says how to start one with metrics).
    """
    from .._proc import pid_alive

    path = mount_state_file(mountpoint)
    where = os.path.abspath(mountpoint)
    try:
        with open(path) as f:
            rec = json.load(f)
        address, pid = str(rec["metrics"]), int(rec["pid"])
    except FileNotFoundError:
        raise IrdmaError(f"no mount on {where} serves metrics (nothing recorded in {path})",
                         f"mount it with `irdma mount --metrics 127.0.0.1:0 META_URL {mountpoint}`, or pass"
                         " --endpoint HOST:PORT if it runs as another user or elsewhere") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IrdmaError(f"cannot read the metrics record {path} of the mount on {where}: {exc}",
                         f"remount {mountpoint} with --metrics, or pass --endpoint HOST:PORT") from None
    if not pid_alive(pid):
        raise IrdmaError(f"the mount process (pid {pid}) that served metrics for {where} is gone",
                         f"`irdma umount {mountpoint}` cleans it; mount again with --metrics HOST:PORT")
    return Target(f"mount {where}", address)


async def shard_targets(meta_url: str) -> tuple[list[Target], list[str]]:
    """The metrics endpoints of every shard in the shard map of ``meta_url``, from their STAT
    replies.

    Returns:
        The targets, and one line per shard that has none (not answering, or no --metrics).

    Raises:
        IrdmaError: the namespace cannot be opened (see :meth:`irdma.Client.open`).
    """
    from ..client.native import Client

    async with Client.open(meta_url, transport="tcp", client_name="irdma stats") as client:
        stats = await client.shard_stats()
    targets: list[Target] = []
    missing: list[str] = []
    for rec, st, why in stats:
        if rec.state == "removed":
            continue
        if st is None:
            missing.append(f"shard {rec.shard_id} at {rec.address}: {why or 'no answer'}")
        elif not st.metrics:
            missing.append(f"shard {rec.shard_id} at {rec.address}: serves no metrics (start it with --metrics)")
        else:
            targets.append(Target(f"shard {rec.shard_id}", st.metrics))
    return targets, missing


def discover(mountpoints: Sequence[str] = (), meta_url: str | None = None,
             endpoints: Sequence[str] = ()) -> tuple[list[Target], list[str]]:
    """Every endpoint named by mountpoints, a metadata URL (its shards) and explicit addresses.

    Returns:
        The targets, and notes about shards that have none.

    Raises:
        InvalidArgument: nothing named, or an endpoint that is not HOST:PORT.
        IrdmaError: a mountpoint without metrics; no shard of ``meta_url`` serves metrics.
    """
    import trio

    targets: list[Target] = []
    notes: list[str] = []
    for addr in endpoints:
        parse_metrics_address(addr, "--endpoint")
        targets.append(Target(addr, addr))
    for mnt in mountpoints:
        targets.append(mount_target(mnt))
    if meta_url:
        shards, notes = trio.run(shard_targets, meta_url)
        if not shards:
            raise IrdmaError(f"no shard of {redact(meta_url)} serves metrics" + (f" ({notes[0]})" if notes else ""),
                             "start the shards with `irdma server --metrics HOST:PORT` (`irdma up --metrics"
                             " HOST:PORT`), or pass --endpoint HOST:PORT")
        targets += shards
    if not targets:
        raise InvalidArgument("nothing to show", "name a mountpoint, --meta URL, or --endpoint HOST:PORT")
    return targets, notes


# ---------------------------------------------------------------- scraping
def scrape(target: Target, timeout: float = 2.0) -> Scrape:
    """GET ``target``'s exposition text and parse it.

    Raises:
        IrdmaError: it did not answer within ``timeout`` seconds, or not with Prometheus text;
            the message names the address and what to check.
    """
    try:
        with urllib.request.urlopen(target.url, timeout=timeout) as resp:  # noqa: S310 - http only
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise IrdmaError(f"{target.name}: no metrics from {target.url}: {reason}",
                         "check that the process runs with --metrics at that address and that this host can"
                         " reach it") from None
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[s.name].append((s.labels, s.value))
    except ValueError as exc:
        raise IrdmaError(f"{target.name}: {target.url} did not answer Prometheus text: {exc}",
                         "check that the address is an irdma --metrics address") from None
    return Scrape(time.monotonic(), dict(samples))


def scrape_all(targets: Sequence[Target], timeout: float) -> list[Scrape | IrdmaError]:
    """Scrape every target at once (threads); a failed one gives its error in its place."""

    def one(t: Target) -> Scrape | IrdmaError:
        try:
            return scrape(t, timeout)
        except IrdmaError as exc:
            return exc

    if len(targets) == 1:
        return [one(targets[0])]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return list(pool.map(one, targets))


# ---------------------------------------------------------------- rates
def _sum(samples: Iterable[tuple[dict[str, str], float]], **match: str) -> float:
    return sum(v for labels, v in samples if all(labels.get(k) == want for k, want in match.items()))


def _by(samples: Iterable[tuple[dict[str, str], float]], key: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, v in samples:
        out[labels.get(key, "")] += v
    return out


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q`` quantile of a histogram given as ``{upper bound: cumulative count}`` (``le``
    buckets), interpolated linearly within the bucket it falls in (as ``histogram_quantile``).

    Returns:
        Seconds, or None when the histogram is empty. A quantile in the ``+Inf`` bucket is
        the largest finite bound.
    """
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if math.isinf(b):
                return prev_bound
            if count == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = b, count
    return prev_bound


@dataclasses.dataclass
class Row:
    """One line of the view: rates over the last interval. Units: per second, bytes per
    second, seconds for latencies; ``requests`` is the count since the process started."""

    endpoint: str
    layer: str
    op: str
    requests_s: float
    pull_bytes_s: float = 0.0
    push_bytes_s: float = 0.0
    p50_s: float | None = None
    p99_s: float | None = None
    errors_s: float = 0.0
    inflight: float | None = None
    held: str = ""
    requests: float = 0.0


def rows_of(target: Target, prev: Scrape, cur: Scrape) -> list[Row]:
    """The rows of one endpoint from two scrapes of it (``prev`` first): for each layer it
    exposes (shard, client, fuse), a ``total`` row and up to :data:`MAX_OP_ROWS` op rows."""
    dt = max(cur.at - prev.at, 1e-6)
    rows: list[Row] = []
    for layer, prefix, directions in _LAYERS:
        rows += _layer_rows(target, prev, cur, dt, layer, prefix, directions)
    return rows


def summary_of(prev: Scrape, cur: Scrape) -> str:
    """What the process of an endpoint uses over the interval between two scrapes (the
    ``usage`` group of ``juicefs stats``): ``cpu 12%`` (of one core, from
    ``process_cpu_seconds_total``) and ``mem 85M`` (resident, ``process_resident_memory_bytes``);
    with a local read cache, ``cache 97% hits 1.0G`` (chunk reads served from it over the
    interval, bytes it holds); empty when the exporter has none of these."""
    parts = []
    cpu_now, cpu_then = cur.samples.get("process_cpu_seconds_total"), prev.samples.get("process_cpu_seconds_total")
    if cpu_now and cpu_then:
        used = (_sum(cpu_now) - _sum(cpu_then)) / max(cur.at - prev.at, 1e-6)
        parts.append(f"cpu {used * 100:.0f}%")
    mem = cur.samples.get("process_resident_memory_bytes")
    if mem:
        parts.append(f"mem {_bytes(_sum(mem))}")
    held = cur.samples.get("irdma_cache_bytes")
    if held is not None:  # a mount or client with a local read cache (docs/cache.md)
        hits = _sum(cur.samples.get("irdma_cache_hits_total", [])) - _sum(prev.samples.get("irdma_cache_hits_total", []))
        misses = (_sum(cur.samples.get("irdma_cache_misses_total", []))
                  - _sum(prev.samples.get("irdma_cache_misses_total", [])))
        ratio = f" {hits / (hits + misses) * 100:.0f}% hits" if hits + misses > 0 else ""
        parts.append(f"cache{ratio} {_bytes(_sum(held))}")
    return ", ".join(parts)


def _layer_rows(target: Target, prev: Scrape, cur: Scrape, dt: float, layer: str, prefix: str,
                directions: dict[str, str]) -> list[Row]:
    """The rows of one layer (``shard``, ``client``, ``fuse``) of :func:`rows_of`."""
    req_name = f"{prefix}_requests_total"
    if not any(name.startswith(prefix + "_") for name in cur.samples):
        return []  # this process has no such layer
    now_req = cur.samples.get(req_name, [])
    ops = sorted(_by(now_req, "op"))

    def delta(name: str, **match: str) -> float:
        return _sum(cur.samples.get(name, []), **match) - _sum(prev.samples.get(name, []), **match)

    def hist(match: dict[str, str]) -> tuple[float | None, float | None]:
        name = f"{prefix}_request_duration_seconds_bucket"
        buckets: dict[float, float] = defaultdict(float)
        for sign, samples in ((1, cur.samples.get(name, [])), (-1, prev.samples.get(name, []))):
            for labels, v in samples:
                if all(labels.get(k) == want for k, want in match.items()):
                    buckets[float(labels["le"])] += sign * v
        return quantile(0.5, buckets), quantile(0.99, buckets)

    def row(op: str, match: dict[str, str]) -> Row:
        reqs = delta(req_name, **match)
        r = Row(target.name, layer, op, reqs / dt, requests=_sum(now_req, **match))
        if layer == "fuse":
            b = delta(f"{prefix}_bytes_total", **match)
            if op in ("read", "total"):
                r.pull_bytes_s = (b if op == "read" else delta(f"{prefix}_bytes_total", op="read")) / dt
            if op in ("write", "total"):
                r.push_bytes_s = (b if op == "write" else delta(f"{prefix}_bytes_total", op="write")) / dt
            r.errors_s = delta(f"{prefix}_errors_total", **match) / dt
        else:
            for direction, what in directions.items():
                rate = delta(f"{prefix}_bytes_total", direction=direction, **match) / dt
                setattr(r, f"{what}_bytes_s", rate)
            r.errors_s = (reqs - delta(req_name, status="ok", **match)) / dt
        r.p50_s, r.p99_s = hist(match)
        return r

    total = row("total", {})
    if layer != "fuse":
        total.inflight = _sum(cur.samples.get(f"{prefix}_inflight_requests", []))
    if layer == "shard":
        held = _sum(cur.samples.get("irdma_shard_held_bytes", []))
        cap = _sum(cur.samples.get("irdma_shard_capacity_bytes", []))
        chunks = _sum(cur.samples.get("irdma_shard_chunks", []))
        lag = _sum(cur.samples.get("irdma_shard_replication_pending_forwards", []))
        total.held = f"held {_bytes(held)} of {_bytes(cap)}, {_count(chunks)} chunks" + (f", lag {_count(lag)}" if lag else "")
    rows: list[Row] = [total]
    cumulative = _by(now_req, "op")
    op_rows = [row(op, {"op": op}) for op in ops if cumulative[op] > 0]
    op_rows.sort(key=lambda r: (-r.requests_s, -cumulative[r.op], r.op))  # busiest now, then ever
    rows += op_rows[:MAX_OP_ROWS]
    return rows


# ---------------------------------------------------------------- the view
def _num(x: float | None) -> str:
    """A number in at most 4 characters, as ``juicefs stats`` writes them: ``0``, ``0.25``,
    ``12.5``, ``350``, ``1.2K``, ``35M`` (powers of 1000); ``-`` for None (nothing measured)."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if abs(x) < 0.01:
        return "<.01" if x > 0 else "0"
    for scale, suffix in ((1.0, ""), (1e3, "K"), (1e6, "M"), (1e9, "G"), (1e12, "T")):
        v = x / scale
        if abs(v) < 999.5 or suffix == "T":
            if suffix == "":
                return f"{v:.2f}" if abs(v) < 9.995 else f"{v:.1f}" if abs(v) < 99.95 else f"{v:.0f}"
            return f"{v:.1f}{suffix}" if abs(v) < 9.95 else f"{v:.0f}{suffix}"
    return f"{x:.0f}"  # pragma: no cover


def _count(x: float) -> str:
    """A count (requests, chunks) in at most 4 characters: ``7``, ``350``, ``1.2K``, ``35M``."""
    return f"{x:.0f}" if abs(x) < 999.5 else _num(x)


def _bytes(n: float) -> str:
    """Bytes in at most 4 characters, in powers of 1024 (``512B``, ``1.2K``, ``35M``, ``128G``:
    KiB, MiB, GiB)."""
    for suffix in ("B", "K", "M", "G", "T"):
        if abs(n) < 999.5 or suffix == "T":
            return f"{n:.0f}{suffix}" if suffix == "B" or abs(n) >= 9.95 else f"{n:.1f}{suffix}"
        n /= 1024
    return f"{n:.0f}T"  # pragma: no cover


def _ms(s: float | None) -> str:
    return "-" if s is None else _num(s * 1e3)


def _mib(b: float) -> str:
    return _num(b / (1 << 20))


#: Columns of the view: header, what a row shows, shown from this terminal width on. The
#: narrow set fits 80 columns (op names up to 14 characters with their indent).
_COLUMNS: tuple[tuple[str, Any, int], ...] = (
    ("ops/s", lambda r: _num(r.requests_s), 0),
    ("pull MiB/s", lambda r: _mib(r.pull_bytes_s), 0),
    ("push MiB/s", lambda r: _mib(r.push_bytes_s), 0),
    ("p50 ms", lambda r: _ms(r.p50_s), 0),
    ("p99 ms", lambda r: _ms(r.p99_s), 0),
    ("err/s", lambda r: _num(r.errors_s), 0),
    ("infl", lambda r: "" if r.inflight is None else _count(r.inflight), 0),
    ("ops", lambda r: _count(r.requests), 100),
)


def render(rows: Sequence[Row], down: Sequence[str] = (), notes: Sequence[str] = (), interval: float = 1.0,
           summaries: dict[str, str] | None = None, width: int = 80, live: bool = True) -> Group:
    """The view of :func:`run` for ``rows``, for a terminal ``width`` columns wide: a title
    line, then per endpoint a line naming it (its ``summaries`` entry: cpu and memory; a
    shard's bytes held, capacity and chunks) and a table with a group of rows per layer
    (``shard``, ``client``, ``fuse``: its total, then its busiest ops), and lines for the
    endpoints that did not answer.

    Headers and numbers are short (``ops/s``, ``pull MiB/s``, ``p50 ms``; ``1.2K``, ``35M``)
    so that at 80 columns nothing is cut; from 100 columns on the count of requests since
    the process started is shown too. ``live``: the view runs until Ctrl-C (the title says so);
    False for a set count of refreshes.
    """
    summaries = summaries or {}
    cols = [(h, f) for h, f, min_width in _COLUMNS if width >= min_width]
    parts: list[Any] = [Text(f"irdma stats: rates over {interval:g} s" + (" (Ctrl-C to stop)" if live else ""),
                                style="bold")]
    by_endpoint: dict[str, list[Row]] = {}
    for r in rows:
        by_endpoint.setdefault(r.endpoint, []).append(r)
    for endpoint, ep_rows in by_endpoint.items():
        extra = [x for x in (next((r.held for r in ep_rows if r.held), ""), summaries.get(endpoint, "")) if x]
        parts.append(Text.assemble(("\n" + endpoint, "bold cyan"), (": " + "; ".join(extra)) if extra else ""))
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False, show_edge=False)
        table.add_column("op", justify="left", no_wrap=True, min_width=14)
        for header, _ in cols:
            table.add_column(header, justify="right", no_wrap=True)
        layer = ""
        for r in ep_rows:
            if r.layer != layer and layer:
                table.add_section()
            layer = r.layer
            total = r.op == "total"
            table.add_row(r.layer if total else "  " + r.op, *(f(r) for _, f in cols), style="bold" if total else None)
        parts.append(table)
    for line in [*down, *notes]:
        parts.append(Text(line, style="yellow"))
    return Group(*parts)


# ---------------------------------------------------------------- the loop
def run(*, mountpoints: Sequence[str] = (), meta_url: str | None = None, endpoints: Sequence[str] = (),
        interval: float = 1.0, count: int | None = None, console: Console | None = None) -> int:
    """Show the metrics of the named endpoints live until Ctrl-C, or for ``count`` refreshes.

    On a terminal the table is redrawn in place (rich ``Live``); elsewhere (a pipe, a file)
    each refresh prints one table.

    Args:
        mountpoints: mounts to show (found by :func:`mount_target`).
        meta_url: show every shard of this namespace (found by :func:`shard_targets`).
        endpoints: more exporters, ``HOST:PORT`` each.
        interval: seconds between refreshes (> 0); rates are over this interval.
        count: stop after this many refreshes (None: until interrupted).
        console: where to draw (default: stdout).

    Returns:
        How many refreshes were shown.

    Raises:
        InvalidArgument: ``interval`` <= 0 or ``count`` < 1, or nothing named.
        IrdmaError: an endpoint cannot be found or does not answer the first scrape (the
            message names its address and what to do). Later, an endpoint that stops
            answering is shown as such and the view goes on.
    """
    if not interval > 0:
        raise InvalidArgument(f"--interval {interval} must be more than 0 seconds", "pass --interval 1")
    if count is not None and count < 1:
        raise InvalidArgument(f"--count {count} must be 1 or more", "leave --count out to run until Ctrl-C")
    console = console or Console()
    targets, notes = discover(mountpoints, meta_url, endpoints)
    timeout = max(1.0, min(interval, 5.0))
    prev: list[Scrape | IrdmaError] = scrape_all(targets, timeout)
    for got in prev:
        if isinstance(got, IrdmaError):
            raise got
    shown = 0
    live: Any = None
    if console.is_terminal:
        from rich.live import Live

        live = Live(render([], interval=interval, width=console.width, live=count is None), console=console,
                    auto_refresh=False)
        live.start()
    try:
        deadline = time.monotonic()
        while count is None or shown < count:
            deadline += interval
            time.sleep(max(0.0, deadline - time.monotonic()))
            cur = scrape_all(targets, timeout)
            rows: list[Row] = []
            down: list[str] = []
            summaries: dict[str, str] = {}
            for t, old, new in zip(targets, prev, cur, strict=True):
                if isinstance(new, IrdmaError):
                    down.append(f"{t.name} ({t.address}): no answer (check that it still runs)")
                elif isinstance(old, Scrape):
                    rows += rows_of(t, old, new)
                    summaries[t.name] = summary_of(old, new)
            table = render(rows, down, notes, interval, summaries, console.width, live=count is None)
            if live is not None:
                live.update(table, refresh=True)
            else:
                console.print(table, soft_wrap=False)  # lines fit the width (a long mount path wraps)
            prev = [n if isinstance(n, Scrape) else o for o, n in zip(prev, cur, strict=True)]
            shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    return shown


__all__ = ["Target", "Scrape", "Row", "discover", "mount_target", "shard_targets", "scrape", "scrape_all",
           "quantile", "rows_of", "summary_of", "render", "run"]
