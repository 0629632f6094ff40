"""Nurseries whose failures read as plain irdma errors.

Trio wraps every error that leaves a nursery in an ExceptionGroup. When all the errors of a
group are :class:`IrdmaError` (say, two shards refused a write), callers want the error, not
the group: :func:`open_nursery` raises the first one, with the group as its cause. Any other
group (a bug, a cancellation, Ctrl-C) passes through untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio

from ._errors import IrdmaError


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


@contextlib.asynccontextmanager
async def open_nursery() -> AsyncIterator[trio.Nursery]:
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if leaves and all(isinstance(e, IrdmaError) for e in leaves):
            raise leaves[0] from (group if len(leaves) > 1 else None)
        raise
