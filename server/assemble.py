"""A shard process put together: its data directory's store, its memory region, the verbs
front end where RDMA is there, and :func:`irdma.server.serve.run_server` over them.

``irdma server`` (:mod:`irdma.ops.cli`) checks its options, registers the shard, then calls
:func:`assemble_shard` and :meth:`ShardProcess.serve`; what is below is the same for any
caller that runs a shard in its own process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from types import TracebackType
from typing import TYPE_CHECKING, Any

import trio

from irdma._errors import IrdmaError, TransportUnavailable
from irdma.transport import verbs_status
from irdma.units import format_size
from irdma.wire.auth import KeySource

from .serve import run_server
from .shard import Region, Shard

if TYPE_CHECKING:
    from .store import ShardStore
    from .verbs import VerbsShard

log = logging.getLogger("irdma.server")

#: The memory region of a shard with no data directory and no capacity given: 2 GiB.
DEFAULT_CAPACITY = 2 << 30


@dataclasses.dataclass
class ShardProcess:
    """A shard ready to serve, and what it holds: its store (a data directory) and its verbs
    front end, each None without. Closing closes the verbs front end, then syncs and closes the
    store."""

    shard: Shard
    store: ShardStore | None = None
    verbs: VerbsShard | None = None

    def serve(self, host: str, port: int, *, keys: KeySource | None, port_file: str | None = None,
              max_connections: int, max_per_peer: int, metrics: str | None = None, sock: Any = None) -> None:
        """Serve the shard on ``host:port`` until SIGTERM or SIGINT (:func:`run_server`, in
        :func:`trio.run`; the arguments are its own).

        Raises:
            IrdmaError, OSError: as :func:`run_server`.
        """
        trio.run(functools.partial(run_server, self.shard, host, port, port_file=port_file, keys=keys,
                                   verbs=self.verbs, max_connections=max_connections, max_per_peer=max_per_peer,
                                   metrics=metrics, sock=sock))

    def close(self) -> None:
        if self.verbs is not None:
            self.verbs.close()
        if self.store is not None:
            self.store.sync()
            self.store.close()

    def __enter__(self) -> ShardProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def assemble_shard(shard_id: int, capacity: int | None, *, data_dir: str | None, durability: str,
                   cluster: str | None, transport: str, name: str | None = None) -> ShardProcess:
    """Shard ``shard_id``: its chunks in ``data_dir`` (memory-mapped files a restart keeps,
    :class:`~irdma.server.store.ShardStore`, of the cluster ``cluster``: the key's hex id)
    or in memory; a region of ``capacity`` bytes (a multiple of the page; None: the data
    directory's own, else :data:`DEFAULT_CAPACITY`); registered with the RDMA device when
    ``transport`` is ``verbs``, or ``auto`` and verbs work here. ``name``: what its replies
    call it (an unregistered shard).

    Raises:
        TransportUnavailable: ``transport`` is ``verbs`` and verbs do not work here.
        IrdmaError: the memory region cannot be allocated.
        OSError: the data directory cannot be used.
    """
    store = None
    if data_dir is not None:
        from .store import ShardStore

        store = ShardStore(data_dir, shard_id, capacity, durability, cluster)
        capacity = store.capacity
        log.info("shard %d: data in %s (%s, durability %s)", shard_id, store.path,
                 "new" if store.fresh else "reopened with its chunks", durability)
    elif capacity is None:
        capacity = DEFAULT_CAPACITY
    verbs = None
    if transport != "tcp":
        ok, why = verbs_status()
        if transport == "auto":
            log.info("transport auto: %s (%s)", "verbs" if ok else "tcp", why)
        if ok or transport == "verbs":
            from .verbs import VerbsShard

            if not ok:
                raise TransportUnavailable(f"RDMA verbs transport unavailable: {why}", "use --transport tcp")
            verbs = VerbsShard(shard_id, capacity, store=store)
    try:
        if verbs is not None:
            shard = verbs.shard
        elif store is not None:
            shard = Shard(shard_id, Region(capacity, buffer=memoryview(store.region)), memoryview(store.versions),
                          store=store)
        else:
            shard = Shard(shard_id, Region(capacity))
    except MemoryError as exc:
        raise IrdmaError(f"cannot allocate a memory region of {format_size(capacity)}", "pass a smaller --capacity") from exc
    except OSError as exc:
        raise IrdmaError(f"cannot allocate a memory region of {format_size(capacity)}: {exc.strerror}",
                         "pass a smaller --capacity") from exc
    if name is not None:
        shard.name = name
    return ShardProcess(shard, store, verbs)
