"""A plain synchronous client for scripts: :class:`Client` run on a trio loop in a thread."""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import trio

from .._errors import IrdmaError
from ..meta import Inode
from ..wire.compress import Compression
from ..wire.protocol import Round, Update, UpdateOp
from . import comm
from .native import Client


class SyncClient:
    """The same operations as :class:`irdma.Client`, as ordinary blocking calls.

    Create with :func:`irdma.connect`; use as a context manager or call :meth:`close`.
    Errors are the same as the async client's.
    """

    def __init__(self, meta_url: str, **kwargs: Any) -> None:
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._client: Client | None = None
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._thread = threading.Thread(target=self._main, args=(meta_url, kwargs), name="irdma-sync", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _main(self, meta_url: str, kwargs: dict[str, Any]) -> None:
        async def amain() -> None:
            try:
                async with Client.open(meta_url, **kwargs) as client, trio.open_nursery() as nursery:
                    self._client = client
                    self._nursery = nursery  # where submit()'s calls run
                    self._token = trio.lowlevel.current_trio_token()
                    self._stop = trio.Event()
                    self._ready.set()
                    await self._stop.wait()
                    nursery.cancel_scope.cancel()  # calls still running end as "client closed"
            except BaseException as exc:  # reported to the constructor, or to the next call
                self._error = exc
                self._ready.set()

        trio.run(amain)

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the client's loop.

        Raises:
            IrdmaError: the client is closed, or its loop ended on an error after it started
                (that error is the cause); else what ``fn`` raises.
        """
        if self._token is None or self._client is None:
            raise IrdmaError("this irdma client is closed", "open a new one with irdma.connect()")
        try:
            return trio.from_thread.run(lambda: fn(*args, **kwargs), trio_token=self._token)
        except trio.RunFinishedError:
            cause = self._error
            raise IrdmaError(
                f"this irdma client stopped: {cause!r}" if cause else "this irdma client stopped",
                "open a new one with irdma.connect()",
            ) from cause

    def run(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """Run ``await fn(*args, **kwargs)`` on the client's loop and wait for its result: any
        async call of :attr:`client` (or one taking it) made from this thread.

        Returns:
            What ``fn`` returns.

        Raises:
            IrdmaError: the client is closed, or its loop ended on an error after it started
                (that error is the cause); else what ``fn`` raises.
        """
        return self._run(fn, *args, **kwargs)

    def submit(self, fn: Callable[[Client], Awaitable[Any]], *, priority: int = 0,
               slice_bytes: int = 0, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        """Start ``await fn(client)`` on the client's loop and return at once (overlapped
        transfers: P3's pushes during back-propagation, pulls ahead of the forward pass).

        Its requests go at ``priority`` (0 = most urgent) in slices of at most ``slice_bytes``
        bytes (0: none): :func:`irdma.client.comm.priority`. A buffer handed to ``fn`` must not be
        touched until the future is done. ``timeout`` (seconds) cancels ``fn`` when it runs
        longer: the future then fails with TimeoutError and nothing of ``fn`` runs after (a
        ``result(timeout=...)`` that gives up does not stop it; this does). Cancelling the
        future before it started skips ``fn``.

        Returns:
            A future of ``fn``'s result; its exception is ``fn``'s, TimeoutError past
            ``timeout``, or IrdmaError when the client closed before ``fn`` finished.

        Raises:
            ValueError: a bad priority, slice size or timeout; IrdmaError: the client is closed.
        """
        comm.check_priority(priority)
        comm.check_slice(slice_bytes)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout {timeout!r}: use a number of seconds > 0, or None")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        async def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # cancelled by the caller before it started
            try:
                with trio.fail_after(timeout if timeout is not None else math.inf), \
                        comm.priority(priority, slice_bytes):
                    result = await fn(self.client)
            except trio.TooSlowError:
                fut.set_exception(TimeoutError(f"an irdma transfer took longer than {timeout:g} s: cancelled"))
            except BaseException as exc:  # the caller's to see
                cancelled = isinstance(exc, trio.Cancelled) or (
                    isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None)
                if cancelled:  # the client is closing
                    fut.set_exception(IrdmaError("this irdma client closed before the call finished",
                                                 "keep the client open until its futures are done"))
                    raise
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        def start() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(run)

        self._run_sync(start)
        return fut

    def _run_sync(self, fn: Callable[[], None]) -> None:
        if self._token is None or self._client is None:
            raise IrdmaError("this irdma client is closed", "open a new one with irdma.connect()")
        try:
            trio.from_thread.run_sync(fn, trio_token=self._token)
        except trio.RunFinishedError:
            raise IrdmaError("this irdma client stopped", "open a new one with irdma.connect()") from self._error

    @property
    def client(self) -> Client:
        assert self._client is not None
        return self._client

    def write(self, path: str, data: object, offset: int = 0, *, op: UpdateOp | str | None = None,
              chunk_size: int | None = None, compress: Compression | str | None = None,
              feedback: np.ndarray | None = None) -> int:
        return int(self._run(self.client.write, path, data, offset, op=op, chunk_size=chunk_size, compress=compress,
                             feedback=feedback))

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytearray:
        return self._run(self.client.read, path, offset, length)  # type: ignore[no-any-return]

    def push(self, path: str, delta: np.ndarray, offset: int = 0, *, compress: Compression | str | None = None,
             residual: np.ndarray | None = None, round: Round | None = None) -> None:
        """Push ``delta`` into the file, compressed with error feedback if asked, as a
        contribution to a synchronous round if given one (see Client.push)."""
        self._run(self.client.push, path, delta, offset, compress=compress, residual=residual, round=round)

    def pull(self, path: str, shape: Sequence[int] | None = None, dtype: str = "<f4") -> np.ndarray:
        return self._run(self.client.pull, path, shape, dtype)  # type: ignore[no-any-return]

    def pull_rows(self, path: str, ids: Sequence[int] | np.ndarray, *, row_len: int | None = None,
                  out: np.ndarray | None = None) -> np.ndarray:
        """Sparse pull (see Client.pull_rows)."""
        return self._run(self.client.pull_rows, path, ids, row_len=row_len, out=out)  # type: ignore[no-any-return]

    def push_rows(self, path: str, ids: Sequence[int] | np.ndarray, rows: np.ndarray, *,
                  op: UpdateOp | Update | str | None = None, row_len: int | None = None) -> None:
        """Sparse push (see Client.push_rows)."""
        self._run(self.client.push_rows, path, ids, rows, op=op, row_len=row_len)

    def set_shape(self, path: str, shape: Sequence[int]) -> None:
        """Record a file's tensor shape (see Client.set_shape)."""
        self._run(self.client.set_shape, path, shape)

    def create(self, path: str, *, chunk_size: int | None = None) -> Inode:
        return self._run(self.client.create, path, chunk_size=chunk_size)  # type: ignore[no-any-return]

    def makedirs(self, path: str) -> Inode:
        return self._run(self.client.makedirs, path)  # type: ignore[no-any-return]

    def set_update_op(self, path: str, op: str) -> None:
        self._run(self.client.set_update_op, path, op)

    def flush(self) -> None:
        """Return once every write so far is durable on the shards (see Client.flush)."""
        self._run(self.client.flush)

    def truncate(self, path: str, size: int) -> None:
        self._run(self.client.truncate, path, size)

    def unlink(self, path: str) -> None:
        self._run(self.client.unlink, path)

    def snapshot(self, path: str, name: str, *, keep: int | None = None) -> Any:
        """:meth:`Client.snapshot`: a consistent, copy-on-write snapshot of ``path``."""
        return self._run(self.client.snapshot, path, name, keep=keep)

    def snapshots(self, path: str) -> list[Any]:
        """:meth:`Client.snapshots`: the snapshots of ``path``, oldest first."""
        return self._run(self.client.snapshots, path)  # type: ignore[no-any-return]

    def restore_snapshot(self, path: str, name: str) -> None:
        """:meth:`Client.restore_snapshot`."""
        self._run(self.client.restore_snapshot, path, name)

    def clone_snapshot(self, path: str, name: str, new_path: str) -> Inode:
        """:meth:`Client.clone_snapshot`."""
        return self._run(self.client.clone_snapshot, path, name, new_path)  # type: ignore[no-any-return]

    def delete_snapshot(self, path: str, name: str) -> int:
        """:meth:`Client.delete_snapshot`."""
        return self._run(self.client.delete_snapshot, path, name)  # type: ignore[no-any-return]

    def listdir(self, path: str = "/") -> list[str]:
        return self._run(self.client.listdir, path)  # type: ignore[no-any-return]

    def stat(self, path: str) -> Inode:
        return self._run(self.client.stat, path)  # type: ignore[no-any-return]

    def shard_stats(self) -> list[Any]:
        return self._run(self.client.shard_stats)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close the connections and stop the loop thread. Safe to call twice."""
        if self._token is not None and self._stop is not None:
            token, self._token = self._token, None
            trio.from_thread.run_sync(self._stop.set, trio_token=token)
            self._thread.join()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(meta_url: str, **kwargs: Any) -> SyncClient:
    """Open the namespace at ``meta_url`` for blocking use (same arguments as Client.open)."""
    return SyncClient(meta_url, **kwargs)
