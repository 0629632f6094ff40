"""The cluster key, the mutual authentication of a connection, and the MAC of every frame.

Every connection to a shard (from a client, a mount, the CLI, or another shard forwarding a
replicated update) proves knowledge of the cluster's 256-bit key before any data op, and the
shard proves it back, with a challenge-response over fresh nonces from both sides, in the
manner of SCRAM (RFC 5802) and TLS 1.3 pre-shared keys (RFC 8446 section 4.2.11):

1. client -> shard  HELLO carrying the cluster id (16 bytes) and a client nonce Nc (32 bytes);
2. shard -> client  a challenge: a shard nonce Ns (32 bytes);
3. client -> shard  AUTH: ``HMAC-SHA256(K, "irdma client proof" || T)`` with the transcript
   ``T = cluster id || Nc || Ns``;
4. shard -> client  the HELLO reply and ``HMAC-SHA256(K, "irdma shard proof" || T)``, which the
   client checks before it trusts anything the shard says.

Neither side sends the key; a replayed HELLO or AUTH fails because the other side's nonce is
new. Both sides then derive one session key per direction, ``HMAC-SHA256(K, "irdma c2s" || T)``
and ``HMAC-SHA256(K, "irdma s2c" || T)``, and every later frame on the TCP stream carries a
16-byte tag: GMAC, that is the tag of AES-256-GCM under the session key with the 96-bit nonce
``sequence number`` (big-endian) and ``header || body`` as associated data and no plaintext
(NIST SP 800-38D; as TLS 1.3's AES-256-GCM authenticates, RFC 8446 section 5.3). The sequence
number counts the frames of one direction from 0 and is never sent, so each (key, nonce) pair
is used once, and a frame cannot be replayed, reordered, dropped or spliced from another
connection without the tag failing: the receiver then closes the connection. Frames are
authenticated, not encrypted (see SECURITY.md). GMAC, not HMAC-SHA256, because OpenSSL's
GHASH (carry-less multiply instructions) tagged 4 MiB blocks at 19 GB/s on one core of the
2-core machine this was measured on (2026-12-04; 4.5-26 GB/s on others), against 1.8 GB/s for
HMAC-SHA256: with HMAC the MAC, not the network, bounded pulls and pushes.

The key file (JSON, mode 0600) holds the cluster id and up to two keys: the current one, which
clients use, and the previous one, which shards still accept while a rotation completes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
from collections.abc import Sequence

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from irdma._errors import AuthFailed as AuthFailed  # re-exported: callers catch auth.AuthFailed
from irdma._errors import InvalidArgument

#: Bytes of a cluster id, a nonce, a key, a frame tag.
CLUSTER_ID_SIZE = 16
NONCE_SIZE = 32
KEY_SIZE = 32
TAG_SIZE = 16
#: Name of the key file beside a namespace's metadata (``irdma up`` and ``irdma format`` make it).
KEY_FILE_NAME = "cluster.key"
#: The environment variable every command reads the key file's path from.
KEY_FILE_ENV = "IRDMA_KEY_FILE"


#: The security levels of a cluster, named as NFS's Kerberos flavours (RFC 2203, RFC 7530
#: section 3.2.1) name theirs: ``integrity`` (krb5i: every byte of every frame carries the
#: frame's tag; the default) and ``auth`` (krb5, mutual authentication and a tag over every
#: header and control field, but the tensor *payload* of WRITE, SCATTER, READ and GATHER frames
#: is left out of the tag: for fabrics whose links are trusted, as RDMA's one-sided path is;
#: a man in the middle may then change payload bytes, never who speaks or what is asked).
SECURITY_LEVELS = ("integrity", "auth")
DEFAULT_SECURITY = "integrity"


@dataclasses.dataclass(frozen=True)
class KeyRing:
    """A cluster's id and keys (newest first; at most two during a rotation), and its security
    level (one of :data:`SECURITY_LEVELS`)."""

    cluster_id: bytes
    keys: tuple[bytes, ...]
    security: str = DEFAULT_SECURITY

    @property
    def current(self) -> bytes:
        return self.keys[0]

    @property
    def cluster_hex(self) -> str:
        return self.cluster_id.hex()


def new_ring() -> KeyRing:
    """A fresh cluster id and a fresh 256-bit key from the OS's CSPRNG (``secrets``)."""
    return KeyRing(secrets.token_bytes(CLUSTER_ID_SIZE), (secrets.token_bytes(KEY_SIZE),))


