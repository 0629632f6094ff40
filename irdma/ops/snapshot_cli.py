"""``irdma snapshot``: consistent, copy-on-write snapshots of files and directories (issue 23;
the mechanism is :mod:`irdma.client.snapshots`). Added to :data:`irdma.ops.cli.cli`."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click
import trio
from rich.markup import escape
from rich.table import Table

from ..units import format_size

_Deco = Callable[[Callable[..., Any]], Callable[..., Any]]


def group(META_OPTION: _Deco, friendly: _Deco, console: Any, out: Any,  # noqa: N803
          target: Callable[[str, str], Any]) -> click.Group:
    """The ``snapshot`` command group, built with :mod:`irdma.ops.cli`'s option and error
    handling, and ``target`` (:func:`irdma.ops.cli.target`: the namespace and path a PATH
    names; a path under a mount is in that mount's namespace and directory), passed in: that
    module imports this one."""

    def _namespace(path: str, meta_url: str) -> tuple[str, str]:
        t = target(path, meta_url)
        return t.path, t.meta_url

    @click.group()
    def snapshot() -> None:
        """Snapshots: a consistent point-in-time copy of a live file or directory, made in O(files)
        (no parameter byte copied: the shards copy a chunk on its next write), read at
        DIR/.snapshots/NAME (read-only). Through a mount: `mkdir DIR/.snapshots/NAME`, `rmdir` it.

        PATH is a path in the namespace (/jobs/x), or a path under an irdma mount: then the
        mount's namespace and the directory it shows (--subdir) are used."""


    @snapshot.command("create")
    @click.argument("path")
    @click.argument("name")
    @META_OPTION
    @click.option("--keep", type=click.IntRange(1), default=None,
                  help="Then delete the oldest snapshots of the directory beyond the newest N.")
    @friendly
    def create_cmd(path: str, name: str, meta_url: str, keep: int | None) -> None:
        """Snapshot PATH (a directory, or a file: into its directory's .snapshots) as NAME.

        Every push acknowledged before this command started is in the snapshot, no push started
        after it returned is; pushes wait about one round trip to the shards meanwhile."""
        from ..client.native import Client

        ns, meta_url = _namespace(path, meta_url)

        async def run() -> object:
            async with Client.open(meta_url, transport="tcp") as client:
                return await client.snapshot(ns, name, keep=keep)

        info = trio.run(run)
        console.print(f"snapshot {escape(info.name)} of {escape(ns)}: {info.files} files, {format_size(info.bytes)}"  # type: ignore[attr-defined]
                      f" at {escape(info.path)}", highlight=False)  # type: ignore[attr-defined]


    @snapshot.command("list")
    @click.argument("path")
    @META_OPTION
    @click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout (times in ns since the epoch).")
    @friendly
    def list_cmd(path: str, meta_url: str, as_json: bool) -> None:
        """The snapshots of PATH (a directory, or a file's directory), oldest first."""
        from ..client.native import Client

        ns, meta_url = _namespace(path, meta_url)

        async def run() -> list:  # type: ignore[type-arg]
            async with Client.open(meta_url, transport="tcp") as client:
                return await client.snapshots(ns)

        snaps = trio.run(run)
        if as_json:
            out.print_json(json.dumps([vars(s) for s in snaps]))
            return
        table = Table(title=f"snapshots of {escape(ns)}")
        for col in ("name", "created", "maker", "files", "size", "held alone", "shared", "state"):
            table.add_column(col, justify="left" if col in ("name", "created", "maker", "state") else "right")

        def size(n: int) -> str:
            return "?" if n < 0 else format_size(n)

        def user(uid: int) -> str:  # the maker's name where this host knows it, else its uid
            import pwd

            try:
                return pwd.getpwuid(uid).pw_name
            except (KeyError, OverflowError):
                return str(uid)

        for s in snaps:
            table.add_row(escape(s.name), datetime.fromtimestamp(s.created_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S"),
                          escape(user(s.maker)), str(s.files), format_size(s.bytes), size(s.held_alone),
                          size(s.shared), s.state)
        out.print(table)
        out.print("size: the files' bytes; held alone: what the shards keep for the snapshot only (copied since,"
                  " every replica; `delete` frees it); shared: still shared with the live files (every replica);"
                  " maker: whose it is (it, the directory's owner and root may delete it through a mount)",
                  highlight=False)


    @snapshot.command("delete")
    @click.argument("path")
    @click.argument("name")
    @META_OPTION
    @friendly
    def delete_cmd(path: str, name: str, meta_url: str) -> None:
        """Delete snapshot NAME of PATH; the chunks only it held are freed on the shards."""
        from ..client.native import Client

        ns, meta_url = _namespace(path, meta_url)

        async def run() -> int:
            async with Client.open(meta_url, transport="tcp") as client:
                return await client.delete_snapshot(ns, name)

        n = trio.run(run)
        console.print(f"deleted snapshot {escape(name)} of {escape(ns)} ({n} files)", highlight=False)

    @snapshot.command("restore")
    @click.argument("path")
    @click.argument("name")
    @META_OPTION
    @friendly
    def restore_cmd(path: str, name: str, meta_url: str) -> None:
        """Make PATH what snapshot NAME holds again, atomically for readers (a file is replaced,
        a directory's entries swapped in one step); no byte is copied. Files open elsewhere keep
        what they had until reopened."""
        from ..client.native import Client

        ns, meta_url = _namespace(path, meta_url)

        async def run() -> None:
            async with Client.open(meta_url, transport="tcp") as client:
                await client.restore_snapshot(ns, name)

        trio.run(run)
        console.print(f"restored {escape(ns)} from snapshot {escape(name)}", highlight=False)

    @snapshot.command("clone")
    @click.argument("path")
    @click.argument("name")
    @click.argument("new_path")
    @META_OPTION
    @friendly
    def clone_cmd(path: str, name: str, new_path: str, meta_url: str) -> None:
        """A writable copy of snapshot NAME of PATH at NEW_PATH, sharing every chunk with the
        snapshot until written (copy-on-write)."""
        from ..client.native import Client
        from . import info as I

        ns, meta_url = _namespace(path, meta_url)
        # NEW_PATH is in the snapshot's namespace: a plain path, or one under a mount of it
        there = I.resolve_target(new_path, meta_url, True, named_by=f"the namespace of {path}")
        dst = there.path

        async def run() -> None:
            async with Client.open(meta_url, transport="tcp") as client:
                await client.clone_snapshot(ns, name, dst)

        trio.run(run)
        console.print(f"cloned snapshot {escape(name)} of {escape(ns)} to {escape(dst)}", highlight=False)

    return snapshot
