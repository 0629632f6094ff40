"""``irdma format`` (a namespace and its key by hand), ``irdma key`` (rotation, the security level)
and ``irdma dump`` / ``irdma load`` (the metadata's backup and migration)."""

from __future__ import annotations

import contextlib
import os

import click

from ..._errors import InvalidArgument
from .. import cluster as _cluster
from ._common import META_OPTION, console, friendly


@click.command("format")
@click.argument("url", required=False)
@META_OPTION
@click.option("--replicas", "-r", type=click.IntRange(1, 8), default=None,
              help="Copies of each chunk of new files [default: 2 once there are 2 shards or more, else 1].")
@friendly
def format_(url: str | None, meta_url: str, replicas: int | None) -> None:
    """Make an empty namespace by hand in the database at URL (a new SQLite file, or an empty
    PostgreSQL database: postgresql://USER@HOST:PORT/DB) and the cluster key file.

    The key goes to --key-file / $IRDMA_KEY_FILE (required for PostgreSQL: copy it, mode 0600,
    to every host), else cluster.key beside a SQLite file. An existing key file is kept. Then on
    each host: `irdma server --listen ADDR --meta URL --data-dir DIR --key-file K`, and
    `irdma mount URL MNT --key-file K`.
    """

    from ..._errors import Exists, NotFound
    from ...meta import meta_path, meta_scheme, open_meta
    from ...wire.auth import KEY_FILE_ENV, KEY_FILE_NAME, create_key_file, read_key_file

    meta_url = url or meta_url
    key_file = os.environ.get(KEY_FILE_ENV)
    if meta_scheme(meta_url) == "sqlite":
        path = meta_path(meta_url)
        if os.path.exists(path):
            raise Exists(f"a namespace already exists at {path}", "use it, or pick another URL")
        key_file = key_file or os.path.join(os.path.dirname(path), KEY_FILE_NAME)
        meta_url = f"sqlite://{path}"
    else:
        if not key_file:
            raise InvalidArgument("where should the cluster key go? a PostgreSQL namespace has no directory of its own",
                                  "pass --key-file PATH (or set IRDMA_KEY_FILE), then copy that file to every host")
        try:
            with contextlib.closing(open_meta(meta_url)):
                pass
        except (InvalidArgument, NotFound):
            pass  # an empty database: what format is for
        else:
            raise Exists("the database already holds an irdma namespace", "use it, or pick another database")
    ring = read_key_file(key_file) if os.path.exists(key_file) else create_key_file(key_file)
    with contextlib.closing(open_meta(meta_url, create=True)) as meta:
        meta.set_replicas(replicas or 2)
        shown = meta.url
    console.print(f"namespace {shown}; cluster key {key_file} (cluster {ring.cluster_hex}): start shards"
                  f" with `irdma server --listen HOST:PORT --meta URL --data-dir DIR --key-file {key_file}`",
                  highlight=False, soft_wrap=True)


# ---------------------------------------------------------------- metadata backup and migration
_PROGRESS_OPTION = click.option("--progress/--no-progress", default=None,
                                help="Progress bars on standard error [default: when it is a terminal].")
_QUIET_OPTION = click.option("--quiet", "-q", is_flag=True, help="No progress and no summary line.")


@click.command("dump")
@click.argument("meta_url")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@_PROGRESS_OPTION
@_QUIET_OPTION
@friendly
def dump_cmd(meta_url: str, file: str, progress: bool | None, quiet: bool) -> None:
    """Back up the metadata at META_URL to FILE (JSON; - for standard output; .gz: gzipped).

    One consistent snapshot of every persistent table (namespace, xattrs, symlinks, chunk
    maps, shard map, settings, job coordination state, id counters), streamed; writers may go
    on. Not in a dump: the shards' bytes, the cluster key file, sessions. Restore or migrate
    with `irdma load URL FILE` (SQLite <-> PostgreSQL either way).
    """
    from ..dumpload import dump_file

    dump_file(meta_url, file, progress=progress, quiet=quiet, console=console)


@click.command("load")
@click.argument("meta_url")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@_PROGRESS_OPTION
@_QUIET_OPTION
@friendly
def load_cmd(meta_url: str, file: str, progress: bool | None, quiet: bool) -> None:
    """Restore the metadata `irdma dump` wrote to FILE (- for standard input) into META_URL.

    META_URL must hold no namespace yet: a new SQLite file (made here), an empty PostgreSQL
    database, or a namespace `irdma format` just made; anything else is refused, unchanged.
    The load is one transaction: on any error nothing is changed. Then start the shards on
    their data directories with --meta META_URL and the cluster's key file.
    """
    from ..dumpload import load_file

    load_file(meta_url, file, progress=progress, quiet=quiet, console=console)



@click.group()
def key() -> None:
    """The cluster key: every connection to a shard proves it (see SECURITY.md)."""


@key.command("rotate")
@click.option("--dir", "cluster_dir", default=None, type=click.Path(file_okay=False),
              help="The local cluster whose key to rotate (its cluster.key). [default: $IRDMA_KEY_FILE]")
@click.option("--finish", is_flag=True, help="Stop accepting the previous key (once every process has the new one).")
@friendly
def key_rotate(cluster_dir: str | None, finish: bool) -> None:
    """Put a new key in the key file without stopping anything.

    Shards and clients read the file again when it changes: new connections prove the new key,
    shards still accept the previous one (and open connections keep their session keys) until
    `irdma key rotate --finish`. A key file on several hosts must be copied to each of them.
    """
    from ...wire.auth import KEY_FILE_ENV, rotate_key_file

    path = os.environ.get(KEY_FILE_ENV) if cluster_dir is None else _cluster.key_file_of(cluster_dir)
    if not path:
        raise InvalidArgument("which key file? pass --dir D of the cluster, or --key-file / IRDMA_KEY_FILE")
    ring = rotate_key_file(path, drop_old=finish)
    if finish:
        console.print(f"{path}: only the current key is accepted now (cluster {ring.cluster_hex})", highlight=False)
    else:
        console.print(f"{path}: new key in use; the previous one is still accepted until"
                      f" `irdma key rotate --finish` (cluster {ring.cluster_hex})", highlight=False)


@key.command("security")
@click.argument("level", type=click.Choice(["integrity", "auth"]), required=False)
@click.option("--dir", "cluster_dir", default=None, type=click.Path(file_okay=False),
              help="The local cluster whose key file to change (its cluster.key). [default: $IRDMA_KEY_FILE]")
@friendly
def key_security(level: str | None, cluster_dir: str | None) -> None:
    """Show or set the cluster's security level (kept in the key file, so every shard and
    client that reads it agrees; a shard and a client at different levels refuse each other).

    integrity (the default): every byte of every frame is authenticated (GMAC). auth: the
    headers and control fields are, tensor payloads are not (faster; for trusted fabrics).
    Connections opened after the change use the new level; open ones keep theirs (remount and
    restart clients to move them). See SECURITY.md.
    """
    from ...wire.auth import KEY_FILE_ENV, read_key_file, set_security

    path = os.environ.get(KEY_FILE_ENV) if cluster_dir is None else _cluster.key_file_of(cluster_dir)
    if not path:
        raise InvalidArgument("which key file? pass --dir D of the cluster, or --key-file / IRDMA_KEY_FILE")
    ring = set_security(path, level) if level is not None else read_key_file(path)
    console.print(f"{path}: security level {ring.security}" + (" (new connections use it)" if level else ""),
                  highlight=False)
