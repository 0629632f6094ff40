"""``mount -t fuse.irdma`` and ``/etc/fstab``: mount options as ``irdma mount`` arguments.

mount(8) runs an external helper for a filesystem type that has one ("External helpers" in
mount(8)): for type ``fuse.irdma`` it runs ``/sbin/mount.fuse.irdma SOURCE MOUNTPOINT
[-sfnv] [-N NS] -o OPTIONS [-t fuse.irdma]``, where OPTIONS are the fstab line's fourth field
(or ``mount -o``) with ``rw``/``ro`` first and mount(8)'s ``noauto`` removed. The console
script ``mount.fuse.irdma`` (:func:`irdma.ops.cli.mount_helper.helper_main`) turns that into ``irdma mount SOURCE
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
