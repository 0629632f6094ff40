"""The ``irdma server`` process: a shard served over TCP (and verbs) until SIGTERM or SIGINT.

The parts: :mod:`irdma.server.dispatch` applies requests to the shard (no sockets),
:mod:`irdma.server.tcp` and :mod:`irdma.server.verbs` are the front ends that move frames,
:mod:`irdma.wire.framing` the frames and the handshake both sides of the wire share.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sqlite3
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import trio

from irdma._errors import IrdmaError
from irdma.metrics import Exporter
from irdma.metrics import serve as serve_metrics
from irdma.metrics import set_transport as set_metrics_transport
from irdma.wire import auth
from irdma.wire import protocol as P

from .dispatch import Dispatcher, ThreadWork
from .shard import PARK_SYNC_S, Shard
from .tcp import (
    FRAME_TIMEOUT_S,
    HANDSHAKE_TIMEOUT_S,
    HELLO_MAX_BODY,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_PEER,
    PIPELINE_DEPTH,
    ShardServer,
)

if TYPE_CHECKING:
    from .verbs import VerbsShard

log = logging.getLogger("irdma.server")


async def run_server(
    shard: Shard,
    host: str,
    port: int,
    *,
    port_file: str | None = None,
    keys: auth.KeySource | None = None,
    max_payload: int = P.DEFAULT_MAX_PAYLOAD,
    verbs: VerbsShard | None = None,
    max_connections: int = MAX_CONNECTIONS,
    max_per_peer: int = MAX_CONNECTIONS_PER_PEER,
    metrics: str | None = None,
    sock: Any = None,
) -> None:
    """The ``irdma server`` main: serve until SIGTERM or SIGINT, then exit cleanly.

    ``sock``: a stdlib socket already bound and listening on ``host:port`` (see
    :meth:`ShardServer.serve_tcp`).

    ``metrics``: ``HOST:PORT`` to serve Prometheus metrics on (:mod:`irdma.metrics`; port 0
    picks one); the bound address is told in STAT replies, where ``irdma stats --meta`` finds it.

    Raises:
        IrdmaError: the metrics address cannot be served (bad address, port in use), before
            the shard listens; OSError: ``host:port`` cannot be bound.
    """
    server = ShardServer(shard, max_payload=max_payload, keys=keys, max_connections=max_connections,
                         max_per_peer=max_per_peer)
    server.verbs = verbs
    set_metrics_transport("tcp,verbs" if verbs is not None else "tcp")  # irdma_build_info's label
    exporter: Exporter | None = None
    if metrics:
        exporter = await trio.to_thread.run_sync(serve_metrics, metrics)
        server.metrics_address = exporter.address
    try:
        await _serve_until_signal(server, shard, host, port, port_file, keys, verbs, sock)
    finally:
        if exporter is not None:
            exporter.close()


async def _serve_until_signal(server: ShardServer, shard: Shard, host: str, port: int, port_file: str | None,
                              keys: auth.KeySource | None, verbs: VerbsShard | None, sock: Any = None) -> None:
    """Serve until SIGTERM or SIGINT, then return (the caller syncs and closes the store).

    The signal handlers go in first: the shard is ready (answers handshakes, writes ``port_file``)
    only once a signal stops it cleanly, so one sent the moment it is ready (``irdma down``, a test
    that saw the port file) is a clean stop, never a death by the signal. One that comes while it
    is still starting stops it as cleanly, as soon as it can (it may never write its port file).

    Raises:
        OSError: ``host:port`` cannot be bound, or ``port_file`` cannot be written.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, signals, nursery.cancel_scope, shard.name)
            bound = await nursery.start(functools.partial(server.serve_tcp, host, port, sock=sock))
            address = f"{bound[0]}:{bound[1]}"
            log.info("%s serving %d bytes on %s (%s)%s", shard.name, shard.capacity, address,
                     "tcp and verbs" if verbs is not None else "tcp",
                     f"; metrics on http://{server.metrics_address}/metrics" if server.metrics_address else "")
            if keys is None:
                log.warning("serving WITHOUT authentication (--no-auth): anyone who reaches %s can read and write"
                            " every chunk", address)
            nursery.start_soon(_trim_freed, shard)
            if port_file:
                await trio.to_thread.run_sync(_write_port_file, port_file, address)


async def _stop_on_signal(signals: AsyncIterator[int], scope: trio.CancelScope, name: str) -> None:
    """Cancel ``scope`` (the shard's serving) at the first signal of ``signals``."""
    async for signum in signals:
        log.info("%s stopping on signal %d", name, signum)
        scope.cancel()
        return


async def _trim_freed(shard: Shard) -> None:
    """Zero, once a second, the extents freed more than :data:`irdma.server.shard.TRIM_DELAY_S` ago that no
    chunk took since (:meth:`Shard.trim`); and sync (off the event loop) when an extent a chunk grew out of
    has waited :data:`irdma.server.shard.PARK_SYNC_S` for a client's sync, so that it is free again
    (:meth:`Shard.reclaim`) even if no client ever syncs, or an update has waited
    :data:`irdma.wire.protocol.SYNC_INTERVAL_S` for one (a mount's ``close`` does not sync: ``fsync`` does)."""
    while True:
        await trio.sleep(1.0)
        since = shard.parked_since()
        now = time.monotonic()
        updated = shard.unsynced_since
        if ((since is not None and now - since >= PARK_SYNC_S)
                or (updated is not None and now - updated >= P.SYNC_INTERVAL_S)):
            try:
                await trio.to_thread.run_sync(shard.sync)
            except (OSError, sqlite3.Error) as exc:  # they stay held (counted as used) until a sync works
                log.warning("%s could not sync (tried again in a second; the extents chunks grew out of stay"
                            " held until then): %s", shard.name, exc)
        try:
            shard.trim()
        except OSError as exc:  # the bytes stay in a free extent: never read, zeroed before reuse
            log.warning("%s could not zero freed extents: %s", shard.name, exc)


def _write_port_file(path: str, address: str) -> None:
    """Write ``address`` to ``path`` atomically (a reader never sees half of it)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)


__all__ = ["ShardServer", "Dispatcher", "ThreadWork", "run_server", "IrdmaError", "FRAME_TIMEOUT_S",
           "HANDSHAKE_TIMEOUT_S", "HELLO_MAX_BODY", "PIPELINE_DEPTH"]
