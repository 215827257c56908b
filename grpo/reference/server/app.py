"""The reference server's HTTP side: a bottle app on a multi-threaded WSGI server.

    GET  /health        alive and model loaded (503 while shutting down)
    GET  /v1/info       model, weights hash / version, vocabulary, tokenizer fingerprint, dtype, device, limits
    POST /v1/logprobs   binary request -> binary answer (grpo/reference/wire.py)
    POST /v1/reload     admin: {"checkpoint": "/path"} -> new weights, then /v1/info's answer; one at a
                        time (409 meanwhile), once per Idempotency-Key; safetensors only, never a folder
                        with pickles, and inside GRPO_REF_RELOAD_ROOT when that is set
    POST /v1/reward     with --reward-model: JSON {"prompts": [text or messages], "completions": [text]}
                        -> {"scores": [...], "version", "rows", "compute_ms"} (grpo/scoring/models.py), through
                        the same queue, limits and Idempotency-Key joining as /v1/logprobs
    POST /v1/reward/reload  admin: as /v1/reload, for the reward model (atomic: each answer names its version)

A request may carry ``Idempotency-Key: <unique id>``; a retry with the same key and body joins
the first one's computation (or takes its answer) instead of computing it again, and work whose
client has disconnected is dropped (grpo/reference/server/worker.py).

Every request needs ``Authorization: Bearer <token>`` when the server has a token; a server
without one only binds loopback. Errors are JSON ``{"error", "field", "status"}``. One JSON
access-log line per request (method, path, status, latency, bytes) goes to stderr.
SIGTERM/SIGINT stop accepting connections, let in-flight requests finish, then exit 0.

The app runs on wsgi.py's HTTP/1.1 server: keep-alive connections (the trainer's pooled session sends every
request of a run over one connection), deadlines on a client's request line, headers and body (a body late
past its deadline gets 408 here), and a drain on shutdown that does not wait for idle or stalled connections.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Optional, TextIO

import bottle
import torch

from grpo.foundation import dist
from grpo.foundation.config import Config, ConfigError
from grpo.reference.wire import CONTENT_TYPE, TOKEN_ENV, WireError, encode_flat_response, parse_request
from grpo.reference.server.worker import DeviceWorker, Job, QueueFull, ReloadBusy
from grpo.reference.server.wsgi import ThreadingWSGIServer, body_seconds, connection_gone, content_length, make_server


RELOAD_ROOT_ENV = "GRPO_REF_RELOAD_ROOT"  # when set, /v1/reload only reads folders inside it
WAIT_POLL_S = 0.1  # while a request waits for the device, its client's connection is checked this often
KEY_HEADER = "Idempotency-Key"  # the client's id of one logical request, the same on every retry
PARSE_SLOTS = 4  # request bodies read and parsed at once (each up to max_request_bytes, about 3x that decoded)
PARSE_WAIT_S = 10.0  # how long a request waits for a parse slot before a 503


@dataclass
class ServerLimits:
    max_request_bytes: int
    max_batch_tokens: int
    parse_slots: int = PARSE_SLOTS
    parse_wait_s: float = PARSE_WAIT_S

    @property
    def max_padded_tokens(self) -> int:
        """rows x longest row per request: no more forward work than a full-size body of real int32 tokens."""
        return self.max_request_bytes // 4


class Slots:
    """A counting semaphore that reports how many slots are taken."""

    def __init__(self, n: int):
        self._sem = threading.BoundedSemaphore(n)
        self._lock = threading.Lock()
        self.n = n
        self.busy = 0

    def acquire(self, timeout: float) -> bool:
        if not self._sem.acquire(timeout=timeout):
            return False
        with self._lock:
            self.busy += 1
        return True

    def release(self) -> None:
        with self._lock:
            self.busy -= 1
        self._sem.release()


# --------------------------------------------------------------------------- security


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def check_bind(host: str, token: Optional[str]) -> None:
    """Refuse to serve an address other machines can reach without a token."""
    if not token and not is_loopback(host):
        raise ConfigError(
            f"ref.host={host!r} is reachable from other machines, so a token is required: "
            f"set {TOKEN_ENV} (or --token / ref.token), or bind 127.0.0.1"
        )


def resolve_token(explicit: Optional[str]) -> Optional[str]:
    """The server's bearer token: the flag or config value, else the environment variable."""
    return explicit or os.environ.get(TOKEN_ENV) or None


# --------------------------------------------------------------------------- logging


