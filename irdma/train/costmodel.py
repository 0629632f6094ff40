"""A cost model of one iteration of data-parallel training with a parameter server. Pure: no I/O.

How it works
------------
Every worker computes a forward pass, then back-propagation, pushes its gradient (``P`` bytes after
compression) to the shards, and pulls the updated model (``M`` bytes) back before its next forward
pass (BSP). The model prices that round trip on the network of the test bed: hosts with one full
duplex NIC each (``B`` bytes/s each way, one-way latency ``L`` s) and a software cap ``R`` (bytes/s
that the client or shard processes of one host can move each way; on a small CPU it, not the link,
is the limit), so a NIC moves ``rate = min(B, R)`` bytes/s each way.

Traffic of one synchronising iteration (``W`` workers on ``H`` hosts, ``g = W/H`` per host, ``S``
shards; "units" are what push: workers (``u = g`` per host, ``U = W`` in all) in ``flat`` and the
compressed modes, hosts (``u = 1``, ``U = H``) in ``hier``; bytes spread evenly over the shards, as
irdma stripes every file by chunk):

- shards on hosts of their own: a worker host sends ``u*P`` and receives ``u*M``; a shard host
  receives ``U*P/S`` and sends ``U*M/S``. Seconds per byte of one unit's push or pull on the
  busiest NIC: ``f/rate`` with ``f = max(u, U/S)`` (Li et al., OSDI 2014).
- ``colocated`` (shard ``s`` on host ``s mod H``): a host with ``s_h`` shards sends
  ``u*P*(1 - s_h/S)`` pushes and receives ``s_h*(U - u)*P/S``; pulls the other way round with ``M``.
  ``f = max(u*(1 - s_h/S), s_h*(U - u)/S)`` over ``s_h`` in ``floor(S/H), ceil(S/H)``.

Overlap ``none`` (pull all, compute, push all; push and pull do not overlap: a pull follows the
push whose update it reads, so full duplex does not help), in seconds::

    transfer_s = f*(P + M)/rate                        push phase, then pull phase
    latency_s  = 4*L + 2*requests*o/(S*window)         2 round trips; requests = slices (per direction)
    local_s    = 2*(g + 1)*M/mem_bw   (hier, g > 1)     reduce g gradients, then copy M to g workers
    T_sync     = C + local_s + transfer_s + latency_s
    T          = ((K - 1)*(C + local_s) + T_sync)/K     hier: cross-host traffic every K steps

Overlap ``fifo`` and ``p3``: a small event simulation over layers (deterministic, O(layers + slices)
heap operations). Back-prop (a fraction ``beta`` of ``C``, layer ``n-1`` first) makes layer ``i``'s
gradient after its share of the compute; its push is queued then. A link is a serial server at
``f/rate`` seconds per byte plus ``o/(S*window)`` per slice: pushes on one (worker TX, shard RX),
pulls on another (shard TX, worker RX), one shared server when ``colocated``. Layer ``i``'s pull is
queued ``3*L`` after its push leaves (arrival, acknowledgement, request) and lands ``L`` after it is
sent. ``fifo`` serves in the order queued (so the last layer's pull comes first and the forward pass
waits for the first layer's, which comes last); ``p3`` (Jayarajan et al., SysML 2019) serves the
lowest layer index first and preempts at slice boundaries. The next forward pass runs layer ``i``
once its pull has landed and layer ``i-1`` is done: ``T`` is when it ends. Compute per layer is
proportional to its bytes unless ``layer_compute_s`` gives it.

Compute ``C``: given, or a roofline (Williams et al., CACM 2009) ``max(flops/peak, bytes/mem_bw)``.
Ring all-reduce, for reference (Patarasuk and Yuan, JPDC 2009): ``2(N-1)/N * M/B + 2(N-1)*L``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..units import format_duration, format_size, parse_size

MODES = ("flat", "hier", "topk", "sign")
OVERLAPS = ("none", "fifo", "p3")
#: What a :class:`Prediction` may name as its bound.
BOUNDS = ("compute", "worker NIC", "shard NIC", "host NIC", "software cap", "latency", "memory")
#: P3's reference slice: 40,000 float32.
P3_SLICE_BYTES = 160_000


class ConfigError(ValueError):
    """A :class:`Config` that describes no training job; ``field`` names the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def parse_mode(mode: str) -> tuple[str, float]:
    """``"topk:0.01"`` -> ``("topk", 0.01)``; ``"flat"``, ``"hier"``, ``"sign"`` -> ``(mode, 1.0)``.

    Raises:
        ConfigError: an unknown mode, or a top-k fraction outside (0, 1].
    """
    kind, _, arg = mode.partition(":")
    if kind == "topk":
        try:
            fraction = float(arg)
        except ValueError:
            fraction = math.nan
        if not 0 < fraction <= 1:
            raise ConfigError("mode", f"{mode!r}: write topk:FRACTION with 0 < FRACTION <= 1, e.g. topk:0.01")
        return kind, fraction
    if kind in MODES and not arg:
        return kind, 1.0
    raise ConfigError("mode", f"{mode!r} is no mode: use flat, hier, topk:FRACTION or sign")


