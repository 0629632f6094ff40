"""``mount -t fuse.irdma`` and ``/etc/fstab``: mount options as ``irdma mount`` arguments.

mount(8) runs an external helper for a filesystem type that has one ("External helpers" in
mount(8)): for type ``fuse.irdma`` it runs ``/sbin/mount.fuse.irdma SOURCE MOUNTPOINT
[-sfnv] [-N NS] -o OPTIONS [-t fuse.irdma]``, where OPTIONS are the fstab line's fourth field
(or ``mount -o``) with ``rw``/``ro`` first and mount(8)'s ``noauto`` removed. The console
script ``mount.fuse.irdma`` (:func:`helper_main`) turns that into ``irdma mount SOURCE
MOUNTPOINT --option ...`` and runs it: the same checks, the same background mount process, and
it returns once the mount answers, as mount(8) expects. Without the helper, fuse3's
``mount.fuse3`` runs the program ``irdma SOURCE MOUNTPOINT -o OPTIONS`` instead, which
:func:`irdma.ops.cli.fstab_args` maps the same way.

Options (:data:`OPTIONS`, which is :data:`irdma.fs.options.FSTAB_OPTIONS`): every ``irdma
mount`` option by its name with ``_`` for ``-`` (``subdir=/jobs/x``, ``attr_cache=5``,
``entry_cache=5``, ``transport=tcp``, ``log_file=``, ``key_file=``, ``timeout=``, ``sync_timeout=``, ``metrics=``, ``allow_other``, ``nonempty``,
``direct_io``, ``read_only``, ``cache_dir=``, ``cache_size=``, ``cache_memory=``), plus ``ro`` (``--read-only``) and ``rw``. mount(8)'s own options
(``defaults``, ``auto``, ``noauto``, ``user``, ``nouser``, ``users``, ``owner``, ``group``,
``_netdev``, ``nofail``, ``comment=``, ``x-*``) are its business and are ignored here, as are
``nosuid``, ``nodev`` (every irdma mount is both), ``suid``, ``dev`` (mount.fuse3 adds them) and
``exec``. Anything else is an error (:class:`MountOptionError`) unless ``-s`` (sloppy) was given.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from irdma.fs.options import FSTAB_OPTIONS

from .._errors import InvalidArgument

#: ``-o`` option -> ``irdma mount`` flag; True after it: the option takes a value (``name=value``).
#: The mount's options (:class:`irdma.fs.options.MountOptions`), the ``irdma mount`` options of
#: no mount process (``nonempty``, ``log_file``, ``key_file``), and ``ro``.
OPTIONS: dict[str, tuple[str, bool]] = FSTAB_OPTIONS
#: Options that mount(8) consumes, and the device and set-user-ID flags: every irdma mount is
#: nosuid,nodev (libfuse's default), and mount.fuse3 adds ``dev,suid`` to what it passes on.
IGNORED = frozenset({"rw", "defaults", "auto", "noauto", "user", "nouser", "users", "owner", "group", "_netdev",
                     "nofail", "comment", "nosuid", "nodev", "suid", "dev", "exec",
                     # the kernel's access-time and write flags: a FUSE mount of irdma keeps its own
                     "noatime", "relatime", "strictatime", "atime", "nodiratime", "lazytime", "nolazytime",
                     "noexec", "sync", "async", "dirsync"})

#: mount(8)'s exit status for a bad invocation, and for a mount that failed ("RETURN CODES").
EXIT_USAGE, EXIT_FAILURE = 1, 32


class MountOptionError(InvalidArgument):
    """A ``-o`` option that irdma does not know, or one without the value it needs."""


def mount_args(source: str, mountpoint: str, options: str, *, sloppy: bool = False) -> list[str]:
    """The arguments of ``irdma mount`` for ``SOURCE MOUNTPOINT -o OPTIONS`` (comma-separated,
    in the order given; see the module's docstring for the names).

    Raises:
        MountOptionError: an unknown option (unless ``sloppy``), a flag given a value, or a
            value option without one.
    """
    args = ["mount", source, mountpoint]
    for opt in filter(None, options.split(",")):
        name, eq, value = opt.partition("=")
        key = name.replace("-", "_")
        if key in IGNORED or name.startswith("x-"):
            continue
        flag = OPTIONS.get(key)
        if flag is None:
            if sloppy:
                continue
            raise MountOptionError(
                f"unknown mount option {opt!r} for fuse.irdma",
                "remove it; irdma takes " + ", ".join(sorted(OPTIONS)) + " and ignores those of mount itself:"
                " _netdev, noauto, nofail, defaults, user, x-*")
        if flag[1] and not value:
            raise MountOptionError(f"mount option {name} needs a value", f"write it as {name}=VALUE")
        if not flag[1] and eq:
            raise MountOptionError(f"mount option {name} takes no value (got {opt!r})", f"write it as {name}")
        args += [flag[0], value] if flag[1] else [flag[0]]
    return args


def helper_main(argv: list[str] | None = None) -> None:
    """``mount.fuse.irdma SOURCE MOUNTPOINT [-sfnv] [-N NS] [-o OPTIONS] [-t TYPE]``: the
    mount(8) helper of type ``fuse.irdma`` (see the module's docstring). ``-f`` (fake) checks
    the options and mounts nothing; ``-n``, ``-v`` and ``-t`` are accepted; ``-N`` (another
    mount namespace) is refused. Exits 0 once the mount answers, 1 for bad arguments, 32 when
    the mount failed (mount(8)'s codes)."""
    argv = sys.argv[1:] if argv is None else argv
    prog = "mount.fuse.irdma"
    positional: list[str] = []
    options: list[str] = []
    flags = ""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-o", "-t", "-N") and i + 1 < len(argv):
            if arg == "-N":
                _fail(prog, "mounting in another namespace (-N) is not supported",
                      "run mount(8) inside that namespace instead")
            if arg == "-o":
                options.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("-o") and len(arg) > 2:
            options.append(arg[2:])
        elif arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= set("sfnvrw"):
            flags += arg[1:]
        elif arg.startswith("-"):
            _fail(prog, f"unknown argument {arg!r}", f"usage: {prog} SOURCE MOUNTPOINT [-o OPTIONS]")
        else:
            positional.append(arg)
        i += 1
    if len(positional) != 2:
        _fail(prog, f"expected SOURCE and MOUNTPOINT, got {len(positional)} argument(s)",
              f"usage: {prog} SOURCE MOUNTPOINT [-o OPTIONS] (the way mount -t fuse.irdma runs it)")
    if "r" in flags:
        options.append("ro")
    try:
        args = mount_args(positional[0], positional[1], ",".join(options), sloppy="s" in flags)
    except MountOptionError as exc:
        _fail(prog, str(exc))
    if "f" in flags:  # mount -f: check everything, change nothing
        return
    # mount(8) runs helpers with a bare environment; the mount process may need fusermount3
    os.environ.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    from .cli import main

    try:
        main(args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            sys.exit(EXIT_FAILURE)
        raise


def _fail(prog: str, message: str, hint: str = "") -> NoReturn:
    print(f"{prog}: {message}" + (f" ({hint})" if hint else ""), file=sys.stderr)
    sys.exit(EXIT_USAGE)
