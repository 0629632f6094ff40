"""The baselines ``make bench`` sets irdma's figures against, measured in the same run: plain
loopback TCP streams (raw, and with irdma's per-block GMAC on both ends: the same-work ceiling
of the ``integrity`` security level), a Python socket ping-pong, and tmpfs. Each does the
necessary work of the irdma figure it bounds and nothing of irdma's."""

from __future__ import annotations

import hmac
import os
import socket
import subprocess
import threading
import time

from harness import PY

MiB = 1 << 20


_TCP_SERVER = r"""
import hmac, mmap, os, socket, sys, tempfile, threading
per, streams, mac, fresh = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "mac", sys.argv[4]
if mac:
    from irdma.wire.auth import FrameMac
ls = socket.create_server(("127.0.0.1", 0)); print(ls.getsockname()[1], flush=True)
def serve(c):
    mode = c.recv(1); buf = bytearray(4 << 20); view = memoryview(buf); tag = bytearray(16)
    fm = FrameMac(bytes(32)) if mac else None
    if mode == b"W":
        mm = None
        if fresh:  # each block into the next 4 MiB of a new file's shared mapping, as a shard's region
            fd, path = tempfile.mkstemp(dir=fresh, prefix="irdma-bench-fresh-")
            os.unlink(path); os.posix_fallocate(fd, 0, per)
            mm = mmap.mmap(fd, per, flags=mmap.MAP_SHARED); os.close(fd); region = memoryview(mm)
        got = 0
        while got < per:
            n, k = min(len(buf), per - got), 0
            if mm is not None:
                view = region[got : got + n]
            while k < n:
                k += c.recv_into(view[k:n])
            if fm is not None:
                t = 0
                while t < 16:
                    t += c.recv_into(memoryview(tag)[t:])
                if not hmac.compare_digest(fm.tag([view[:n]]), bytes(tag)):
                    raise SystemExit("a block failed its tag")
            got += n
        c.sendall(b"k")
        if mm is not None:
            view = region = None; mm.close()
    else:
        sent = 0
        while sent < per:
            n = min(len(buf), per - sent); c.sendall(view[:n])
            if fm is not None:
                c.sendall(fm.tag([view[:n]]))
            sent += n
    c.close()
ts = []
for _ in range((1 if fresh else 2) * streams):
    c, _ = ls.accept(); t = threading.Thread(target=serve, args=(c,)); t.start(); ts.append(t)
for t in ts: t.join()
"""


PING_SERVER = r"""
import socket, sys
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
reply = bytes(int(sys.argv[1]))
while conn.recv(64):
    conn.sendall(reply)
"""


def socket_ping(ops: int) -> list[float]:
    """Seconds of each of ``ops`` round trips of a plain Python socket ping-pong: a 40-byte
    request to another process, answered with 4 KiB and a 24-byte header and tag (the size of
    irdma's READ reply); blocking sockets, TCP_NODELAY, loopback."""
    server = subprocess.Popen([PY, "-c", PING_SERVER, str(4096 + 24)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            want, buf, samples = 4096 + 24, bytearray(4096 + 24), []
            req = bytes(40)
            for _ in range(ops):
                t0 = time.perf_counter()
                s.sendall(req)
                got = 0
                while got < want:
                    k = s.recv_into(memoryview(buf)[got:])
                    if not k:
                        raise RuntimeError("the ping-pong server hung up")
                    got += k
                samples.append(time.perf_counter() - t0)
    finally:
        server.kill()
        server.wait(30)
    return samples


def tcp_ceiling(total: int, streams: int, mac: bool = False, fresh: str | None = None) -> dict[str, float]:
    """MB/s of plain loopback TCP sockets: ``streams`` connections to another process, 4 MiB
    blocks, ``push`` (this process sends) and ``pull`` (it receives).

    ``mac``: the *same-work ceiling* of the default ``integrity`` security level (issue 41):
    the same streams, and every 4 MiB block carries a 16-byte GMAC tag (AES-256-GCM with the
    block as associated data, :class:`irdma.wire.auth.FrameMac`) that the sender computes and
    the receiver computes again and compares, as a shard and a client do for every frame.
    Raw loopback is the ceiling of ``--security auth`` (payloads untagged).

    ``fresh``: a directory on the shards' filesystem: ``push`` only, and the receiver lands each
    stream's ``total / streams`` bytes in memory it never held: the shared mapping of a new file
    there, its blocks allocated first (``posix_fallocate``), block after block, as a shard
    stores a push (assign) that creates its chunks in its region. That is the necessary work of
    such a push, where the receiver of the other ceilings reuses one warm 4 MiB buffer. (On a
    virtual machine whose host takes freed guest memory back, every page of it is a host fault
    the first time: docs/benchmarks.md, Bandwidth.)"""
    from irdma.wire.auth import FrameMac

    per = total // streams
    srv = subprocess.Popen([PY, "-c", _TCP_SERVER, str(per), str(streams), "mac" if mac else "raw", fresh or ""],
                           stdout=subprocess.PIPE, text=True)
    assert srv.stdout is not None
    port = int(srv.stdout.readline())
    out: dict[str, float] = {}
    for mode in ("W",) if fresh else ("W", "R"):
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]

        def run(s: socket.socket, mode: str = mode) -> None:
            s.sendall(mode.encode())
            buf = bytearray(4 * MiB)
            view = memoryview(buf)
            fm = FrameMac(bytes(32)) if mac else None
            tag = bytearray(16)
            done = 0
            while done < per:
                n = min(len(buf), per - done)
                if mode == "W":
                    s.sendall(view[:n])
                    if fm is not None:
                        s.sendall(fm.tag([view[:n]]))
                else:
                    k = 0
                    while k < n:
                        k += s.recv_into(view[k:n])
                    if fm is not None:
                        t = 0
                        while t < 16:
                            t += s.recv_into(memoryview(tag)[t:])
                        if not hmac.compare_digest(fm.tag([view[:n]]), bytes(tag)):
                            raise RuntimeError("a block of the same-work ceiling failed its tag")
                done += n
            if mode == "W":
                s.recv(1)
            s.close()

        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["push" if mode == "W" else "pull"] = per * streams / (time.perf_counter() - t0) / 1e6
    if srv.wait(timeout=60) != 0:
        raise RuntimeError(f"the loopback ceiling's server failed (exit {srv.returncode}): see its stderr above")
    return out


def tmpfs_ceiling(size: int, block: int = 4 * MiB) -> dict[str, float]:
    """MB/s (10^6 bytes per second) of ``size`` bytes written (pwrite, then fsync) and read back
    (preadv) in ``block``-byte pieces in a file on /dev/shm: the ceiling of the checkpoint and
    mount figures that are set over tmpfs. The file is removed, also on failure."""
    path = f"/dev/shm/irdma-bench-{os.getpid()}"
    data = os.urandom(block)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        for off in range(0, size, block):
            os.pwrite(fd, data, off)
        os.fsync(fd)
        os.close(fd)
        w = size / (time.perf_counter() - t0) / 1e6
        fd = os.open(path, os.O_RDONLY)
        buf = bytearray(block)
        t0 = time.perf_counter()
        for off in range(0, size, block):
            os.preadv(fd, [buf], off)
        os.close(fd)
        r = size / (time.perf_counter() - t0) / 1e6
    finally:
        os.unlink(path)
    return {"write": w, "read": r}
