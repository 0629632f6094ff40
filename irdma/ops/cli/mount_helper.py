"""``mount.fuse.irdma``: the mount(8) helper of type ``fuse.irdma`` (:mod:`irdma.ops.fstab` maps its
options to `irdma mount` arguments; this runs them)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from ..fstab import EXIT_FAILURE, EXIT_USAGE, MountOptionError, mount_args
from . import main


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
    try:
        main(args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            sys.exit(EXIT_FAILURE)
        raise


def _fail(prog: str, message: str, hint: str = "") -> NoReturn:
    print(f"{prog}: {message}" + (f" ({hint})" if hint else ""), file=sys.stderr)
    sys.exit(EXIT_USAGE)
