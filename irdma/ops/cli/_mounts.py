"""``irdma mount`` (its options: :class:`irdma.fs.options.MountOptions`), ``irdma umount``,
``irdma warmup``, and the fstab command lines mount.fuse3 runs (:func:`fstab_args`)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import click
import trio

from irdma.fs.options import MountOptions

from ..._errors import IrdmaError
from ...transport import TRANSPORTS
from ...units import format_size
from .. import cluster as _cluster
from ._common import _size, console, friendly


def _cache_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    from irdma.fs.mount import check_cache_seconds

    try:
        return None if value is None else check_cache_seconds((param.name or "").replace("_", " "), value)
    except IrdmaError as exc:
        raise click.BadParameter(str(exc)) from None


_F = TypeVar("_F", bound=Callable[..., Any])


def _option(name: str, *decls: str, **kwargs: Any) -> Callable[[_F], _F]:
    """The click option of mount option ``name``: its flag and help are
    :class:`~irdma.fs.options.MountOptions`' (the defaults, the mount process's, in the help)."""
    return click.option(MountOptions.flag(name), *decls, help=MountOptions.help(name) or None, **kwargs)


def _size_text(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return value if value is None else str(_size(ctx, param, value))


@click.command()
@click.argument("meta_url")
@click.argument("mountpoint", type=click.Path(file_okay=False))
@_option("transport", type=click.Choice(TRANSPORTS), default=MountOptions.default("transport"), show_default=True)
@click.option("--foreground", "-f", is_flag=True, help="Serve in this process until unmounted.")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Log of the background mount process.")
@_option("direct_io", is_flag=True)
@_option("allow_other", is_flag=True)
@click.option("--nonempty", is_flag=True, help="Mount over a directory that holds files (hidden until unmounted).")
@_option("timeout", type=click.FloatRange(min=0, min_open=True), default=None)
@_option("sync_timeout", type=click.FloatRange(min=0, min_open=True, max=86400), default=None)
@_option("read_only", is_flag=True)
@_option("subdir", metavar="PATH")
@_option("attr_cache", type=float, callback=_cache_seconds, metavar="SECONDS")
@_option("entry_cache", type=float, callback=_cache_seconds, metavar="SECONDS")
@_option("metrics", "metrics_addr", default=None, metavar="HOST:PORT")
@_option("cache_dir", type=click.Path(file_okay=False), default=None)
@_option("cache_size", default=None, callback=_size_text)
@_option("cache_memory", default=None, callback=_size_text)
@friendly
def mount(meta_url: str, mountpoint: str, transport: str, foreground: bool, log_file: str | None,
          direct_io: bool, allow_other: bool, timeout: float | None, metrics_addr: str | None = None,
          nonempty: bool = False, sync_timeout: float | None = None,
          cache_dir: str | None = None, cache_size: str | None = None, cache_memory: str | None = None,
          **view: Any) -> None:
    """Mount the namespace at META_URL on MOUNTPOINT with FUSE (sqlite:///PATH/meta.db, or
    postgresql://USER@HOST:PORT/DB with the password in ~/.pgpass or $PGPASSFILE, never in the URL:
    it would show in `ps`). `-o ro,subdir=/x,...` takes an fstab line's options (docs/deploy.md)."""
    from irdma.fs.mount import check_mountpoint, resolve_subdir, serve_mount, spawn_mount

    from ...meta import meta_path, meta_scheme, open_meta

    meta = open_meta(meta_url)  # fail here, clearly, if there is no namespace
    shown = meta.url
    try:
        if view["subdir"] is not None:
            resolve_subdir(meta, view["subdir"])  # --read-only, --subdir, --attr-cache, --entry-cache
    finally:
        meta.close()
    view = {k: v for k, v in view.items() if v is not None}
    extra: dict[str, Any] = {} if timeout is None else {"request_timeout": timeout}
    extra.update({} if sync_timeout is None else {"sync_timeout": sync_timeout})
    caching: dict[str, Any] = {"cache_dir": cache_dir, "cache_size": cache_size, "cache_memory": cache_memory}
    if foreground:
        logging.getLogger("irdma").setLevel(logging.INFO)
        from ...client.cache import make_cache

        cache = make_cache(cache_dir, cache_size, cache_memory)
        given = {"transport": transport, "direct_io": direct_io, "allow_other": allow_other, "metrics": metrics_addr,
                 "timeout": timeout, "sync_timeout": sync_timeout, **view}
        opts = MountOptions(**{k: v for k, v in given.items() if v is not None})  # the rest: the defaults
        trio.run(functools.partial(serve_mount, meta_url, check_mountpoint(mountpoint, nonempty=nonempty),
                                   **opts.serve_kwargs(), cache=cache))
        return
    name = f"mount-{os.path.basename(os.path.abspath(mountpoint))}.log"
    if log_file is None and meta_scheme(meta_url) == "sqlite":
        log_file = os.path.join(os.path.dirname(meta_path(meta_url)), name)
    elif log_file is None:
        os.makedirs(_cluster.default_dir(), mode=0o700, exist_ok=True)
        log_file = os.path.join(_cluster.default_dir(), name)
    with console.status(f"mounting {shown} on {mountpoint}"):
        pid = spawn_mount(meta_url, mountpoint, transport=transport, log_file=log_file, direct_io=direct_io,
                          allow_other=allow_other, metrics=metrics_addr, nonempty=nonempty, **extra, **view,
                          **caching)
    console.print(f"mounted on {os.path.abspath(mountpoint)} (pid {pid}, log {log_file}); `irdma umount {mountpoint}` to stop.",
                  highlight=False, soft_wrap=True)


