"""Only key holders get in: the cluster key, mutual authentication, frame tags, private files.

Real shard processes of `irdma up`; the attacker is the ordinary user ``nobody`` with raw
sockets, or this process without the key, with a wrong one, or replaying and altering bytes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import trio
from helpers import RawShard, irdma_cli, running_cluster, wait_until

import irdma
from irdma._concurrency import open_nursery
from irdma._errors import AuthFailed
from irdma.ops.cluster import key_file_of
from irdma.transport.tcp import TcpTransport
from irdma.wire import auth
from irdma.wire import protocol as P

MB = 1 << 20

# What an ordinary local user can do with a raw socket and no key (stdlib only: it runs as
# `nobody` under the system's python). Each attempt must get an error reply or a closed
# connection, never a chunk byte; it prints one line per attempt.
ATTACK = r"""
import os, socket, struct, sys
host, port, cluster_id, fid = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4])
HDR = struct.Struct("!2sBBIHHI")

def frame(op, body, rid=1, version=4):
    return HDR.pack(b"IR", version, op, rid, 0, 0, len(body)) + body

def hello(offer=b"", name=b"nobody"):
    return frame(1, struct.pack("!BBHH", 4, 4, len(name), len(offer)) + name + offer, 0)

def read_req(chunk=0):
    return frame(2, struct.pack("!QQQI", fid, chunk, 0, 4096))

def write_req():  # an assign of 8 bytes at the start of chunk 0
    return frame(3, struct.pack("!QQIIB3x", fid, 0, 1 << 20, 0, 0)[:28] + b"EVILEVIL")

def free_req():
    return frame(5, struct.pack("!QQ", fid, 0))

def talk(*frames):
    s = socket.create_connection((host, port), timeout=10)
    got = b""
    try:
        for f in frames:
            s.sendall(f)
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
    except OSError:
        pass
    s.close()
    return got

def statuses(got):
    out = []
    while len(got) >= 16:
        magic, v, op, rid, status, flags, n = HDR.unpack_from(got)
        out.append((op, status, flags, got[16:16 + n]))
        got = got[16 + n:]
    return out

for name, frames in [
    ("read without hello", [read_req()]),
    ("write without hello", [write_req()]),
    ("free without hello", [free_req()]),
    ("hello without key, then read", [hello(), read_req()]),
    ("hello without key, then write", [hello(), write_req()]),
    ("other cluster", [hello(os.urandom(48)), read_req()]),
    ("right cluster id, made-up proof", [hello(cluster_id + os.urandom(32)), frame(14, os.urandom(32), 0), read_req()]),
    ("16 MiB announced before hello", [HDR.pack(b"IR", 4, 1, 0, 0, 0, 16 << 20)]),
]:
    replies = statuses(talk(*frames))
    ok = [r for r in replies if r[1] == 0]
    # only a challenge (flag 0x40) may come back OK: never data, never a version
    leaked = [r for r in ok if not r[2] & 0x40]
    print(name, "LEAK" if leaked else "refused", [r[1] for r in replies])
"""


def test_an_ordinary_user_without_the_key_reads_writes_and_frees_nothing(tmp_path: object) -> None:
    """As `nobody`, with raw sockets: no chunk byte read, nothing written, freed or allocated;
    the key file, the metadata and the shards' data are not readable by other users."""
    tmp = str(tmp_path)
    data = np.random.default_rng(5).integers(0, 255, 3 * MB, dtype=np.uint8).tobytes()
    with running_cluster(os.path.join(tmp, "c"), shards=2) as c:
        key_file = key_file_of(c.dir)
        for path in (key_file, os.path.join(c.dir, "meta.db")):
            assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, f"{path} is open to other users"
        assert stat.S_IMODE(os.stat(c.dir).st_mode) & 0o077 == 0
        ring = auth.read_key_file(key_file)
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            cl.write("/secret", data, chunk_size=1 << 20)
            ino = cl.stat("/secret").ino
            before = [(s.shard_id, s.used, s.chunks) for s in _stats(cl)]
        for shard in c.shards:
            host, port = shard.address.rsplit(":", 1)
            res = subprocess.run(["/usr/bin/python3", "-c", ATTACK, host, port, ring.cluster_hex, str(ino)],
                                 user="nobody", capture_output=True, text=True, timeout=120, cwd="/")
            assert res.returncode == 0, res.stderr
            lines = res.stdout.splitlines()
            assert len(lines) == 8 and all(" refused " in ln for ln in lines), res.stdout
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            assert hashlib.sha256(cl.read("/secret")).digest() == hashlib.sha256(data).digest()
            assert [(s.shard_id, s.used, s.chunks) for s in _stats(cl)] == before  # nothing allocated or freed