def write_key_file(path: str, ring: KeyRing) -> None:
    """Write ``ring`` to ``path`` atomically, mode 0600 from the start (never readable by others)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"cluster_id": ring.cluster_id.hex(), "keys": [k.hex() for k in ring.keys],
                       "security": ring.security}, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def create_key_file(path: str) -> KeyRing:
    """Make a new key file at ``path`` (refuses to overwrite one).

    Raises:
        InvalidArgument: ``path`` exists.
    """
    if os.path.exists(path):
        raise InvalidArgument(f"a key file already exists at {path}", "use it, or `irdma key rotate` to replace its key")
    ring = new_ring()
    write_key_file(path, ring)
    return ring


def read_key_file(path: str) -> KeyRing:
    """Load a key file.

    Raises:
        InvalidArgument: it cannot be read, is not a key file, or its mode gives any permission
            to its group or to other users (it must be 0600 or stricter).
    """
    try:
        with open(path) as f:
            st = os.fstat(f.fileno())  # the file read, not whatever the path names a moment later
            data = json.load(f)
    except FileNotFoundError:
        raise InvalidArgument(f"no key file at {path}",
                              "pass the cluster's key file with --key-file or IRDMA_KEY_FILE") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read the key file {path}: {exc}", "pass the cluster's key file") from None
    loose = stat.S_IMODE(st.st_mode) & 0o077
    if loose:
        who = " and ".join(w for w, bits in (("its group", 0o070), ("every user", 0o007)) if loose & bits)
        raise InvalidArgument(f"the key file {path} (mode {stat.S_IMODE(st.st_mode):04o}) is open to {who}:"
                              " a key file must be private to its owner",
                              f"chmod 600 {path} (and rotate the key if others could read it: `irdma key rotate`)")
    try:
        cid = bytes.fromhex(data["cluster_id"])
        keys = tuple(bytes.fromhex(k) for k in data["keys"])
        security = data.get("security", DEFAULT_SECURITY)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InvalidArgument(f"{path} is not an irdma key file", "pass the cluster's key file") from None
    if len(cid) != CLUSTER_ID_SIZE or not keys or any(len(k) != KEY_SIZE for k in keys):
        raise InvalidArgument(f"{path} is not an irdma key file (bad sizes)", "pass the cluster's key file")
    if security not in SECURITY_LEVELS:
        raise InvalidArgument(f"{path}: unknown security level {security!r}",
                              f"set one of {', '.join(SECURITY_LEVELS)} with `irdma key security LEVEL`")
    return KeyRing(cid, keys, security)


def rotate_key_file(path: str, drop_old: bool = False) -> KeyRing:
    """Put a new key first in a key file, keeping the previous one accepted by shards (or, with
    ``drop_old``, keep only the current key: end a rotation)."""
    ring = read_key_file(path)
    keys = ring.keys[:1] if drop_old else (secrets.token_bytes(KEY_SIZE), ring.keys[0])
    out = KeyRing(ring.cluster_id, keys, ring.security)
    write_key_file(path, out)
    return out


def set_security(path: str, level: str) -> KeyRing:
    """Set the security level of a key file (shards and clients that read it use the level for
    every connection they open from then on; open connections keep theirs).

    Raises:
        InvalidArgument: ``level`` is not one of :data:`SECURITY_LEVELS`; the key file cannot
            be read (see :func:`read_key_file`).
    """
    if level not in SECURITY_LEVELS:
        raise InvalidArgument(f"unknown security level {level!r}", f"use one of {', '.join(SECURITY_LEVELS)}")
    ring = read_key_file(path)
    out = dataclasses.replace(ring, security=level)
    if out != ring:
        write_key_file(path, out)
    return out


class KeySource:
    """A key file read again whenever it changes (so a rotation reaches running processes).

    ``path`` None: no key (an unauthenticated peer; shards refuse it unless they run without
    authentication).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._ring: KeyRing | None = None
        if path is not None:
            self.ring()  # fail now on a bad file, not at the first connection

    def ring(self) -> KeyRing | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_ino)
        except OSError:
            stamp = None
        with self._lock:
            if self._ring is None or (stamp is not None and stamp != self._stamp):
                self._ring = read_key_file(self.path)
                self._stamp = stamp
            return self._ring


def transcript(cluster_id: bytes, client_nonce: bytes, shard_nonce: bytes,
               security: str = DEFAULT_SECURITY) -> bytes:
    """The handshake's transcript ``T``. The security level is part of it (``auth`` appends its
    name), so both proofs fail unless both sides use the same level: a man in the middle
    cannot talk a connection down to ``auth``."""
    level = b"" if security == DEFAULT_SECURITY else b" security=" + security.encode()
    return b"irdma auth 1" + cluster_id + client_nonce + shard_nonce + level


def _mac(key: bytes, label: bytes, t: bytes) -> bytes:
    return hmac.new(key, label + t, hashlib.sha256).digest()


def client_proof(key: bytes, t: bytes) -> bytes:
    return _mac(key, b"irdma client proof", t)


def shard_proof(key: bytes, t: bytes) -> bytes:
    return _mac(key, b"irdma shard proof", t)


def session_keys(key: bytes, t: bytes) -> tuple[bytes, bytes]:
    """``(client-to-shard, shard-to-client)`` frame keys of one connection."""
    return _mac(key, b"irdma c2s", t), _mac(key, b"irdma s2c", t)


def match_client(ring: KeyRing, t: bytes, proof: bytes) -> bytes | None:
    """The key of ``ring`` the client's proof was made with, or None (constant time per key)."""
    found = None
    for key in ring.keys:
        if hmac.compare_digest(client_proof(key, t), proof):
            found = key
    return found


