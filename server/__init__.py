"""Shard servers: memory regions of chunks, chunk versions, server-side update ops.

Importable only as ``irdma.server`` (see setup.cfg). Knows nothing of files or paths: a chunk
is named by ``(file_id, chunk_index)``.
"""

from .shard import Region, Shard

__all__ = ["Region", "Shard"]
