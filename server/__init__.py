"""Shard servers: memory regions of chunks, chunk versions, server-side update ops.

Importable only as ``irdma.server`` (see setup.cfg). Knows nothing of files or paths: a chunk
is named by ``(file_id, chunk_index)``.

The layers, bottom up (each imports only those below it):

* :mod:`.shard` (with :mod:`.store` for a data directory and :mod:`.optim` for the optimizer
  update ops): the memory region, its chunks and their versions; synchronous, no I/O but the
  store's.
* :mod:`.replicate`: chain replication (apply, forward to the successor, answer when the rest
  of the chain did; CRAQ's clean reads; resync).
* :mod:`.rounds`: synchronous rounds, the members' pushes of a range summed and applied once.
* :mod:`.dispatch`: a request frame in, its reply out (:class:`~.dispatch.Dispatcher`); disk
  I/O in worker threads; the one status table of :mod:`irdma.wire.protocol` for errors; metrics.
* Front ends that only move frames: :mod:`.tcp` (pipelined connections) and :mod:`.verbs`
  (queue pairs, one-sided reads and writes); both use :mod:`irdma.wire.framing` for the frames and
  the handshake they share with the clients.
* :mod:`.serve`: the ``irdma server`` process (signals, the port file, the metrics exporter).
"""

from .shard import Region, Shard

__all__ = ["Region", "Shard"]
