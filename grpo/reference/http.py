"""The trainer's client of the reference server (``ref.url``; the server is ``ref_client.py``).

One keep-alive HTTP/1.1 connection per thread (http.client: about 1.3 ms a request less than ``requests``
on loopback, docs/results.md); connect/read timeouts; retries with exponential backoff and jitter
on connection errors, timeouts, 503 and other 5xx for up to ``ref.retry_window`` seconds, then
:class:`ReferenceServerError` naming the URL and how to start the server. Every attempt of one
log-prob request carries the same ``Idempotency-Key``, so a retry after a read timeout joins
the server's computation of the first attempt instead of queueing another copy; a warning
(once) says when ``ref.read_timeout`` is too short for the server's compute time. At start it
checks health and that the server's tokenizer and vocabulary are the policy's. ``submit`` runs the request on a background thread so the
trainer keeps working meanwhile; ``pop_metrics`` reports latency and bytes per step.
"""

from __future__ import annotations

import logging
import http.client
import json as jsonlib
import os
import random
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import requests
import torch

from grpo.foundation.config import Config, ConfigError
from grpo.foundation.logprobs import Packed, Scores
from grpo.reference.wire import CONTENT_TYPE, TOKEN_ENV, WireError, decode_scores, encode_request
from grpo.reference.protocol import ReferenceServerError

log = logging.getLogger("reference")
RETRY_LOG_S = 10.0  # an outage is logged at its first retry, then this often while it lasts

BACKOFF_BASE = 0.05  # seconds before the first retry; doubles each time
BACKOFF_CAP = 2.0


def backoff(attempt: int, retry_after: float = 0.0) -> float:
    """Seconds to wait before retry ``attempt`` (1, 2, ...): exponential, jittered, >= Retry-After."""
    step = min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (attempt - 1))
    return max(retry_after, step * random.uniform(0.5, 1.0))


@dataclass
class Answer:
    """One HTTP answer, read whole."""

    status_code: int
    headers: Any  # http.client.HTTPMessage: case-insensitive .get
    content: bytes

    def json(self) -> Any:
        return jsonlib.loads(self.content)


class ReadTimeout(TimeoutError):
    """Connected and sent, but no whole answer within ref.read_timeout."""


class Connections:
    """One keep-alive connection per thread to ``url``'s server. ``request`` sends, reads the whole answer and
    keeps the connection unless the server closes it; a kept connection that the server has closed meanwhile
    (it closes idle ones, docs/reference-server.md) is replaced once, at once, before the error counts."""

    def __init__(self, url: str, connect_timeout: float, read_timeout: Optional[float], headers: dict[str, str]):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"ref.url={url!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:59875)")
        self.cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.host, self.port, self.prefix = parts.hostname, parts.port, parts.path.rstrip("/")
        self.connect_timeout, self.read_timeout, self.headers = connect_timeout, read_timeout, headers
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _open(self) -> http.client.HTTPConnection:
        conn = self.cls(self.host, self.port, timeout=self.connect_timeout)
        conn.connect()  # TCP_NODELAY is set by http.client
        conn.sock.settimeout(self.read_timeout)
        with self._lock:
            self._all.append(conn)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()
            with self._lock:
                if conn in self._all:
                    self._all.remove(conn)

    def request(self, method: str, path: str, body: Optional[bytes], headers: dict[str, str]) -> Answer:
        headers = {**self.headers, **headers}
        for attempt in range(2):
            conn = getattr(self._local, "conn", None)
            kept = conn is not None
            try:
                if conn is None:
                    conn = self._local.conn = self._open()
            except OSError:
                self._local.conn = None
                raise
            try:
                conn.request(method, self.prefix + path, body=body, headers=headers)
                resp = conn.getresponse()
                answer = Answer(resp.status, resp.headers, resp.read())
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._drop()
                if kept and attempt == 0:
                    continue  # the server had closed the kept connection: once more on a new one
                raise
            except TimeoutError as e:
                self._drop()
                raise ReadTimeout(f"no answer within ref.read_timeout={self.read_timeout:g} s") from e
            except (OSError, http.client.HTTPException):
                self._drop()
                raise
            if resp.will_close:
                self._drop()
            return answer
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


def _retry_after(resp: Answer) -> float:
    try:
        return max(0.0, float(resp.headers.get("Retry-After", 0)))
    except ValueError:
        return 0.0


def _error_text(resp: Answer) -> str:
    try:
        payload = resp.json()
        field = f" [{payload['field']}]" if payload.get("field") else ""
        return f"HTTP {resp.status_code}{field}: {payload.get('error')}"
    except (ValueError, AttributeError, KeyError):
        return f"HTTP {resp.status_code}: {resp.content[:200].decode(errors='replace')}"


