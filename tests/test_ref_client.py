"""The client's retries, errors and start-up checks, against a server running in a thread."""

from __future__ import annotations

import contextlib
import json
import io
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from grpo.foundation.config import ConfigError, ModelConfig
from grpo.foundation.modeling import load_model
from grpo.training.configure import load_config
from grpo.reference.http import BACKOFF_CAP, HTTPReference, backoff
from grpo.reference.wire import CONTENT_TYPE, encode_request
from grpo.reference.launch import free_port
from grpo.reference.server import app as server_app
from grpo.reference.server import wsgi as server_wsgi
from grpo.reference.server.app import AccessLog, build_server, check_bind
from grpo.reference.protocol import ReferenceServerError, sliced_logprobs
from grpo.foundation.tiny import build_tiny, make_char_tokenizer, write_tiny
from tests.ref_support import assert_same, ragged_batch, trickle_headers
from tests.patience import SERVER_S, WAIT_S


@pytest.fixture(scope="module")
def server():
    """builtin:tiny-char served from a thread, without a token."""
    cfg = load_config(None, None, ["ref.port=0", "ref.max_queue=4"])
    srv = build_server(cfg, "cpu", AccessLog(io.StringIO()))
    thread = threading.Thread(target=srv.serve_until_shutdown, daemon=True)
    thread.start()
    yield srv
    srv.begin_shutdown("test over")
    thread.join(10)


