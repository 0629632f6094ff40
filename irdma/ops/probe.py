"""Whether irdma shards answer, and free ports to start them on (``irdma up``, ``irdma shard
add``, the test bed).

A shard answers when the handshake of :mod:`irdma.wire.auth` completes (HELLO, then AUTH with
the cluster key when there is one): a listening socket of something else, or a shard of
another cluster, does not. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Sequence

import trio

from .._concurrency import open_nursery
from .._errors import ShardUnavailable
from .._proc import pid_alive
from ..transport import make_transport
from ..wire.auth import KeyRing

#: Seconds ``up`` waits for the handshake of a shard it did not start.
HANDSHAKE_TIMEOUT = 3.0


def _free_port(host: str) -> int:
    return _free_ports(host, 1)[0]


def _free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` now: the sockets stay bound until all are chosen,
    so the kernel cannot hand the same ephemeral port out twice (it did, one CI run in ~40)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


async def wait_for_shard(address: str, transport: str, deadline: float, pid: int | None = None,
                         key: KeyRing | None = None) -> None:
    """Wait until the shard at ``address`` answers the handshake, or raise at ``deadline``.

    Args:
        pid: the shard's process, if it is ours: stop waiting as soon as it exits.

    Raises:
        ShardUnavailable: no answer by ``deadline``, or the process ``pid`` exited.
    """
    tr = make_transport(transport)
    last: Exception | None = None
    while time.monotonic() < deadline:
        if pid is not None and not pid_alive(pid):
            raise ShardUnavailable(f"the shard process (pid {pid}) exited")
        try:
            with trio.move_on_at(trio.current_time() + deadline - time.monotonic()):
                async with open_nursery() as nursery:
                    conn = await tr.connect(address, nursery, client_name="irdma up", key=key)
                    await conn.aclose()
                return
        except ShardUnavailable as exc:
            last = exc
            await trio.sleep(0.05)
    raise ShardUnavailable(f"shard at {address} did not answer in time: {last}")


async def check_shard(address: str, timeout: float, *, key: KeyRing | None = None) -> None:
    """Check that an irdma shard answers the handshake at ``address`` within ``timeout`` seconds.

    One try: a refused connection fails at once, an address that does not answer (a firewall,
    a host that is down, a service that is not irdma) after ``timeout``.

    Raises:
        ShardUnavailable: no irdma shard answered; the message says why.
    """
    tr = make_transport("tcp")
    with trio.move_on_after(timeout) as scope:
        async with open_nursery() as nursery:
            conn = await tr.connect(address, nursery, client_name="irdma shard add", key=key)
            await conn.aclose()
    if scope.cancelled_caught:
        raise ShardUnavailable(f"no answer from {address} in {timeout:g} s")


async def _answering(addresses: Sequence[str], key: KeyRing | None,
                     timeout: float = HANDSHAKE_TIMEOUT) -> set[str]:
    """The addresses at which an irdma shard answers the handshake (all tried at once)."""
    ok: set[str] = set()

    async def one(address: str) -> None:
        with contextlib.suppress(ShardUnavailable):
            await check_shard(address, timeout, key=key)
            ok.add(address)

    async with open_nursery() as nursery:
        for address in addresses:
            nursery.start_soon(one, address)
    return ok
