"""An opened RDMA device and the memory regions registered with it (verbs transport, shard).

:class:`VerbsDevice` opens a device (context, protection domain, port 1, its RoCE v2 or
InfiniBand GID) and registers memory regions after checking the memlock limit; the error of
each failure names its inputs and the fix. :func:`device_status` says whether a device is
usable here; :func:`view_of` is a memory region's bytes. Used by the client connection
(:mod:`irdma.transport.verbs`) and the verbs shard (:mod:`irdma.server.verbs`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource

from irdma._errors import TransportUnavailable

from ._pyverbs import MR, PD, Context, PyverbsError, PyverbsRDMAError, e, get_device_list

REMOTE_ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
LOCAL_ACCESS = e.IBV_ACCESS_LOCAL_WRITE  # memory no peer may reach (a shard's own registration)


def _fix(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


def device_status(name: str | None = None) -> tuple[bool, str]:
    """Whether an RDMA device is usable here, and which (or why not)."""
    try:
        devs = get_device_list()
    except (PyverbsError, PyverbsRDMAError) as exc:
        return False, f"no RDMA device: the kernel has no RDMA subsystem or no device is up ({_fix(exc)})"
    names = [d.name.decode() for d in devs]
    if not names:
        return False, "no RDMA device found (`ibv_devices` lists none; for Soft-RoCE: rdma link add rxe0 type rxe netdev IFACE)"
    if name is not None and name not in names:
        return False, f"RDMA device {name} not found; devices here: {', '.join(names)}"
    return True, f"RDMA device {name or names[0]}"


def view_of(mr: MR) -> memoryview:
    """A writable memoryview of a memory region's buffer (no copy)."""
    return memoryview((ctypes.c_char * mr.length).from_address(mr.buf)).cast("B")


def _gid_bytes(gid: str) -> bytes:
    return bytes.fromhex(gid.replace(":", ""))


def _gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def _gid_index(dev: str, port: int = 1) -> int:
    """The RoCE v2 GID that maps an IPv4 address (``::ffff:a.b.c.d``), else index 0 (InfiniBand)."""
    base = f"/sys/class/infiniband/{dev}/ports/{port}"
    try:
        indices = sorted(int(x) for x in os.listdir(f"{base}/gids"))
    except OSError:
        return 0
    for idx in indices:
        try:
            with open(f"{base}/gid_attrs/types/{idx}") as f:
                typ = f.read().strip()
            with open(f"{base}/gids/{idx}") as f:
                gid = f.read().strip()
        except OSError:
            continue
        if typ == "RoCE v2" and gid.startswith("0000:0000:0000:0000:0000:ffff"):
            return idx
    return 0


class VerbsDevice:
    """An opened RDMA device: context, protection domain, port 1 and its GID.

    Raises:
        TransportUnavailable: no device, or it cannot be opened.
    """

    def __init__(self, name: str | None = None) -> None:
        ok, why = device_status(name)
        if not ok:
            raise TransportUnavailable(why, "use --transport tcp, or load an RDMA driver")
        if name is None:
            name = get_device_list()[0].name.decode()
        self.name = name
        try:
            self.ctx = Context(name=name)
            self.pd = PD(self.ctx)
            self.port_attr = self.ctx.query_port(1)
            self.dev_attr = self.ctx.query_device()
        except PyverbsRDMAError as exc:
            raise TransportUnavailable(f"cannot open RDMA device {name}: {_fix(exc)}") from None
        self.gid_index = _gid_index(name)
        self.gid = self.ctx.query_gid(1, self.gid_index).gid
        self.max_msg = int(self.port_attr.max_msg_sz) or (1 << 31)
        self.max_rd_atomic = max(1, min(16, int(self.dev_attr.max_qp_rd_atom or 1)))
        self._mrs: list[MR] = []

    def register(self, length: int, access: int, what: str, keep: bool = True, address: int | None = None) -> MR:
        """Allocate and register ``length`` bytes (or register the memory at ``address``).

        Raises:
            TransportUnavailable: the memlock limit is too low, or the device refused.
        """
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < length:
            raise TransportUnavailable(
                f"cannot register the {what} of {length} bytes: the memlock limit is {soft} bytes",
                "raise it: `ulimit -l unlimited` (or LimitMEMLOCK=infinity for a systemd unit), or use --transport tcp",
            )
        try:
            mr = MR(self.pd, length, access) if address is None else MR(self.pd, length, access, address=address)
        except PyverbsRDMAError as exc:
            hint = "use --transport tcp"
            if getattr(exc, "error_code", None) in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
                hint = "raise the memlock limit (`ulimit -l unlimited`) or register less (--capacity)"
            raise TransportUnavailable(
                f"RDMA device {self.name} refused to register the {what}: length {length}, access flags {access:#x}:"
                f" {_fix(exc)}",
                hint,
            ) from None
        if keep:  # closed with the device; others are closed by their owner
            self._mrs.append(mr)
        return mr

    def close(self) -> None:
        """Close the memory regions, the PD and the context (children first). Safe twice."""
        for mr in reversed(self._mrs):
            mr.close()
        self._mrs.clear()
        self.pd.close()
        self.ctx.close()
