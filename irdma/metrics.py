"""Prometheus metrics of shards, clients and mounts, and their HTTP exporter.

Every metric irdma exposes is defined here, in one per-process :data:`REGISTRY` (not
``prometheus_client``'s global one, so a library user's own metrics never mix with ours).
``irdma server --metrics HOST:PORT`` and ``irdma mount --metrics HOST:PORT`` serve it at
``http://HOST:PORT/metrics`` (:func:`serve`: a daemon thread, never the trio loop).

Names follow the Prometheus conventions (https://prometheus.io/docs/practices/naming/): base
units (``_seconds``, ``_bytes``) as the last word of the name, then ``_total`` on counters and on
counters only; no ``_created`` series (:func:`serve` turns them off: they double every counter
and no dashboard reads them); ``_info`` gauges of value 1 for what a process is. Labels take
values from small fixed sets only (op names, transport names, statuses, error kinds, errno
names, shard ids), never file names or chunk ids.

The shard (``irdma_shard_*``; see :class:`ShardMetrics`):

* ``irdma_shard_requests_total{op,transport,status}``: requests answered. ``op`` is the
  protocol opcode in lower case (``read``, ``write``, ``remote_write``, ``sync``, ``stat``
  ...), with ``forward`` for an update another shard forwarded along a replication chain (so
  ``write`` counts only what clients pushed); ``transport`` is ``tcp`` or ``verbs`` (SENDs on
  a verbs queue pair; pulls over verbs are one-sided RDMA READs the shard never sees);
  ``status`` is ``ok`` or the error status in lower case (``no_space``, ``bad_request`` ...).
* ``irdma_shard_bytes_total{op,transport,direction}``: payload bytes, ``in`` (pushed to the
  shard: the data of a write) or ``out`` (pulled: the data of a read reply; a hole is 0).
  Headers, tags and other protocol bytes are not counted.
* ``irdma_shard_request_duration_seconds{op,transport}``: histogram of the time from a decoded
  request to its reply (for a chained update: until the rest of the chain acknowledged it).
* ``irdma_shard_inflight_requests``: requests being applied or waiting for their chain.
* ``irdma_shard_chunks{shard}``, ``irdma_shard_held_bytes{shard}``,
  ``irdma_shard_capacity_bytes{shard}``: read from the shard at scrape time.
* ``irdma_shard_replication_pending_forwards{shard}``: updates forwarded to the next replica
  and not yet acknowledged by it (the replication lag in updates); ``irdma_shard_dirty_chunks``:
  chunks with such updates (a clean read of one goes to the chain's tail).
* ``irdma_shard_replication_forwards_total{status}``: updates forwarded to the next replica.
* ``irdma_shard_replication_forward_duration_seconds``: histogram of the time a forward took to
  be acknowledged by the rest of the chain (the replication lag in seconds).
* ``irdma_shard_errors_total{kind}``: failed requests by kind (the status).

The client (``irdma_client_*``, every process with an :class:`irdma.Client`, a mount too; see
:class:`ClientMetrics`), counted per request to one shard:

* ``irdma_client_requests_total{op,transport,status}``: ``op`` is the transport call
  (``read``, ``write``, ``stat``, ``sync``, ``free``, ``punch``, ``resync``, ``checksum``,
  ``list``); ``status`` is ``ok`` or the error kind (:func:`error_kind`).
* ``irdma_client_bytes_total{op,direction}``: payload bytes of successful calls, ``in``
  (pulled: the bytes read) or ``out`` (pushed: the data of a write).
* ``irdma_client_request_duration_seconds{op,transport}``: latency histogram.
* ``irdma_client_inflight_requests``; ``irdma_client_errors_total{kind}``.

The mount (``irdma_fuse_*``, see :class:`FuseMetrics`): ``irdma_fuse_requests_total{op}``
(FUSE request type: ``read``, ``write``, ``lookup``, ``getattr``, ``fsync`` ...),
``irdma_fuse_request_duration_seconds{op}``, ``irdma_fuse_bytes_total{op}`` (bytes returned by
``read``, accepted by ``write``), ``irdma_fuse_errors_total{op,errno}`` (``errno`` as its
symbolic name) and ``irdma_fuse_not_found_total{op,errno}``. An answer that only says "there is
no such name" or "no such attribute" is not an error (:data:`NOT_ERRORS`): ``ENOENT`` from
``lookup`` (the kernel looks a name up before every ``O_CREAT`` open, ``mkdir``, ``rename`` over
nothing; ``$PATH`` and ``sys.path`` searches are made of them) and ``ENODATA`` (Linux's
``ENOATTR``) from ``getxattr`` or ``listxattr`` (the kernel asks ``getxattr
security.capability`` before every write to a file). Those count in
``irdma_fuse_requests_total`` and ``irdma_fuse_not_found_total``, never in
``irdma_fuse_errors_total``, so an alert on the error rate stays quiet on healthy traffic. The
same errno from any other request (``ENOENT`` from ``getattr``: a file removed under an open
handle) is an error.

The local read cache (``irdma_cache_*``, a mount or client with a cache; see
:class:`CacheMetrics` and :mod:`irdma.client.cache`): ``irdma_cache_hits_total{tier}`` (chunk
reads served from ``memory`` or ``disk``), ``irdma_cache_misses_total`` (chunk reads that went to
the shards), ``irdma_cache_evictions_total{tier}``, ``irdma_cache_bytes{tier}`` (bytes held) and
``irdma_cache_validations_total{result}`` (kept chunks checked at an open: ``valid``, ``stale``,
``checksum``).

The metadata engine (``irdma_meta_*``, every process with a client, mounts included; see
:class:`MetaMetrics` and :class:`irdma.meta.aio.AsyncMeta`): ``irdma_meta_calls_total{call}``,
the engine calls made, by method (``create_open``, ``open_file``, ``extend``, ``close_inodes``:
what a small file costs through a mount).

Every exporter (shard and mount alike) also serves what describes the process:
``irdma_build_info{version,python,transport}`` (always 1: the irdma version, the Python version,
the transports the process speaks: ``tcp``, ``tcp,verbs`` for a shard with an RDMA device, or
the mount's transport), and ``prometheus_client``'s process collector (``process_cpu_seconds_total``,
``process_resident_memory_bytes``, ``process_open_fds``, ``process_start_time_seconds`` ...),
platform collector (``python_info``) and garbage-collector counters (``python_gc_*``).

Renamed by issue 24 (old -> new), for dashboards and alerts written against the old names
(``docs/deploy.md`` has the same table):

* ``irdma_shard_bytes_held`` -> ``irdma_shard_held_bytes``
* ``irdma_shard_request_seconds`` -> ``irdma_shard_request_duration_seconds``
* ``irdma_shard_replication_forward_seconds`` -> ``irdma_shard_replication_forward_duration_seconds``
* ``irdma_client_request_seconds`` -> ``irdma_client_request_duration_seconds``
* ``irdma_fuse_request_seconds`` -> ``irdma_fuse_request_duration_seconds``
* ``irdma_fuse_errors_total{op="lookup",errno="ENOENT"}`` -> ``irdma_fuse_not_found_total``
* every ``*_created`` series: gone.

Recording never fails a request: every hook catches and logs its own errors (once).
"""

