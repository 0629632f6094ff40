"""The metadata engine off the event loop: every call runs in a worker thread.

A :class:`MetaStore` is synchronous (SQLite blocks while another process holds its write
lock; PostgreSQL waits for the server). :class:`AsyncMeta` exposes the same methods as trio coroutines that run the call with
``trio.to_thread.run_sync`` under a :class:`trio.CapacityLimiter`, so a slow or locked
database stalls only the requests that need it, never the FUSE loop or the transfers
(trio's rule: nothing blocking on the event loop). Engines bound every call by their own
timeout (``busy_timeout``: SQLite's wait for the write lock; PostgreSQL's lock waits and
retries of conflicting transactions), so every wait here has a deadline too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import trio

from .base import MetaStore

#: Metadata calls running at once per client (each worker thread has its own connection).
META_THREADS = 4


class AsyncMeta:
    """Every public method of the wrapped :class:`MetaStore`, awaitable.

    ``meta.lookup(parent, name)`` becomes ``await ameta.lookup(parent, name)``; errors are the
    engine's (IrdmaError subclasses). ``store`` is the synchronous engine, for code that is
    not on an event loop.
    """

    def __init__(self, store: MetaStore, threads: int = META_THREADS) -> None:
        self.store = store
        self.url = store.url
        self._limiter = trio.CapacityLimiter(threads)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.store, name)
        if name.startswith("_") or not callable(fn):
            return fn  # type: ignore[no-any-return]

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self._limiter)

        call.__name__ = name
        setattr(self, name, call)  # cached: later lookups skip __getattr__
        return call
