"""Progress of the long commands that move data (``irdma rebalance``, ``shard drain``, ``shard
resync``, ``gc``; meant for ``dump``, ``load`` and ``warmup`` too).

One context manager, :func:`transfer_progress`, gives a ``step(done_bytes, total_bytes,
done_items, total_items)`` callback. A command passes it to the code that does the work, which
calls it as bytes and items (chunks, files, entries) get done; the manager shows them:

- on a terminal, a rich bar (``rich.progress``: ``BarColumn``, ``DownloadColumn``,
  ``TransferSpeedColumn``, ``TimeRemainingColumn``) with the bytes done of the total, the rate,
  the time left and the count of items, redrawn in place and removed at the end (the command
  prints its summary then);
- elsewhere (a pipe, a log file, CI), one plain line every ``interval`` seconds and one at the
  end, on the same console (stderr for the CLI), such as
  ``drain shard 1: 12/40 chunks, 48.0 MiB/160.0 MiB, 9.6 MiB/s, 12 s left``.

Example::

    with transfer_progress("drain shard 1", unit="chunks", console=console) as step:
        copied = await client.drain_shard(1, step)

A total of None means not known yet (the bar pulses, the line leaves out the time left);
``step.describe(text)`` changes the label (a new phase: ``"gc: listing shard 2"``). The
callback is cheap (it only records numbers; drawing happens at most every ``interval``
seconds off a terminal, and in rich's refresh thread on one), so it can be called for every
chunk. It must be called from one thread at a time (trio tasks of one run are fine).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Column
from rich.text import Text

from ..units import format_size

#: Seconds between two plain lines off a terminal.
LINE_INTERVAL = 5.0


class _BinarySpeedColumn(TransferSpeedColumn):
    """rich's rate column in the binary units the rest of the bar uses (``MiB/s``, not ``MB/s``)."""

    def render(self, task: Any) -> Text:
        speed = task.finished_speed or task.speed
        if speed is None:
            return Text("?", style="progress.data.speed")
        return Text(f"{format_size(int(speed))}/s", style="progress.data.speed")


class Transfer:
    """The ``step`` callback :func:`transfer_progress` yields (call it; see the module's docstring)."""

    def __init__(self, label: str, unit: str, console: Console, interval: float) -> None:
        self.label = label
        self.unit = unit
        self.console = console
        self.interval = interval
        self.done_bytes = 0
        self.total_bytes: int | None = None
        self.done_items = 0
        self.total_items: int | None = None
        self.started = time.monotonic()
        self._last_line = self.started
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, done_bytes: int, total_bytes: int | None, done_items: int, total_items: int | None) -> None:
        """Record how far the work got: bytes done of ``total_bytes``, and items (chunks,
        files) done of ``total_items`` (None: not known). A total that drops below what was
        done (a new phase of the work) starts the rate and the time left over."""
        if (total_bytes is not None and self.total_bytes is not None and total_bytes != self.total_bytes) \
                or done_bytes < self.done_bytes:
            self.started = time.monotonic()  # a new phase (rebalance: the next move)
            if self._bar is not None and self._task is not None:
                self._bar.reset(self._task)
        self.done_bytes, self.total_bytes = done_bytes, total_bytes
        self.done_items, self.total_items = done_items, total_items
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done_bytes, total=total_bytes, items=self._items())
        elif time.monotonic() - self._last_line >= self.interval:
            self.print_line()

    def describe(self, text: str) -> None:
        """Change the label shown before the numbers (a new phase of the work)."""
        self.label = text
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=text)

    def _items(self) -> str:
        total = "?" if self.total_items is None else str(self.total_items)
        return f"{self.done_items}/{total} {self.unit}"

    def line(self) -> str:
        """The plain line of where the work stands (what off-terminal output prints)."""
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.done_bytes / elapsed
        parts = [self._items(), format_size(self.done_bytes) + (
            f"/{format_size(self.total_bytes)}" if self.total_bytes is not None else ""),
            f"{format_size(int(rate))}/s"]
        if self.total_bytes and rate > 0 and self.done_bytes < self.total_bytes:
            parts.append(f"{(self.total_bytes - self.done_bytes) / rate:.0f} s left")
        return f"{self.label}: {', '.join(parts)}"

    def print_line(self) -> None:
        """Print :meth:`line` now (off a terminal; the next one comes ``interval`` seconds later)."""
        self._last_line = time.monotonic()
        self.console.print(self.line(), highlight=False, markup=False, soft_wrap=True)

    def attach_bar(self, bar: Progress) -> None:
        """Draw on ``bar`` from now on (a task of its own, labelled :attr:`label`), not in lines."""
        self._bar = bar
        self._task = bar.add_task(self.label, total=None, items=self._items())

    def detach_bar(self) -> None:
        """Stop drawing on the bar given to :meth:`attach_bar` (it is being closed)."""
        self._bar = None


@contextlib.contextmanager
def transfer_progress(label: str, *, unit: str = "chunks", console: Console | None = None,
                      interval: float = LINE_INTERVAL, final_line: bool = True) -> Iterator[Transfer]:
    """Show the progress of a transfer while the block runs (see the module's docstring).

    Args:
        label: what is done (``"drain shard 1"``), shown first.
        unit: the items counted (``"chunks"``, ``"files"``).
        console: where to draw (default: a new stderr console). On a terminal a bar, else lines.
        interval: seconds between plain lines off a terminal.
        final_line: off a terminal, print one last line when the block ends (the bar on a
            terminal is removed; the command prints its own summary).

    Yields:
        The ``step(done_bytes, total_bytes, done_items, total_items)`` callback
        (:class:`Transfer`), which also has ``describe(text)``.
    """
    console = console or Console(stderr=True)
    t = Transfer(label, unit, console, interval)
    if not console.is_terminal or console.is_dumb_terminal:
        try:
            yield t
        finally:
            if final_line and (t.done_items or t.done_bytes):
                t.print_line()
        return
    # the numbers keep their width; the bar takes what is left (at most 40 columns), and a label
    # too long for an 80-column terminal is shortened
    label_col = Column(no_wrap=True, overflow="ellipsis", max_width=max(12, console.width - 56))
    wide = console.width >= 120
    columns: list[Any] = [TextColumn("{task.description}", table_column=label_col),
                          BarColumn(bar_width=40 if wide else None),
                          DownloadColumn(binary_units=True, table_column=Column(no_wrap=True)),
                          _BinarySpeedColumn(table_column=Column(no_wrap=True)),
                          TimeRemainingColumn(table_column=Column(no_wrap=True)),
                          TextColumn("{task.fields[items]}", table_column=Column(no_wrap=True))]
    with Progress(*columns, console=console, transient=True, expand=not wide) as bar:
        t.attach_bar(bar)
        try:
            yield t
        finally:
            t.detach_bar()


__all__ = ["Transfer", "transfer_progress", "LINE_INTERVAL"]