from __future__ import annotations

import bisect
import errno as _errno
import logging
import os
import platform
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from . import _errors as E
from .units import format_host, parse_address

log = logging.getLogger("irdma.metrics")

#: Every irdma metric of this process.
REGISTRY = CollectorRegistry(auto_describe=True)

#: Histogram buckets of request latencies, seconds: 10 us to 10 s.
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: The environment variable ``irdma up --metrics HOST:PORT`` hands its shards: shard N serves
#: its metrics on HOST:PORT+N (HOST:0 for a free port each), see :func:`shard_address`.
SHARD_METRICS_ENV = "IRDMA_SHARD_METRICS"

_warned: set[str] = set()


def _warn_once(what: str, exc: BaseException) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("metrics: %s failed (%r); requests go on, this metric may be off", what, exc)


# ---------------------------------------------------------------- error kinds
#: The error kind of an exception (a label value), by class; the nearest class wins.
_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (E.Dirty, "dirty"),
    (E.Fenced, "fenced"),
    (E.ReplicaStale, "replica_stale"),
    (E.ReplicaFailed, "replica_failed"),
    (E.ShardUnavailable, "unavailable"),
    (E.NoSpace, "no_space"),
    (E.BadRequest, "bad_request"),
    (E.DataLost, "data_lost"),
    (E.AuthFailed, "auth_failed"),
    (E.RemoteProtocolError, "protocol"),
    (E.LocalProtocolError, "protocol"),
    (E.TransportUnavailable, "transport"),
    (E.IrdmaError, "other"),
)