def _stats(cl: irdma.SyncClient) -> list[P.StatReply]:
    return [st for _, st, _ in cl.shard_stats() if st is not None]


def test_wrong_key_other_cluster_and_no_key_are_refused_with_a_clear_error(tmp_path: object) -> None:
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=1) as c:
        ring = auth.read_key_file(key_file_of(c.dir))
        address = c.shards[0].address

        async def connect(key: auth.KeyRing | None) -> None:
            async with open_nursery() as n:
                conn = await TcpTransport().connect(address, n, key=key, timeout=5)
                await conn.aclose()

        trio.run(connect, ring)  # the right key gets in
        wrong = auth.KeyRing(ring.cluster_id, (secrets.token_bytes(32),))
        with pytest.raises(AuthFailed, match="wrong cluster key"):
            trio.run(connect, wrong)
        with pytest.raises(AuthFailed, match="another cluster"):
            trio.run(connect, auth.new_ring())
        with pytest.raises(AuthFailed, match="key file"):
            trio.run(connect, None)
        # the CLI without the key: one line that says what to do, exit 1
        elsewhere = os.path.join(tmp, "elsewhere.key")
        auth.create_key_file(elsewhere)
        res = irdma_cli("shard", "list", "--meta", c.meta_url, "--key-file", elsewhere, check=False)
        assert "key" in res.stdout + res.stderr
        # a key file others may read is refused before it is used
        loose = os.path.join(tmp, "loose.key")
        auth.create_key_file(loose)
        os.chmod(loose, 0o644)
        res = irdma_cli("status", "--meta", c.meta_url, "--key-file", loose, check=False)
        assert res.returncode != 0 and "chmod 600" in res.stderr


def test_replayed_handshakes_and_replayed_or_altered_frames_are_refused(tmp_path: object) -> None:
    """A recorded HELLO+AUTH replayed gets a new challenge its proof cannot answer; a data frame
    sent twice, or altered by one bit, closes the connection before it is applied."""
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=1) as c:
        ring = auth.read_key_file(key_file_of(c.dir))
        address = c.shards[0].address
        n = 1024
        one = np.ones(n, dtype="<f4").tobytes()
        add = b"".join(P.encode_request(P.Write(4242, 0, 4096, 0, P.UpdateOp.ADD, one), 7))

        s = RawShard(address, ring)
        s.send(add)
        assert isinstance(s.reply(), P.VersionReply)
        # the same frame and its tag again: the sequence number moved on, the tag fails
        tag = s.macs.send.tag([add])  # type: ignore[union-attr]
        s.macs.send.seq -= 1  # type: ignore[union-attr]
        s.sock.sendall(add + tag)
        s.sock.sendall(add + tag)  # a replay of the frame just sent
        assert isinstance(s.reply(), P.VersionReply)  # the first copy is applied ...
        assert _closed(s.sock)  # ... the replay closes the connection
        s.close()
        # one bit altered in the payload: the connection closes, nothing applied
        s = RawShard(address, ring)
        bad = bytearray(add)
        bad[-1] ^= 1
        tag = s.macs.send.tag([add])  # type: ignore[union-attr]
        s.sock.sendall(bytes(bad) + tag)
        assert _closed(s.sock)
        s.close()
        # a recorded handshake replayed: the shard's nonce is new, the old proof fails
        rec = _RecordingProxy(address)
        try:
            trio.run(_connect_and_close, rec.address, ring)
            hello_auth = bytes(rec.recorded)
        finally:
            rec.close()
        host, port = address.rsplit(":", 1)
        r = socket.create_connection((host, int(port)), timeout=10)
        r.sendall(hello_auth + add + b"\0" * auth.TAG_SIZE)
        replies = _replies(r)
        r.close()
        assert replies and isinstance(replies[0], P.AuthChallenge), replies
        assert isinstance(replies[1], P.ErrorReply) and replies[1].status == P.Status.AUTH_FAILED
        assert len(replies) == 2
        # the sum holds the two adds that were authentic, no more
        s = RawShard(address, ring)
        s.request(P.Read(4242, 0, 0, 4 * n), 9)
        got = s.reply()
        assert isinstance(got, P.ReadReply)
        np.testing.assert_array_equal(np.frombuffer(bytes(got.data), dtype="<f4"), np.full(n, 2.0, dtype="<f4"))
        s.close()


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _replies(sock: socket.socket) -> list[object]:
    dec = P.FrameDecoder()
    out = []
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            break
        if not data:
            break
        dec.feed(data)
        while (f := dec.next_frame()) is not None:
            out.append(P.decode_reply(f))
    return out