def how_to_start(url: str) -> str:
    """How to start the reference server that ``url`` should reach."""
    port = urlsplit(url).port or 59875
    return (f"Start it with `python ref_client.py --config <your config>` (or `python ref_client.py --model "
            f"<reference model> --port {port}`), or check ref.url.")


def probe(cfg: Config, teacher: bool = False, why: str = "") -> None:
    """At start, before any model loads: is anything listening at ``ref.url`` (``teacher``: at ``teacher.url``, the
    distillation teacher's server, with the same ``ref.*`` client settings)? A refused (or unreachable) connection
    is retried for ``ref.startup_wait`` seconds, then :class:`ReferenceServerError` naming the key and how to start
    the server: not the minute of ``ref.retry_window``, which is for outages of a server that was up. Anything that
    answers, even slowly or with an error, passes: the client's own checks and retries follow. ``why``: what the run
    asks the server for, said in the error."""
    r = cfg.ref
    url = cfg.teacher.url if teacher else r.url
    deadline = time.monotonic() + r.startup_wait
    while True:
        try:
            requests.get(url.rstrip("/") + "/health",
                         timeout=(min(r.connect_timeout, max(r.startup_wait, 1.0)), r.read_timeout))
            return
        except requests.ConnectionError as e:  # refused, reset, unreachable, connect timeout
            if time.monotonic() + 0.25 > deadline:
                if teacher:
                    start = ("the distillation teacher's server must run before training starts: start it with "
                             "`python ref_client.py --config <your config> ref.model=TEACHER ref.port=PORT` (or "
                             "`vllm serve TEACHER` with teacher.api: openai), or check teacher.url.")
                    raise ReferenceServerError(
                        f"nothing is listening at teacher.url={url!r} (tried for ref.startup_wait="
                        f"{r.startup_wait:g} s; {type(e).__name__}): {start} A server started at the same time as the "
                        f"trainer: raise ref.startup_wait (docs/distillation.md).") from None
                raise ReferenceServerError(
                    f"nothing is listening at ref.url={r.url!r} (tried for ref.startup_wait={r.startup_wait:g} s; "
                    f"{type(e).__name__}){f', and the run asks it: {why}' if why else ''}. The reference server must "
                    f"run before training starts: "
                    f"{how_to_start(r.url)} A server started at the same time as the trainer: raise "
                    f"ref.startup_wait. No server at all: ref.url=null keeps the reference in the trainer "
                    f"(docs/troubleshooting.md)."
                ) from None
            time.sleep(0.25)
        except requests.RequestException:  # it answered, or is slow: HTTPReference takes it from here
            return


def check_reload(cfg: Config) -> None:
    """With ``ref.sync_every``, the server must be able to reload the run's folders: at start, not at the first
    sync after that step's work (and again after every --resume). ConfigError naming the fix otherwise."""
    r = cfg.ref
    if not (r.url and r.sync_every):
        return
    token = r.token or os.environ.get(TOKEN_ENV)
    if not token:
        raise ConfigError(f"ref.sync_every={r.sync_every} reloads the reference server's weights, an admin request: "
                          f"set ref.token (or {TOKEN_ENV}) to the server's token")
    try:
        resp = requests.get(r.url.rstrip("/") + "/v1/info", headers={"Authorization": f"Bearer {token}"},
                            timeout=(r.connect_timeout, r.read_timeout))
        info = resp.json() if resp.status_code == 200 else {}
    except (requests.RequestException, ValueError):
        return  # the client's own checks and retries report an unreachable server
    reload = info.get("reload")
    if not isinstance(reload, dict):
        return  # a server from before this field: the first sync will tell
    if not reload.get("enabled"):
        raise ConfigError(f"ref.sync_every={r.sync_every}: the reference server at {r.url} cannot reload (it has "
                          f"no token); restart it with {TOKEN_ENV} set, or set ref.sync_every=0")
    root = reload.get("root")
    run = Path(cfg.train.output_dir).resolve()
    if root and not (run == Path(root) or Path(root) in run.parents):
        raise ConfigError(f"ref.sync_every={r.sync_every}: the reference server reloads only folders inside "
                          f"GRPO_REF_RELOAD_ROOT={root!r}, and this run writes its reference folders in {str(run)!r}: "
                          f"set train.output_dir inside it, or restart the server with a root that holds the run")


