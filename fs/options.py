"""The options of a mount, in one place (:class:`MountOptions`).

Four things take them and agree through this module: ``irdma mount``'s flags
(:mod:`irdma.ops.cli`, click), the mount process's command line (``python -m irdma.fs``:
:func:`add_arguments`, argparse), the ``-o`` names of an fstab line (:data:`FSTAB_OPTIONS`, read
by :mod:`irdma.ops.fstab`) and the keywords of :func:`irdma.fs.mount.serve_mount` and
:func:`irdma.fs.mount.spawn_mount` (which writes the process's command line with
:func:`process_argv`). Each option's flag is ``--`` and its name with ``-`` for ``_``; its
``-o`` name is its name.

The defaults are the mount process's: an ``irdma mount`` without the flag passes nothing and
the process uses these (``--transport`` and ``--timeout`` are always passed).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from irdma.client.native import DEFAULT_TIMEOUT
from irdma.xattrs import DEFAULT_SYNC_TIMEOUT

#: Seconds the kernel may cache a file's attributes (``irdma mount --attr-cache``'s default).
ATTR_TIMEOUT = 1.0
#: Seconds the kernel may cache a name's inode (``irdma mount --entry-cache``'s default). A mount
#: with a longer one raises the namespace's unlink grace to twice it before it serves
#: (:meth:`irdma.meta.base.MetaStore.raise_unlink_grace`): a name it cached stays openable.
ENTRY_TIMEOUT = 1.0


def _opt(default: Any, help: str, *, fstab: bool = True, seconds: bool = False) -> Any:
    """A field of :class:`MountOptions`: ``help`` (``{default}``: the default, as ``%g``),
    ``fstab``: whether an fstab line may give it, ``seconds``: a float the command line
    carries as ``repr(float(value))``."""
    return dataclasses.field(default=default, metadata={"help": help, "fstab": fstab, "seconds": seconds})


@dataclasses.dataclass(frozen=True)
class MountOptions:
    """What a mount process serves with (:func:`irdma.fs.mount.serve_mount`'s keywords but the
    read cache, which :func:`irdma.client.cache.make_cache` makes of ``cache_dir``,
    ``cache_size`` and ``cache_memory``). The fields are in the order of the process's command
    line."""

    transport: str = _opt("auto", "")
    timeout: float = _opt(DEFAULT_TIMEOUT, "Seconds each request to a shard and each metadata lock wait may take"
                          " (EIO or EBUSY after) [default: {default}].")
    direct_io: bool = _opt(False, "Direct I/O for every file (else per file: xattr user.irdma.io).")
    allow_other: bool = _opt(False, "Let every user use the mount; the kernel checks file modes.")
    sync_timeout: float = _opt(DEFAULT_SYNC_TIMEOUT, "Seconds a barrier or lock wait of MOUNTPOINT/.irdma may take"
                               " (ETIMEDOUT after) [default: {default}].", seconds=True)
    read_only: bool = _opt(False, "Refuse every change (EROFS); the kernel mounts it ro.")
    subdir: str | None = _opt(None, "Mount this directory of the namespace (/jobs/x) as the root.")
    attr_cache: float = _opt(ATTR_TIMEOUT, "Seconds the kernel caches attributes (0 to 3600) [default: {default}].",
                             seconds=True)
    entry_cache: float = _opt(ENTRY_TIMEOUT, "Seconds the kernel caches names (0 to 3600; unlinked files stay"
                              " openable twice as long) [default: {default}].", seconds=True)
    cache_dir: str | None = _opt(None, "Keep chunks read in this directory (the disk tier of the local read cache;"
                                 " docs/cache.md).")
    cache_size: str | None = _opt(None, "Bytes of the disk tier, such as 10G [default: 10GiB].")
    cache_memory: str | None = _opt(None, "Bytes of the memory tier [default: 256MiB with --cache-dir, else 0: off].")
    metrics: str | None = _opt(None, "Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: a free one);"
                               " `irdma stats` shows them.")
    debug: bool = _opt(False, "Log every request (debug level).", fstab=False)

    @classmethod
    def flag(cls, name: str) -> str:
        """The command-line flag of option ``name`` (``--attr-cache``)."""
        return "--" + name.replace("_", "-")

    @classmethod
    def help(cls, name: str) -> str:
        """The help text of option ``name``, its default filled in."""
        f = _FIELDS[name]
        default = f.default
        return str(f.metadata["help"]).format(default=f"{default:g}" if isinstance(default, float) else default)

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of option ``name``."""
        return _FIELDS[name].default

    def serve_kwargs(self) -> dict[str, Any]:
        """The keywords of :func:`irdma.fs.mount.serve_mount` but ``cache`` (the read cache is
        made of ``cache_dir``, ``cache_size`` and ``cache_memory``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _CACHE}


_FIELDS = {f.name: f for f in dataclasses.fields(MountOptions)}
_CACHE = ("cache_dir", "cache_size", "cache_memory")

#: ``irdma mount`` options that are no mount process's (the background process's log, the
#: cluster key file, mounting over a directory with entries), which an fstab line may give too.
LAUNCH_OPTIONS: tuple[str, ...] = ("nonempty", "log_file", "key_file")
_TAKES_VALUE = {"log_file": True, "key_file": True, "nonempty": False}

#: ``-o`` option of an fstab line -> (``irdma mount`` flag, whether it takes a value).
FSTAB_OPTIONS: dict[str, tuple[str, bool]] = {
    "ro": ("--read-only", False),
    **{f.name: (MountOptions.flag(f.name), f.type not in ("bool", bool)) for f in dataclasses.fields(MountOptions)
       if f.metadata["fstab"]},
    **{name: (MountOptions.flag(name), _TAKES_VALUE[name]) for name in LAUNCH_OPTIONS},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` (the mount process's) a flag for every field of :class:`MountOptions`,
    with its default."""
    for f in dataclasses.fields(MountOptions):
        flag, help_ = MountOptions.flag(f.name), MountOptions.help(f.name) or None
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=help_)
        else:
            kind: Callable[[str], Any] = float if f.type in ("float", float) else str
            parser.add_argument(flag, type=kind, default=f.default, help=help_)


def from_arguments(args: argparse.Namespace) -> MountOptions:
    """The options :func:`add_arguments`' flags parsed to."""
    return MountOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MountOptions)})


def process_argv(given: Mapping[str, Any]) -> list[str]:
    """The mount process's flags for the options ``given`` (a name of :class:`MountOptions`
    -> its value; None or False: not given, the process's default), in the fields' order."""
    argv: list[str] = []
    for f in dataclasses.fields(MountOptions):
        value = given.get(f.name)
        if value is None:
            continue
        flag = MountOptions.flag(f.name)
        if f.type in ("bool", bool):  # a flag: given when true (any truthy value, as the old lists had it)
            if value:
                argv.append(flag)
        else:
            argv += [flag, repr(float(value)) if f.metadata["seconds"] else str(value)]
    return argv