async def _connect_and_close(address: str, ring: auth.KeyRing) -> None:
    async with open_nursery() as n:
        conn = await TcpTransport().connect(address, n, key=ring, timeout=5)
        await conn.aclose()


class _RecordingProxy:
    """Forwards one connection to a shard and records what the client sent."""

    def __init__(self, upstream: str) -> None:
        self.recorded = bytearray()
        self._l = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._l.getsockname()[1]}"
        host, port = upstream.rsplit(":", 1)
        self._up = (host, int(port))
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            cli, _ = self._l.accept()
        except OSError:
            return
        srv = socket.create_connection(self._up)

        def back() -> None:
            try:
                while data := srv.recv(65536):
                    cli.sendall(data)
            except OSError:
                pass
            cli.close()

        threading.Thread(target=back, daemon=True).start()
        try:
            while data := cli.recv(65536):
                self.recorded += data
                srv.sendall(data)
        except OSError:
            pass
        srv.close()

    def close(self) -> None:
        self._l.close()
        self._t.join(10)


def test_a_connection_that_never_says_hello_is_closed_after_the_handshake_deadline(tmp_path: object) -> None:
    """Slow loris: connections that send nothing, or half a HELLO, are closed within the
    handshake deadline, and the shard reserved no more than a HELLO for them."""
    from irdma.server.serve import HANDSHAKE_TIMEOUT_S

    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=1) as c:
        host, port = c.shards[0].address.rsplit(":", 1)
        socks = [socket.create_connection((host, int(port)), timeout=30) for _ in range(20)]
        hello = b"".join(P.encode_request(P.Hello(client_name="slow"), 0))
        for s in socks[10:]:
            s.sendall(hello[:20])  # half a HELLO
        t0 = time.monotonic()
        for s in socks:
            assert _closed(s)
            s.close()
        assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 5
        # the shard still serves key holders
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            cl.write("/x", b"still here")
            assert cl.read("/x") == b"still here"


def test_key_rotation_under_a_push_loop_loses_nothing(tmp_path: object) -> None:
    """`irdma key rotate` while a client pushes adds and new clients connect: no error, the sum
    exact; after `--finish` the old key is refused and the new one works."""
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2) as c:
        key_file = key_file_of(c.dir)
        old = auth.read_key_file(key_file)
        n = 4096
        pushes = [0]
        errors: list[BaseException] = []
        stop = threading.Event()

        def pusher() -> None:
            try:
                with irdma.connect(c.meta_url, transport="tcp") as cl:
                    cl.write("/sum", np.zeros(n, dtype="<f4"))
                    cl.set_update_op("/sum", "add")
                    while not stop.is_set() and pushes[0] < 20000:
                        cl.push("/sum", np.ones(n, dtype="<f4"))
                        pushes[0] += 1
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=pusher)
        t.start()
        try:
            wait_until(lambda: pushes[0] > 20 or bool(errors), 60, "the pusher to start")
            irdma_cli("key", "rotate", "--dir", c.dir)
            new = auth.read_key_file(key_file)
            assert new.current != old.current and old.current in new.keys and new.cluster_id == old.cluster_id
            mark = pushes[0]
            # new connections (a fresh client) prove the new key while the pusher goes on
            with irdma.connect(c.meta_url, transport="tcp") as cl:
                cl.read("/sum")
            trio.run(_connect_and_close, c.shards[0].address, old)  # the old key is still accepted
            wait_until(lambda: pushes[0] > mark + 20 or bool(errors), 60, "the pusher to go on after the rotation")
            irdma_cli("key", "rotate", "--dir", c.dir, "--finish")
            with pytest.raises(AuthFailed):
                trio.run(_connect_and_close, c.shards[0].address, old)
            trio.run(_connect_and_close, c.shards[0].address, auth.read_key_file(key_file))
            mark = pushes[0]
            wait_until(lambda: pushes[0] > mark + 20 or bool(errors), 60, "the pusher to go on after --finish")
        finally:
            stop.set()
            t.join(60)
        assert not errors, errors
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            np.testing.assert_array_equal(cl.pull("/sum"), np.full(n, float(pushes[0]), dtype="<f4"))


