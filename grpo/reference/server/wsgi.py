"""The reference server's HTTP/1.1 layer: the threaded WSGI server its bottle app (app.py) runs on, built on
the standard library's wsgiref with the deadlines, keep-alive and drain a server facing a trainer needs.

    make_server(host, port, app) -> ThreadingWSGIServer (serve_forever / shutdown / server_close)
    connection_gone(environ)     whether the client of a request still being answered has left

- **Deadlines.** A connection must send its request line and headers within HEADER_TIMEOUT_S of its first byte
  (trickling a byte at a time does not extend it); its body gets BODY_GRACE_S plus a second per MiB, then the app
  answers 408; an idle kept connection is closed after KEEPALIVE_IDLE_S.
- **Keep-alive.** A connection is kept only after an answer with a Content-Length to a request whose whole body
  was read (anything else answers ``Connection: close``), so no body byte is ever read as the next request.
- **Drain.** Once ``draining`` is set (shutdown), connections with nothing in flight (idle, or still sending
  their headers) are dropped at once, a body still arriving gets at most DRAIN_GRACE_S, and requests being
  answered finish; ``server_close`` joins their threads.
- **A client that leaves** while its request waits for the device is seen (``connection_gone``), so its work is
  dropped.

Why not waitress or cheroot: docs/reference-server.md ("The HTTP layer"), measured by
scripts/benchmarks/http_servers.py.
"""

from __future__ import annotations

import io
import math
import select
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Optional
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer
from wsgiref.simple_server import make_server as wsgiref_server

HEADER_TIMEOUT_S = 10.0  # a connection must send its request line and headers within this
KEEPALIVE_IDLE_S = 120.0  # a kept connection may wait this long for its next request (then it is closed)
BODY_GRACE_S = 30.0  # and its body within this, plus one second per MiB (MIN_BODY_RATE)
MIN_BODY_RATE = 2**20  # bytes per second
DRAIN_GRACE_S = 5.0  # on shutdown, a body still arriving gets at most this long
POLL_S = 0.5  # a blocked read re-checks its deadline and the shutdown flag this often
SEND_TIMEOUT_S = 120.0  # an answer the client does not take for this long drops the connection


def content_length(raw: Optional[str]) -> Optional[int]:
    """A Content-Length header's value: None when absent; ValueError unless plain digits ('abc', '1e3', '-5')."""
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"Content-Length {raw!r} is not a non-negative integer")
    return int(raw)


def client_gone(sock: Optional[socket.socket]) -> bool:
    """Whether the client closed ``sock`` (its whole request was read, so anything readable now is the end)."""
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed
        return True


def connection_gone(environ: dict) -> bool:
    """Whether the client of this request (its whole body read) has closed its connection."""
    return client_gone(environ.get("grpo.connection"))


class ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per connection; closing waits for requests being handled (idle ones leave at once)."""

    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True  # a restarted server gets its port back at once

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.draining = threading.Event()  # build_server shares the app's


class ConnectionReader(io.RawIOBase):
    """A connection's reads against a deadline, re-checked every POLL_S; past it they raise TimeoutError.

    While the server drains, a connection waiting for its next request (``phase`` "idle") or still
    sending its request line and headers ("request") has nothing in flight and is dropped at once; a
    body still arriving gets DRAIN_GRACE_S. The first bytes of an idle connection start its "request"
    phase, so the header deadline counts from there, not from the previous answer.
    """

    def __init__(self, sock: socket.socket, draining: threading.Event):
        self.sock, self.draining = sock, draining
        self.phase = "request"
        self.deadline = math.inf  # time.monotonic() by which this phase's bytes must have arrived
        self._drain_deadline: Optional[float] = None

    def readable(self) -> bool:
        return True

    def _seconds_left(self) -> float:
        now = time.monotonic()
        deadline = self.deadline
        if self.draining.is_set():
            if self.phase in ("idle", "request"):
                return 0.0
            if self._drain_deadline is None:
                self._drain_deadline = now + DRAIN_GRACE_S
            deadline = min(deadline, self._drain_deadline)
        return deadline - now

    def readinto(self, buf: Any) -> int:
        while True:
            left = self._seconds_left()
            if left <= 0:
                raise TimeoutError(f"the client's {self.phase} did not arrive in time")
            self.sock.settimeout(min(left, POLL_S))
            try:
                n = self.sock.recv_into(buf)
            except TimeoutError:
                continue
            finally:
                self.sock.settimeout(SEND_TIMEOUT_S)
            if self.phase == "idle" and n:
                self.phase, self.deadline = "request", time.monotonic() + HEADER_TIMEOUT_S
            return n

    def wait_for_request(self) -> None:
        """Between two requests of a kept connection."""
        self.phase, self.deadline = "idle", time.monotonic() + KEEPALIVE_IDLE_S


class BodyInput:
    """``wsgi.input``: the request's body and no more (a read never waits for the next request of a kept
    connection); counts what the app took, so the connection is kept only once the whole body was read."""

    def __init__(self, stream: Any, length: int):
        self.stream, self.left = stream, length

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.stream.read(n) if n else b""
        self.left -= len(data)
        return data

    def readline(self, limit: int = -1) -> bytes:
        limit = self.left if limit is None or limit < 0 else min(limit, self.left)
        data = self.stream.readline(limit) if limit else b""
        self.left -= len(data)
        return data


class KeepAliveServerHandler(ServerHandler):
    """wsgiref's response writer, answering HTTP/1.1; says ``Connection: close`` unless the connection can
    carry another request (a Content-Length on the answer, the whole body read, the server not draining)."""

    http_version = "1.1"
    keep = False

    def cleanup_headers(self) -> None:
        super().cleanup_headers()
        h = self.request_handler
        self.keep = (not h.close_connection and "Content-Length" in self.headers and h.body.left == 0
                     and not h.server.draining.is_set())
        if not self.keep:
            self.headers["Connection"] = "close"

    def handle_error(self) -> None:  # an answer that failed half-way leaves the connection unusable
        self.keep = False
        super().handle_error()


def body_seconds(n: int) -> float:
    """How long a body of ``n`` bytes may take to arrive."""
    return BODY_GRACE_S + n / MIN_BODY_RATE


class QuietHandler(WSGIRequestHandler):
    """wsgiref's handler with deadlines on reading the request (:class:`ConnectionReader`) and keep-alive
    connections (BaseHTTPRequestHandler.handle serves requests until ``close_connection``)."""

    timeout = SEND_TIMEOUT_S
    protocol_version = "HTTP/1.1"  # parse_request keeps HTTP/1.1 connections unless asked to close

    def setup(self) -> None:
        super().setup()
        # the answer goes out as headers then body: without TCP_NODELAY, Nagle's algorithm holds the body's
        # last partial segment until the client acknowledges the headers (a delayed ACK: up to 40 ms)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile.close()
        self.reader = ConnectionReader(self.connection, self.server.draining)
        self.rfile = io.BufferedReader(self.reader)

    def handle(self) -> None:
        self.reader.deadline = time.monotonic() + HEADER_TIMEOUT_S  # the first request's line and headers
        BaseHTTPRequestHandler.handle(self)  # WSGIRequestHandler.handle would serve one request only

    def handle_one_request(self) -> None:
        """One request (as wsgiref's), its request line and headers due within HEADER_TIMEOUT_S of its first byte."""
        self.close_connection = True
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if not self.raw_requestline:
                return  # connected (or kept) and closed without a request
            if len(self.raw_requestline) > 65536:
                self.requestline, self.request_version, self.command = "", "", ""
                self.send_error(414)
                return
            if not self.parse_request():  # it has answered the error
                return
        except OSError:  # silent or trickling client, or the server is draining: nothing is in flight
            self.close_connection = True
            return
        try:
            n = content_length(self.headers.get("Content-Length")) or 0
        except ValueError:
            n, self.close_connection = 0, True  # the access-log middleware answers 400; the body's end is unknown
        self.reader.phase, self.reader.deadline = "body", time.monotonic() + body_seconds(n)
        self.body = BodyInput(self.rfile, n)  # wsgi.input
        handler = KeepAliveServerHandler(self.body, self.wfile, self.get_stderr(), self.get_environ(), multithread=False)
        handler.request_handler = self
        handler.run(self.server.get_app())
        self.close_connection = not handler.keep
        if not self.close_connection:
            self.reader.wait_for_request()

    def get_environ(self) -> dict:
        env = super().get_environ()
        env["grpo.connection"] = self.connection  # to notice a client that leaves while its request waits
        return env

    def log_message(self, format: str, *args: Any) -> None:  # the access log replaces wsgiref's lines
        pass


def make_server(host: str, port: int, app: Callable) -> ThreadingWSGIServer:
    """``app`` bound to ``host:port`` (not serving yet); set ``.draining`` to begin a shutdown."""
    return wsgiref_server(host, port, app, server_class=ThreadingWSGIServer, handler_class=QuietHandler)
