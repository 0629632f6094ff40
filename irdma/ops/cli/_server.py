"""``irdma server``: one shard process. The options are checked and the shard registered
here; :func:`irdma.server.assemble.assemble_shard` puts the process together."""

from __future__ import annotations

import errno
import logging
import socket

import click

from ..._errors import InvalidArgument, IrdmaError
from ...transport import TRANSPORTS
from .. import cluster as _cluster
from ._common import METRICS_OPTION, _leaf, _size, friendly


@click.command()
@click.option("--listen", default="127.0.0.1:7700", show_default=True, help="HOST:PORT to serve (port 0 picks one).")
@click.option("--capacity", default=None, callback=lambda ctx, p, v: None if v is None else _size(ctx, p, v),
              help="Size of the memory region [default: 2GiB; with --data-dir, the directory's own].")
@click.option("--shard-id", type=click.IntRange(0), default=None,
              help="This shard's id in the shard map [default: the one --meta registers, else the one its --data-dir"
              " holds; a shard with none is an unregistered shard, id 0 in its replies].")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True)
@click.option("--port-file", type=click.Path(dir_okay=False), help="Write the bound HOST:PORT here when ready.")
@click.option("--key-file", envvar="IRDMA_KEY_FILE", type=click.Path(dir_okay=False), default=None,
              help="The cluster's key file (0600): every connection must prove this key. [env: IRDMA_KEY_FILE]")
@click.option("--no-auth", is_flag=True, help="Serve anyone who connects, without a key (a trusted test bed only).")
@click.option("--max-connections", type=click.IntRange(1), default=4096, show_default=True,
              help="Most connections served at once.")
@click.option("--max-connections-per-peer", type=click.IntRange(1), default=1024, show_default=True,
              help="Most connections served at once from one peer address.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Keep the shard's chunks in this directory (memory-mapped files): a restart on it keeps them.")
@click.option("--durability", type=click.Choice(["fsync", "memory"]), default="fsync", show_default=True,
              help="With --data-dir: fsync/close wait for the disk (fsync), or only for the page cache (memory).")
@click.option("--meta", "meta_url", default=None,
              help="Register in this namespace's shard map (sqlite:// or postgresql:// URL): a new shard joins,"
              " a restarted one keeps its id (the one in --data-dir, or the one registered at its address).")
@click.option("--advertise", default=None,
              help="HOST:PORT clients reach this shard at, registered with --meta [default: --listen].")
@METRICS_OPTION
@friendly
def server(listen: str, capacity: int | None, shard_id: int | None, transport: str, port_file: str | None,
           key_file: str | None, no_auth: bool, max_connections: int, max_connections_per_peer: int,
           data_dir: str | None, durability: str, meta_url: str | None, advertise: str | None,
           metrics_addr: str | None = None) -> None:
    """Run one shard server in the foreground until SIGTERM or Ctrl-C.

    Every connection must prove the cluster key (--key-file; `irdma up` and `irdma format`
    make one) before any data op; --no-auth serves anyone, for a trusted test bed only.
    With --meta the shard registers itself (the same command on any host:
    `irdma server --listen ADDR --meta URL --data-dir DIR --key-file K`).
    """
    from irdma.server.assemble import assemble_shard
    from irdma.server.shard import PAGE
    from irdma.wire.auth import KeySource

    from ...transport import parse_address

    logging.getLogger("irdma").setLevel(min(logging.getLogger().level, logging.INFO))
    try:
        host, port = parse_address(listen)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    if capacity is not None and capacity < PAGE:
        raise click.BadParameter(f"capacity must be at least {PAGE} bytes", param_hint="--capacity")
    if capacity is not None:
        capacity -= capacity % PAGE
    if key_file is None and not no_auth:
        raise InvalidArgument("a shard needs the cluster's key file, so that only key holders get in",
                              "pass --key-file PATH (`irdma format` or `irdma up` makes one), or --no-auth on a"
                              " trusted test bed")
    if key_file is not None and no_auth:
        raise click.BadParameter("--no-auth and --key-file exclude each other", param_hint="--no-auth")
    from ...metrics import parse_metrics_address, shard_address

    if metrics_addr:
        parse_metrics_address(metrics_addr)  # a bad address fails before anything is registered
    keys = KeySource(key_file) if key_file is not None else None
    ring = keys.ring() if keys is not None else None
    sock = None
    if meta_url is not None:
        # listen first, then register: a client that finds the address in the shard map early
        # waits in the backlog instead of being refused (and marking the shard down)
        sock = _bind(listen)
        try:
            shard_id = _register_self(meta_url, advertise or listen, data_dir)
        except BaseException:
            sock.close()
            raise
    elif advertise is not None:
        raise click.BadParameter("--advertise is the address registered with --meta: pass --meta too",
                                 param_hint="--advertise")
    elif shard_id is None and data_dir is not None:
        from irdma.server.store import stored_shard_id

        shard_id = stored_shard_id(data_dir)
    name = None
    if shard_id is None:  # started by hand: `irdma shard add` registers it under the id the map gives
        shard_id, name = 0, "unregistered shard"
    metrics_addr = shard_address(metrics_addr, shard_id)  # also `irdma up --metrics` (its environment)
    from ..._proc import keep_freed_buffers

    keep_freed_buffers()
    process = assemble_shard(shard_id, capacity, data_dir=data_dir, durability=durability,
                             cluster=ring.cluster_hex if ring else None, transport=transport, name=name)
    with process:
        try:
            process.serve(host, port, keys=keys, port_file=port_file, max_connections=max_connections,
                          max_per_peer=max_connections_per_peer, metrics=metrics_addr, sock=sock)
        except Exception as exc:
            err = _listen_error(_leaf(exc), listen)
            if err is None:
                raise
            raise err from exc


def _bind(listen: str) -> socket.socket:
    """A stdlib socket bound to ``listen`` and listening; errors as the CLI's one line."""
    from ...transport import parse_address

    host, port = parse_address(listen)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        err = _listen_error(exc, listen)
        if err is None:
            raise
        raise err from None
    return sock


def _register_self(meta_url: str, address: str, data_dir: str | None) -> int:
    """`irdma server --meta`: check the address clients will use, then register (see
    :func:`irdma.ops.cluster.register_self`); returns the shard id."""
    from ...transport import parse_address

    try:
        host, port = parse_address(address)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--advertise") from None
    if port == 0 or host in ("0.0.0.0", "::", ""):
        raise click.BadParameter(f"{address} is no address a client can reach: with --meta, listen on a fixed port"
                                 " of one address, or pass --advertise HOST:PORT", param_hint="--listen")
    sid = _cluster.register_self(meta_url, address, data_dir)
    logging.getLogger("irdma.server").info("shard %d at %s: registered in the shard map", sid, address)
    return sid


def _listen_error(exc: BaseException, listen: str) -> IrdmaError | None:
    """An error of binding ``listen`` as an :class:`IrdmaError` that names the address, else None."""
    port = listen.rpartition(":")[2]
    if isinstance(exc, socket.gaierror):
        return InvalidArgument(f"cannot listen on {listen}: {exc.strerror}", "pass --listen HOST:PORT with a HOST"
                               " of this machine, such as 127.0.0.1")
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return IrdmaError(f"cannot listen on {listen}: the address is already in use",
                          f"pick another port, 0 for a free one, or stop what listens there:"
                          f" `ss -ltnp 'sport = :{port}'` names it")
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
        return IrdmaError(f"cannot listen on {listen}: {exc.strerror}",
                          "pass --listen an address of this machine, and a port above 1023 unless root")
    return None
