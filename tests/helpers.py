"""Test helpers: real clusters, real mounts, waiting on conditions with deadlines."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from irdma.fs.mount import spawn_mount, unmount

from irdma.ops import cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll ``cond`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


#: Prometheus samples by name: each sample's labels and value.
Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_samples(text: str) -> Samples:
    """The samples of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def scrape(address: str) -> Samples:
    """The samples a process serves at ``http://ADDRESS/metrics`` (its ``--metrics``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return parse_samples(resp.read().decode())


def total(samples: Samples, name: str, **match: str) -> float:
    """The sum of the samples ``name`` whose labels include ``match``."""
    return sum(v for labels, v in samples.get(name, []) if all(labels.get(k) == w for k, w in match.items()))


def meta_calls() -> float:
    """Metadata engine calls this process's clients made so far (``irdma_meta_calls_total``,
    every method), as a mount's or worker's ``--metrics`` serves them."""
    from irdma.metrics import REGISTRY

    return sum(s.value for m in REGISTRY.collect() if m.name == "irdma_meta_calls" for s in m.samples
               if s.name == "irdma_meta_calls_total")


def irdma_cli(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "irdma.ops.cli", *args], capture_output=True, text=True, env=env,
                         timeout=120)
    if check and res.returncode != 0:
        raise AssertionError(f"irdma {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


_BAD_LOG = re.compile(r"Traceback|\bERROR\b|CRITICAL|Exception")
#: Lines that are not errors of ours: libfuse reports a reply the kernel no longer waits for
#: (the request was interrupted, or the file was released while the mount went down).
_BENIGN = ("fuse_reply_* failed with No such file or directory",)


def assert_clean_log(path: str, allow: tuple[str, ...] = ()) -> None:
    """Fail if a process log shows a traceback or an error (pyfuse3's pytest_checklogs idea)."""
    if not os.path.exists(path):
        return
    with open(path, errors="replace") as f:
        lines = f.readlines()
    bad = [i for i, line in enumerate(lines) if _BAD_LOG.search(line) and not any(a in line for a in allow + _BENIGN)]
    # the first error with the lines after it (its traceback), then the rest of the error lines
    assert not bad, (f"{path} logged errors:\n" + "".join(lines[bad[0] : bad[0] + 40]) + "...\n"
                     + "".join(lines[i] for i in bad[1:20]))


class Cluster:
    def __init__(self, directory: str, shards: int, capacity: int, replicas: int | None = None) -> None:
        self.dir = directory
        self.meta_url = cluster.up(directory, shards, capacity, fresh=True, replicas=replicas)
        self.shards = cluster.read_state(directory)

    def logs(self) -> list[str]:
        return [s.log for s in self.shards]

    def stop(self) -> None:
        for log in self.logs():
            assert_clean_log(log)
        cluster.down(self.dir)


@contextlib.contextmanager
def running_cluster(directory: str, shards: int = 2, capacity: int = 64 << 20,
                    replicas: int | None = None) -> Iterator[Cluster]:
    """``replicas``: None for ``irdma up``'s default (2 with 2 or more shards)."""
    c = Cluster(directory, shards, capacity, replicas)
    try:
        yield c
    finally:
        c.stop()


@contextlib.contextmanager
def mounted(meta_url: str, mountpoint: str, allow_log: tuple[str, ...] = (), **kwargs: object) -> Iterator[str]:
    """A real FUSE mount in a child process; unmounted (and its log checked) on exit.

    ``kwargs`` go to :func:`irdma.fs.mount.spawn_mount` (``direct_io``, ``timeout`` ...)."""
    os.makedirs(mountpoint, exist_ok=True)
    log = mountpoint.rstrip("/") + ".log"
    spawn_mount(meta_url, mountpoint, transport="tcp", log_file=log, **kwargs)  # type: ignore[arg-type]
    try:
        yield mountpoint
    finally:
        if os.path.ismount(mountpoint):
            unmount(mountpoint)
        assert_clean_log(log, allow_log)


class RawShard:
    """A blocking socket to a shard that does the HELLO/AUTH exchange of :mod:`irdma.wire.auth` by
    hand (with ``ring``, else none) and then sends and receives frames with their tags: for
    tests that put their own bytes on the wire."""

    def __init__(self, address: str, ring: object | None, name: str = "raw") -> None:
        import socket

        from irdma.transport.tcp import Macs
        from irdma.wire import auth
        from irdma.wire import protocol as P

        self.P = P
        self.auth = auth
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.macs: Macs | None = None
        try:
            self._handshake(ring, name)
        except BaseException:
            self.sock.close()  # a refused or broken handshake leaves no socket behind
            raise

    def _handshake(self, ring: object | None, name: str) -> None:
        import secrets

        P, auth = self.P, self.auth
        from irdma.transport.tcp import Macs

        offer = b""
        if ring is not None:
            nonce = secrets.token_bytes(auth.NONCE_SIZE)
            offer = ring.cluster_id + nonce  # type: ignore[attr-defined]
        self.sock.sendall(b"".join(P.encode_request(P.Hello(client_name=name, auth=offer), 0)))
        r = self.reply()
        if isinstance(r, P.AuthChallenge) and ring is not None:
            t = auth.transcript(ring.cluster_id, nonce, r.nonce, ring.security)  # type: ignore[attr-defined]
            self.sock.sendall(b"".join(P.encode_request(P.Auth(auth.client_proof(ring.current, t), ), 0)))  # type: ignore[attr-defined]
            r = self.reply()
            assert isinstance(r, P.HelloReply) and r.proof == auth.shard_proof(ring.current, t), r  # type: ignore[attr-defined]
            c2s, s2c = auth.session_keys(ring.current, t)  # type: ignore[attr-defined]
            self.macs = Macs(c2s, s2c, ring.security)  # type: ignore[attr-defined]
        self.hello = r

    def send(self, frame: bytes, payload: int = 0) -> None:
        """Send one whole frame (header and body) and its trailer (``payload``: its last bytes
        that the trailer leaves out under ``--security auth``)."""
        if self.macs is None:
            self.sock.sendall(frame)
            return
        parts = self.P.Parts([frame])
        parts.payload = payload
        self.sock.sendall(frame + self.macs.seal(parts))

    def request(self, msg: object, rid: int) -> None:
        parts = self.P.encode_request(msg, rid)  # type: ignore[arg-type]
        self.send(b"".join(parts), parts.payload)

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            assert got, "the shard closed the connection"
            buf += got
        return buf

    def reply(self) -> object:
        P = self.P
        hdr = self._exactly(P.HEADER_SIZE)
        frame = P.parse_header(hdr, 1 << 30, any_version=True)
        body = self._exactly(frame.body_len) if frame.body_len else b""
        if self.macs is not None:
            self.macs.open([hdr, body], self._exactly(self.macs.trailer))
        frame.body = memoryview(body)
        return P.decode_reply(frame)

    def close(self) -> None:
        self.sock.close()
