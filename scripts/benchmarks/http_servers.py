"""The reference server's HTTP layer (grpo/reference/server/wsgi.py) against the WSGI servers bottle runs on,
waitress and cheroot: the same probes of what a server facing a trainer needs, and the HTTP path's cost.

    pip install waitress cheroot        # not dependencies of the project: only this comparison needs them
    python scripts/benchmarks/http_servers.py [--requests 200] [--servers ours,waitress,cheroot]

Each server runs the same small bottle app (reading a body as the reference app does) in a process of its own on
loopback, each with its closest settings (a 1 s limit for headers and bodies: ours HEADER_TIMEOUT_S / BODY_GRACE_S,
waitress channel_timeout, cheroot timeout; a body limit of 1 MiB; 4 threads) and is stopped the way it supports
(ours SIGTERM, the libraries SIGINT). The probes:

    keep-alive      3 POSTs on one http.client connection use one socket
    trickled        a client sending a header byte every 0.2 s is dropped within 3 s
    starved         with 101 such clients open (more than the libraries' 4 threads, and than waitress's
                    default connection_limit of 100), another client is answered within 3 s
    stalled body    a body that stops arriving is answered (408) or dropped within 3 s
    over limit      a body announced at 10 MiB is refused (413) without being sent
    client left     a request whose client closed its connection while the app waits is seen as gone within 1 s
    drain           on the stop signal, with an idle, a trickling and a stalled connection open, the request
                    being answered (1.5 s of work, then 4 MiB) gets its whole answer and the server exits within 8 s
    cost            median (p90) of a keep-alive POST of 75 KiB answered with 64 KiB, through requests.Session

A server lacking a way to see a client leave fails that probe: a WSGI app cannot see it through the WSGI
environ alone (ours adds the socket, waitress its client_disconnected callable, cheroot's gateway is given
the socket here).
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LIMIT = 2**20  # bytes a body may have
UP, DOWN = 75 * 1024, 64 * 1024  # a 64 x (40 + 256) request and its answer (docs/results.md, bench_ref_http.py)
SERVERS = ("ours", "waitress", "cheroot")
THREADS = 4  # each server's request threads (ours: one per connection)
TRICKLERS = 101  # more than waitress's default connection_limit
DRAINED = 4 * 2**20  # the answer being written when the stop comes: 64 rows x 16k tokens of float32 log-probs


# --------------------------------------------------------------------------- the server side (a child process)


def probe_app(gone):
    """The app every server runs: ``gone(environ)`` says whether the request's client has left."""
    import bottle

    app = bottle.Bottle(catchall=True)
    seen: dict = {}

    def read_body() -> bytes:  # as the reference app reads one: 413 over the limit unread, 408 past its deadline
        n = int(bottle.request.environ.get("CONTENT_LENGTH") or 0)
        if n > LIMIT:
            raise bottle.HTTPResponse(status=413, body=f"{n} bytes: over the limit of {LIMIT}")
        try:
            return bottle.request.environ["wsgi.input"].read(n)
        except TimeoutError:
            raise bottle.HTTPResponse(status=408, body="the body did not arrive in time") from None

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.post("/echo")
    def echo():
        read_body()
        bottle.response.content_type = "application/octet-stream"
        return b"\x01" * DOWN

    @app.post("/wait")
    def wait():  # ?s=seconds of work, answered with ?n= bytes; notes when the client left
        read_body()
        t0 = time.monotonic()
        while time.monotonic() - t0 < float(bottle.request.query.get("s", "3")):
            if gone(bottle.request.environ):
                seen["gone_after_s"] = round(time.monotonic() - t0, 3)
                return {"gone": True}
            time.sleep(0.05)
        bottle.response.content_type = "application/octet-stream"
        return b"\x01" * int(bottle.request.query.get("n", "1"))

    @app.get("/seen")
    def report():
        return dict(seen)

    return app


