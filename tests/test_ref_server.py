"""The reference server as a real subprocess on loopback: exactness, concurrency, bad input,
reload and graceful shutdown. The last test stops the module's server (SIGTERM)."""

from __future__ import annotations

import http.client
import socket
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from safetensors.torch import save as st_save

from grpo.foundation.logprobs import pack
from grpo.training.configure import load_config
from grpo.reference.http import HTTPReference
from grpo.reference.launch import ServerProcess, free_port
from grpo.reference.wire import CONTENT_TYPE, decode_response, encode, encode_request, flatten_packed
from grpo.reference.protocol import sliced_logprobs
from grpo.reference.in_process import InProcessReference
from grpo.foundation.tiny import make_char_tokenizer, make_tiny_model, write_tiny
from tests.ref_support import assert_same, log_events, one_thread, ragged_batch, trickle_headers  # noqa: F401 (one_thread: autouse)
from tests.patience import SERVER_S, WAIT_S

pytestmark = pytest.mark.slow

TOKEN = "test-token-123"
MAX_REQUEST_MB = 0.1
QUEUE = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref_server")
    return {"root": root, "model": write_tiny(root / "tiny"), "log": root / "server.log"}


@pytest.fixture(scope="module")
def server(dirs):
    srv = ServerProcess(["--model", str(dirs["model"]), "--max-queue", str(QUEUE), "--max-request-mb", str(MAX_REQUEST_MB)],
                        port=free_port(), token=TOKEN, log_path=dirs["log"], env={"OMP_NUM_THREADS": "1"})
    srv.start(timeout=SERVER_S)
    yield srv
    srv.stop()


def cfg_for(server, dirs, micro_batch_size: int = 4):
    return load_config(None, None, [f"ref.url={server.url}", f"ref.token={TOKEN}", f"model.name_or_path={dirs['model']}",
                                    f"train.micro_batch_size={micro_batch_size}", "ref.retry_window=60"])


@pytest.fixture(scope="module")
def inproc(server, dirs):
    return InProcessReference(cfg_for(server, dirs), torch.device("cpu"))


def client(server, dirs, inproc, micro_batch_size: int = 4) -> HTTPReference:
    tok = make_char_tokenizer()
    return HTTPReference(cfg_for(server, dirs, micro_batch_size), tok, inproc.model.config.vocab_size)


def post(server, body: bytes, token: str | None = TOKEN, path: str = "/v1/logprobs") -> requests.Response:
    headers = {"Content-Type": CONTENT_TYPE}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return requests.post(server.url + path, data=body, headers=headers, timeout=60)


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("micro_batch_size, temperature", [(4, 1.0), (3, 0.7), (64, 1.3)])
def test_server_equals_in_process_reference_exactly(server, dirs, inproc, micro_batch_size, temperature):
    ref = client(server, dirs, inproc, micro_batch_size)
    inproc.cfg.train.micro_batch_size = micro_batch_size
    for seed in range(3):
        p = ragged_batch(seed, rows=11, vocab=93, max_prompt=30, max_completion=16)
        assert_same(ref.submit(p, temperature).result(), inproc.logprobs(p, temperature))
    lp, ent = ref.logprobs(p, temperature, with_entropy=True)
    want_lp, want_ent = sliced_logprobs(inproc.model, p, temperature, 1024, max_rows=micro_batch_size, with_entropy=True)
    assert_same(lp, want_lp)
    assert_same(ent, want_ent)
    ref.close()


# --------------------------------------------------------------------------- concurrency


def test_eight_concurrent_clients_all_answers_exact(server, dirs, inproc):
    """320 requests from 8 clients at once; the queue (8) holds them all, so no request is refused."""
    inproc.cfg.train.micro_batch_size = 4
    batches = [ragged_batch(100 + i, rows=2 + i % 7, vocab=93) for i in range(16)]
    temps = [0.8 + 0.05 * i for i in range(16)]
    expected = [inproc.logprobs(p, t) for p, t in zip(batches, temps)]
    seen_before = len(log_events(dirs["log"]))
    clients = [client(server, dirs, inproc) for _ in range(8)]
    start = threading.Barrier(8)
    per_client = 40

    def hammer(k: int) -> int:
        start.wait()
        wrong = 0
        for j in range(per_client):
            i = (k * 5 + j) % len(batches)
            wrong += not torch.equal(clients[k].submit(batches[i], temps[i]).result(), expected[i])
        return wrong

    with ThreadPoolExecutor(8) as pool:
        wrong = sum(pool.map(hammer, range(8)))
    assert wrong == 0, "every answer must equal the in-process reference exactly"
    statuses = Counter(e["status"] for e in log_events(dirs["log"])[seen_before:])
    assert statuses == Counter({200: 8 * per_client + 2 * 8}), statuses  # + /health and /v1/info per client
    for c in clients:
        c.close()