def wire_bytes(tensor_bytes: int, mode: str, elem_bytes: int = 4) -> int:
    """Bytes a push of one tensor of ``tensor_bytes`` (``n = ceil(tensor_bytes/elem_bytes)`` elements)
    puts on the wire: ``topk:F``: 8 bytes (int32 index + float32 value) per kept element, ``ceil(F*n)``
    of them; ``sign``: ``ceil(n/8)`` bytes of signs + one float32 scale per 1024 elements; else dense.

    Raises:
        ConfigError: an unknown mode.
    """
    kind, fraction = parse_mode(mode)
    n = -(-tensor_bytes // elem_bytes)
    if kind == "topk":
        return 8 * math.ceil(fraction * n)
    if kind == "sign":
        return -(-n // 8) + 4 * -(-n // 1024)
    return tensor_bytes


def roofline_time(flops: float, bytes_moved: float, peak_flops_per_s: float, mem_bytes_per_s: float) -> float:
    """Seconds of a computation bound by arithmetic or by memory: ``max(flops/peak, bytes/mem_bw)``."""
    return max(flops / peak_flops_per_s, bytes_moved / mem_bytes_per_s)


def ring_allreduce_time(model_bytes: float, n: int, bytes_per_s: float, latency_s: float) -> float:
    """Seconds of a ring all-reduce of ``model_bytes`` over ``n`` members (Patarasuk and Yuan 2009):
    ``2(n-1)/n * M/B + 2(n-1)*L`` (reduce-scatter then all-gather, ``n-1`` steps each).

    Raises:
        ValueError: ``n`` below 1 or a rate not above zero.
    """
    if n < 1 or not bytes_per_s > 0:
        raise ValueError(f"a ring needs n >= 1 members and a rate above zero (n={n}, rate={bytes_per_s})")
    return 2 * (n - 1) / n * model_bytes / bytes_per_s + 2 * (n - 1) * latency_s


def parse_tensor_size(text: str, elem_bytes: int = 4) -> int:
    """Bytes of one tensor: ``160KB``, ``4MiB``, ``65536``, or ``40000f`` (a count of float32).

    Raises:
        ValueError: not a size, or not above zero.
    """
    t = text.strip()
    if t[-1:] in ("f", "F") and t[:-1].strip().isdigit():
        n = int(t[:-1]) * elem_bytes
    else:
        n = parse_size(t)
    if n <= 0:
        raise ValueError(f"{text!r}: a tensor has at least one byte")
    return n


def sizes_from_layout(entries: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    """Tensor bytes, in forward order, of a Keras job's ``layout.json`` (irdma.train.keras.LAYOUT: a list of
    ``{name, shape, offset, dtype}`` in variable order; bytes = product of ``shape`` x dtype size).

    Raises:
        ValueError: an entry without a list ``shape`` of non-negative ints or a numpy ``dtype``;
            an empty layout.
    """
    import numpy as np

    sizes = []
    for k, e in enumerate(entries):
        shape, dtype = (e.get("shape"), e.get("dtype", "<f4")) if isinstance(e, Mapping) else (None, None)
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"layout entry {k}: 'shape' must be a list of non-negative ints, not {shape!r}")
        try:
            if not isinstance(dtype, str):
                raise TypeError
            itemsize = np.dtype(dtype).itemsize
        except TypeError:
            raise ValueError(f"layout entry {k}: {dtype!r} is no dtype") from None
        n = math.prod(shape) * itemsize
        if n > 0:
            sizes.append(n)
    if not sizes:
        raise ValueError("the layout names no tensor with any bytes")
    return tuple(sizes)


@dataclass(frozen=True)
class Config:
    """One training job on one network, and how it communicates.

    Exactly one of ``compute_s``, ``layer_compute_s`` and ``flops`` gives the compute.

    Attributes:
        sizes: bytes of each tensor (float32 unless ``elem_bytes`` says otherwise), in forward order.
        workers: ``W``, data-parallel workers.
        hosts: ``H``, hosts the workers run on; must divide ``W`` (``W/H`` workers per host).
        shards: ``S``, shard servers, each on a host of its own unless ``colocated``.
        colocated: shards run on the worker hosts (shard ``s`` on host ``s mod H``).
        link_bytes_per_s: ``B``, bandwidth of each host's NIC, each way (full duplex).
        latency_s: ``L``, one-way latency between two hosts.
        cap_bytes_per_s: ``R``, bytes/s each way that the processes of one host can move (None: no cap).
        overhead_s: ``o``, fixed cost of one request (one slice, or one tensor when not sliced).
        slice_bytes: P3 slice size in dense bytes; 0 sends whole tensors.
        window: requests in flight per shard.
        compute_s: ``C``, seconds of compute (forward + back-prop) of one iteration of one worker.
        layer_compute_s: seconds of compute per tensor, in forward order (``C`` is their sum).
        flops, peak_flops_per_s, compute_bytes: roofline, ``C = max(flops/peak, compute_bytes/mem_bw)``;
            ``compute_bytes`` defaults to ``3*M`` (weights read twice, gradient written once).
        mem_bytes_per_s: memory bandwidth (roofline, and the local sum of ``hier``).
        mode: ``flat`` | ``hier`` (one push/pull per host after a local sum) | ``topk:F`` | ``sign``.
        sync_every: ``K``; ``hier`` only: cross-host traffic every K steps, local sums in between.
        overlap: ``none`` | ``fifo`` | ``p3`` (see the module docstring).
        backward_fraction: ``beta``, the share of ``C`` spent in back-prop.
        elem_bytes: bytes per element (what ``topk`` and ``sign`` count).
        encode_s_per_byte: seconds of the worker's CPU to encode one dense byte of gradient
            (``topk``, ``sign``): each push is that much later (serial with the sending).

    Raises:
        ConfigError: a field out of range (its ``field`` attribute names it).
    """

    sizes: tuple[int, ...]
    workers: int = 1
    hosts: int = 1
    shards: int = 1
    colocated: bool = False
    link_bytes_per_s: float = 125e6
    latency_s: float = 0.0
    cap_bytes_per_s: float | None = None
    overhead_s: float = 0.0
    slice_bytes: int = 0
    window: int = 1
    compute_s: float | None = None
    layer_compute_s: tuple[float, ...] | None = None
    flops: float | None = None
    peak_flops_per_s: float | None = None
    compute_bytes: float | None = None
    mem_bytes_per_s: float = 10e9
    mode: str = "flat"
    sync_every: int = 1
    overlap: str = "none"
    backward_fraction: float = 2 / 3
    elem_bytes: int = 4
    encode_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(self.sizes))
        if self.layer_compute_s is not None:
            object.__setattr__(self, "layer_compute_s", tuple(self.layer_compute_s))

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ConfigError(field, f"{field}={getattr(self, field)!r}: {why}")

        need(len(self.sizes) > 0 and all(isinstance(s, int) and s > 0 for s in self.sizes), "sizes",
             "give one or more tensor sizes, each a whole number of bytes above zero")
        for name in ("workers", "hosts", "shards", "window", "sync_every", "elem_bytes"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be 1 or more")
        need(self.workers % self.hosts == 0, "hosts", f"must divide workers={self.workers}")
        need(self.link_bytes_per_s > 0, "link_bytes_per_s", "must be above zero")
        need(self.cap_bytes_per_s is None or self.cap_bytes_per_s > 0, "cap_bytes_per_s", "must be above zero")
        need(self.mem_bytes_per_s > 0, "mem_bytes_per_s", "must be above zero")
        need(self.latency_s >= 0, "latency_s", "must be zero or more")
        need(self.overhead_s >= 0, "overhead_s", "must be zero or more")
        need(self.encode_s_per_byte >= 0, "encode_s_per_byte", "must be zero or more")
        need(self.slice_bytes >= 0, "slice_bytes", "must be zero (whole tensors) or more")
        need(0 < self.backward_fraction < 1, "backward_fraction", "must be between 0 and 1")
        need(self.overlap in OVERLAPS, "overlap", f"use one of {', '.join(OVERLAPS)}")
        kind, _ = parse_mode(self.mode)
        need(self.sync_every == 1 or kind == "hier", "sync_every", f"only mode hier syncs every K steps, not {self.mode}")
        given = [n for n in ("compute_s", "layer_compute_s", "flops") if getattr(self, n) is not None]
        need(len(given) == 1, "compute_s", f"give exactly one of compute_s, layer_compute_s, flops (got {given})")
        need(self.compute_s is None or self.compute_s >= 0, "compute_s", "must be zero or more")
        lc = self.layer_compute_s
        need(lc is None or (len(lc) == len(self.sizes) and all(x >= 0 for x in lc)), "layer_compute_s",
             f"give one time of zero or more per tensor ({len(self.sizes)})")
        if self.flops is not None:
            need(self.flops >= 0, "flops", "must be zero or more")
            need(self.peak_flops_per_s is not None and self.peak_flops_per_s > 0, "peak_flops_per_s",
                 "a roofline needs the peak FLOP/s, above zero")

    # ------------------------------------------------------------ derived quantities
    @property
    def model_bytes(self) -> int:
        """``M``: bytes of the whole model (what a pull moves)."""
        return sum(self.sizes)

    @property
    def rate_bytes_per_s(self) -> float:
        """``min(B, R)``: what one NIC moves each way."""
        cap = self.cap_bytes_per_s
        return self.link_bytes_per_s if cap is None else min(self.link_bytes_per_s, cap)

    def push_sizes(self) -> tuple[int, ...]:
        """Bytes each tensor's push puts on the wire (:func:`wire_bytes`); pulls stay dense."""
        return tuple(wire_bytes(s, self.mode, self.elem_bytes) for s in self.sizes)

    def slices(self) -> tuple[int, ...]:
        """Requests per tensor and direction: ``ceil(size/slice_bytes)``, or 1 when not sliced."""
        if self.slice_bytes == 0:
            return (1,) * len(self.sizes)
        return tuple(-(-s // self.slice_bytes) for s in self.sizes)

    def compute_time_s(self) -> float:
        """``C``: seconds of compute of one iteration of one worker."""
        if self.layer_compute_s is not None:
            return float(sum(self.layer_compute_s))
        if self.compute_s is not None:
            return self.compute_s
        assert self.flops is not None and self.peak_flops_per_s is not None
        moved = 3 * self.model_bytes if self.compute_bytes is None else self.compute_bytes
        return roofline_time(self.flops, moved, self.peak_flops_per_s, self.mem_bytes_per_s)

    def layer_times_s(self) -> tuple[float, ...]:
        """Compute seconds of each tensor's layer (forward + back-prop)."""
        if self.layer_compute_s is not None:
            return self.layer_compute_s
        c, m = self.compute_time_s(), self.model_bytes
        return tuple(c * s / m for s in self.sizes)

    @property
    def label(self) -> str:
        """``'hier K=2, p3, slice 156.2 KiB'``: what tells this configuration from its siblings."""
        mode = self.mode + (f" K={self.sync_every}" if self.sync_every > 1 else "")
        piece = f"slice {format_size(self.slice_bytes)}" if self.slice_bytes else "whole tensors"
        return f"{mode}, {self.overlap}, {piece}"


@dataclass(frozen=True)
class Prediction:
    """The predicted cost of one training iteration (amortized over ``K`` steps in ``hier``).

    Attributes:
        config: what was predicted.
        time_s: seconds per iteration.
        compute_s: ``C``, the compute part.
        comm_s: communication as if nothing overlapped it: ``local_s + transfer_s + latency_s``.
        exposed_s: communication not hidden behind compute: ``time_s - compute_s``
            (equal to ``comm_s`` with overlap ``none``).
        transfer_s: bytes over the busiest NIC, ``f*(P + M)/rate``, per iteration.
        latency_s: round trips and per-request overheads, ``4L + 2*requests*o/(S*window)``, per iteration.
        local_s: the local sum and copy of ``hier``, ``2*(g+1)*M/mem_bw`` (0 otherwise).
        push_bytes: bytes one worker pushes per iteration (``hier``: its share of its host's push).
        pull_bytes: bytes one worker pulls per iteration (``hier``: likewise).
        busiest_link_bytes: bytes per iteration through the busiest NIC, one direction.
        busiest: the host that NIC is on: ``worker host``, ``shard host`` or ``host`` (colocated).
        bound: the largest of compute, transfer (named by its NIC, or ``software cap`` where
            ``R < B``), latency and memory: one of :data:`BOUNDS`.
    """

    config: Config
    time_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    transfer_s: float
    latency_s: float
    local_s: float
    push_bytes: float
    pull_bytes: float
    busiest_link_bytes: float
    busiest: str
    bound: str

    def as_dict(self) -> dict[str, Any]:
        """Every field, the config's flattened in, as JSON-ready values."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        d["config"] = dataclasses.asdict(self.config)
        d["label"] = self.config.label
        return d


# ---------------------------------------------------------------- traffic
@dataclass(frozen=True)
class _Traffic:
    factor: float  # f: busiest-NIC bytes per byte of one unit's push (or pull)
    where: str  # which host that NIC is on
    link_bytes: float  # bytes per sync iteration through the busiest NIC, one direction
    units_per_host: int  # u


def _traffic(c: Config, push: int, model: int) -> _Traffic:
    kind, _ = parse_mode(c.mode)
    g = c.workers // c.hosts
    u, units = (1, c.hosts) if kind == "hier" else (g, c.workers)
    if not c.colocated:
        worker, shard = u, units / c.shards
        link = max(u * push, u * model, units * push / c.shards, units * model / c.shards)
        return _Traffic(max(worker, shard), "worker host" if worker >= shard else "shard host", link, u)
    f, link = 0.0, 0.0
    for s in {c.shards // c.hosts, -(-c.shards // c.hosts)}:
        out_push, in_push = u * (1 - s / c.shards), s * (units - u) / c.shards
        f = max(f, out_push, in_push)
        # in one direction: this host's pushes out + its shards' pull answers out, and the reverse
        link = max(link, out_push * push + in_push * model, in_push * push + out_push * model)
    return _Traffic(f, "host", link, u)


# ---------------------------------------------------------------- the link simulation
_PUSH, _PULL = 0, 1


def _serve(arrivals: list[tuple[float, int, int]], counts: Sequence[int], durations: Sequence[Sequence[float]],
           priority: bool, pull_delay_s: float | None) -> dict[tuple[int, int], float]:
    """One serial link: when each job (direction, layer) has sent its last slice.

    ``arrivals`` holds ``(time, direction, layer)``; a job is ``counts[layer]`` slices of
    ``durations[direction][layer]`` seconds each. FIFO serves jobs whole in the order they arrive;
    ``priority`` serves the lowest layer first and preempts at slice boundaries. With
    ``pull_delay_s`` the link is shared: a push's end queues its layer's pull that much later.
    """
    seq, arrived = itertools.count(), itertools.count()
    pending = [(t, next(seq), d, i) for t, d, i in arrivals]
    heapq.heapify(pending)
    ready: list[tuple[int, int, int, int]] = []  # (key, seq, direction, layer)
    left: dict[tuple[int, int], int] = {}
    done: dict[tuple[int, int], float] = {}
    t = 0.0
    while pending or ready:
        if not ready:
            t = max(t, pending[0][0])
        while pending and pending[0][0] <= t:
            _, s, d, i = heapq.heappop(pending)
            left[d, i] = counts[i]
            heapq.heappush(ready, (i if priority else next(arrived), s, d, i))
        _, _, d, i = ready[0]
        dur, n = durations[d][i], left[d, i]
        if priority and pending and dur > 0:  # run until the slice boundary at or after the next arrival
            n = min(n, max(1, math.ceil((pending[0][0] - t) / dur)))
        t += n * dur
        left[d, i] -= n
        if left[d, i] == 0:
            heapq.heappop(ready)
            done[d, i] = t
            if d == _PUSH and pull_delay_s is not None:
                heapq.heappush(pending, (t + pull_delay_s, next(seq), _PULL, i))
    return done


def _simulate(c: Config, push: Sequence[int], traffic: _Traffic | None, local: bool) -> float:
    """Seconds from the start of back-prop to the end of the next forward pass (module docstring);
    ``traffic`` None: no network this step (a local-only ``hier`` step)."""
    n = len(c.sizes)
    layer = c.layer_times_s()
    beta = c.backward_fraction
    g = c.workers // c.hosts
    copy_s = [(g + 1) * s / c.mem_bytes_per_s if local and g > 1 else 0.0 for s in c.sizes]
    ready, t, end = [0.0] * n, 0.0, 0.0
    for i in reversed(range(n)):  # back-prop, last layer first; hier: reduce each gradient locally
        t += beta * layer[i]
        end = max(end, t) + copy_s[i]
        ready[i] = end
    backprop_end = t
    if traffic is None:
        landed = ready
    else:
        counts = c.slices()
        per_byte = traffic.factor / c.rate_bytes_per_s
        per_req = c.overhead_s / (c.shards * c.window)
        enc = c.encode_s_per_byte if parse_mode(c.mode)[0] in ("topk", "sign") else 0.0
        durations = [[per_byte * push[i] / counts[i] + per_req + enc * c.sizes[i] / counts[i] for i in range(n)],
                     [per_byte * c.sizes[i] / counts[i] + per_req for i in range(n)]]
        lat = c.latency_s
        pushes = [(ready[i], _PUSH, i) for i in reversed(range(n))]  # ties: back-prop order
        priority = c.overlap == "p3"
        if c.colocated:
            done = _serve(pushes, counts, durations, priority, 3 * lat)
        else:
            done = _serve(pushes, counts, durations, priority, None)
            pulls = [(done[_PUSH, i] + 3 * lat, _PULL, i) for i in reversed(range(n))]
            done = _serve(pulls, counts, durations, priority, None)
        landed = [done[_PULL, i] + lat for i in range(n)]
    avail, end = [0.0] * n, 0.0
    for i in sorted(range(n), key=lambda i: landed[i]):  # hier: copy each pulled tensor to the g workers
        end = max(end, landed[i]) + copy_s[i]
        avail[i] = end
    t = backprop_end
    for i in range(n):  # the next forward pass
        t = max(t, avail[i]) + (1 - beta) * layer[i]
    return t


# ---------------------------------------------------------------- the public API
def predict(config: Config) -> Prediction:
    """The cost of one iteration of ``config`` (formulas in the module docstring)."""
    c = config
    kind, _ = parse_mode(c.mode)
    push_sizes = c.push_sizes()
    P, M = sum(push_sizes), c.model_bytes
    K = c.sync_every
    traffic = _traffic(c, P, M)
    g = c.workers // c.hosts
    compute = c.compute_time_s()
    local = 2 * (g + 1) * M / c.mem_bytes_per_s if kind == "hier" and g > 1 else 0.0
    transfer = traffic.factor * (P + M) / c.rate_bytes_per_s
    latency = 4 * c.latency_s + 2 * sum(c.slices()) * c.overhead_s / (c.shards * c.window)
    if kind in ("topk", "sign"):
        transfer += c.encode_s_per_byte * M  # encoding on the worker, before its bytes go
    if c.overlap == "none":
        t_local, t_sync = compute + local, compute + local + transfer + latency
    else:
        t_local = _simulate(c, push_sizes, None, kind == "hier")
        t_sync = _simulate(c, push_sizes, traffic, kind == "hier")
    time = ((K - 1) * t_local + t_sync) / K
    net_share = traffic.units_per_host / g / K  # bytes of one worker that cross the network
    if c.cap_bytes_per_s is not None and c.cap_bytes_per_s < c.link_bytes_per_s:
        nic = "software cap"
    else:
        nic = {"worker host": "worker NIC", "shard host": "shard NIC", "host": "host NIC"}[traffic.where]
    terms = {"compute": compute, nic: transfer / K, "latency": latency / K, "memory": local}
    return Prediction(
        config=c, time_s=time, compute_s=compute, comm_s=local + (transfer + latency) / K,
        exposed_s=time - compute, transfer_s=transfer / K, latency_s=latency / K, local_s=local,
        push_bytes=P * net_share, pull_bytes=M * net_share, busiest_link_bytes=traffic.link_bytes / K,
        busiest=traffic.where, bound=max(terms, key=lambda k: terms[k]),
    )


def rank(configs: Iterable[Config]) -> list[Prediction]:
    """Predictions of ``configs``, fastest first (ties: fewer bytes on the busiest link, then input order)."""
    preds = [predict(c) for c in configs]
    order = sorted(range(len(preds)), key=lambda k: (preds[k].time_s, preds[k].busiest_link_bytes, k))
    return [preds[k] for k in order]


def best(configs: Iterable[Config]) -> Config:
    """The configuration of ``configs`` predicted fastest (ties as in :func:`rank`).

    Raises:
        ValueError: ``configs`` is empty.
    """
    ranked = rank(configs)
    if not ranked:
        raise ValueError("best() of no configurations")
    return ranked[0].config


def grid(base: Config, modes: Iterable[str] = ("flat", "hier", "topk:0.01", "sign"),
         overlaps: Iterable[str] = OVERLAPS, slices: Iterable[int] = (0, P3_SLICE_BYTES)) -> list[Config]:
    """Every combination of ``modes`` x ``overlaps`` x ``slices`` on ``base`` (its ``sync_every``
    kept for ``hier``, 1 for the others).

    Raises:
        ConfigError: a bad mode, overlap or slice size.
    """
    out = []
    for mode, overlap, piece in itertools.product(modes, overlaps, slices):
        k = base.sync_every if parse_mode(mode)[0] == "hier" else 1
        out.append(dataclasses.replace(base, mode=mode, overlap=overlap, slice_bytes=piece, sync_every=k))
    return out


def explain(ranked: Sequence[Prediction]) -> str:
    """Why the first of ``ranked`` (from :func:`rank`) wins: its time, against the runner-up and
    against flat pushes with no overlap, and what bounds it."""
    if not ranked:
        raise ValueError("explain() of no predictions")
    top = ranked[0]
    why = [f"{top.config.label}: {format_duration(top.time_s)} per iteration, bound by {top.bound}"]
    if len(ranked) > 1:
        ratio, nxt = ranked[1].time_s / top.time_s, ranked[1].config.label
        why.append(f"{ratio:.2f}x faster than the next ({nxt})" if ratio >= 1.01 else f"within 1% of the next ({nxt})")
    base = [p for p in ranked if p.config.mode == "flat" and p.config.overlap == "none"]
    if base and base[0] is not top:
        why.append(f"{base[0].time_s / top.time_s:.2f}x faster than flat pushes with no overlap")
    if top.exposed_s > 0:
        why.append(f"{format_duration(top.exposed_s)} of communication not hidden behind compute")
    if parse_mode(top.config.mode)[0] in ("topk", "sign"):
        why.append("compression changes what is learned: check the accuracy")
    return "; ".join(why)