#: Frames up to this many bytes are tagged by the one-shot AEAD (joined: a copy this small
#: costs less than a fresh GCM context).
_ONE_SHOT_MAX = 64 << 10


class FrameMac:
    """The tags of one direction of one connection: a running sequence number under a session
    key. Tags must be made (or checked) in the order frames go on the wire."""

    def __init__(self, key: bytes) -> None:
        self._aes = algorithms.AES(key)
        self._aead = AESGCM(key)
        self.seq = 0

    def tag(self, parts: Sequence[bytes | bytearray | memoryview]) -> bytes:
        """The GMAC of the next frame, ``parts`` in order (see the module's docstring).

        The same tag two ways (GCM with an empty plaintext and the frame as associated data,
        NIST SP 800-38D): a small frame goes through the one-shot AEAD, whose key schedule is
        made once per connection (about 5x cheaper per frame); a large one is fed part by part
        to a fresh GCM context, so its payload is never copied."""
        nonce = self.seq.to_bytes(12, "big")
        self.seq += 1
        if sum(len(p) for p in parts) <= _ONE_SHOT_MAX:
            return self._aead.encrypt(nonce, b"", b"".join(parts))[:TAG_SIZE]
        gcm = Cipher(self._aes, modes.GCM(nonce)).encryptor()
        for p in parts:
            gcm.authenticate_additional_data(p)
        gcm.finalize()
        return gcm.tag[:TAG_SIZE]

    def check(self, parts: Sequence[bytes | bytearray | memoryview], tag: bytes | bytearray | memoryview) -> None:
        """Raises AuthFailed when ``tag`` is not this frame's."""
        if not hmac.compare_digest(self.tag(parts), bytes(tag)):
            raise AuthFailed(f"frame {self.seq - 1} failed its authentication tag (modified, replayed or"
                             " out of order): connection closed")


#: Bytes of the payload length that precedes the tag under ``--security auth``.
PAYLOAD_LEN_SIZE = 4


def _prefix(parts: Sequence[bytes | bytearray | memoryview], n: int) -> list[bytes | bytearray | memoryview]:
    """The first ``n`` bytes of ``parts`` (views, no copy)."""
    out: list[bytes | bytearray | memoryview] = []
    for p in parts:
        if n <= 0:
            break
        if len(p) <= n:
            out.append(p)
        else:
            out.append(memoryview(p)[:n])
        n -= len(p)
    return out


class Macs:
    """The frame tags of one authenticated connection: ``send`` for the frames this side
    sends, ``recv`` for those it receives, and the connection's security level.

    The *trailer* follows every frame (not counted in its header's ``body_len``): under
    ``integrity`` the 16-byte tag of the whole frame; under ``auth`` a u32 (big-endian) payload
    length ``p`` and then the tag of the frame less its last ``p`` bytes, followed by those 4
    bytes. ``p`` is what the sender's :func:`irdma.wire.protocol.encode_request` /
    ``encode_reply`` marked as tensor payload (``parts.payload``); the receiver needs no
    knowledge of the frame to check it, and a ``p`` reaching into the header is refused.
    """

    def __init__(self, send_key: bytes, recv_key: bytes, security: str = DEFAULT_SECURITY) -> None:
        self.send = FrameMac(send_key)
        self.recv = FrameMac(recv_key)
        self.security = security
        self.payload_free = security == "auth"
        #: Bytes that follow every frame.
        self.trailer = TAG_SIZE + (PAYLOAD_LEN_SIZE if self.payload_free else 0)

    def seal(self, parts: Sequence[bytes | bytearray | memoryview]) -> bytes:
        """The trailer of the next frame sent (call in the order frames go on the wire)."""
        if not self.payload_free:
            return self.send.tag(parts)
        payload = getattr(parts, "payload", 0)
        plen = payload.to_bytes(PAYLOAD_LEN_SIZE, "big")
        covered = _prefix(parts, sum(len(p) for p in parts) - payload)
        return plen + self.send.tag([*covered, plen])

    def open(self, parts: Sequence[bytes | bytearray | memoryview], trailer: bytes | bytearray | memoryview) -> None:
        """Check the trailer of the next frame received (``parts``: header and body, in order).

        Raises:
            AuthFailed: the tag does not verify, or the payload length covers the header.
        """
        if not self.payload_free:
            self.recv.check(parts, trailer)
            return
        plen = bytes(trailer[:PAYLOAD_LEN_SIZE])
        payload = int.from_bytes(plen, "big")
        total = sum(len(p) for p in parts)
        if payload > total - len(parts[0]):
            self.recv.seq += 1  # this frame's nonce is spent either way
            raise AuthFailed(f"frame {self.recv.seq - 1} claims {payload} payload bytes of {total}: connection closed")
        self.recv.check([*_prefix(parts, total - payload), plen], trailer[PAYLOAD_LEN_SIZE:])