def _wait_health(server, key: str, value: int, timeout: float = WAIT_S) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    deadline = time.monotonic() + timeout
    while requests.get(server.url + "/health", headers=auth, timeout=10).json()[key] < value:
        assert time.monotonic() < deadline, f"/health never showed {key} >= {value}"
        time.sleep(0.002)


def test_overload_answers_503_with_retry_after_and_the_client_retries(dirs, inproc):
    """A deliberate overload: a long request runs, the queue fills up, and the next requests are refused with 503 +
    Retry-After; the client retries and gets the exact answer; queued requests stay exact. The long request (a body
    over the shared server's limit: a server of its own) would run for minutes on a loaded machine, so nothing races
    its length: once the checks are done its client leaves, and the server drops it at its next forward pass (499)."""
    log = dirs["root"] / "overload.log"
    srv = ServerProcess(["--model", str(dirs["model"]), "--max-queue", str(QUEUE), "--max-request-mb", "8"],
                        port=free_port(), token=TOKEN, log_path=log, env={"OMP_NUM_THREADS": "1"})
    srv.start(timeout=SERVER_S)
    inproc.cfg.train.micro_batch_size = 1
    long = encode_request(ragged_batch(3, rows=1500, vocab=93, max_prompt=250, max_completion=240, width=240), 1.0,
                          rows_per_pass=1)  # 1500 forward passes: about 30 s on the idle 2-core machine
    p = ragged_batch(21, rows=4, vocab=93)
    body, expected = encode_request(p, 1.0, rows_per_pass=1), inproc.logprobs(p, 1.0)
    ref = client(srv, dirs, inproc, micro_batch_size=1)
    port = int(srv.url.rsplit(":", 1)[1])
    running = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        running.request("POST", "/v1/logprobs", body=long,
                        headers={"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {TOKEN}"})
        with ThreadPoolExecutor(QUEUE) as pool:
            _wait_health(srv, "running", 1)
            queued = [pool.submit(post, srv, body) for _ in range(QUEUE)]
            _wait_health(srv, "queued", QUEUE)
            refused = post(srv, body)
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["Retry-After"]) >= 1 and "busy" in refused.json()["error"]
            answer = ref.submit(p, 1.0)  # sent while the queue is still full: refused, then retried
            deadline = time.monotonic() + WAIT_S
            while Counter(e["status"] for e in log_events(log))[503] < 2:
                assert time.monotonic() < deadline, "the client's request was never refused"
                time.sleep(0.1)
            running.close()  # the long request's client leaves: the server drops it, the queue drains
            assert_same(answer.result(), expected)
            assert ref.pop_metrics()["ref/retries"] >= 1, "the client met a 503 and retried"
            for f in queued:
                assert f.result().status_code == 200
                assert_same(decode_response(f.result().content, p.length, p.width)[0], expected)
        statuses = Counter(e["status"] for e in log_events(log) if e["path"] == "/v1/logprobs")
        assert set(statuses) == {200, 499, 503} and statuses[503] >= 2 and statuses[499] == 1, statuses
    finally:
        running.close()
        ref.close()
        srv.stop()


# --------------------------------------------------------------------------- bad input


def _valid_body_and_expected(inproc):
    p = ragged_batch(7, rows=5, vocab=93)
    inproc.cfg.train.micro_batch_size = 4
    return p, encode_request(p, 1.0, rows_per_pass=4), inproc.logprobs(p, 1.0)


def _bad_bodies(p):
    ids, plen, clen = flatten_packed(p)
    good = {"input_ids": ids, "prompt_lens": plen, "completion_lens": clen}
    header = {"temperature": 1.0, "rows_per_pass": 4}
    oov = ids.clone()
    oov[2] = 5000
    return [
        ("malformed body", b"\x00\x01garbage" * 10, 400, "body"),
        ("wrong dtype", encode({**good, "input_ids": ids.double()}, header), 400, "input_ids"),
        ("inconsistent lengths", encode({**good, "completion_lens": clen + 1}, header), 400, "input_ids"),
        ("rows disagree", encode({**good, "prompt_lens": plen[:-1]}, header), 400, "completion_lens"),
        ("out-of-vocabulary id", encode({**good, "input_ids": oov}, header), 400, "input_ids"),
        ("bad temperature", encode(good, {"temperature": -1}), 400, "temperature"),
        # issue 58 item 13: explicit nulls answered 500, which clients retry as a server fault
        ("null top_k", encode(good, {**header, "top_k": None}), 400, "top_k"),
        ("null pad_id", encode(good, {**header, "pad_id": None}), 400, "pad_id"),
        ("lengths that wrap int64", encode({"input_ids": ids[:2], "prompt_lens": torch.tensor([2**62, 2**62, 1, 1]),
                                            "completion_lens": torch.tensor([2**62, 2**62, 0, 0])}, header), 400, "prompt_lens"),
        ("deeply nested header", st_save(good, metadata={"header": "[" * 10_000 + "]" * 10_000}), 400, "header"),
        ("oversized body", b"\x00" * int(MAX_REQUEST_MB * 2**20 + 1000), 413, "body"),
        # 61 rows x 1000 tokens = 61,000 padded tokens from a 5 KiB body; the limit is 0.1 MiB / 4 = 26,214
        ("padded total over the limit", encode_request(pack([[5]] * 60 + [[5] * 500], [[]] * 60 + [[6] * 500], 0), 1.0),
         413, "completion_lens"),
    ]


