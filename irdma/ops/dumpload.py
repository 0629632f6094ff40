"""`irdma dump` and `irdma load`: files, progress and messages around :mod:`irdma.meta.dump`.

A dump goes to a file (written as ``FILE.tmp-PID`` in the same directory, mode 0600, and
renamed over FILE once complete: never a half dump under FILE's name), to standard output
(``-``), or through gzip when FILE ends in ``.gz``. A load reads the same (``-``: standard
input). Progress goes to standard error: rich bars (rows done of the total, bytes, rows per
second, time left) on a terminal or when asked, one summary line otherwise, nothing when quiet.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from .._errors import IrdmaError
from ..units import format_size


class _RateColumn(ProgressColumn):
    """Rows per second."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("-" if speed is None else f"{speed:,.0f} rows/s", style="progress.data.speed")


@contextlib.contextmanager
def _bars(what: str, show: bool, console: Console) -> Iterator[Callable[[Any, int, int], None]]:
    """A progress callback (:data:`irdma.meta.dump.Progress`) drawing one bar when ``show``."""
    if not show:
        yield lambda header, rows, nbytes: None
        return
    with Progress(TextColumn(f"{what:>4}"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                  TextColumn("{task.fields[nbytes]}"), _RateColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task(what, total=None, nbytes="0 B")

        def update(header: Any, rows: int, nbytes: int) -> None:
            bar.update(task, total=max(header.rows, 1), completed=rows, nbytes=format_size(nbytes))

        yield update


def _show(progress: bool | None, quiet: bool, console: Console) -> bool:
    return not quiet and (progress if progress is not None else console.is_terminal)


def dump_file(meta_url: str, file: str, *, progress: bool | None, quiet: bool, console: Console) -> None:
    """``irdma dump META_URL FILE``: see the module docstring and :func:`irdma.meta.dump.dump`.

    Raises:
        IrdmaError: the database cannot be opened or read, or FILE cannot be written (nothing
            is left under FILE's name).
    """
    from ..meta import open_meta
    from ..meta.dump import dump

    start = time.monotonic()
    meta = open_meta(meta_url)
    written = 0
    try:
        with _bars("dump", _show(progress, quiet, console), console) as update, _output(file) as out:

            def track(header: Any, rows: int, nbytes: int) -> None:
                nonlocal written
                written = nbytes
                update(header, rows, nbytes)

            header = dump(meta, out, progress=track)
    finally:
        meta.close()
    if not quiet:
        size = f" ({format_size(written)}{' before gzip' if file.endswith('.gz') else ''})"
        console.print(f"dumped {header.rows:,} rows of {len(header.tables)} tables from {header.source} to"
                      f" {'standard output' if file == '-' else file}{size} in {time.monotonic() - start:.1f} s;"
                      " the shards' data and the cluster key file are not in a dump", highlight=False)


@contextlib.contextmanager
def _output(file: str) -> Iterator[IO[bytes]]:
    if file == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    path = os.path.abspath(file)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # names and owners: private
    except OSError as exc:
        raise IrdmaError(f"cannot write {tmp}: {exc.strerror}", "pick a FILE in a directory you can write") from None
    try:
        with os.fdopen(fd, "wb") as raw:
            if path.endswith(".gz"):
                with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
                    yield gz  # type: ignore[misc]
            else:
                yield raw
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise IrdmaError(f"cannot write {path}: {exc.strerror}", "free some space, or pick another FILE") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _input(file: str) -> Iterator[IO[bytes]]:
    """The dump's stream (gunzipped for a FILE ending in ``.gz``)."""
    if file == "-":
        yield sys.stdin.buffer
        return
    try:
        raw = open(file, "rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise IrdmaError(f"cannot read {file}: {exc.strerror}", "pass the FILE `irdma dump` wrote") from None
    with raw:
        if file.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                yield gz  # type: ignore[misc]
        else:
            yield raw


def load_file(meta_url: str, file: str, *, progress: bool | None, quiet: bool, console: Console) -> None:
    """``irdma load META_URL FILE``: see :func:`irdma.meta.dump.load`. The dump's header is read
    and checked before the target is opened; a new SQLite file made for the load is removed
    again if the load fails.

    Raises:
        InvalidArgument: not a dump, an unknown format version, a damaged dump, a target that
            is not empty or cannot take the dump's tables (nothing changed).
        IrdmaError: the target cannot be opened or written (nothing changed).
    """
    from ..meta import meta_path, meta_scheme, open_meta
    from ..meta.dump import DumpReader, load

    start = time.monotonic()
    with _input(file) as stream:
        reader = DumpReader(stream, "standard input" if file == "-" else file)
        made: str | None = None
        if meta_scheme(meta_url) == "sqlite":
            path = meta_path(meta_url)
            if not os.path.exists(path):
                made = path
        try:
            meta = open_meta(meta_url, create=True)
            try:
                with _bars("load", _show(progress, quiet, console), console) as update:
                    header = load(meta, reader, progress=update)
                shown = meta.url
            finally:
                meta.close()
        except BaseException:
            if made is not None:
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(OSError):
                        os.unlink(made + suffix)
            raise
    if not quiet:
        console.print(f"loaded {header.rows:,} rows of {len(header.tables)} tables ({format_size(reader.bytes_read)})"
                      f" into {shown} in"
                      f" {time.monotonic() - start:.1f} s (dumped from {header.engine} {header.source} at"
                      f" {header.dumped_at}); the cluster key is not in a dump: give every shard and mount the"
                      " cluster's key file (--key-file), and start the shards on their data directories",
                      highlight=False)
