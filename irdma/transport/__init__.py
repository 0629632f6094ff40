"""Transports: how a client reaches shards. Chosen by name, like ps-lite's ``Van::Create``."""

from __future__ import annotations

import logging

from irdma._errors import TransportUnavailable

from ..units import parse_address
from .base import ShardConnection, ShardInfo, Transport
from .tcp import TcpTransport

log = logging.getLogger("irdma.transport")

TRANSPORTS = ("auto", "tcp", "verbs")


def verbs_status() -> tuple[bool, str]:
    """Whether RDMA verbs can run here, and why (or why not)."""
    try:
        from . import verbs
    except ImportError as exc:  # pragma: no cover - depends on the machine
        return False, f"pyverbs is not importable ({exc}): apt-get install python3-pyverbs"
    return verbs.device_status()


def make_transport(name: str) -> Transport:
    """The transport called ``name``: ``tcp``, ``verbs`` or ``auto``.

    ``auto`` picks verbs when a usable RDMA device is present, TCP otherwise, and logs which
    it picked and why at DEBUG on the ``irdma.transport`` logger (a library prints nothing by
    default; ``logging.getLogger("irdma.transport").setLevel(logging.DEBUG)`` with a handler,
    or ``irdma -vv COMMAND``, shows it; a mount's log names its transport at INFO).

    Raises:
        ValueError: an unknown name.
        TransportUnavailable: ``verbs`` where verbs cannot run (the message says why and how
            to fix it).
    """
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}: use one of {', '.join(TRANSPORTS)}")
    if name == "tcp":
        return TcpTransport()
    ok, why = verbs_status()
    if name == "auto":
        log.debug("transport auto: picked %s (%s)", "verbs" if ok else "tcp", why)
        if not ok:
            return TcpTransport()
    if not ok:
        raise TransportUnavailable(f"RDMA verbs transport unavailable: {why}", "use --transport tcp")
    from .verbs import VerbsTransport

    return VerbsTransport()


__all__ = ["Transport", "ShardConnection", "ShardInfo", "TcpTransport", "make_transport", "parse_address", "TRANSPORTS"]