class HTTPReference:
    """Reference log-probs from a server; implements grpo.reference.protocol.Reference."""

    def __init__(self, cfg: Config, tokenizer=None, vocab_size: Optional[int] = None, role: str = "reference"):
        """``role`` "teacher" (distillation's teacher, at teacher.url): the server's teacher when it holds one beside
        its reference (started with --teacher-model), else its model."""
        self._connect(cfg, tokenizer, cfg.teacher.url if role == "teacher" else cfg.ref.url)
        self._request("GET", "/health")
        self.server_info = self.info()
        self.model_field = "teacher" if role == "teacher" and self.server_info.get("teacher") else "reference"
        self._check_compatible(tokenizer, vocab_size)

    def _connect(self, cfg: Config, tokenizer, url: str) -> None:
        """The client's state for the server at ``url`` (nothing sent yet): the client settings are ``ref``'s (the
        teacher's server shares them)."""
        r = cfg.ref
        self.url = url.rstrip("/")
        self.timeout = (r.connect_timeout, r.read_timeout)
        self.retry_window = r.retry_window
        self.rows_per_pass = cfg.train.micro_batch_size
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        token = r.token or os.environ.get(TOKEN_ENV)
        self.connections = Connections(self.url, r.connect_timeout, r.read_timeout,
                                       {"Authorization": f"Bearer {token}"} if token else {})
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ref-http")
        self._lock = threading.Lock()
        self._metrics = self._zero_metrics()
        self._warned_read_timeout = False

    # ------------------------------------------------------------------ transport
    def _how_to_start(self) -> str:
        return how_to_start(self.url)[:-1] + ", or raise ref.retry_window."

    def _request(self, method: str, path: str, body: Optional[bytes] = None, json: Optional[dict] = None,
                 content_type: Optional[str] = None, key: Optional[str] = None,
                 retry_5xx: bool = True) -> Answer:
        """The first non-retryable answer; retries connection errors, timeouts, 503 and 5xx within the window.

        ``key`` (the same on every attempt) lets the server recognise the retries of one request.
        ``retry_5xx=False``: a 500 (the server tried and failed) is final; 503 (busy) is still retried.
        """
        url = self.url + path
        deadline = time.monotonic() + self.retry_window
        if json is not None:
            body, content_type = jsonlib.dumps(json).encode(), "application/json"
        headers = {"Content-Type": content_type} if content_type else {}
        if key:
            headers["Idempotency-Key"] = key
        attempt = 0
        said = 0.0  # when the outage was last logged: the first retry, then every RETRY_LOG_S seconds
        while True:
            try:
                resp = self.connections.request(method, path, body, headers)
                if resp.status_code < 500 or (not retry_5xx and resp.status_code != 503):
                    if resp.status_code >= 400:
                        raise ReferenceServerError(f"reference server at {url} refused the request: {_error_text(resp)}")
                    return resp
                last, wait_at_least = _error_text(resp), _retry_after(resp)
            except (OSError, http.client.HTTPException) as e:  # connection refused/reset, timeouts
                last, wait_at_least = f"{type(e).__name__}: {e}", 0.0
                if isinstance(e, ReadTimeout):
                    last += (" (the server may need longer than that for this request; raise ref.read_timeout)")
            attempt += 1
            delay = backoff(attempt, wait_at_least)
            if time.monotonic() + delay > deadline:
                raise ReferenceServerError(
                    f"reference server at {url} is unavailable: no answer after {attempt} attempts within "
                    f"ref.retry_window={self.retry_window:g} s (last error: {last}). {self._how_to_start()}"
                )
            with self._lock:
                self._metrics["ref/retries"] += 1
            now = time.monotonic()
            if attempt == 1 or now - said >= RETRY_LOG_S:
                said = now
                log.warning("reference server at %s: no answer (%s); retry %d, for up to %.0f s more "
                            "(ref.retry_window=%g s)", url, last, attempt, deadline - now, self.retry_window)
            time.sleep(delay)

    # ------------------------------------------------------------------ start-up checks
    def _check_compatible(self, tokenizer, vocab_size: Optional[int]) -> None:
        info = self.server_info if self.model_field == "reference" else self.server_info["teacher"]
        problems = []
        if tokenizer is not None:
            from grpo.foundation.modeling import tokenizer_fingerprint

            mine = tokenizer_fingerprint(tokenizer)
            if info.get("tokenizer_fingerprint") != mine:
                problems.append(f"tokenizer fingerprint {info.get('tokenizer_fingerprint')} ({info.get('tokenizer_size')} "
                                f"tokens) != the policy's {mine} ({len(tokenizer)} tokens)")
        if vocab_size is not None and info.get("vocab_size") != vocab_size:
            problems.append(f"vocabulary size {info.get('vocab_size')} != the policy's {vocab_size}")
        if problems:
            raise ConfigError(
                f"the reference server at {self.url} serves {info.get('model')!r}, which does not match the policy: "
                + "; ".join(problems)
                + ". Token ids would mean different text to the two models, so the KL term would be meaningless. "
                "Serve a reference of the policy's model family (usually the policy's starting checkpoint): "
                "python ref_client.py --config <this run's config>"
            )

    # ------------------------------------------------------------------ the Reference protocol
    def logprobs(self, packed: Packed, temperature: float, with_entropy: bool = False
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[rows, width] float32 log-probs (and entropy) of ``packed``'s completion tokens."""
        s = self.scores(packed, temperature, with_entropy)
        return s.logprobs, s.entropy

    def scores(self, packed: Packed, temperature: float, with_entropy: bool = False, top_k: int = 0) -> Scores:
        """[rows, width] float32 log-probs of ``packed``'s completion tokens (and entropy; and the ``top_k`` most
        likely next tokens at each position, [rows, width, top_k])."""
        t_enc = time.perf_counter()
        body = encode_request(packed, temperature, with_entropy, self.pad_id, self.rows_per_pass, top_k,
                              self.model_field)
        t0 = time.perf_counter()
        resp = self._request("POST", "/v1/logprobs", body=body, content_type=CONTENT_TYPE, key=uuid.uuid4().hex)
        t_dec = time.perf_counter()
        try:
            scores, header = decode_scores(resp.content, packed.length, packed.width, top_k)
        except WireError as e:
            raise ReferenceServerError(f"reference server at {self.url} sent a malformed answer: {e}") from None
        self._check_read_timeout(float(header.get("compute_ms", 0.0)) / 1000, packed.input_ids.shape[0])
        t1 = time.perf_counter()
        with self._lock:
            m = self._metrics
            m["ref/latency"] += t1 - t0
            m["ref/server_compute"] += float(header.get("compute_ms", 0.0)) / 1000
            m["ref/server_parse"] += float(header.get("parse_ms", 0.0)) / 1000
            m["ref/server_wait"] += float(header.get("wait_ms", 0.0)) / 1000
            m["ref/client_codec"] += (t0 - t_enc) + (t1 - t_dec)
            m["ref/bytes_sent"] += len(body)
            m["ref/bytes_received"] += len(resp.content)
            m["ref/requests"] += 1
        return scores

    def _check_read_timeout(self, compute_s: float, rows: int) -> None:
        """Warn once when the server's compute time for one request is over half of ref.read_timeout."""
        read_timeout = self.timeout[1]
        if self._warned_read_timeout or read_timeout is None or compute_s <= read_timeout / 2:
            return
        self._warned_read_timeout = True
        warnings.warn(
            f"the reference server at {self.url} needed {compute_s:.2f} s to compute one request ({rows} rows), "
            f"but ref.read_timeout={read_timeout:g} s: requests that take longer time out and are retried "
            f"(each retry joins the server's computation, but waits out a timeout and a backoff). "
            f"Set ref.read_timeout to at least {max(2 * read_timeout, 3 * compute_s):.3g} s.",
            RuntimeWarning, stacklevel=3)

    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]":
        return self._pool.submit(lambda: self.logprobs(packed, temperature)[0])

    def submit_topk(self, packed: Packed, temperature: float, top_k: int) -> "Future[Scores]":
        return self._pool.submit(lambda: self.scores(packed, temperature, top_k=top_k))

    def info(self) -> dict:
        return self._request("GET", "/v1/info").json()

    def reload(self, checkpoint_dir: str) -> dict:
        """Ask the server to load new reference weights (admin: needs the token).

        Retried only where that cannot load twice: every attempt carries one Idempotency-Key, so
        a retry after a read timeout (a slow load) waits for the same load; a failed load (500)
        is not retried.
        """
        resp = self._request("POST", "/v1/reload", json={"checkpoint": str(checkpoint_dir)}, key=uuid.uuid4().hex,
                             retry_5xx=False)
        self.server_info = resp.json()
        return self.server_info

    # ------------------------------------------------------------------ metrics
    @staticmethod
    def _zero_metrics() -> dict[str, float]:
        return {"ref/latency": 0.0, "ref/server_compute": 0.0, "ref/server_parse": 0.0, "ref/server_wait": 0.0,
                "ref/client_codec": 0.0, "ref/bytes_sent": 0.0, "ref/bytes_received": 0.0, "ref/requests": 0.0,
                "ref/retries": 0.0}

    def pop_metrics(self) -> dict[str, float]:
        """Totals since the last call (one training step): seconds, bytes, requests, retries."""
        with self._lock:
            out, self._metrics = self._metrics, self._zero_metrics()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.connections.close()