def test_bad_requests_get_4xx_naming_the_problem_and_the_server_keeps_serving(server, inproc):
    p, good, expected = _valid_body_and_expected(inproc)
    cases = _bad_bodies(p) + [("missing token", good, 401, "Authorization"), ("wrong token", good, 403, "Authorization")]
    for name, body, status, field in cases:
        token = {"missing token": None, "wrong token": "nope"}.get(name, TOKEN)
        r = post(server, body, token=token)
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()
        assert err["field"] == field and err["error"], (name, err)
        ok = post(server, good)
        assert ok.status_code == 200, (name, ok.text)
        lp, _, _ = decode_response(ok.content, p.length, p.width)
        assert_same(lp, expected)
    assert "is outside the vocabulary" in post(server, cases[4][1]).json()["error"]
    padded = next(body for name, body, _, _ in cases if name == "padded total over the limit")
    assert "max_padded_tokens=26214" in post(server, padded).json()["error"]
    r = requests.get(server.url + "/v1/logprobs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 405 and r.json()["status"] == 405


def test_one_connection_carries_the_requests_and_closes_when_the_body_was_not_read(server, inproc):
    """HTTP/1.1 keep-alive: answers that leave the connection in step keep it (the same socket serves the
    next request); an answer given before the body was read (401, a 413 past twice the limit) says
    Connection: close, so no body byte is ever taken for the next request's line."""
    import http.client

    p, good, expected = _valid_body_and_expected(inproc)
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": CONTENT_TYPE}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)

    def ask(method: str, path: str, body: bytes | None = None, headers: dict = auth):
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r, r.read()

    r, _ = ask("GET", "/health")
    assert r.status == 200 and r.version == 11 and r.getheader("Connection") is None
    sock = conn.sock
    for _ in range(3):
        r, content = ask("POST", "/v1/logprobs", good)
        assert r.status == 200 and conn.sock is sock  # no new connection
        assert_same(decode_response(content, p.length, p.width)[0], expected)
    r, _ = ask("POST", "/v1/logprobs", b"\x00garbage", auth)  # read, then refused: the connection stays usable
    assert r.status == 400 and conn.sock is sock
    r, _ = ask("POST", "/v1/logprobs", good, {"Content-Type": CONTENT_TYPE})  # refused before its body is read
    assert r.status == 401 and r.getheader("Connection") == "close" and conn.sock is None
    r, content = ask("POST", "/v1/logprobs", good)  # http.client opens a new connection
    assert r.status == 200 and conn.sock is not None
    assert_same(decode_response(content, p.length, p.width)[0], expected)
    conn.close()

    with requests.Session() as s:  # every bad request of the test above, then a good one, on one session
        s.headers.update(auth)
        for name, body, status, field in _bad_bodies(p):
            r = s.post(server.url + "/v1/logprobs", data=body, timeout=60)
            assert r.status_code == status and r.json()["field"] == field, (name, r.status_code, r.text)
            ok = s.post(server.url + "/v1/logprobs", data=good, timeout=60)
            assert ok.status_code == 200, (name, ok.text)
            assert_same(decode_response(ok.content, p.length, p.width)[0], expected)


# --------------------------------------------------------------------------- reload


def test_reload_swaps_weights_and_info_reports_the_new_version(server, dirs, inproc):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = requests.get(server.url + "/v1/info", headers=auth, timeout=10).json()
    assert before["vocab_size"] == 93 and before["dtype"] == "float32" and before["weights_hash"]
    other = write_tiny(dirs["root"] / "step-7", seed=1)
    ref = client(server, dirs, inproc)
    info = ref.reload(str(other))
    assert info["version"] == before["version"] + 1 and info["checkpoint_step"] == 7
    assert info["weights_hash"] != before["weights_hash"]
    p = ragged_batch(11, rows=6, vocab=93)
    new_cfg = cfg_for(server, dirs)
    new_cfg.ref.model = str(other)
    assert_same(ref.submit(p, 1.0).result(), InProcessReference(new_cfg, torch.device("cpu")).logprobs(p, 1.0))

    foreign = dirs["root"] / "foreign"
    tok = make_char_tokenizer("0123456789+=")
    make_tiny_model(len(tok)).save_pretrained(foreign)
    tok.save_pretrained(foreign)
    for path, words in [(str(foreign), "tokenizer"), (str(dirs["root"] / "missing"), "not a folder")]:
        r = requests.post(server.url + "/v1/reload", json={"checkpoint": path}, headers=auth, timeout=60)
        assert r.status_code == 400 and r.json()["field"] == "checkpoint" and words in r.json()["error"]
    r = requests.post(server.url + "/v1/reload", json={"checkpoint": str(other)}, timeout=10)
    assert r.status_code == 401

    back = ref.reload(str(dirs["model"]))
    assert back["weights_hash"] == before["weights_hash"] and back["version"] == before["version"] + 2
    ref.close()


# --------------------------------------------------------------------------- shutdown (stops the server)


def stalled_connections(host: str, port: int, stop: threading.Event) -> tuple[list[socket.socket], threading.Thread]:
    """An idle connection, a kept one (answered, then waiting for a next request), trickled headers (a byte
    every 0.2 s until ``stop``, at most 200 s) and a stalled body, each accepted by the server."""
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(4)]
    idle, trickle, stalled, kept = socks
    kept.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    trickle.sendall(b"GET /health HTTP/1.0\r\n")
    stalled.sendall(f"POST /v1/logprobs HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n"
                    "0123456789".encode())

    return socks, trickle_headers(trickle, stop, 0.2)


