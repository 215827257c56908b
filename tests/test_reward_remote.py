"""A remote reward endpoint (``rewards: [{url: ...}]``, OpenRLHF's remote_rm_url shape) against a real local HTTP
server thread: the wire format, batching, the token; slow, down, or wrong answers are retried and then stop the run
with a clear error, never a silent 0."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo.foundation.config import RewardPoolConfig, RewardSpec
from grpo.foundation.dist import free_port
from grpo.foundation.plugins import RewardServiceError
from grpo.scoring.combined import CombinedReward


class Judge:
    """A scoring service whose behaviour each test sets: ``mode`` ok | slow | wrong_count | error | flaky."""

    def __init__(self):
        self.mode, self.requests, self.token = "ok", [], "judge-secret"
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests.append({"body": body, "auth": self.headers.get("Authorization"),
                                       "key": self.headers.get("Idempotency-Key")})
                if self.headers.get("Authorization") != f"Bearer {judge.token}":
                    return self.answer(401, {"error": "token"})
                if judge.mode == "slow":
                    time.sleep(1.5)
                if judge.mode == "error" or (judge.mode == "flaky" and len(judge.requests) == 1):
                    return self.answer(503, {"error": "busy"})
                scores = [float(len(c)) if "skip" not in c else None for c in body["completions"]]
                if judge.mode == "wrong_count":
                    scores = scores[:-1]
                self.answer(200, {"rewards": scores} if judge.mode != "bare" else scores)

            def answer(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        # polled every 50 ms for shutdown (the default 0.5 s is the wait of every test's close)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def judge(monkeypatch):
    j = Judge()
    monkeypatch.setenv("GRPO_REWARD_TOKEN", j.token)
    yield j
    j.close()


def remote(url, **spec):
    spec = {"url": url, "retry_window": 2.0, "timeout": 1.0, **spec}
    return CombinedReward([RewardSpec(**spec)], RewardPoolConfig(num_workers=0))


def test_wire_format_batches_token_and_none(judge):
    r = remote(judge.url, batch_size=2, weight=0.5, kwargs={"task": "digits"})
    total, per_fn = r(["t"] * 3, ["ab", "skip", "abcd"], {"answer": ["1", "2", "3"]}, raw_prompts=["p1", "p2", "p3"])
    assert total == [1.0, 0.0, 2.0]  # 0.5 * len; the "skip" row is null: left out of the sum
    assert [len(q["body"]["completions"]) for q in judge.requests] == [2, 1]
    first = judge.requests[0]
    assert first["auth"] == "Bearer judge-secret" and first["key"]
    assert first["body"] == {"query": ["p1ab", "p2skip"], "prompts": ["p1", "p2"], "completions": ["ab", "skip"],
                             "columns": {"answer": ["1", "2"]}, "labels": ["1", "2"], "task": "digits"}
    m = r.pop_metrics()
    assert m["reward/remote_127.0.0.1/skipped"] == 1.0 and m["reward/remote_127.0.0.1/retries"] == 0.0
    judge.mode = "bare"  # a bare JSON list is accepted too
    assert r(["t"], ["abc"], {}, raw_prompts=["p"])[0] == [1.5]


def test_a_transient_failure_is_retried_with_the_same_key(judge):
    judge.mode = "flaky"
    r = remote(judge.url)
    assert r(["t"], ["abc"], {}, raw_prompts=["p"])[0] == [3.0]
    assert len(judge.requests) == 2 and judge.requests[0]["key"] == judge.requests[1]["key"]
    assert r.pop_metrics()["reward/remote_127.0.0.1/retries"] == 1.0


# the failures' retry window and the slow endpoint's timeout: short, so each test waits about a second (the judge
# sleeps 1.5 s: every slow request times out, however busy the machine; the window holds 3 timeouts)
FAIL_FAST = {"retry_window": 1.0, "timeout": 0.3}


def wait_for_requests(judge, n: int) -> None:
    """The judge's handler threads record a request when they take it: on a busy machine that can come after the
    client has given up on it."""
    deadline = time.monotonic() + 60
    while len(judge.requests) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(judge.requests) >= n, f"the judge saw {len(judge.requests)} requests, expected at least {n}"


@pytest.mark.parametrize("mode,words", [("slow", "no answer within 0.3s (timeout)"),
                                        ("wrong_count", "a wrong answer: 1 scores for 2 rows"),
                                        ("error", "HTTP 503")])
def test_slow_or_wrong_endpoints_are_retried_then_stop_the_run(judge, mode, words):
    judge.mode = mode
    r = remote(judge.url, **FAIL_FAST)
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError, match="failed .* time\\(s\\) over 1s of retries; last: .*") as e:
        r(["t"] * 2, ["ab", "cd"], {}, raw_prompts=["p", "p"])
    assert words in str(e.value) and "rather than score these rows 0" in str(e.value)
    assert time.monotonic() - t0 < 60, "gave up after its 1 s retry window"
    assert int(str(e.value).split(" failed ")[1].split(" ")[0]) >= 2, "retried within the window"
    wait_for_requests(judge, 2)


def test_a_down_endpoint_and_a_refused_token_stop_the_run(judge, monkeypatch):
    port = free_port()  # nobody listens there
    with pytest.raises(RewardServiceError, match="cannot connect"):
        remote(f"http://127.0.0.1:{port}/score", **FAIL_FAST)(["t"], ["a"], {}, raw_prompts=["p"])
    monkeypatch.setenv("GRPO_REWARD_TOKEN", "wrong")
    with pytest.raises(RewardServiceError, match="refused the request \\(HTTP 401"):
        remote(judge.url)(["t"], ["a"], {}, raw_prompts=["p"])
    assert len(judge.requests) == 1  # a 4xx is not retried


def test_scores_that_are_not_finite_in_float32_are_a_wrong_answer():
    """A service's score must fit the trainer's float32 rewards: 1e300 was taken (inf there: the group's advantages
    and the loss nan), a huge integer raised OverflowError out of the step."""
    from grpo.scoring.remote import score_list

    assert score_list({"rewards": [1, -2.5, None, 3.4e38]}, 4) == [1.0, -2.5, None, 3.4e38]
    for bad in (float("nan"), float("inf"), 1e300, -1e39, 10 ** 400, True, "1"):
        with pytest.raises(ValueError, match=r"is not a number finite in float32 \(\|r\| <= 3.4e38\) or null"):
            score_list([0.0, bad], 2)
