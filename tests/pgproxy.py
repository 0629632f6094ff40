"""A TCP proxy between PostgreSQL clients and a server that cuts a connection at a chosen
message, for tests of what a client does when its connection breaks.

It reads the frontend/backend protocol (PostgreSQL documentation, "Frontend/Backend Protocol",
"Message Flow" and "Message Formats"): after the untyped StartupMessage, every message is one
type byte, a big-endian int32 length that counts itself, and the body. A simple query is
``Q`` with the query text NUL-terminated; the server answers each statement with
``CommandComplete`` (``C``, the command tag such as ``COMMIT``) and the query with
``ReadyForQuery`` (``Z``). Clients must connect with ``sslmode=disable&gssencmode=disable``
(:meth:`PgProxy.url` adds them): an encrypted stream could not be read.

:meth:`PgProxy.cut_next` arms one cut, taken by the next connection that matches:

- ``"begin"``: the client's ``BEGIN ...`` is not forwarded and the connection is closed: lost
  inside the transaction, before any COMMIT (nothing committed);
- ``"commit-unsent"``: the client's query holding ``COMMIT`` is not forwarded: the client sent
  its COMMIT and never hears back, the server never saw it (nothing committed);
- ``"commit-answered"``: the COMMIT is forwarded and the server's ``CommandComplete COMMIT`` is
  not: the transaction committed, the client never hears it (the unknown-outcome case).

With ``keep_server=True`` only the client's side is closed: the server's process stays
connected (idle, or idle in its transaction), as when a network cut or a dead client host leaves
it running. :meth:`PgProxy.refuse` cuts every connection and refuses new ones (a server that is
down) until called with False. Every wait here has a deadline; threads end when their sockets close.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Literal

Cut = Literal["begin", "commit-unsent", "commit-answered"]


class _Link:
    """One client connection and its upstream connection, pumped by two threads."""

    def __init__(self, proxy: PgProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.client, self.server = proxy, client, server
        self.await_commit = False  # the COMMIT went up: cut at the server's CommandComplete COMMIT
        self.closed = False

    def close(self, keep_server: bool = False) -> None:
        """Close both sides (``keep_server``: the client's only; :meth:`PgProxy.close` closes
        the other)."""
        self.closed = True
        for s in (self.client,) if keep_server else (self.client, self.server):  # twice is fine
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self) -> None:
        keep = self.proxy._cut_done()
        self.close(keep_server=keep)

    def up(self) -> None:
        """Client to server: the StartupMessage, then typed messages, each checked against the cut."""
        buf = b""
        started = False
        try:
            while not self.closed:
                data = self.client.recv(65536)
                if not data:
                    break
                buf += data
                out = b""
                while True:
                    if not started:
                        if len(buf) < 8:
                            break
                        (n,) = struct.unpack("!I", buf[:4])
                        if len(buf) < n:
                            break
                        code = struct.unpack("!I", buf[4:8])[0]
                        assert code not in (80877103, 80877104), "connect with sslmode=disable&gssencmode=disable"
                        out, buf, started = out + buf[:n], buf[n:], True
                        continue
                    if len(buf) < 5:
                        break
                    (n,) = struct.unpack("!I", buf[1:5])
                    if len(buf) < 1 + n:
                        break
                    msg, buf = buf[:1 + n], buf[1 + n:]
                    action = self.proxy._match(msg)
                    if action == "drop":
                        if out:
                            self.server.sendall(out)
                        self.cut()
                        return
                    if action == "await":
                        self.await_commit = True
                    out += msg
                if out:
                    self.server.sendall(out)
        except OSError:
            pass
        finally:
            if not self.closed:
                self.close()

    def down(self) -> None:
        """Server to client: typed messages; cut at ``CommandComplete COMMIT`` when armed."""
        buf = b""
        try:
            while not self.closed:
                data = self.server.recv(65536)
                if not data:
                    break
                buf += data
                out = b""
                while len(buf) >= 5:
                    (n,) = struct.unpack("!I", buf[1:5])
                    if len(buf) < 1 + n:
                        break
                    msg, buf = buf[:1 + n], buf[1 + n:]
                    if self.await_commit and msg[:1] == b"C" and msg[5:] == b"COMMIT\0":
                        if out:
                            self.client.sendall(out)
                        self.cut()
                        return
                    out += msg
                if out:
                    self.client.sendall(out)
        except OSError:
            pass
        finally:
            if not self.closed:
                self.close()


class PgProxy:
    """Listens on a free port of 127.0.0.1 and forwards to ``upstream_port`` there.

    Attributes:
        cuts: connections cut by :meth:`cut_next` so far.
        port: the port it listens on.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._armed: Cut | None = None
        self._keep_server = False
        self._refusing = False
        self._links: list[_Link] = []
        self._threads: list[threading.Thread] = []
        self.cuts = 0
        self._closed = False
        self._spawn(self._accept)

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def url(self, url: str) -> str:
        """``url`` (of the upstream server on 127.0.0.1) through this proxy, unencrypted."""
        proxied = url.replace(f"127.0.0.1:{self.upstream[1]}", f"127.0.0.1:{self.port}")
        return proxied + ("&" if "?" in proxied else "?") + "sslmode=disable&gssencmode=disable"

    def cut_next(self, when: Cut, keep_server: bool = False) -> None:
        """Arm one cut (see the module docstring)."""
        with self._lock:
            self._armed, self._keep_server = when, keep_server

    def refuse(self, on: bool = True) -> None:
        """Cut every connection and refuse new ones (``on``), or accept them again."""
        with self._lock:
            self._refusing = on
            links = [x for x in self._links if not x.closed] if on else []
        for link in links:
            link.close()

    def _match(self, msg: bytes) -> str:
        """What to do with client message ``msg``: ``forward``, ``drop`` (cut here) or
        ``await`` (forward, cut at the server's answer)."""
        if msg[:1] != b"Q":
            return "forward"
        text = msg[5:-1].decode(errors="replace").upper()
        with self._lock:
            armed = self._armed
            if armed == "begin" and text.startswith("BEGIN"):
                self._armed = None
                return "drop"
            if armed in ("commit-unsent", "commit-answered") and "COMMIT" in text:
                self._armed = None
                return "drop" if armed == "commit-unsent" else "await"
        return "forward"

    def _cut_done(self) -> bool:
        """Count a cut; whether it keeps the server's side open."""
        with self._lock:
            self.cuts += 1
            return self._keep_server

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                refusing = self._refusing
            if refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            link = _Link(self, client, server)
            with self._lock:
                self._links.append(link)
            self._spawn(link.up)
            self._spawn(link.down)

    def close(self) -> None:
        """Stop listening, close every connection and wait for the threads (twice is fine)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()  # also the server's side a keep_server cut left open
        for t in self._threads:
            t.join(10)

    def __enter__(self) -> PgProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