@contextlib.contextmanager
def serving(*overrides: str):
    """Another builtin:tiny-char server in a thread (``ref.*`` overrides), shut down on exit."""
    cfg = load_config(None, None, ["ref.port=0", *overrides])
    srv = build_server(cfg, "cpu", AccessLog(io.StringIO()))
    thread = threading.Thread(target=srv.serve_until_shutdown, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.begin_shutdown("test over")
        thread.join(30)


def wait_for(check, timeout: float = WAIT_S, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0.01)


def raw_connection(url: str, data: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def client_cfg(url: str, *overrides: str):
    return load_config(None, None, [f"ref.url={url}", "algo.beta=0.04", *overrides])


def test_client_matches_the_in_process_computation(server):
    model, tok = build_tiny()
    ref = HTTPReference(client_cfg(server.url, "train.micro_batch_size=3"), tok, vocab_size=model.config.vocab_size)
    p = ragged_batch(5, rows=8, vocab=len(tok))
    lp, ent = ref.logprobs(p, temperature=0.9, with_entropy=True)
    want_lp, want_ent = sliced_logprobs(model.eval(), p, 0.9, 1024, max_rows=3, with_entropy=True)
    assert_same(lp, want_lp)
    assert_same(ent, want_ent)
    m = ref.pop_metrics()
    assert m["ref/requests"] == 1 and m["ref/bytes_sent"] > 0 and m["ref/bytes_received"] > 0
    assert m["ref/latency"] >= m["ref/server_compute"] > 0
    assert ref.pop_metrics()["ref/requests"] == 0, "pop_metrics resets the per-step totals"
    ref.close()


def test_tokenizer_mismatch_stops_with_an_explanation(server):
    other = make_char_tokenizer("0123456789+=")
    with pytest.raises(ConfigError) as e:
        HTTPReference(client_cfg(server.url), other)
    msg = str(e.value)
    assert server.url in msg and "tokenizer fingerprint" in msg and "ref_client.py" in msg


def test_vocabulary_mismatch_stops_with_an_explanation(server):
    _, tok = build_tiny()
    with pytest.raises(ConfigError) as e:
        HTTPReference(client_cfg(server.url), tok, vocab_size=len(tok) + 7)
    assert f"vocabulary size {len(tok)} != the policy's {len(tok) + 7}" in str(e.value)


def test_no_server_gives_the_url_and_how_to_start_it():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ReferenceServerError) as e:
        HTTPReference(client_cfg(url, "ref.retry_window=1.0", "ref.connect_timeout=0.5"))
    elapsed = time.monotonic() - t0
    msg = str(e.value)
    assert url in msg and "python ref_client.py" in msg and "ref.retry_window=1" in msg
    assert "attempts" in msg and elapsed < 30, "gave up after its 1 s window, not the default 60 s"


def test_reload_needs_a_token(server):
    r = requests.post(server.url + "/v1/reload", json={"checkpoint": "/tmp"}, timeout=10)
    assert r.status_code == 403 and r.json()["field"] == "Authorization"


def test_backoff_grows_exponentially_with_jitter_and_honours_retry_after():
    for attempt in range(1, 12):
        step = min(BACKOFF_CAP, 0.05 * 2 ** (attempt - 1))
        samples = [backoff(attempt) for _ in range(50)]
        assert all(step / 2 <= s <= step for s in samples)
        assert len(set(samples)) > 1, "jittered"
    assert backoff(1, retry_after=3.0) == 3.0


@pytest.mark.parametrize("host, token, ok", [
    ("127.0.0.1", None, True), ("::1", None, True), ("localhost", None, True),
    ("0.0.0.0", None, False), ("10.1.2.3", None, False), ("myhost", None, False), ("0.0.0.0", "s3cret", True),
])
def test_binding_beyond_loopback_needs_a_token(host, token, ok):
    if ok:
        check_bind(host, token)
    else:
        with pytest.raises(ConfigError, match="GRPO_REF_TOKEN"):
            check_bind(host, token)


@pytest.mark.parametrize("argv, words", [
    (["--device", "nope"], "--device 'nope' is not a torch device: give cpu, cuda or cuda:N"),
    (["--device", "cuda:5"], "--device 'cuda:5': "),  # no GPU here, or fewer than six
    (["--model", "/nonexistent/ref"], "ref.model='/nonexistent/ref' looks like a local folder, and "),
    (["--reward-batch-tokens", "0"], "--reward-batch-tokens 0 is invalid: it must be > 0"),
])
def test_the_servers_own_flags_are_refused_before_any_model_loads(argv, words, capsys, monkeypatch):
    """ref_client.py's flags that are not config keys: torch's traceback (a bad or absent device), the hub's
    repo-id complaint (a missing folder) or a server started on a 0-token reward batch, before."""
    import ref_client
    from grpo.reference.server import app

    monkeypatch.setattr(app, "serve", lambda *a, **k: pytest.fail("the server was started"))
    assert ref_client.main(argv) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("algo, key, more", [(None, "ref.url", ["algo.beta=0.04"]), ("opd", "teacher.url", []),
                                              (None, "rewards[0].url", [])])
def test_urls_without_a_host_or_with_a_bad_port_are_refused_at_load(algo, key, more):
    """A port out of range or not a number passed the config and was a ValueError from inside the HTTP client once
    the run had started; no host (http://:80) was caught only there."""
    def given(url):
        return [f"rewards=[{{url: '{url}'}}]" if key.startswith("rewards") else f"{key}={url}", *more]

    for url in ("http://127.0.0.1:99999", "http://127.0.0.1:abc", "http://:80", "http://127.0.0.1:0", "host:80"):
        with pytest.raises(ConfigError, match=rf"{re.escape(key)}='{re.escape(url)}' is invalid: give an http:// or "
                                              r"https:// URL with a host and, optionally, a port from 1 to 65535"):
            load_config(None, algo, given(url))
    for url in ("http://127.0.0.1:59875", "https://judge.example/score", "http://[::1]:8000/v1"):
        load_config(None, algo, given(url))


def test_ref_limits_are_validated():
    with pytest.raises(ConfigError, match="ref.port"):
        load_config(None, None, ["ref.port=70000"])
    with pytest.raises(ConfigError, match="ref.max_queue"):
        load_config(None, None, ["ref.max_queue=0"])


def test_request_bodies_are_read_and_parsed_a_bounded_number_at_a_time(monkeypatch):
    """Each body being read or parsed holds up to max_request_bytes (more once decoded); at most
    PARSE_SLOTS at once, and a request that waits PARSE_WAIT_S for a slot gets 503 + Retry-After."""
    monkeypatch.setattr(server_app, "PARSE_SLOTS", 1)
    monkeypatch.setattr(server_app, "PARSE_WAIT_S", 0.3)
    _, tok = build_tiny()
    body = encode_request(ragged_batch(1, rows=3, vocab=len(tok)), 1.0)
    post = lambda url: requests.post(url + "/v1/logprobs", data=body, headers={"Content-Type": CONTENT_TYPE}, timeout=30)
    with serving() as srv:
        health = lambda: requests.get(srv.url + "/health", timeout=10).json()
        slow = raw_connection(srv.url, b"POST /v1/logprobs HTTP/1.0\r\nContent-Length: 1000\r\n\r\n" + body[:10])
        try:
            wait_for(lambda: health().get("parsing") == 1, what="one body being read")
            busy = post(srv.url)
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", busy.text
            assert "reading and parsing 1 other requests" in busy.json()["error"]
        finally:
            slow.close()  # its body ends early: 400, and the slot is free again
        wait_for(lambda: health()["parsing"] == 0, what="the slot freed")
        assert post(srv.url).status_code == 200


def _raw_answer(url: str, request: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a hand-written HTTP request (the server closes after one answer)."""
    sock = raw_connection(url, request)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("method, path, length", [("POST", "/v1/logprobs", "abc"), ("POST", "/v1/logprobs", "1e3"),
                                                  ("POST", "/v1/logprobs", "-5"), ("GET", "/health", "abc")])
def test_a_malformed_content_length_is_a_logged_json_400(server, method, path, length):
    before = server.log.stream.getvalue()
    status, err = _raw_answer(server.url, f"{method} {path} HTTP/1.0\r\nContent-Length: {length}\r\n\r\n".encode())
    assert status == 400 and err["field"] == "Content-Length" and repr(length) in err["error"], err
    lines = [json.loads(x) for x in server.log.stream.getvalue()[len(before):].splitlines()]
    assert [(x["event"], x["path"], x["status"]) for x in lines] == [("request", path, 400)], lines
    assert lines[0]["bytes_in"] is None


def test_a_post_without_content_length_or_with_a_bad_idempotency_key_is_refused(server):
    status, err = _raw_answer(server.url, b"POST /v1/logprobs HTTP/1.0\r\n\r\n")
    assert status == 411 and err["field"] == "Content-Length", err
    _, tok = build_tiny()
    body = encode_request(ragged_batch(1, rows=2, vocab=len(tok)), 1.0)
    r = requests.post(server.url + "/v1/logprobs", data=body, timeout=30,
                      headers={"Content-Type": CONTENT_TYPE, "Idempotency-Key": "x" * 129})
    assert r.status_code == 400 and r.json()["field"] == "Idempotency-Key", r.text


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(whether the server closed ``sock`` within ``seconds``, what it sent first)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
        return True, data
    except (TimeoutError, ConnectionResetError):
        return False, data
    finally:
        sock.close()


def test_clients_that_never_finish_their_request_are_dropped(monkeypatch):
    """A connection that sends nothing, or trickles its headers, is closed after HEADER_TIMEOUT_S;
    a body that stalls gets 408 after BODY_GRACE_S (plus a second per MiB). Was: 120 s per stalled read."""
    monkeypatch.setattr(server_wsgi, "HEADER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(server_wsgi, "BODY_GRACE_S", 0.5)
    with serving() as srv:
        idle = raw_connection(srv.url)
        trickle = raw_connection(srv.url, b"GET /health HTTP/1.0\r\n")
        stalled_body = raw_connection(srv.url, b"POST /v1/logprobs HTTP/1.0\r\nContent-Length: 1000\r\n\r\n0123456789")
        stop = threading.Event()

        sender = trickle_headers(trickle, stop, 0.1)  # for longer than the 30 s below
        t0 = time.monotonic()
        try:
            # 0.5 s limits against the 120 s a stalled read used to hold: 30 s only catches a hang
            assert _closed_within(idle, 30) == (True, b""), "an idle connection is closed without an answer"
            assert _closed_within(trickle, 30)[0], "trickled headers do not keep a connection open"
            closed, answer = _closed_within(stalled_body, 30)
            assert closed and answer.split()[1] == b"408" and b'"field": "body"' in answer, answer
            assert time.monotonic() - t0 < 60
        finally:
            stop.set()
            sender.join(10)


def _jobs(url: str) -> dict:
    return requests.get(url + "/v1/info", timeout=10).json().get("jobs", {})


def _slow_batch(vocab: int):
    """240 rows, one per forward pass: about a second of compute on a 2-core machine."""
    return ragged_batch(9, rows=240, vocab=vocab)


def test_a_timed_out_request_is_computed_once_and_a_retry_gets_its_answer(server):
    """read_timeout below the compute time: every retry used to queue another full copy (6 computed,
    then 'server is unavailable'). Now the retries join the one computation (same Idempotency-Key and
    body) and the client warns once that its read_timeout is too short."""
    model, tok = build_tiny()
    ref = HTTPReference(client_cfg(server.url, "train.micro_batch_size=1", "ref.read_timeout=0.2",
                                   f"ref.retry_window={SERVER_S:g}"), tok, vocab_size=model.config.vocab_size)
    p = _slow_batch(len(tok))
    before = _jobs(server.url)
    with pytest.warns(RuntimeWarning, match=r"ref.read_timeout=0.2 s") as seen:
        lp, _ = ref.logprobs(p, 1.0)
        lp2, _ = ref.logprobs(p, 1.0)
    assert len([w for w in seen if "ref.read_timeout" in str(w.message)]) == 1, "warned once"
    want = sliced_logprobs(model.eval(), p, 1.0, 1024, max_rows=1)[0]
    assert_same(lp, want)
    assert_same(lp2, want)
    assert ref.pop_metrics()["ref/retries"] >= 2, "both requests timed out at least once"
    after = _jobs(server.url)
    assert after["computed"] - before.get("computed", 0) == 2, (before, after)
    assert after["joined"] - before.get("joined", 0) >= 2, (before, after)
    ref.close()


def test_queued_work_whose_client_left_is_dropped(server):
    """A request whose client gave up (read timeout, no retry) while it waited in the queue is not computed."""
    _, tok = build_tiny()
    post = lambda body, timeout: requests.post(server.url + "/v1/logprobs", data=body, timeout=timeout,
                                               headers={"Content-Type": CONTENT_TYPE})
    slow = encode_request(_slow_batch(len(tok)), 1.0, rows_per_pass=1)
    small = encode_request(ragged_batch(2, rows=3, vocab=len(tok)), 1.0)
    before = _jobs(server.url)
    health = lambda: requests.get(server.url + "/health", timeout=10).json()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, slow, 120)
        wait_for(lambda: health()["running"] == 1, what="the slow request running")
        with pytest.raises(requests.ReadTimeout):
            post(small, 0.2)  # queued behind the slow one; the client gives up and closes the connection
        assert running.result().status_code == 200
    wait_for(lambda: health()["queued"] == 0 and health()["running"] == 0, what="an idle worker")
    after = _jobs(server.url)
    assert after["computed"] - before.get("computed", 0) == 1, (before, after)
    assert after["dropped"] - before.get("dropped", 0) == 1, (before, after)
    assert '"status": 499' in server.log.stream.getvalue(), "the request whose client left is logged as 499"


ADMIN = "admin-token-42"


def _reload(url: str, path, token: str = ADMIN) -> requests.Response:
    return requests.post(url + "/v1/reload", json={"checkpoint": str(path)}, timeout=60,
                         headers={"Authorization": f"Bearer {token}"})


def test_a_sync_the_server_cannot_reload_fails_at_start(tmp_path, monkeypatch):
    """Issue 30, item 13: ref.sync_every with a server that has no token, or whose reload root excludes the
    run, failed at the first sync (after that step's work, before its checkpoint), and again after --resume."""
    from grpo.training.configure import probe_services

    def check(url, *overrides):
        probe_services(load_config(None, None, [f"ref.url={url}", "algo.beta=0.04", "ref.sync_every=2", *overrides]))

    monkeypatch.delenv("GRPO_REF_TOKEN", raising=False)
    with serving() as srv:  # no token: /v1/reload is off
        with pytest.raises(ConfigError, match=r"set ref.token \(or GRPO_REF_TOKEN\) to the server's token"):
            check(srv.url)
        with pytest.raises(ConfigError, match=r"cannot reload \(it has no token\); restart it with GRPO_REF_TOKEN"):
            check(srv.url, f"ref.token={ADMIN}")
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("GRPO_REF_RELOAD_ROOT", str(root))
    with serving(f"ref.token={ADMIN}") as srv:
        with pytest.raises(ConfigError, match=r"reloads only folders inside GRPO_REF_RELOAD_ROOT=.*root'.*elsewhere"):
            check(srv.url, f"ref.token={ADMIN}", f"train.output_dir={tmp_path / 'elsewhere'}")
        check(srv.url, f"ref.token={ADMIN}", f"train.output_dir={root / 'run'}")  # inside the root: fine
        check(srv.url, "ref.sync_every=0", "ref.token=")  # no sync: nothing to check


def test_reload_answers_client_mistakes_with_400_naming_the_field():
    """Issue 30, item 27: deeply nested JSON and a 5000-character path were 500s."""
    with serving(f"ref.token={ADMIN}") as srv:
        auth = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
        nested = requests.post(srv.url + "/v1/reload", data="[" * 100_000 + "]" * 100_000, headers=auth, timeout=60)
        assert nested.status_code == 400 and nested.json()["field"] == "body", nested.text
        long = _reload(srv.url, "/tmp/" + "x" * 5000)
        assert long.status_code == 400 and long.json()["field"] == "checkpoint", long.text
        assert "5005 characters" in long.json()["error"]
        named = _reload(srv.url, "/tmp/" + "y" * 300)  # one name longer than the file system allows
        assert named.status_code == 400 and named.json()["field"] == "checkpoint", named.text
        again = _reload(srv.url, "/tmp/" + "y" * 300)  # not 409: the failed reload left no reload in progress
        assert again.status_code == 400 and again.json()["field"] == "checkpoint", again.text


def _pickled_weights_beside_a_decoy(folder):
    """A tiny checkpoint whose real weights are a pickle (pytorch_model.bin) beside a decoy .safetensors."""
    write_tiny(folder, seed=1)
    (folder / "model.safetensors").rename(folder / "decoy.safetensors")
    torch.save(build_tiny(seed=2)[0].state_dict(), folder / "pytorch_model.bin")
    return folder


def test_reload_reads_only_safetensors_weights_from_inside_the_reload_root(tmp_path, monkeypatch):
    """Reload used to check only that some *.safetensors existed, then from_pretrained (without
    use_safetensors=True) loaded the pytorch_model.bin pickle beside the decoy."""
    root = tmp_path / "allowed"
    monkeypatch.setenv("GRPO_REF_RELOAD_ROOT", str(root))
    good = write_tiny(root / "step-3", seed=1)
    for sub in ("trainer/rank0.pt", "ds/mp_rank_00_model_states.pt"):  # a trainer checkpoint's own pickles, in subfolders
        (good / sub).parent.mkdir()
        torch.save({"step": 3}, good / sub)
    decoy_only = write_tiny(root / "decoy-only", seed=1)
    (decoy_only / "model.safetensors").rename(decoy_only / "decoy.safetensors")
    outside = write_tiny(tmp_path / "elsewhere" / "step-4", seed=1)
    (root / "link").symlink_to(outside)
    with serving(f"ref.token={ADMIN}") as srv:
        before = requests.get(srv.url + "/v1/info", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
        for path, words in [(_pickled_weights_beside_a_decoy(root / "pickled"), "pytorch_model.bin"),
                            (decoy_only, "model.safetensors"),
                            (outside, "outside the server's reload root"),
                            (root / "link", "outside the server's reload root")]:
            r = _reload(srv.url, path)
            assert r.status_code == 400 and r.json()["field"] == "checkpoint", (path, r.status_code, r.text)
            assert words in r.json()["error"], (path, r.json())
        assert srv.worker.version == before["version"], "nothing was loaded"
        info = _reload(srv.url, good).json()
        assert info["version"] == before["version"] + 1 and info["checkpoint_step"] == 3


def test_reload_reads_no_file_outside_the_reload_root(tmp_path, monkeypatch):
    """Issue 30, item 18: three ways out of GRPO_REF_RELOAD_ROOT: a symlinked weights file, an index naming
    ../.. shards, and an adapter whose base lies outside the root (or is a hub name)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path / "allowed"
    monkeypatch.setenv("GRPO_REF_RELOAD_ROOT", str(root))
    outside = write_tiny(tmp_path / "elsewhere" / "model", seed=2)
    linked = write_tiny(root / "linked", seed=1)
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside / "model.safetensors")
    sharded = write_tiny(root / "sharded", seed=1)
    weights = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    save_file(weights, str(tmp_path / "elsewhere" / "shard.safetensors"), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "../../elsewhere/shard.safetensors" for k in weights}}))
    adapters = {}
    for name, base in (("adapter-out", str(outside)), ("adapter-hub", "org/some-model")):
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "peft_type": "LORA"}))
        (folder / "adapter_model.safetensors").write_bytes(b"")
        adapters[name] = folder
    # issue 42, item 18: an adapter whose base names itself (or two naming each other) was a 500 (RecursionError)
    for name, base in (("adapter-self", "adapter-self"), ("adapter-a", "adapter-b"), ("adapter-b", "adapter-a")):
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(root / base),
                                                                "peft_type": "LORA"}))
        (folder / "adapter_model.safetensors").write_bytes(b"")
        adapters[name] = folder
    with serving(f"ref.token={ADMIN}") as srv:
        version = srv.worker.version
        for path, words in [(linked, "model.safetensors resolves to"), (sharded, "shard.safetensors resolves to"),
                            (adapters["adapter-out"], "is outside the server's reload root"),
                            (adapters["adapter-hub"], "whose base 'org/some-model' is not a folder inside"),
                            (adapters["adapter-self"], "is itself or one of the adapters above it"),
                            (adapters["adapter-a"], "is itself or one of the adapters above it")]:
            r = _reload(srv.url, path)
            assert r.status_code == 400 and r.json()["field"] == "checkpoint", (path, r.text)
            assert words in r.json()["error"], (path, r.json())
        assert srv.worker.version == version, "nothing was loaded"


def test_load_model_can_insist_on_safetensors(tmp_path):
    folder = _pickled_weights_beside_a_decoy(tmp_path / "ck")
    load_model(ModelConfig(), str(folder))  # a trainer's own loads still take any format from_pretrained takes
    with pytest.raises(ConfigError, match="model.safetensors"):
        load_model(ModelConfig(), str(folder), safetensors_only=True)


def test_a_reload_that_times_out_is_loaded_once_and_never_two_at_a_time(tmp_path, monkeypatch):
    """The client retried /v1/reload like an idempotent call: a load slower than ref.read_timeout was
    loaded again on every retry (version +2 or more, several models in memory at once). Now every attempt
    carries one Idempotency-Key and joins the first; a different reload meanwhile gets 409."""
    from grpo.reference.server import worker as worker_module

    first, second = write_tiny(tmp_path / "step-1", seed=1), write_tiny(tmp_path / "step-2", seed=2)
    loads = {"active": 0, "most": 0, "count": 0}
    lock = threading.Lock()
    real_load = worker_module.load_reference

    def slow_load(*args, **kwargs):
        with lock:
            loads["count"] += 1
            loads["active"] += 1
            loads["most"] = max(loads["most"], loads["active"])
        try:
            time.sleep(1.0)
            return real_load(*args, **kwargs)
        finally:
            with lock:
                loads["active"] -= 1

    model, tok = build_tiny()
    with serving(f"ref.token={ADMIN}") as srv:
        monkeypatch.setattr(worker_module, "load_reference", slow_load)
        ref = HTTPReference(client_cfg(srv.url, f"ref.token={ADMIN}", "ref.read_timeout=0.3",
                                        f"ref.retry_window={SERVER_S:g}"),
                            tok, vocab_size=model.config.vocab_size)
        version = ref.server_info["version"]
        info = ref.reload(str(first))
        assert info["version"] == version + 1 and info["checkpoint_step"] == 1
        assert ref.pop_metrics()["ref/retries"] >= 1, "the load outlasted the read timeout"
        assert loads == {"active": 0, "most": 1, "count": 1}, loads

        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(ref.reload, str(second))
            wait_for(lambda: loads["active"] == 1, what="the second reload loading")
            r = _reload(srv.url, first)
            assert r.status_code == 409 and r.json()["field"] == "checkpoint", r.text
            assert "in progress" in r.json()["error"] and "step-2" in r.json()["error"]
            assert pending.result(timeout=WAIT_S)["version"] == version + 2
        assert loads["most"] == 1 and loads["count"] == 2 and srv.worker.version == version + 2
        ref.close()
