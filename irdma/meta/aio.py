"""The metadata engine off the event loop: every call runs in a worker thread.

A :class:`MetaStore` is synchronous (SQLite blocks while another process holds its write
lock; PostgreSQL waits for the server). :class:`AsyncMeta` exposes the same methods as trio
coroutines that run the call on one of at most ``threads`` worker threads of the client
(:class:`MetaThreads`), so a slow or locked database stalls only the requests that need it,
never the FUSE loop or the transfers (trio's rule: nothing blocking on the event loop).
Engines bound every call by their own timeout (``busy_timeout``: SQLite's wait for the write
lock; PostgreSQL's lock waits and retries of conflicting transactions), so every wait here has
a deadline too.

A call is handed over as ``trio.to_thread.run_sync`` does it (the worker reschedules the
waiting task through the run's :class:`trio.lowlevel.TrioToken`; the call cannot be cancelled
once it started, so a cancelled call either never ran or ran to its end), without its
per-call machinery: no :class:`trio.CapacityLimiter` round, no thread-cache job, one queue.
On this machine the hop of an empty call is about 156 us against 230 us for
``trio.to_thread.run_sync`` (a metadata call is 16-37 us of SQLite work), and a file opened,
written and closed through the mount makes three or four.
"""

from __future__ import annotations

import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio

from irdma.metrics import meta_metrics

from .base import MetaStore

#: Metadata calls running at once per client (each worker thread has its own connection).
META_THREADS = 4
#: Seconds a metadata worker thread waits for a call before it ends (trio's thread cache: 10).
IDLE_S = 10.0
#: The calls after which what a client cached of a file by path may be wrong (its name, size,
#: attributes, xattrs, chunk map or replicas): each adds one to :attr:`AsyncMeta.changes`.
CHANGES = frozenset({
    "rename", "unlink", "rmdir", "link", "symlink", "mknod", "setattr", "extend", "setxattr", "removexattr",
    "restore_contents", "clone_tree", "remove_tree", "delete_inode", "copy_chunk_maps", "set_replicas",
    "withdraw_replicas", "note_replica", "remove_shard", "drain_shard", "finish_move", "snapshot_commit",
    "clear_setid",
})


class MetaThreads:
    """At most ``limit`` daemon threads that run the calls :meth:`run` hands them, in order of
    arrival; a thread is started when a call finds none idle and ends after ``idle_s`` s
    without one (so a client that is gone leaves no thread behind for long)."""

    def __init__(self, limit: int = META_THREADS, idle_s: float = IDLE_S, name: str = "irdma-meta") -> None:
        if limit < 1:
            raise ValueError(f"a metadata client needs at least one thread, not {limit}")
        self.limit, self.idle_s, self.name = limit, idle_s, name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], trio.lowlevel.TrioToken, trio.lowlevel.Task]] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self.threads = 0  # started and not ended
        self._idle = 0  # waiting for a call
        self._unclaimed = 0  # handed over, not yet taken by a thread

    async def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on a worker thread; its value, or what it raised. A caller cancelled before
        the call is handed over raises :class:`trio.Cancelled` and nothing ran; after that the
        call runs to its end and the cancellation is delivered at the caller's next checkpoint."""
        await trio.lowlevel.checkpoint_if_cancelled()
        ctx = contextvars.copy_context()
        job = (functools.partial(ctx.run, fn), trio.lowlevel.current_trio_token(), trio.lowlevel.current_task())
        start = False
        with self._lock:
            self._jobs.put(job)
            self._unclaimed += 1
            if self._unclaimed > self._idle and self.threads < self.limit:
                self.threads += 1
                start = True
        if start:
            try:
                threading.Thread(target=self._work, name=self.name, daemon=True).start()
            except BaseException:
                with self._lock:  # no thread: a running one takes the call when it is free
                    self.threads -= 1
                    alone = self.threads == 0
                if alone:
                    raise
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                fn, token, task = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._unclaimed == 0:  # nothing handed over meanwhile: end
                        self.threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._unclaimed -= 1
            result = outcome.capture(fn)
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            del fn, task, result