def test_a_shard_refuses_to_start_without_a_key_or_on_another_clusters_data(tmp_path: object) -> None:
    tmp = str(tmp_path)
    res = irdma_cli("server", "--listen", "127.0.0.1:0", "--capacity", "8MiB", "--transport", "tcp", check=False)
    assert res.returncode == 1 and "--key-file" in res.stderr
    k1, k2 = os.path.join(tmp, "k1"), os.path.join(tmp, "k2")
    auth.create_key_file(k1)
    auth.create_key_file(k2)
    data = os.path.join(tmp, "d")
    port_file = os.path.join(tmp, "port")
    proc = subprocess.Popen([sys.executable, "-m", "irdma.ops.cli", "server", "--listen", "127.0.0.1:0", "--capacity",
                             "8MiB", "--transport", "tcp", "--key-file", k1, "--data-dir", data, "--port-file",
                             port_file])
    try:
        wait_until(lambda: os.path.exists(port_file), 30, "the shard to listen")
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    res = irdma_cli("server", "--listen", "127.0.0.1:0", "--transport", "tcp", "--key-file", k2, "--data-dir", data,
                    check=False)
    assert res.returncode == 1 and "cluster" in res.stderr, res.stderr


def test_up_with_a_key_file_elsewhere_and_every_command_with_it(tmp_path: object) -> None:
    """`irdma up` with IRDMA_KEY_FILE makes (or uses) the key there; commands find it by the
    variable or by --key-file, and fail clearly without it. The key is on no command line."""
    tmp = str(tmp_path)
    d, key_file = os.path.join(tmp, "c"), os.path.join(tmp, "keys", "k")
    os.makedirs(os.path.dirname(key_file))
    env = {**os.environ, "IRDMA_KEY_FILE": key_file}
    irdma_cli("up", "--dir", d, "--shards", "2", "--capacity", "64MiB", env=env)
    try:
        assert os.path.exists(key_file) and not os.path.exists(os.path.join(d, "cluster.key"))
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        key_hex = [k.hex() for k in auth.read_key_file(key_file).keys]
        for pid in (s.pid for s in __import__("irdma.ops.cluster", fromlist=["read_state"]).read_state(d)):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode()
            assert key_file in cmdline and not any(k in cmdline for k in key_hex)
        meta = f"sqlite://{d}/meta.db"
        assert irdma_cli("status", "--meta", meta, env=env).returncode == 0
        assert irdma_cli("status", "--meta", meta, "--key-file", key_file).returncode == 0
        res = irdma_cli("status", "--meta", meta, check=False)  # no key: refused, says what to do
        assert res.returncode != 0 and "--key-file" in res.stdout + res.stderr
        with open(os.path.join(d, "meta.db"), "rb") as f:
            assert not any(k.encode() in f.read() for k in key_hex)
    finally:
        irdma_cli("down", "--dir", d, env=env, check=False)


