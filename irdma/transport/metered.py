"""A :class:`~irdma.transport.base.ShardConnection` that records every call in the client's
metrics (:class:`irdma.metrics.ClientMetrics`): the one wrapper over any transport.

It wraps what a transport implements: the data path (``read``, ``write``, ``gather``,
``scatter``, whose bytes it counts) and :meth:`~irdma.transport.base.ShardConnection.call`;
the control methods (``stat``, ``free``, ``checksum``...) are the base class's, over ``call``,
so each is recorded once, under its request's ``op`` label.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..metrics import client_metrics, error_kind
from ..wire.protocol import Call
from .base import ShardConnection

_R = TypeVar("_R")
#: The ``op`` label of each control request class: its opcode's name in lower case (``stat``,
#: ``free_files``, ``list`` for LIST: what :meth:`ShardConnection.list_chunks` sends).
_OPS: dict[type, str] = {}


def _op(cls: type[Call[Any]]) -> str:
    op = _OPS.get(cls)
    if op is None:
        op = _OPS[cls] = cls.OPCODE.name.lower()
    return op


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

    async def call(self, request: Call[_R]) -> _R:
        # every control method of ShardConnection (stat, free_files, list_chunks...) comes here
        return await self._call(_op(type(request)), self.conn.call, request)  # type: ignore[no-any-return]

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