@click.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--threads", "-p", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Files read at once.")
@click.option("--meta", "meta_url", default=None,
              help="PATHS are namespace paths of this metadata URL (else paths on a mount); needs --cache-dir.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="With --meta: the disk cache to fill (a mount with the same --cache-dir uses it).")
@click.option("--cache-size", default=None, callback=lambda c, p, v: v if v is None else str(_size(c, p, v)),
              help="With --meta: bytes of that disk cache [default: 10GiB].")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@friendly
def warmup(paths: tuple[str, ...], threads: int, meta_url: str | None, cache_dir: str | None,
           cache_size: str | None, transport: str) -> None:
    """Fill the local read cache with files, ahead of their reads (as `juicefs warmup`): PATHS on
    a mount started with --cache-dir or --cache-memory, or namespace PATHS with --meta URL
    --cache-dir DIR. Directories are read whole. See docs/cache.md."""
    from .. import warmup as W
    from ..progress import transfer_progress

    if (meta_url is None) != (cache_dir is None):
        raise click.UsageError("--meta and --cache-dir go together (namespace paths into a disk cache);"
                               " without them PATHS are on a mount")
    done = [0, 0]
    totals: list[int | None] = [None, None]
    with transfer_progress("warmup", unit="files", console=console) as step:

        def tick(n: int, files: int) -> None:
            done[0] += n
            done[1] += files
            step(done[0], totals[0], done[1], totals[1])

        def sized(total_bytes: int, total_files: int) -> None:
            totals[:] = [total_bytes, total_files]
            step(0, total_bytes, 0, total_files)

        if meta_url is None:
            files = W.mount_files(paths)
            sized(sum(size for _, size in files), len(files))
            result = W.warm_mount(files, threads, tick)
        else:
            assert cache_dir is not None
            result = trio.run(W.warm_namespace, meta_url, paths, cache_dir, cache_size, threads, transport, tick, sized)
    rate = result.bytes / result.seconds if result.seconds > 0 else 0.0
    console.print(f"warmed {result.files} files, {format_size(result.bytes)} in {result.seconds:.1f} s"
                  f" ({format_size(rate)}/s)", highlight=False)


@click.command()
@click.argument("mountpoint", type=click.Path(file_okay=False))
@friendly
def umount(mountpoint: str) -> None:
    """Unmount an irdma mount (waits for its writes to be on the shards); cleans a dead one."""
    from irdma.fs.mount import MountState, unmount

    was = unmount(mountpoint)
    if was is MountState.LIVE:
        console.print(f"unmounted {os.path.abspath(mountpoint)}", highlight=False, soft_wrap=True)
    else:
        why = "its process had exited" if was is MountState.DEAD else "its process did not answer"
        console.print(f"cleaned the {was.value} mount on {os.path.abspath(mountpoint)} ({why}); writes it had not"
                      " flushed are lost. Mount it again with `irdma mount`.", highlight=False, soft_wrap=True)