@pytest.mark.parametrize("size", [0, 100, (64 << 10) - 40, (64 << 10) - 39, 1 << 20])
def test_frame_tags_are_gcm_tags_whichever_way_they_are_made(size: int) -> None:
    """Small frames are tagged by the one-shot AEAD, large ones part by part: both give the GCM
    tag of an empty plaintext with the frame as associated data (NIST SP 800-38D), in sequence."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = secrets.token_bytes(32)
    parts = [secrets.token_bytes(40), memoryview(secrets.token_bytes(size))]
    mac = auth.FrameMac(key)
    for seq in range(3):
        ref = Cipher(algorithms.AES(key), modes.GCM(seq.to_bytes(12, "big"))).encryptor()
        for p in parts:
            ref.authenticate_additional_data(p)
        ref.finalize()
        assert mac.tag(parts) == ref.tag[: auth.TAG_SIZE]
    tag = auth.FrameMac(key).tag(parts)
    auth.FrameMac(key).check(parts, tag)  # the same frame in the same place passes
    flipped = bytes([parts[0][0] ^ 1]) + bytes(parts[0][1:])
    with pytest.raises(AuthFailed):  # a flipped bit fails the check
        auth.FrameMac(key).check([flipped, parts[1]], tag)


@pytest.mark.parametrize("mode", [0o640, 0o660, 0o604, 0o620, 0o602, 0o644, 0o610, 0o601], ids=lambda m: f"{m:04o}")
def test_a_key_file_open_to_its_group_or_to_others_is_refused_with_the_chmod_to_run(
        tmp_path: object, mode: int) -> None:
    path = os.path.join(str(tmp_path), "cluster.key")
    auth.create_key_file(path)
    os.chmod(path, mode)
    with pytest.raises(irdma.InvalidArgument) as refused:
        auth.read_key_file(path)
    assert f"{mode:04o}" in str(refused.value) and f"chmod 600 {path}" in refused.value.hint
    assert ("its group" in str(refused.value)) == bool(mode & 0o070)
    with pytest.raises(irdma.InvalidArgument, match="chmod 600"):
        auth.KeySource(path)  # what `irdma server --key-file` and every command read it with
    os.chmod(path, 0o600)
    assert auth.read_key_file(path).cluster_id
    for private in (0o400, 0o700):  # nothing for the group or others: fine
        os.chmod(path, private)
        assert auth.read_key_file(path).cluster_id


async def _raw_exchange(address: tuple[str, int], *frames: bytes) -> bytes:
    """What a peer with only a socket gets back for ``frames`` (sent one after the other as
    each is answered) until the shard closes the connection."""
    sock = trio.socket.socket()
    with sock:
        await sock.connect(address)
        got = b""
        for f in frames:
            await sock.send(f)
            with trio.move_on_after(2):
                got += await sock.recv(65536)
        with trio.fail_after(10):
            while chunk := await sock.recv(65536):
                got += chunk
    return got


def test_a_refusal_tells_a_peer_without_the_key_nothing_of_the_cluster(tmp_path: object) -> None:
    """A peer that has not proved the key, refused for naming another cluster, a wrong proof,
    no offer or another opcode first, never hears the cluster id (raw or hex) or the key."""
    from irdma.server.serve import ShardServer
    from irdma.server.shard import Region, Shard

    key_file = os.path.join(str(tmp_path), "cluster.key")
    ring = auth.create_key_file(key_file)
    secrets_of_cluster = [ring.cluster_id, ring.cluster_hex.encode(), ring.cluster_hex.upper().encode(),
                          ring.current, ring.current.hex().encode()]

    def hello(offer: bytes) -> bytes:
        return b"".join(P.encode_request(P.Hello(client_name="raw", auth=offer), 0))

    other_id = secrets.token_bytes(auth.CLUSTER_ID_SIZE)
    attempts = {
        "another cluster's id": [hello(other_id + secrets.token_bytes(auth.NONCE_SIZE))],
        "no offer": [hello(b"")],
        "a short offer": [hello(other_id)],
        "a wrong proof": [hello(ring.cluster_id + secrets.token_bytes(auth.NONCE_SIZE)),
                          b"".join(P.encode_request(P.Auth(secrets.token_bytes(32)), 0))],
        "a STAT first": [b"".join(P.encode_request(P.Stat(), 1))],
    }

    async def main() -> dict[str, bytes]:
        server = ShardServer(Shard(1, Region(1 << 20)), keys=auth.KeySource(key_file))
        out = {}
        async with trio.open_nursery() as n:
            host, port = await n.start(server.serve_tcp, "127.0.0.1", 0)
            for what, frames in attempts.items():
                out[what] = await _raw_exchange((host, port), *frames)
            n.cancel_scope.cancel()
        return out

    answers = trio.run(main)
    for what, got in answers.items():
        assert b"" != got, f"{what}: no refusal at all"
        for secret in secrets_of_cluster:
            assert secret not in got, f"{what}: the refusal {got!r} tells the cluster's secrets"
    # the refusals still say what is wrong
    frame = P.FrameDecoder(max_body=1 << 20)
    frame.feed(answers["another cluster's id"])
    reply = P.decode_reply(frame.next_frame())  # type: ignore[arg-type]
    assert isinstance(reply, P.ErrorReply) and reply.status == P.Status.AUTH_FAILED
    assert "another cluster" in reply.message and other_id.hex() not in reply.message


def test_security_auth_leaves_payloads_out_of_the_tag_and_nothing_else(tmp_path: object) -> None:
    """`irdma key security auth` on a running cluster: connections opened from then on tag
    every header and control field but not tensor payloads (SECURITY.md's threat model). A
    payload bit flipped on the wire is applied (that is what the level gives up); a flipped
    bit of a control field (the offset) closes the connection with nothing applied; a peer
    at the other level is refused with a message naming both levels; the native client pulls
    and pushes as before."""
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=1) as c:
        path = key_file_of(c.dir)
        old = auth.read_key_file(path)
        assert old.security == "integrity"
        r = irdma_cli("key", "security", "auth", "--dir", c.dir)
        assert r.returncode == 0, r.stderr
        ring = auth.read_key_file(path)
        assert ring.security == "auth" and ring.keys == old.keys  # the same key, another level
        assert "auth" in irdma_cli("key", "security", "--dir", c.dir).stderr
        address = c.shards[0].address
        n = 1024
        one = np.ones(n, dtype="<f4").tobytes()
        parts = P.encode_request(P.Write(4343, 0, 4096, 0, P.UpdateOp.ADD, one), 7)
        assert parts.payload == 4 * n
        add = b"".join(parts)

        s = RawShard(address, ring)
        assert s.macs is not None and s.macs.trailer == auth.TAG_SIZE + auth.PAYLOAD_LEN_SIZE
        flipped = bytearray(add)
        flipped[-4:] = np.float32(3.0).tobytes()  # the last element of the payload: 1.0 -> 3.0
        trailer = s.macs.seal(parts)  # the trailer of the frame as it was sent
        s.sock.sendall(bytes(flipped) + trailer)
        assert isinstance(s.reply(), P.VersionReply)  # applied: payloads are not covered
        # a control field altered (the write's offset, 0 -> 8): closed, nothing applied
        moved = bytearray(add)
        moved[P.HEADER_SIZE + 20: P.HEADER_SIZE + 24] = (8).to_bytes(4, "big")
        s.sock.sendall(bytes(moved) + s.macs.seal(parts))
        assert _closed(s.sock)
        s.close()
        # a payload length that reaches into the header: refused
        s = RawShard(address, ring)
        parts.payload = len(add)
        s.sock.sendall(add + s.macs.seal(parts))  # type: ignore[union-attr]
        assert _closed(s.sock)
        s.close()
        # the other level (a stale copy of the key file): refused, both levels named
        with pytest.raises(AuthFailed, match="security level mismatch.*'auth'.*'integrity'"):
            trio.run(_connect_and_close, address, old)
        # the native client at the new level: what the raw frames left, then a round trip
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            cl.create("/w", chunk_size=4096)
            x = np.arange(4 << 20, dtype="<f4")
            cl.write("/w", x)
            np.testing.assert_array_equal(np.frombuffer(bytes(cl.read("/w")), dtype="<f4"), x)
        s = RawShard(address, ring)
        s.request(P.Read(4343, 0, 0, 4 * n), 9)
        got = s.reply()
        assert isinstance(got, P.ReadReply)
        want = np.ones(n, dtype="<f4")
        want[-1] = 3.0
        np.testing.assert_array_equal(np.frombuffer(bytes(got.data), dtype="<f4"), want)
        s.close()