class AccessLog:
    """JSON lines, one per event; thread-safe."""

    def __init__(self, stream: TextIO = sys.stderr):
        self.stream = stream
        self.lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ts": round(time.time(), 3), "event": event, **fields})
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()


def _refuse(start_response: Callable, status: int, message: str, field: str) -> list[bytes]:
    """A JSON error answered by the middleware itself, before the app sees the request."""
    body = json.dumps({"error": message, "field": field, "status": status}).encode()
    reason = "Bad Request" if status == 400 else "Error"
    start_response(f"{status} {reason}", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def with_access_log(app: Callable, log: AccessLog) -> Callable:
    """WSGI middleware: one 'request' line with status and latency per request.

    A malformed Content-Length is answered here (JSON 400), so the app only sees valid ones.
    """

    def wrapped(environ: dict, start_response: Callable):
        t0 = time.perf_counter()
        seen: dict[str, Any] = {}

        def capture(status: str, headers: list, exc_info=None):
            seen["status"] = int(status.split()[0])
            seen["bytes_out"] = next((int(v) for k, v in headers if k.lower() == "content-length"), None)
            return start_response(status, headers, exc_info)

        refused: Optional[str] = None
        try:
            bytes_in: Optional[int] = content_length(environ.get("CONTENT_LENGTH")) or 0
        except ValueError as e:
            bytes_in, refused = None, str(e)
            environ["grpo.log"] = {"error": refused, "field": "Content-Length"}
        try:
            if refused:
                return _refuse(capture, 400, refused, "Content-Length")
            return app(environ, capture)
        finally:
            log("request", method=environ.get("REQUEST_METHOD"), path=environ.get("PATH_INFO"),
                status=seen.get("status"), latency_ms=round((time.perf_counter() - t0) * 1000, 2),
                bytes_in=bytes_in, bytes_out=seen.get("bytes_out"),
                client=environ.get("REMOTE_ADDR"), **environ.get("grpo.log", {}))

    return wrapped


# --------------------------------------------------------------------------- the app


def error(status: int, message: str, field: Optional[str] = None, **headers: str) -> bottle.HTTPResponse:
    body = json.dumps({"error": message, "field": field, "status": status})
    bottle.request.environ["grpo.log"] = {"error": message, **({"field": field} if field else {})}
    return bottle.HTTPResponse(body, status=status, headers={"Content-Type": "application/json", **headers})


def _json(payload: dict, status: int = 200) -> bottle.HTTPResponse:
    return bottle.HTTPResponse(json.dumps(payload), status=status, headers={"Content-Type": "application/json"})


def _drain(stream: Any, n: int) -> None:
    """Read and drop ``n`` body bytes, so the client sees our answer rather than a reset connection."""
    try:
        while n > 0:
            chunk = stream.read(min(1 << 20, n))
            if not chunk:
                return
            n -= len(chunk)
    except OSError:  # the client stalled or left: it gets the answer or nothing
        return


def _content_length() -> int:
    """The request's Content-Length (411 when absent; the middleware already refused malformed ones)."""
    raw = bottle.request.environ.get("CONTENT_LENGTH")
    try:
        n = content_length(raw)
    except ValueError as e:
        raise error(400, str(e), "Content-Length") from None
    if n is None:
        raise error(411, "a Content-Length header is required", "Content-Length")
    return n


def _read_body(limit: int) -> bytes:
    """The body, at most ``limit`` bytes (413 beyond); needs a Content-Length (411)."""
    n = _content_length()
    stream = bottle.request.environ["wsgi.input"]
    if n > limit:
        _drain(stream, n if n <= 2 * limit else 0)
        raise error(413, f"request body of {n} bytes exceeds the server's limit of {limit} bytes "
                         f"(ref.max_request_mb); send fewer rows per request or raise the limit", "body")
    try:
        body = stream.read(n)
    except TimeoutError:
        raise error(408, f"the body did not arrive in time: a {n}-byte body has {body_seconds(n):g} s", "body") from None
    except OSError as e:
        raise error(400, f"reading the body failed ({e})", "body") from None
    if len(body) != n:
        raise error(400, f"body truncated: Content-Length says {n} bytes, {len(body)} arrived", "body")
    return body


def _parse(limits: ServerLimits, slots: Slots, vocab_size: int):
    """(request, body hash): read and validate a logprobs request within a parse slot (503 when none frees up in time)."""
    if not slots.acquire(timeout=limits.parse_wait_s):
        n = _content_length()
        _drain(bottle.request.environ["wsgi.input"], n if n <= limits.max_request_bytes else 0)
        raise error(503, f"the server is busy reading and parsing {slots.n} other requests; retry later",
                    None, **{"Retry-After": "1"})
    try:
        body = _read_body(limits.max_request_bytes)
        req = parse_request(body, vocab_size, limits.max_batch_tokens, limits.max_padded_tokens)
        return req, hashlib.blake2b(body, digest_size=16).digest()
    except WireError as e:
        raise error(e.status, e.message, e.field) from None
    finally:
        slots.release()


MAX_REWARD_ROWS = 65536


def load_json(body: bytes) -> Any:
    """A client's JSON body; ValueError (the caller's 400) for bad JSON, too deeply nested JSON included."""
    try:
        return json.loads(body or b"null")
    except RecursionError:
        raise ValueError("nested too deeply") from None


MAX_PATH_CHARS = 4096  # PATH_MAX on Linux: a longer checkpoint path names no folder


def parse_reward_request(body: bytes) -> tuple[list, list[str]]:
    """(prompts, completions) of a /v1/reward body; WireError (400) naming the bad field otherwise."""
    try:
        payload = load_json(body)
    except ValueError as e:
        raise WireError("body", f"body is not JSON ({e}); send {{\"prompts\": [...], \"completions\": [...]}}")
    if not isinstance(payload, dict):
        raise WireError("body", "body must be a JSON object with prompts and completions")
    prompts, completions = payload.get("prompts"), payload.get("completions")
    if not isinstance(completions, list) or not all(isinstance(c, str) for c in completions):
        raise WireError("completions", "must be a list of strings")
    if not isinstance(prompts, list) or len(prompts) != len(completions):
        raise WireError("prompts", f"must be a list as long as completions ({len(completions)})")
    if not 0 < len(completions) <= MAX_REWARD_ROWS:
        raise WireError("completions", f"{len(completions)} rows: send 1 to {MAX_REWARD_ROWS}")
    for i, p in enumerate(prompts):
        chat = isinstance(p, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in p)
        if not (isinstance(p, str) or chat):
            raise WireError("prompts", f"prompts[{i}] must be a string or a list of {{role, content}} strings")
    return prompts, completions


def _idempotency_key() -> Optional[str]:
    """The request's Idempotency-Key (None without one; 400 unless 1-128 printable ASCII characters)."""
    key = bottle.request.get_header(KEY_HEADER)
    if key is None:
        return None
    if not (0 < len(key) <= 128 and key.isascii() and key.isprintable()):
        raise error(400, f"{KEY_HEADER} {key[:40]!r} must be 1 to 128 printable ASCII characters, e.g. a UUID", KEY_HEADER)
    return key


def _await(worker: DeviceWorker, job: Job) -> Optional[Any]:
    """The job's result, or None once this request's client has gone (the worker then drops work nobody awaits)."""
    environ = bottle.request.environ
    try:
        while True:
            try:
                return job.future.result(timeout=WAIT_POLL_S)
            except FutureTimeout:
                if connection_gone(environ):
                    return None
    finally:
        worker.leave(job)


def _queued(worker: DeviceWorker, submit: Callable[[], Job], failed: str) -> tuple[Any, Any]:
    """Queue a job (``submit``) and wait for its result: (result, None), or (None, the error response): 503 with
    Retry-After when the queue is full, 500 when it failed, 499 when the client left first."""
    try:
        job = submit()
    except QueueFull as e:
        return None, error(503, f"the server is busy ({worker.max_queue} requests queued); retry later",
                           None, **{"Retry-After": str(e.retry_after)})
    try:
        result = _await(worker, job)
    except Exception as e:  # e.g. out of device memory: the client may retry; the worker lives on
        return None, error(500, f"{failed}: {type(e).__name__}: {e}")
    if result is None:
        return None, error(499, "the client closed the connection before the answer was ready")
    return result, None


def create_app(worker: DeviceWorker, limits: ServerLimits, token: Optional[str],
               draining: threading.Event) -> bottle.Bottle:
    app = bottle.Bottle(catchall=True)
    slots = Slots(limits.parse_slots)

    def json_error_page(err: bottle.HTTPError) -> str:  # bottle's own errors (404, 405, 500) as JSON
        bottle.response.content_type = "application/json"
        if err.status_code >= 500 and err.exception is not None:
            message = f"internal error: {type(err.exception).__name__}: {err.exception}"
        else:
            message = str(err.body)
        return json.dumps({"error": message, "field": None, "status": err.status_code})

    app.default_error_handler = json_error_page

    @app.hook("before_request")
    def authenticate() -> None:
        if not token:
            return
        got = bottle.request.get_header("Authorization", "")
        if not got.startswith("Bearer "):
            raise error(401, f"missing bearer token: send 'Authorization: Bearer <token>' "
                             f"(client: ref.token or {TOKEN_ENV})", "Authorization", **{"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(got[len("Bearer "):].encode(), token.encode()):
            raise error(403, "wrong bearer token", "Authorization")

    @app.get("/health")
    def health():
        if draining.is_set():
            return _json({"status": "shutting down"}, 503)
        queued, running = worker.load()
        return _json({"status": "ok", "model": worker.current.source, "version": worker.version,
                      "queued": queued, "running": running, "parsing": slots.busy})

    @app.get("/v1/info")
    def info():
        out = worker.info()
        # whether /v1/reload can serve a trainer's ref.sync_every (checked at its start: grpo/reference/http.py)
        out["reload"] = {"enabled": bool(token), "root": None if worker.reload_root is None else str(worker.reload_root)}
        out["limits"].update(max_request_bytes=limits.max_request_bytes, max_padded_tokens=limits.max_padded_tokens,
                             parse_slots=limits.parse_slots)
        return _json(out)

    @app.post("/v1/logprobs")
    def logprobs():
        t0 = time.perf_counter()
        req, digest = _parse(limits, slots, worker.current.vocab_size)
        if req.model == "teacher" and worker.teacher is None:
            return error(404, "this server holds no teacher: start it with --teacher-model", "model")
        key = _idempotency_key()
        t1 = time.perf_counter()
        result, failed = _queued(worker, lambda: worker.submit(req, None if key is None else (key, digest)),
                                 "computing log-probs failed")
        if failed is not None:
            return failed
        scores, seconds, version = result
        # where the server's time went besides the forward (scripts/benchmarks/bench_ref_http.py): reading and checking the
        # body, and the wait for the device thread beyond its compute (queue, hand-off)
        parse_ms, wait_ms = (t1 - t0) * 1000, (time.perf_counter() - t1 - seconds) * 1000
        bottle.request.environ["grpo.log"] = {"rows": req.rows, "tokens": req.tokens,
                                              "compute_ms": round(seconds * 1000, 2), "version": version}
        topk = (scores.topk_logprobs, scores.topk_ids) if req.top_k else None
        out = encode_flat_response(scores.logprobs, scores.entropy,
                                   {"version": version, "rows": req.rows, "tokens": req.tokens,
                                    "compute_ms": seconds * 1000, "parse_ms": parse_ms, "wait_ms": wait_ms}, topk)
        return bottle.HTTPResponse(out, status=200, headers={"Content-Type": CONTENT_TYPE})

    @app.post("/v1/reward")
    def reward():
        if worker.reward is None:
            return error(404, "this server hosts no reward model: start it with --reward-model", "path")
        if not slots.acquire(timeout=limits.parse_wait_s):
            n = _content_length()
            _drain(bottle.request.environ["wsgi.input"], n if n <= limits.max_request_bytes else 0)
            return error(503, "the server is busy parsing other requests; retry later", None, **{"Retry-After": "1"})
        try:
            body = _read_body(limits.max_request_bytes)
            prompts, completions = parse_reward_request(body)
        except WireError as e:
            return error(e.status, e.message, e.field)
        finally:
            slots.release()
        key = _idempotency_key()
        digest = hashlib.blake2b(b"reward" + body, digest_size=16).digest()
        result, failed = _queued(worker, lambda: worker.submit_reward(prompts, completions,
                                                                      None if key is None else (key, digest)),
                                 "scoring failed")
        if failed is not None:
            return failed
        scores, seconds, version = result
        bottle.request.environ["grpo.log"] = {"rows": len(scores), "compute_ms": round(seconds * 1000, 2),
                                              "reward_version": version}
        return _json({"scores": scores, "version": version, "rows": len(scores), "compute_ms": seconds * 1000})

    @app.post("/v1/reward/reload")
    def reward_reload():
        return reload("reward")

    @app.post("/v1/reload")
    def reload(target: str = "reference"):
        if not token:
            return error(403, f"reload is an admin endpoint and this server has no token; restart it with "
                              f"{TOKEN_ENV} (or --token) set", "Authorization")
        try:
            payload = load_json(_read_body(limits.max_request_bytes))
        except ValueError as e:
            return error(400, f"body is not JSON ({e}); send {{\"checkpoint\": \"/path/to/folder\"}}", "body")
        path = payload.get("checkpoint") if isinstance(payload, dict) else None
        if not isinstance(path, str) or not path:
            return error(400, f"must be a folder path string, got {str(path)[:200]!r}", "checkpoint")
        if len(path) > MAX_PATH_CHARS:
            return error(400, f"a path of {len(path)} characters names no folder (at most {MAX_PATH_CHARS})",
                         "checkpoint")
        try:
            future = worker.reload(path, _idempotency_key(), target)
        except ReloadBusy as e:
            return error(409, str(e), "checkpoint")
        try:
            return _json(future.result())
        except ConfigError as e:
            return error(400, str(e), "checkpoint")
        except OSError as e:  # the client's path: too long a name, not readable...
            return error(400, f"{path[:200]!r} cannot be read: {e.strerror or e}", "checkpoint")

    return app


# --------------------------------------------------------------------------- the server


@dataclass
class RefServer:
    """A bound, not yet serving, reference server."""

    httpd: ThreadingWSGIServer
    worker: DeviceWorker
    draining: threading.Event
    log: AccessLog

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def begin_shutdown(self, reason: str) -> None:
        """Stop accepting connections (callable from any thread, e.g. a signal handler)."""
        self.draining.set()
        self.log("shutting down", reason=reason, queued=self.worker.load()[0])
        threading.Thread(target=self.httpd.shutdown, daemon=True).start()  # shutdown() waits for serve_forever

    def serve_until_shutdown(self) -> None:
        try:
            self.httpd.serve_forever(poll_interval=0.2)
        finally:
            self.httpd.server_close()  # joins the request threads: in-flight requests finish
            self.worker.stop()
        self.log("stopped")


def build_server(cfg: Config, device: str, log: Optional[AccessLog] = None, reward: Optional[dict] = None,
                 teacher: Optional[str] = None) -> RefServer:
    """Load the reference model (and ``reward``'s model: {model, label, dtype, batch_tokens, load: its loader,
    e.g. grpo.scoring.models.RewardModel}; and ``teacher``, a
    distillation teacher beside it) and bind ``ref.host:ref.port`` (refusing an open address without a token)."""
    log = log or AccessLog()
    r = cfg.ref
    token = resolve_token(r.token)
    check_bind(r.host, token)
    source = r.model or cfg.model.name_or_path
    # on CUDA the host only parses and encodes: one CPU thread unless OMP_NUM_THREADS says (dist.host_threads)
    threads = dist.host_threads(True) if str(device).startswith("cuda") else torch.get_num_threads()
    log("loading", model=source, dtype=cfg.model.dtype, device=device, cpu_threads=threads)
    t0 = time.perf_counter()
    reload_root = os.environ.get(RELOAD_ROOT_ENV) or None
    worker = DeviceWorker(cfg.model, source, device, r.max_batch_tokens, r.max_queue, cfg.train.logprob_chunk_size,
                          reload_root, reward, teacher)
    limits = ServerLimits(max_request_bytes=int(r.max_request_mb * 2**20), max_batch_tokens=r.max_batch_tokens,
                          parse_slots=PARSE_SLOTS, parse_wait_s=PARSE_WAIT_S)
    draining = threading.Event()
    app = with_access_log(create_app(worker, limits, token, draining), log)
    httpd = make_server(r.host, r.port, app)
    httpd.draining = draining
    server = RefServer(httpd, worker, draining, log)
    info = worker.info()
    log("ready", url=server.url, model=source, weights_hash=info["weights_hash"], dtype=info["dtype"],
        device=info["device"], auth=bool(token), reload_root=reload_root, load_s=round(time.perf_counter() - t0, 2))
    return server


def serve(cfg: Config, device: str, log: Optional[AccessLog] = None, reward: Optional[dict] = None,
          teacher: Optional[str] = None) -> int:
    """Serve until SIGTERM/SIGINT (a second signal exits at once); returns the exit code."""
    server = build_server(cfg, device, log, reward, teacher)

    def on_signal(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if server.draining.is_set():
            server.log("forced exit", signal=name)
            os._exit(1)
        server.begin_shutdown(name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.serve_until_shutdown()
    return 0