def serve_ours(port: int) -> None:
    from grpo.reference.server import wsgi

    wsgi.HEADER_TIMEOUT_S, wsgi.BODY_GRACE_S = 1.0, 1.0
    httpd = wsgi.make_server("127.0.0.1", port, probe_app(wsgi.connection_gone))
    signal.signal(signal.SIGTERM, lambda *_: (httpd.draining.set(),
                                              threading.Thread(target=httpd.shutdown, daemon=True).start()))
    print("ready", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        httpd.server_close()


def serve_waitress(port: int) -> None:
    import waitress

    def gone(environ: dict) -> bool:
        check = environ.get("waitress.client_disconnected")
        return bool(check and check())

    server = waitress.create_server(probe_app(gone), host="127.0.0.1", port=port, threads=THREADS, channel_timeout=1,
                                    cleanup_interval=1, max_request_body_size=LIMIT, channel_request_lookahead=1)
    print("ready", flush=True)
    server.run()  # SIGINT: KeyboardInterrupt, which run() takes as its stop


def serve_cheroot(port: int) -> None:
    from cheroot import wsgi

    from grpo.reference.server.wsgi import client_gone

    class Gateway(wsgi.Gateway_10):
        def get_environ(self):
            return {**super().get_environ(), "grpo.connection": self.req.conn.socket}

    server = wsgi.Server(("127.0.0.1", port), probe_app(lambda env: client_gone(env.get("grpo.connection"))),
                         numthreads=THREADS, timeout=1, shutdown_timeout=5)
    server.gateway, server.max_request_body_size = Gateway, LIMIT
    print("ready", flush=True)
    server.safe_start()  # SIGINT: KeyboardInterrupt, which safe_start takes as its stop


# --------------------------------------------------------------------------- the probes (this process)


def start(name: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", name, "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{name} did not start (is it installed? pip install {name})")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} is not listening on {port}")


def closed_within(sock: socket.socket, seconds: float) -> tuple[float | None, bytes]:
    """(seconds until the server closed ``sock``, None if it did not within ``seconds``; what it answered)."""
    t0, data = time.monotonic(), b""
    sock.settimeout(seconds)
    try:
        while chunk := sock.recv(65536):
            data += chunk
        return time.monotonic() - t0, data
    except ConnectionResetError:
        return time.monotonic() - t0, data
    except TimeoutError:
        return None, data
    finally:
        sock.close()


def status_of(data: bytes) -> str:
    return data.split()[1].decode() if data.startswith(b"HTTP/") else "none"


def trickler(port: int, stop: threading.Event) -> tuple[socket.socket, threading.Thread]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")

    def send() -> None:
        while not stop.wait(0.2):
            try:
                sock.send(b"X")
            except OSError:
                return

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sock, sender


def stalled_body(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789")
    return sock


def probe_keep_alive(port: int) -> tuple[bool, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    socks = set()
    for _ in range(3):
        conn.request("POST", "/echo", body=b"\x00" * UP)
        r = conn.getresponse()
        ok = r.status == 200 and len(r.read()) == DOWN
        socks.add(id(conn.sock))
        if not ok:
            return False, f"status {r.status}"
    conn.close()
    return len(socks) == 1, f"{len(socks)} socket(s) for 3 requests"


def probe_trickled(port: int) -> tuple[bool, str]:
    stop = threading.Event()
    sock, sender = trickler(port, stop)
    took, _ = closed_within(sock, 10)
    stop.set()
    return took is not None and took <= 3, "still open after 10 s" if took is None else f"dropped after {took:.1f} s"


def probe_stalled(port: int) -> tuple[bool, str]:
    took, data = closed_within(stalled_body(port), 10)
    if took is None:
        return False, "still open after 10 s"
    return took <= 3, f"{'answered ' + status_of(data) if data else 'dropped, no answer'} after {took:.1f} s"


def probe_over_limit(port: int) -> tuple[bool, str]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {10 * LIMIT}\r\n\r\n".encode())
    sock.settimeout(3)
    try:
        data = sock.recv(65536)
    except TimeoutError:
        data = b""
    sock.close()
    return status_of(data) == "413", f"answered {status_of(data)} before the body"


def probe_client_left(port: int) -> tuple[bool, str]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /wait?s=2 HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbody")
    time.sleep(0.3)
    sock.close()
    time.sleep(2.0)
    seen = json.loads(_get(port, "/seen"))
    after = seen.get("gone_after_s")
    return after is not None and after <= 1.3, "never seen" if after is None else f"seen after {after:.2f} s"


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    data = conn.getresponse().read()
    conn.close()
    return data


def probe_drain(name: str, proc: subprocess.Popen, port: int) -> tuple[bool, str]:
    stop = threading.Event()
    idle = socket.create_connection(("127.0.0.1", port), timeout=10)
    trickle, _ = trickler(port, stop)
    stalled = stalled_body(port)
    answer: dict = {}

    def in_flight() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        try:
            conn.request("POST", f"/wait?s=1.5&n={DRAINED}", body=b"body")
            r = conn.getresponse()
            answer["status"], answer["bytes"] = r.status, len(r.read())
        except OSError as e:
            answer["error"] = f"{type(e).__name__}"

    client = threading.Thread(target=in_flight)
    client.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM if name == "ours" else signal.SIGINT)
    try:
        proc.wait(8)
        exited = f"exited after {time.monotonic() - t0:.1f} s"
    except subprocess.TimeoutExpired:
        exited = "still running after 8 s"
    client.join(20)
    stop.set()
    for s in (idle, trickle, stalled):
        s.close()
    if "status" in answer:
        got = f"in-flight answered {answer['status']}, {answer['bytes']} of {DRAINED} bytes"
    else:
        got = f"in-flight lost ({answer.get('error')})"
    whole = answer.get("status") == 200 and answer.get("bytes") == DRAINED
    return whole and proc.returncode is not None, f"{got}, {exited}"


def probe_starved(port: int) -> tuple[bool, str]:
    """More trickling clients than the server has threads or connections (waitress: connection_limit 100), then a
    request of another client."""
    stop = threading.Event()
    socks = [trickler(port, stop)[0] for _ in range(TRICKLERS)]
    t0 = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        return status == 200, f"answered {status} after {time.monotonic() - t0:.1f} s"
    except TimeoutError:
        return False, "no answer in 3 s"
    finally:
        stop.set()
        for s in socks:
            s.close()


def cost(port: int, n: int) -> tuple[float, float]:
    import requests

    with requests.Session() as s:
        times = []
        for _ in range(n + 5):
            t0 = time.perf_counter()
            r = s.post(f"http://127.0.0.1:{port}/echo", data=b"\x00" * UP, timeout=10)
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200 and len(r.content) == DOWN
    times = sorted(times[5:])
    return statistics.median(times) * 1000, times[int(0.9 * len(times))] * 1000


def run(name: str, n: int) -> dict:
    from grpo.reference.launch import free_port

    port = free_port()
    proc = start(name, port)
    out = {}
    try:
        for probe in (probe_keep_alive, probe_trickled, probe_starved, probe_stalled, probe_over_limit,
                      probe_client_left):
            try:
                out[probe.__name__[6:]] = probe(port)
            except Exception as e:  # a probe the server broke: its answer is the failure
                out[probe.__name__[6:]] = (False, f"{type(e).__name__}: {e}")
        median, p90 = cost(port, n)
        out["cost"] = (True, f"{median:.2f} ms ({p90:.2f})")
        out["drain"] = probe_drain(name, proc, port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        {"ours": serve_ours, "waitress": serve_waitress, "cheroot": serve_cheroot}[args.serve](args.port)
        return 0
    names = []
    for name in args.servers.split(","):
        if name not in SERVERS:
            p.error(f"--servers: {name!r} is not one of {list(SERVERS)}")
        if name != "ours" and importlib.util.find_spec(name) is None:
            print(f"{name}: not installed, left out (pip install {name})", file=sys.stderr)
            continue
        names.append(name)
    results = {name: run(name, args.requests) for name in names}
    probes = list(next(iter(results.values())))
    print("| probe | " + " | ".join(results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for probe in probes:
        cells = [("" if ok else "FAIL: ") + text for ok, text in (results[s][probe] for s in results)]
        print(f"| {probe} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