def error_kind(exc: BaseException) -> str:
    """The bounded label value naming what kind of failure ``exc`` is.

    Returns:
        ``cancelled`` for a cancellation (a deadline, most often), one of ``dirty``, ``fenced``,
        ``replica_stale``, ``replica_failed``, ``unavailable``, ``no_space``, ``bad_request``,
        ``data_lost``, ``auth_failed``, ``protocol``, ``transport``, ``other`` for an irdma
        error, ``bug`` for anything else.
    """
    for cls, kind in _KINDS:
        if isinstance(exc, cls):
            return kind
    if not isinstance(exc, Exception):
        return "cancelled"
    return "bug"



# ---------------------------------------------------------------- per-request tallies
class _Tally(Collector):
    """Counters, gauges and latency histograms kept in plain Python numbers, one dict per
    recording thread, summed when scraped.

    The request metrics are recorded on every request, on the event loop: ``prometheus_client``'s
    ``Counter.inc`` and ``Histogram.observe`` take a lock and check the value each time (six of
    them a request, a tenth of a shard's CPU for a 4 KiB read). Here a request costs dict
    lookups and integer adds: no lock (each thread writes only its own dict; a scrape reads
    them from the exporter's thread, a value at most one request old, never torn: every cell
    is a list of ints and floats replaced or added to under the GIL).

    Args:
        families: ``name -> (kind, help, label names)``, ``kind`` one of ``counter``, ``gauge``,
            ``histogram`` (buckets :data:`LATENCY_BUCKETS`); names as ``prometheus_client``
            takes them (a counter's ``_total`` is added).
    """

    def __init__(self, families: dict[str, tuple[str, str, tuple[str, ...]]], registry: CollectorRegistry) -> None:
        self.families = families
        self._local = threading.local()
        self._all: list[dict[tuple[str, tuple[str, ...]], list[float]]] = []
        self._lock = threading.Lock()  # only to add a thread's dict
        registry.register(self)

    def cells(self) -> dict[tuple[str, tuple[str, ...]], list[float]]:
        """This thread's cells: ``(family, label values) -> [value]``, or for a histogram
        ``[count per bucket..., count over the last bucket, sum of seconds]``."""
        try:
            return self._local.cells  # type: ignore[no-any-return]
        except AttributeError:
            cells: dict[tuple[str, tuple[str, ...]], list[float]] = {}
            with self._lock:
                self._all.append(cells)
            self._local.cells = cells
            return cells

    def add(self, name: str, labels: tuple[str, ...], n: float = 1) -> None:
        """Add ``n`` to a counter or gauge (a gauge's cells are summed over threads)."""
        cells = self.cells()
        cell = cells.get((name, labels))
        if cell is None:
            cell = cells[(name, labels)] = [0]
        cell[0] += n

    def observe(self, name: str, labels: tuple[str, ...], seconds: float) -> None:
        """One observation of a histogram, in seconds."""
        cells = self.cells()
        cell = cells.get((name, labels))
        if cell is None:
            cell = cells[(name, labels)] = [0] * (len(LATENCY_BUCKETS) + 2)
        cell[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        cell[-1] += seconds

    def describe(self) -> Iterable[Any]:
        return list(self._families({}))

    def collect(self) -> Iterator[Any]:
        with self._lock:
            threads = list(self._all)
        merged: dict[tuple[str, tuple[str, ...]], list[float]] = {}
        for cells in threads:
            for key, cell in list(cells.items()):  # (a dict copy is atomic under the GIL)
                have = merged.get(key)
                if have is None:
                    merged[key] = list(cell)
                else:
                    for i, v in enumerate(cell):
                        have[i] += v
        yield from self._families(merged)

    def _families(self, merged: dict[tuple[str, tuple[str, ...]], list[float]]) -> Iterator[Any]:
        bounds = [*(floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf"]  # type: ignore[no-untyped-call]
        for name, (kind, doc, labels) in self.families.items():
            fam: Any
            if kind == "counter":
                fam = CounterMetricFamily(name, doc, labels=labels)
            elif kind == "gauge":
                fam = GaugeMetricFamily(name, doc, labels=labels)
            else:
                fam = HistogramMetricFamily(name, doc, labels=labels)
            for (fname, values), cell in sorted(merged.items()):
                if fname != name:
                    continue
                if kind == "histogram":
                    cum, buckets = 0.0, []
                    for bound, k in zip(bounds, cell[:-1], strict=True):
                        cum += k
                        buckets.append((bound, cum))
                    fam.add_metric(list(values), buckets, cell[-1])
                else:
                    fam.add_metric(list(values), cell[0])
            if kind == "gauge" and not labels and not fam.samples:
                fam.add_metric([], 0)
            yield fam

# ---------------------------------------------------------------- the shard
class ShardMetrics:
    """The request metrics of a shard server process (one per process: :func:`shard_metrics`).

    :meth:`begin` and :meth:`end` bracket each request: a gauge up and down, a counter
    increment, a histogram observation, and at most one bytes increment; label children are
    cached, so the hot path does a dict lookup per metric and no per-byte work.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.tally = _Tally({
            "irdma_shard_requests": ("counter", "Requests a shard answered.", ("op", "transport", "status")),
            "irdma_shard_bytes": ("counter", "Payload bytes a shard received (in) and sent (out).",
                                  ("op", "transport", "direction")),
            "irdma_shard_request_duration_seconds": ("histogram", "Seconds from a decoded request to its reply.",
                                                     ("op", "transport")),
            "irdma_shard_inflight_requests": ("gauge", "Requests being applied or waiting for their chain.", ()),
        }, registry)
        self.errors = Counter("irdma_shard_errors", "Failed requests by kind.", ("kind",), registry=registry)
        self.forward_seconds = Histogram(
            "irdma_shard_replication_forward_duration_seconds",
            "Seconds an update forwarded to the next replica took to be acknowledged by the rest of its chain.",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.forwards = Counter("irdma_shard_replication_forwards", "Updates forwarded to the next replica.",
                                ("status",), registry=registry)
        self._servers: weakref.WeakSet[Any] = weakref.WeakSet()
        registry.register(_ShardCollector(self._servers))

    def watch(self, server: Any) -> None:
        """Expose ``server``'s chunks, bytes held, capacity and replication lag (read at each
        scrape). ``server``: a :class:`irdma.server.serve.ShardServer` (held weakly)."""
        self._servers.add(server)

    def begin(self) -> float:
        """Note a request that starts; returns its start time (``time.perf_counter``, s)."""
        try:
            self.tally.add("irdma_shard_inflight_requests", (), 1)
        except Exception as exc:  # noqa: BLE001 - metrics never fail a request
            _warn_once("shard begin", exc)
        return time.perf_counter()

    def end(self, t0: float, op: str, transport: str, status: str, bytes_in: int = 0, bytes_out: int = 0) -> None:
        """Note a request that ended ``status`` (``ok`` or an error kind) after starting at ``t0``.

        Args:
            bytes_in: payload bytes it brought (a write's data).
            bytes_out: payload bytes its reply carries (a read's data).
        """
        try:
            dt = time.perf_counter() - t0
            t = self.tally
            t.add("irdma_shard_inflight_requests", (), -1)
            t.add("irdma_shard_requests", (op, transport, status))
            t.observe("irdma_shard_request_duration_seconds", (op, transport), dt)
            if bytes_in:
                t.add("irdma_shard_bytes", (op, transport, "in"), bytes_in)
            if bytes_out:
                t.add("irdma_shard_bytes", (op, transport, "out"), bytes_out)
            if status != "ok":
                self.errors.labels(status).inc()
        except Exception as exc:  # noqa: BLE001
            _warn_once("shard end", exc)

    def forwarded(self, seconds: float, status: str) -> None:
        """Note a forward to the next replica that ended ``status`` after ``seconds``."""
        try:
            self.forwards.labels(status).inc()
            if status == "ok":
                self.forward_seconds.observe(seconds)
        except Exception as exc:  # noqa: BLE001
            _warn_once("replication forward", exc)


class _ShardCollector(Collector):
    """Gauges read from the shards at scrape time (off the hot path)."""

    def __init__(self, servers: weakref.WeakSet[Any]) -> None:
        self._servers = servers

    def describe(self) -> Iterable[Any]:
        return []  # the families depend on the shards: nothing to check at register time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        chunks = GaugeMetricFamily("irdma_shard_chunks", "Chunks the shard holds.", labels=("shard",))
        held = GaugeMetricFamily("irdma_shard_held_bytes", "Bytes of the shard's memory region in use.",
                                 labels=("shard",))
        cap = GaugeMetricFamily("irdma_shard_capacity_bytes", "Bytes of the shard's memory region.",
                                labels=("shard",))
        pending = GaugeMetricFamily("irdma_shard_replication_pending_forwards",
                                    "Updates forwarded to the next replica, not yet acknowledged.",
                                    labels=("shard",))
        dirty = GaugeMetricFamily("irdma_shard_dirty_chunks", "Chunks with forwarded updates not yet acknowledged.",
                                  labels=("shard",))
        unsynced = GaugeMetricFamily("irdma_shard_unsynced_seconds",
                                     "Age of the oldest update applied but not yet synced to disk (0: none; what a"
                                     " power loss could take; the shard syncs within 30 s).", labels=("shard",))
        for server in list(self._servers):
            try:
                # read without a lock, from the exporter's thread: plain ints and a dict copy;
                # a scrape may see a value one request old, never a torn one
                shard = server.shard
                sid = str(shard.shard_id)
                chunks.add_metric([sid], shard.chunk_count)
                held.add_metric([sid], shard.used)
                cap.add_metric([sid], shard.capacity)
                lag = dict(server.replicator._dirty)
                pending.add_metric([sid], sum(lag.values()))
                dirty.add_metric([sid], len(lag))
                since = shard.unsynced_since
                unsynced.add_metric([sid], 0.0 if since is None else max(0.0, time.monotonic() - since))
            except Exception as exc:  # noqa: BLE001 - a scrape never breaks the shard
                _warn_once("shard gauges", exc)
        yield from (chunks, held, cap, pending, dirty, unsynced)


# ---------------------------------------------------------------- the client
class ClientMetrics:
    """The request metrics of a client (one per process: :func:`client_metrics`)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.tally = _Tally({
            "irdma_client_requests": ("counter", "Requests a client sent to shards, by outcome.",
                                      ("op", "transport", "status")),
            "irdma_client_bytes": ("counter", "Payload bytes a client pulled (in) and pushed (out).",
                                   ("op", "direction")),
            "irdma_client_request_duration_seconds": ("histogram", "Seconds a request to one shard took.",
                                                      ("op", "transport")),
            "irdma_client_inflight_requests": ("gauge", "Requests to shards awaiting their reply.", ()),
        }, registry)
        self.errors = Counter("irdma_client_errors", "Failed requests to shards, by kind.", ("kind",),
                              registry=registry)

    def begin(self) -> float:
        try:
            self.tally.add("irdma_client_inflight_requests", (), 1)
        except Exception as exc:  # noqa: BLE001
            _warn_once("client begin", exc)
        return time.perf_counter()

    def end(self, t0: float, op: str, transport: str, status: str, nbytes: int = 0, direction: str = "") -> None:
        """Note a call that ended ``status`` after starting at ``t0`` and moved ``nbytes``."""
        try:
            dt = time.perf_counter() - t0
            t = self.tally
            t.add("irdma_client_inflight_requests", (), -1)
            t.add("irdma_client_requests", (op, transport, status))
            t.observe("irdma_client_request_duration_seconds", (op, transport), dt)
            if nbytes:
                t.add("irdma_client_bytes", (op, direction), nbytes)
            if status != "ok":
                self.errors.labels(status).inc()
        except Exception as exc:  # noqa: BLE001
            _warn_once("client end", exc)


#: FUSE answers with an errno that are not failures, by (request type, errno): the name does not
#: exist (``lookup`` ``ENOENT``: the kernel asks before every create, mkdir and rename onto a new
#: name, and every search of a path list is made of them), or the file has no such extended
#: attribute (``ENODATA``, Linux's ENOATTR: the kernel asks ``getxattr security.capability``
#: before every write). Counting these as errors would make healthy traffic look like failures.
NOT_ERRORS: frozenset[tuple[str, int]] = frozenset({
    ("lookup", _errno.ENOENT), ("getxattr", _errno.ENODATA), ("listxattr", _errno.ENODATA)})


class FuseMetrics:
    """FUSE request metrics of a mount (one per process: :func:`fuse_metrics`)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.tally = _Tally({
            "irdma_fuse_requests": ("counter", "FUSE requests a mount answered, by type.", ("op",)),
            "irdma_fuse_request_duration_seconds": ("histogram", "Seconds a FUSE request took, by type.", ("op",)),
            "irdma_fuse_bytes": ("counter", "Bytes a mount returned to read and accepted from write.", ("op",)),
        }, registry)
        self.errors = Counter("irdma_fuse_errors", "FUSE requests that failed, by type and errno (not-found"
                              " answers of lookup, getxattr and listxattr are not failures).",
                              ("op", "errno"), registry=registry)
        self.not_found = Counter("irdma_fuse_not_found", "FUSE requests answered 'no such name' (lookup ENOENT)"
                                 " or 'no such attribute' (getxattr, listxattr ENODATA): answers, not failures.",
                                 ("op", "errno"), registry=registry)

    def end(self, t0: float, op: str, errno: int = 0, nbytes: int = 0) -> None:
        """Note a FUSE request of type ``op`` that started at ``t0`` and failed with ``errno``
        (0: it succeeded), moving ``nbytes``. An ``(op, errno)`` of :data:`NOT_ERRORS` is an
        answer, not a failure: counted in ``irdma_fuse_requests_total`` and
        ``irdma_fuse_not_found_total``, not in ``irdma_fuse_errors_total``."""
        try:
            dt = time.perf_counter() - t0
            t, key = self.tally, (op,)
            t.add("irdma_fuse_requests", key)
            t.observe("irdma_fuse_request_duration_seconds", key, dt)
            if nbytes:
                t.add("irdma_fuse_bytes", key, nbytes)
            if errno:
                name = _errno.errorcode.get(errno, str(errno))
                if (op, errno) in NOT_ERRORS:
                    self.not_found.labels(op, name).inc()
                else:
                    self.errors.labels(op, name).inc()
        except Exception as exc:  # noqa: BLE001
            _warn_once("fuse", exc)


class MetaMetrics:
    """Metadata engine calls of a client (:class:`irdma.meta.aio.AsyncMeta`; one per process:
    :func:`meta_metrics`): each is one worker-thread hop and, on PostgreSQL, one or more round
    trips to the server. ``call`` is the engine method's name."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.calls = Counter("irdma_meta_calls", "Metadata engine calls a client made, by method.", ("call",),
                             registry=registry)
        self._children: dict[str, Any] = {}

    def note(self, call: str) -> None:
        """Count one call of engine method ``call``."""
        try:
            child = self._children.get(call)
            if child is None:
                child = self._children[call] = self.calls.labels(call)
            child.inc()
        except Exception as exc:  # noqa: BLE001
            _warn_once("meta", exc)


class CacheMetrics:
    """The local read cache of a client (:mod:`irdma.client.cache`; one per process:
    :func:`cache_metrics`). ``tier`` is ``memory`` or ``disk``."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.hits = Counter("irdma_cache_hits", "Chunk reads served from the local read cache, by tier.", ("tier",),
                            registry=registry)
        self.misses = Counter("irdma_cache_misses", "Chunk reads the local read cache could not serve (read from"
                              " the shards, then kept).", registry=registry)
        self.evictions = Counter("irdma_cache_evictions", "Chunks the local read cache dropped to stay within its"
                                 " size, by tier.", ("tier",), registry=registry)
        self.bytes = Gauge("irdma_cache_bytes", "Bytes the local read cache holds, by tier.", ("tier",),
                           registry=registry)
        self.validations = Counter("irdma_cache_validations", "Kept chunks checked against the shards at an open,"
                                   " by result (valid, stale, checksum: valid after a CRC-32 check).", ("result",),
                                   registry=registry)


_singletons: dict[str, Any] = {}
_singleton_lock = threading.Lock()


def _singleton(name: str, make: Callable[[], Any]) -> Any:
    obj = _singletons.get(name)
    if obj is None:
        with _singleton_lock:
            obj = _singletons.get(name)
            if obj is None:
                obj = _singletons[name] = make()
    return obj


def shard_metrics() -> ShardMetrics:
    """This process's :class:`ShardMetrics` (made, and registered, on first use)."""
    return _singleton("shard", ShardMetrics)  # type: ignore[no-any-return]


def client_metrics() -> ClientMetrics:
    """This process's :class:`ClientMetrics` (made, and registered, on first use)."""
    return _singleton("client", ClientMetrics)  # type: ignore[no-any-return]


def fuse_metrics() -> FuseMetrics:
    """This process's :class:`FuseMetrics` (made, and registered, on first use)."""
    return _singleton("fuse", FuseMetrics)  # type: ignore[no-any-return]


def meta_metrics() -> MetaMetrics:
    """This process's :class:`MetaMetrics` (made, and registered, on first use)."""
    return _singleton("meta", MetaMetrics)  # type: ignore[no-any-return]


def cache_metrics() -> CacheMetrics:
    """This process's :class:`CacheMetrics` (made, and registered, on first use)."""
    return _singleton("cache", CacheMetrics)  # type: ignore[no-any-return]


# ---------------------------------------------------------------- what the process is
class _BuildInfo(Collector):
    """``irdma_build_info{version,python,transport}``, always 1 (see :func:`set_transport`)."""

    def __init__(self) -> None:
        self.transport = ""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from ._version import __version__

        info = GaugeMetricFamily("irdma_build_info", "What this process runs: the irdma version, the Python"
                                 " version and the transports it speaks (always 1).",
                                 labels=("version", "python", "transport"))
        info.add_metric([__version__, platform.python_version(), self.transport], 1)
        yield info


_BUILD_INFO = _BuildInfo()
REGISTRY.register(_BUILD_INFO)
# what any Prometheus exporter serves: CPU seconds, memory, open fds, start time; the Python
# version; garbage collections (in REGISTRY, not prometheus_client's global registry)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)


def set_transport(transport: str) -> None:
    """Set the ``transport`` label of ``irdma_build_info``: what this process speaks (``tcp``,
    ``verbs``, ``tcp,verbs``). Until set, the label is empty."""
    _BUILD_INFO.transport = transport


# ---------------------------------------------------------------- the exporter
class Exporter:
    """A running HTTP exporter of :data:`REGISTRY` (see :func:`serve`). ``address`` is the
    bound ``HOST:PORT``; :meth:`close` stops it (safe twice)."""

    def __init__(self, httpd: Any, thread: threading.Thread, address: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.address = address

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``."""
        return f"http://{format_host(self.address)}/metrics"

    def close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            self._thread.join(timeout=5)


def parse_metrics_address(addr: str, what: str = "--metrics") -> tuple[str, int]:
    """Split a metrics ``HOST:PORT`` (port 0: a free one).

    Raises:
        InvalidArgument: not HOST:PORT with a port in 0..65535.
    """
    try:
        return parse_address(addr.strip())
    except ValueError:
        raise E.InvalidArgument(f"{what} {addr!r} is not HOST:PORT",
                                f"pass {what} HOST:PORT, such as 127.0.0.1:9100 (port 0 picks a free one)") from None


def serve(addr: str) -> Exporter:
    """Serve :data:`REGISTRY` at ``http://HOST:PORT/metrics`` from a daemon thread.

    Binding happens here (it does not block: call it before the trio loop, or with
    ``trio.to_thread.run_sync``); requests are served by the exporter's own threads.
    Turns off ``prometheus_client``'s ``*_created`` series for the whole process
    (``disable_created_metrics``).

    Args:
        addr: ``HOST:PORT`` to listen on; port 0 picks a free one (see ``Exporter.address``).

    Returns:
        The running :class:`Exporter`.

    Raises:
        InvalidArgument: ``addr`` is not HOST:PORT, or HOST is not an address of this machine.
        IrdmaError: the port is in use, or may not be bound (below 1024 without root).
    """
    import socket

    from prometheus_client import disable_created_metrics, start_http_server

    host, port = parse_metrics_address(addr)
    # no ``*_created`` series: prometheus_client's switch is process-wide, and only irdma's own
    # processes (a shard, a mount) serve metrics, so it is set here and not at import
    disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        httpd, thread = start_http_server(port, host, registry=REGISTRY)
    except socket.gaierror as exc:
        raise E.InvalidArgument(f"cannot serve metrics on {addr}: {exc.strerror}",
                                "pass --metrics HOST:PORT with a HOST of this machine, such as 127.0.0.1") from None
    except OSError as exc:
        if exc.errno == _errno.EADDRINUSE:
            raise E.IrdmaError(f"cannot serve metrics on {addr}: the address is already in use",
                               f"pick another --metrics port, 0 for a free one, or stop what listens there:"
                               f" `ss -ltnp 'sport = :{port}'` names it") from None
        raise E.IrdmaError(f"cannot serve metrics on {addr}: {exc.strerror or exc}",
                           "pass --metrics an address of this machine, and a port above 1023 unless root") from None
    bound_host, bound_port = httpd.server_address[:2]
    address = f"{host if host else str(bound_host)}:{int(bound_port)}"
    log.info("serving metrics on http://%s/metrics", format_host(address))
    return Exporter(httpd, thread, address)


def shard_address(explicit: str | None, shard_id: int) -> str | None:
    """The metrics address of shard ``shard_id``: ``explicit`` (``irdma server --metrics``) when
    given, else derived from ``$IRDMA_SHARD_METRICS`` (``irdma up --metrics HOST:PORT`` sets it
    for the shards it starts): ``HOST:PORT+shard_id``, or ``HOST:0`` (a free port each) when
    PORT is 0. None: no metrics.

    Raises:
        InvalidArgument: the environment variable is not HOST:PORT, or PORT+shard_id > 65535.
    """
    if explicit:
        return explicit
    base = os.environ.get(SHARD_METRICS_ENV)
    if not base:
        return None
    host, port = parse_metrics_address(base, f"${SHARD_METRICS_ENV}")
    if port == 0:
        return base
    if port + shard_id > 65535:
        raise E.InvalidArgument(f"shard {shard_id} would serve metrics on port {port + shard_id} (> 65535)",
                                "pass `irdma up --metrics` a lower port")
    return f"{format_host(f'{host}:{port + shard_id}')}"


# ---------------------------------------------------------------- mount discovery
def run_dir() -> str:
    """Where mounts record their metrics address: ``$IRDMA_RUN_DIR``, else
    ``$XDG_RUNTIME_DIR/irdma``, else ``/tmp/irdma-UID`` (per user, mode 0700)."""
    d = os.environ.get("IRDMA_RUN_DIR")
    if d:
        return d
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "irdma")
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"irdma-{os.getuid()}")


def mount_state_file(mountpoint: str) -> str:
    """The file where the mount on ``mountpoint`` records its metrics address (JSON:
    ``mountpoint``, ``pid``, ``metrics``, ``meta_url``), keyed by the mountpoint's absolute path."""
    import hashlib

    path = os.path.abspath(mountpoint)
    digest = hashlib.sha256(path.encode()).hexdigest()[:16]
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in os.path.basename(path) or "root")[:64]
    return os.path.join(run_dir(), "mounts", f"{name}-{digest}.json")


def record_mount(mountpoint: str, address: str, meta_url: str) -> str:
    """Record that this process serves ``mountpoint``'s metrics on ``address``; returns the file.

    Raises:
        OSError: the run directory cannot be written.
    """
    import json

    path = mount_state_file(mountpoint)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"mountpoint": os.path.abspath(mountpoint), "pid": os.getpid(), "metrics": address,
                   "meta_url": meta_url}, f)
    os.replace(tmp, path)
    return path


def forget_mount(mountpoint: str) -> None:
    """Remove the record of :func:`record_mount` if this process made it (best effort)."""
    import json

    path = mount_state_file(mountpoint)
    try:
        with open(path) as f:
            if json.load(f).get("pid") != os.getpid():
                return
        os.unlink(path)
    except (OSError, ValueError):
        pass


__all__ = [
    "REGISTRY", "LATENCY_BUCKETS", "SHARD_METRICS_ENV", "ShardMetrics", "ClientMetrics", "FuseMetrics", "NOT_ERRORS",
    "CacheMetrics", "cache_metrics", "MetaMetrics", "meta_metrics",
    "Exporter",
    "error_kind", "shard_metrics", "client_metrics", "fuse_metrics", "serve", "set_transport", "shard_address", "run_dir",
    "mount_state_file", "record_mount", "forget_mount", "parse_metrics_address", "format_host",
]
