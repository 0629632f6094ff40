"""A :class:`~irdma.transport.base.ShardConnection` that records every call in the client's
metrics (:class:`irdma.metrics.ClientMetrics`): the one wrapper over any transport."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..metrics import client_metrics, error_kind
from .base import ShardConnection


class MeteredConnection(ShardConnection):
    """A :class:`ShardConnection` that records every call in :class:`ClientMetrics` and passes
    it on unchanged (same results, same exceptions, same cancellation).

    Args:
        conn: the transport's connection.
        transport: its transport's name (``tcp`` or ``verbs``), the ``transport`` label.
    """

    def __init__(self, conn: ShardConnection, transport: str) -> None:
        self.conn = conn
        self.transport = transport
        self.info = conn.info
        self.address = conn.address
        self.one_sided_reads = conn.one_sided_reads
        self._m = client_metrics()

    async def _call(self, op: str, fn: Callable[..., Any], *args: Any, nbytes: int = 0, direction: str = "") -> Any:
        m = self._m
        t0 = m.begin()
        try:
            out = await fn(*args)
        except BaseException as exc:
            m.end(t0, op, self.transport, error_kind(exc))
            raise
        m.end(t0, op, self.transport, "ok", nbytes, direction)
        return out

    async def read(self, file_id: int, chunk_index: int, offset: int, into: memoryview, clean: bool = False) -> int:
        return await self._call("read", self.conn.read, file_id, chunk_index, offset, into, clean,  # type: ignore[no-any-return]
                                nbytes=len(into), direction="in")

    async def write(self, file_id: int, chunk_index: int, chunk_size: int, offset: int, op: Any,
                    data: memoryview | bytes, existing: bool = False, chain: Any = None) -> int:
        return await self._call("write", self.conn.write, file_id, chunk_index, chunk_size, offset, op,  # type: ignore[no-any-return]
                                data, existing, chain, nbytes=len(data), direction="out")

    async def gather(self, file_id: int, extents: Any, clean: bool = False) -> Any:
        return await self._call("gather", self.conn.gather, file_id, extents, clean,
                                nbytes=int(extents["length"].sum()), direction="in")

    async def scatter(self, file_id: int, chunk_size: int, extents: Any, op: Any, data: memoryview | bytes,
                      existing: bool = False, chain: Any = None) -> int:
        return await self._call("scatter", self.conn.scatter, file_id, chunk_size, extents, op,  # type: ignore[no-any-return]
                                data, existing, chain, nbytes=len(data), direction="out")

    async def resync(self, file_id: int, chunk_index: int, chunk_size: int, chain: Any) -> int:
        return await self._call("resync", self.conn.resync, file_id, chunk_index, chunk_size, chain)  # type: ignore[no-any-return]

    async def checksum(self, file_id: int, chunk_index: int, view: int = 0) -> tuple[int, int]:
        return await self._call("checksum", self.conn.checksum, file_id, chunk_index, view)  # type: ignore[no-any-return]

    async def stat(self) -> Any:
        return await self._call("stat", self.conn.stat)

    async def free(self, file_id: int, first_chunk: int) -> int:
        return await self._call("free", self.conn.free, file_id, first_chunk)  # type: ignore[no-any-return]

    async def punch(self, file_id: int, chunk_index: int, offset: int) -> int:
        return await self._call("punch", self.conn.punch, file_id, chunk_index, offset)  # type: ignore[no-any-return]

    async def sync(self) -> None:
        await self._call("sync", self.conn.sync)

    async def freeze(self, token: int, lease_ms: int, file_ids: Any) -> Any:
        return await self._call("freeze", self.conn.freeze, token, lease_ms, file_ids)

    async def admit(self, token: int, push_ids: Any, wait_ms: int = 0) -> Any:
        return await self._call("admit", self.conn.admit, token, push_ids, wait_ms)

    async def clone(self, token: int, pairs: Any, expect: Any) -> int:
        return await self._call("clone", self.conn.clone, token, pairs, expect)  # type: ignore[no-any-return]

    async def usage(self, file_ids: Any) -> list[Any]:
        return await self._call("usage", self.conn.usage, file_ids)  # type: ignore[no-any-return]

    async def free_files(self, file_ids: Any) -> int:
        return await self._call("free_files", self.conn.free_files, file_ids)  # type: ignore[no-any-return]

    async def thaw(self, token: int) -> None:
        await self._call("thaw", self.conn.thaw, token)

    async def list_chunks(self, after_file: int = 0, after_chunk: int = 0) -> list[Any]:
        return await self._call("list", self.conn.list_chunks, after_file, after_chunk)  # type: ignore[no-any-return]

    @property
    def broken(self) -> bool:
        return self.conn.broken

    def forget_file(self, file_id: int) -> None:
        self.conn.forget_file(file_id)

    async def aclose(self) -> None:
        await self.conn.aclose()

    def __getattr__(self, name: str) -> Any:  # what a transport offers beyond the interface
        return getattr(self.conn, name)


__all__ = ["MeteredConnection"]
