"""Fuzzing: the codec and the shard's request handler never raise on any input and never apply a
request they refuse (hypothesis); a live shard takes 20,000 random frames before and after
authentication and still serves, with the data written before intact and its memory bounded;
the connection caps and EMFILE leave it serving.
"""

from __future__ import annotations

import inspect
import os
import random
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import RawShard, running_cluster, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from irdma.server.serve import ShardServer
from irdma.server.shard import Region, Shard

import irdma
from irdma._errors import RemoteProtocolError
from irdma.ops.cluster import key_file_of
from irdma.wire import auth
from irdma.wire import protocol as P

MB = 1 << 20

frames = st.builds(
    lambda op, flags, status, rid, body: (op, flags, status, rid, body),
    st.integers(0, 20), st.integers(0, 0xFFFF), st.integers(0, 20), st.integers(0, 2**32 - 1),
    st.binary(max_size=300),
)


def _frame(op: int, flags: int, status: int, rid: int, body: bytes) -> P.Frame:
    hdr = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, op, rid, status, flags, len(body))
    frame = P.parse_header(hdr, 1 << 20)
    frame.body = memoryview(body)
    return frame


@settings(max_examples=3000, deadline=None)
@given(frames)
def test_the_codec_decodes_or_refuses_any_frame(f: tuple[int, int, int, int, bytes]) -> None:
    frame = _frame(*f)
    for decode in (P.decode_request, P.decode_reply):
        try:
            decode(frame)
        except RemoteProtocolError:
            pass  # the only error a peer's bytes may cause


@settings(max_examples=2000, deadline=None)
@given(st.binary(min_size=16, max_size=16))
def test_any_header_parses_or_is_refused(hdr: bytes) -> None:
    try:
        P.parse_header(hdr, 1 << 20)
    except RemoteProtocolError:
        pass


def _state(shard: Shard) -> tuple[int, int, list[tuple[int, int, int, int]], bytes]:
    return shard.used, shard.chunk_count, shard.list_chunks(0, 0, 10_000), bytes(shard.region.view[:4096])


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames)
def test_the_handler_never_raises_and_applies_nothing_it_refuses(f: tuple[int, int, int, int, bytes]) -> None:
    shard = Shard(1, Region(1 << 20))
    shard.write(7, 0, 4096, 0, P.UpdateOp.ASSIGN, b"\x01" * 4096)
    server = ShardServer(shard)
    op, flags, status, rid, body = f
    if op == P.Opcode.HELLO or op == P.Opcode.VERBS_CONNECT:
        return  # handled by the connection loop (see the live fuzz below)
    before = _state(shard)
    reply = server.handle(_frame(op, flags & ~P.FLAG_REPLY, 0, rid, body))
    if inspect.isawaitable(reply):  # a chained update waiting for its successor: none here
        reply.close()  # type: ignore[union-attr]
        return
    assert isinstance(reply, (P.HelloReply, P.ReadReply, P.VersionReply, P.StatReply, P.FreeReply, P.ErrorReply,
                              P.LocateReply, P.ListReply, P.ChecksumReply))
    if isinstance(reply, P.ErrorReply):
        assert _state(shard) == before, f"refused with {reply.status.name} but changed the shard"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _random_frame(rng: random.Random) -> bytes:
    body = rng.randbytes(rng.randrange(0, 300))
    op = rng.randrange(0, 20)
    if op == P.Opcode.SYNC:
        op = P.Opcode.STAT
    return P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, op, rng.getrandbits(32), 0,
                         rng.getrandbits(16) & ~P.FLAG_REPLY, len(body)) + body


def _drain(sock: socket.socket) -> None:
    sock.settimeout(0.2)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass


def test_a_live_shard_takes_20000_random_frames_and_keeps_serving(tmp_path: object) -> None:
    tmp = str(tmp_path)
    rng = random.Random(20261122)
    data = np.random.default_rng(9).integers(0, 255, 4 * MB, dtype=np.uint8).tobytes()
    with running_cluster(os.path.join(tmp, "c"), shards=1, capacity=64 * MB) as c:
        shard = c.shards[0]
        host, port = shard.address.rsplit(":", 1)
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            cl.write("/kept", data)
        rss_before = _rss(shard.pid)
        sent = 0
        deadline = time.monotonic() + 240
        # before authentication: random frames (and a HELLO now and then) on fresh connections
        while sent < 10_000 and time.monotonic() < deadline:
            s = socket.create_connection((host, int(port)), timeout=5)
            burst = b"".join(_random_frame(rng) for _ in range(10))
            if rng.random() < 0.3:
                burst = b"".join(P.encode_request(P.Hello(client_name="fuzz"), 0)) + burst
            try:
                s.sendall(burst)
            except OSError:
                pass
            _drain(s)
            s.close()
            sent += 10
        # after authentication: random frames with valid tags on authenticated connections
        ring = auth.read_key_file(key_file_of(c.dir))
        raw = RawShard(shard.address, ring, "fuzz")
        while sent < 20_000 and time.monotonic() < deadline:
            try:
                raw.send(_random_frame(rng))
                raw.reply()
            except (AssertionError, OSError, RemoteProtocolError):
                raw.close()  # it hung up (a framing error): authenticate again
                raw = RawShard(shard.address, ring, "fuzz")
            sent += 1
        raw.close()
        assert sent >= 20_000, f"only {sent} frames in the time allowed"
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            assert cl.read("/kept") == data
            cl.write("/after", b"still serving")
            assert cl.read("/after") == b"still serving"
        assert _rss(shard.pid) - rss_before < 50 * MB


def _hand_shard(tmp: str, *extra: str, prefix: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str, str]:
    key_file = os.path.join(tmp, "k")
    if not os.path.exists(key_file):
        auth.create_key_file(key_file)
    port_file = os.path.join(tmp, "port")
    if os.path.exists(port_file):
        os.unlink(port_file)
    log = open(os.path.join(tmp, "shard.log"), "ab")
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "irdma.ops.cli", "server", "--listen", "127.0.0.1:0",
                             "--capacity", "16MiB", "--transport", "tcp", "--key-file", key_file, "--port-file",
                             port_file, *extra], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_until(lambda: os.path.exists(port_file) or proc.poll() is not None, 30, "the shard to listen")
    assert proc.poll() is None, open(os.path.join(tmp, "shard.log")).read()
    with open(port_file) as f:
        return proc, f.read().strip(), key_file


def test_connections_past_the_per_peer_cap_are_closed_at_once(tmp_path: object) -> None:
    tmp = str(tmp_path)
    proc, address, key_file = _hand_shard(tmp, "--max-connections-per-peer", "8")
    try:
        host, port = address.rsplit(":", 1)
        held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(8)]
        wait_until(lambda: _refused(host, int(port)), 10, "a 9th connection to be refused")
        for s in held:
            s.close()
        # the cap counts open connections only: a key holder gets in again
        wait_until(lambda: _serves(address, key_file), 10, "the shard to serve again")
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def _refused(host: str, port: int) -> bool:
    s = socket.create_connection((host, port), timeout=10)
    s.settimeout(2)
    try:
        return s.recv(1) == b""  # closed before any handshake
    except TimeoutError:
        return False
    except OSError:
        return True
    finally:
        s.close()


def _serves(address: str, key_file: str) -> bool:
    try:
        r = RawShard(address, auth.read_key_file(key_file))
    except (AssertionError, OSError):
        return False
    r.request(P.Stat(), 1)
    ok = isinstance(r.reply(), P.StatReply)
    r.close()
    return ok


@pytest.mark.skipif(not os.path.exists("/usr/bin/prlimit"), reason="needs prlimit (util-linux)")
def test_running_out_of_file_descriptors_does_not_stop_the_shard(tmp_path: object) -> None:
    """With RLIMIT_NOFILE at 40, 60 connections at once: accept backs off through EMFILE; once
    they are gone the shard serves a key holder again."""
    tmp = str(tmp_path)
    proc, address, key_file = _hand_shard(tmp, prefix=["prlimit", "--nofile=40:40"])
    try:
        host, port = address.rsplit(":", 1)
        socks = []
        for _ in range(60):
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=5))
            except OSError:
                break
        for s in socks:
            s.close()
        assert proc.poll() is None, "the shard exited on EMFILE"
        wait_until(lambda: _serves(address, key_file), 30, "the shard to serve after EMFILE")
    finally:
        proc.terminate()
        assert proc.wait(30) == 0