def test_sigterm_lets_the_in_flight_request_finish_and_does_not_wait_for_stalled_connections(server, inproc):
    """SIGTERM while a forward pass runs: that request is answered, then the server exits, although an idle
    connection, a kept one, trickled headers and a stalled body are open. Was: the server joined every
    connection thread, each blocked up to 120 s per read (trickling: forever)."""
    p = ragged_batch(3, rows=24, vocab=93, max_prompt=250, max_completion=240, width=240)
    body = encode_request(p, 1.0, rows_per_pass=1)
    assert len(body) < MAX_REQUEST_MB * 2**20
    auth = {"Authorization": f"Bearer {TOKEN}"}
    stop = threading.Event()
    socks, sender = stalled_connections(server.host, server.port, stop)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=post(server, body)))
    try:
        worker.start()
        running = False
        deadline = time.monotonic() + WAIT_S
        while worker.is_alive() and time.monotonic() < deadline:  # /health answers while the forward pass runs
            h = requests.get(server.url + "/health", headers=auth, timeout=10).json()
            if h["running"]:
                running = True
                break
            time.sleep(0.005)
        assert running, "the slow request finished before it was seen running; make it bigger"
        server.proc.send_signal(15)
        worker.join(SERVER_S)
        assert result["r"].status_code == 200
        inproc.cfg.train.micro_batch_size = 1
        lp, _, _ = decode_response(result["r"].content, p.length, p.width)
        assert_same(lp, inproc.logprobs(p, 1.0))
        try:
            code = server.proc.wait(100)  # the old wait: 120 s per blocked read, forever while trickled
        except subprocess.TimeoutExpired:
            pytest.fail("the server was still waiting for idle or stalled connections 100 s after SIGTERM")
        assert code == 0, code
    finally:
        stop.set()
        sender.join(10)
        for s in socks:
            s.close()
    events = [e["event"] for e in log_events(server.log_path, event="shutting down")]
    assert events == ["shutting down"] and log_events(server.log_path, event="stopped")


def test_the_design_commands_pair_runs_on_the_trainers_defaults(capsys):
    """Issue 42, item 26: ``python ref_client.py`` (no config, no model) refused to start while ``deepspeed
    train.py --algo dapo`` runs on its defaults. It serves the trainer's default model now, and train.py's
    --help shows the pair of commands."""
    import train
    from grpo.foundation.config import RefConfig

    default = load_config(None, None, [])
    srv = ServerProcess([], port=free_port(), env={"OMP_NUM_THREADS": "1"})
    srv.start(timeout=SERVER_S)
    try:
        info = requests.get(srv.url + "/v1/info", timeout=60).json()
        assert info["model"] == default.model.name_or_path, info
    finally:
        srv.stop()
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    assert RefConfig().port == 59875 and "python ref_client.py\n" in text
    assert "deepspeed train.py --algo grpo ref.url=http://127.0.0.1:59875" in text
