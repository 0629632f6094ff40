"""The ``irdma`` command line: shard servers, local clusters, mounts and cluster status.

One module per command group, each giving its click commands to the group :data:`cli` made
here: :mod:`._server` (``irdma server``; the shard process itself is assembled by
:func:`irdma.server.assemble.serve_shard`), :mod:`._lifecycle` (``up``, ``down``,
``destroy``), :mod:`._jobs` (``run``, ``job``), :mod:`._mounts` (``mount``, ``umount``,
``warmup``, and the fstab command lines), :mod:`._shards` (``shard ...``, ``rebalance``),
:mod:`._status` (``status``, ``fsck``, ``gc``), :mod:`.health` (how ``status`` sums a cluster
up: healthy, degraded or unreadable, and its exit code), :mod:`._info` (``info``, ``stats``),
:mod:`._bench` (``bench``, ``tune``), :mod:`._format` (``format``, ``key``, ``dump``,
``load``), :mod:`irdma.ops.snapshot_cli` (``snapshot``); the options, the consoles and the
one-line errors every command shares are :mod:`._common`'s. The names are re-exported here.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import click
from rich.markup import escape

from ..._errors import IrdmaError
from .. import cluster as _cluster
from .. import snapshot_cli
from ._bench import bench, tune
from ._common import (
    DIR_OPTION,
    META_OPTION,
    METRICS_OPTION,
    IrdmaCLI,
    _add_key_file_option,
    _add_key_file_options,
    console,
    fail,
    friendly,
    out,
    target,
)
from ._format import dump_cmd, format_, key, key_rotate, key_security, load_cmd
from ._info import info_cmd, stats_cmd
from ._jobs import job, job_list, job_remove, run
from ._lifecycle import destroy, down, up
from ._server import server
from ._shards import rebalance, shard, shard_add, shard_drain, shard_list, shard_remove, shard_resync
from ._status import fsck, gc, status
from .health import RETIRED, Health, cluster_health

__all__ = [
    "DIR_OPTION", "META_OPTION", "METRICS_OPTION", "RETIRED", "Health", "IrdmaCLI", "bench", "cli", "cluster_health",
    "console", "destroy", "down", "dump_cmd", "fail", "format_", "friendly", "fsck", "fstab_args", "gc", "info_cmd",
    "job", "job_list", "job_remove", "key", "key_rotate", "key_security", "load_cmd", "main", "mount", "out",
    "rebalance", "run", "server", "shard", "shard_add", "shard_drain", "shard_list", "shard_remove", "shard_resync",
    "stats_cmd", "status", "target", "tune", "umount", "up", "warmup", "_cluster",
]


@click.group(cls=IrdmaCLI)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug); tracebacks of bugs.")
@click.version_option(package_name="irdma")
def cli(verbose: int) -> None:
    """irdma: an RDMA parameter server exposed as a POSIX filesystem."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


for _command in (server, up, down, destroy, run, job, stats_cmd, shard, rebalance, status, fsck, info_cmd, gc, bench,
                 format_, dump_cmd, load_cmd, tune, key):
    cli.add_command(_command)
_add_key_file_options(cli)  # every command but the server's and the snapshots' takes --key-file
cli.add_command(snapshot_cli.group(META_OPTION, friendly, console, out, target))

#: The commands of :mod:`._mounts`, made on first use (:class:`IrdmaCLI`): they import irdma.fs.
_LAZY = ("mount", "umount", "warmup")


def _lazy(name: str) -> Callable[[], click.Command]:
    def make() -> click.Command:
        from . import _mounts

        cmd: click.Command = getattr(_mounts, name)
        _add_key_file_option(name, cmd)
        return cmd

    return make


cli.lazy.update((name, _lazy(name)) for name in _LAZY)


def __getattr__(name: str) -> Any:
    """``mount``, ``umount``, ``warmup``: the commands, made on first use."""
    if name in _LAZY:
        command = cli.load(name)
        if command is not None:
            return command
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fstab_args(argv: list[str]) -> list[str] | None:
    """``irdma URL MOUNTPOINT [-o OPTIONS]``, as mount.fuse3 runs the program of an fstab line of
    type ``fuse.irdma``, as the arguments of `irdma mount` (:func:`irdma.ops.fstab.mount_args`),
    and ``irdma mount ... -o OPTIONS`` with the options as flags; None for any other command line.

    Raises:
        MountOptionError: an option irdma does not know.
    """
    if argv[:1] == ["mount"] and "-o" in argv[1:-1]:
        from ..fstab import mount_args

        rest, flags = [], []
        for i, arg in enumerate(argv):
            if arg == "-o" and i + 1 < len(argv):
                flags += mount_args("", "", argv[i + 1])[3:]
            elif i == 0 or argv[i - 1] != "-o":
                rest.append(arg)
        return rest + flags
    if len(argv) < 2 or ("://" not in argv[0] and not argv[0].endswith(".db")) or argv[0].startswith("-"):
        return None
    from ..fstab import mount_args

    options = [argv[i + 1] for i in range(2, len(argv) - 1) if argv[i] == "-o"]
    return mount_args(argv[0], argv[1], ",".join(options))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = fstab_args(argv) or argv
    except IrdmaError as exc:
        console.print(f"error: {escape(str(exc))}", highlight=False)
        sys.exit(1)
    cli.main(args=args, prog_name="irdma")