class AsyncMeta:
    """Every public method of the wrapped :class:`MetaStore`, awaitable.

    ``meta.lookup(parent, name)`` becomes ``await ameta.lookup(parent, name)``; errors are the
    engine's (IrdmaError subclasses). ``store`` is the synchronous engine, for code that is
    not on an event loop. Each call is counted in ``irdma_meta_calls_total{call=NAME}``
    (:class:`irdma.metrics.MetaMetrics`: a mount's ``--metrics`` serve it).

    :attr:`changes` counts this client's calls of :data:`CHANGES` begun (before they run: a
    cache filled meanwhile is already suspect), so what a client caches by path (the tables of
    :mod:`irdma.client.sparse`) can tell that it changed the namespace since.
    """

    def __init__(self, store: MetaStore, threads: int = META_THREADS) -> None:
        self.store = store
        self.url = store.url
        self._threads = MetaThreads(threads)
        self.changes = 0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.store, name)
        if name.startswith("_") or not callable(fn):
            return fn  # type: ignore[no-any-return]

        note = meta_metrics().note
        changes = name in CHANGES

        async def call(*args: Any, **kwargs: Any) -> Any:
            note(name)
            if changes:
                self.changes += 1
            return await self._threads.run(functools.partial(fn, *args, **kwargs))

        call.__name__ = name
        setattr(self, name, call)  # cached: later lookups skip __getattr__
        return call


#: Public names of the SQL engines that are no engine call: :meth:`SqlMeta.held` holds a connection
#: for a block of calls on one thread (a dump or a load), which a call sent to a worker thread cannot.
NOT_CALLS = frozenset({"held"})


def stub() -> str:
    """The text of ``aio.pyi``: :class:`AsyncMeta` as the type checker sees it, one ``async
    def`` per public method of the SQL engines with the engine's own signature, so every
    ``await client.meta.NAME(...)`` is checked and typed (``__getattr__`` alone makes them
    ``Any``). ``tests/test_meta.py`` checks that the file is up to date; regenerate it with
    ``python -m irdma.meta.aio > irdma/meta/aio.pyi``."""
    import inspect

    from .sql import SqlMeta

    out = [
        '"""Generated by ``python -m irdma.meta.aio`` from the SQL engines\' signatures: do not edit."""',
        "",
        "from collections.abc import Callable, Sequence",
        "from typing import Any",
        "",
        "from irdma.placement import Move",
        "",
        "from .base import DamagedFile, Inode, Member, MetaStore, Opened, Session, ShardRecord, Snapshot",
        "",
        "META_THREADS: int",
        "IDLE_S: float",
        "CHANGES: frozenset[str]",
        "",
        "class MetaThreads:",
        "    limit: int",
        "    idle_s: float",
        "    name: str",
        "    threads: int",
        "    def __init__(self, limit: int = ..., idle_s: float = ..., name: str = ...) -> None: ...",
        "    async def run(self, fn: Callable[[], Any]) -> Any: ...",
        "",
        "class AsyncMeta:",
        "    store: MetaStore",
        "    url: str",
        "    changes: int",
        "    def __init__(self, store: MetaStore, threads: int = ...) -> None: ...",
    ]
    for name in sorted(dir(SqlMeta)):
        fn = inspect.getattr_static(SqlMeta, name)
        if name.startswith("_") or not inspect.isfunction(fn) or name in NOT_CALLS:
            continue
        sig = inspect.signature(fn)
        params = []
        for p in sig.parameters.values():
            text = p.name if p.annotation is inspect.Parameter.empty else f"{p.name}: {p.annotation}"
            if p.default is not inspect.Parameter.empty:
                text += " = ..."
            if p.kind is inspect.Parameter.KEYWORD_ONLY and not any(x.startswith("*") for x in params):
                params.append("*")
            params.append(("*" if p.kind is inspect.Parameter.VAR_POSITIONAL else
                           "**" if p.kind is inspect.Parameter.VAR_KEYWORD else "") + text)
        out.append(f"    async def {name}({', '.join(params)}) -> {sig.return_annotation}: ...")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(stub(), end="")
