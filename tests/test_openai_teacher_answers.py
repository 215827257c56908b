"""The OpenAI-compatible teacher's answers checked like the grpo wire's (issue 58 item 5): a ``prompt_logprobs`` answer
missing a rank left a zero slot (log-prob 0.0, probability 1, on token id 0), and a NaN log-prob was taken. Against a
real HTTP server thread on loopback answering as vLLM's ``/v1/completions`` does, with the answer each case sets."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo.foundation.dist import free_port
from grpo.foundation.logprobs import pack
from grpo.reference.protocol import ReferenceServerError
from tests.helpers import config

K = 2


class FakeVllm:
    """/health, /v1/models and /v1/completions; ``spoil(rows)`` edits each answer's prompt_logprobs in place."""

    def __init__(self):
        self.spoil = lambda steps: None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.answer({"data": [{"id": "teacher"}]} if self.path == "/v1/models" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                choices = []
                for index, row in enumerate(body["prompt"]):
                    steps = [None] + [fake.step(row[p], p, body["prompt_logprobs"]) for p in range(1, len(row))]
                    choices.append({"index": index, "prompt_logprobs": steps})
                fake.spoil(choices)
                self.answer({"choices": choices})

            def answer(self, payload):
                data = json.dumps(payload).encode()  # NaN as NaN, as Python's json writes it
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    @staticmethod
    def step(token: int, position: int, k: int) -> dict:
        """The token's own log-prob and ranks 1..k on tokens 1..k (the token itself when it is among them)."""
        out = {str(r): {"logprob": -0.1 * r - 0.01 * position, "rank": r} for r in range(1, k + 1)}
        out.setdefault(str(token), {"logprob": -3.0 - 0.01 * position, "rank": 50})
        return out

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture(scope="module")
def server():
    fake = FakeVllm()
    yield fake
    fake.httpd.shutdown()


def ask(server, spoil=None):
    from grpo.reference.openai import OpenAITeacher

    server.spoil = spoil or (lambda choices: None)
    cfg = config("opd", **{"teacher.url": server.url, "teacher.api": "openai", "teacher.model": "null",
                           "rollout.temperature": 1.0, "ref.retry_window": 0})
    teacher = OpenAITeacher(cfg, None, vocab_size=64)
    packed = pack([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], 0, 3)
    try:
        return teacher.scores(packed, 1.0, top_k=K)
    finally:
        teacher.close()


def test_a_whole_answer_is_read(server):
    s = ask(server)
    # row 0: prompt 3 tokens, completion at positions 3, 4; row 1: prompt 2, completion at 2, 3, 4
    assert s.logprobs[0, :2].tolist() == pytest.approx([-3.03, -3.04]) and s.logprobs[0, 2] == 0
    assert s.logprobs[1].tolist() == pytest.approx([-3.02, -3.03, -3.04])
    assert s.topk_ids[1, 0].tolist() == [1, 2]
    assert s.topk_logprobs[1, 0].tolist() == pytest.approx([-0.12, -0.22])


def drop_rank_2(choices):
    del choices[1]["prompt_logprobs"][3]["2"]


def rank_twice(choices):
    choices[0]["prompt_logprobs"][3]["30"] = {"logprob": -0.5, "rank": 1}


def nan_logprob(choices):
    choices[0]["prompt_logprobs"][4]["1"]["logprob"] = math.nan


def own_nan(choices):
    choices[1]["prompt_logprobs"][2]["12"]["logprob"] = math.nan


def positive(choices):
    choices[1]["prompt_logprobs"][4]["14"]["logprob"] = 0.7


def minus_inf(choices):
    choices[0]["prompt_logprobs"][3]["2"]["logprob"] = -math.inf


@pytest.mark.parametrize("spoil, match", [
    (drop_rank_2, r"sent no token of rank \[2\] at row 1, completion position 1 \(asked for prompt_logprobs=2\)"),
    (rank_twice, r"sent rank 1 twice at row 0, completion position 0 \(tokens 1 and 30\)"),
    (nan_logprob, r"sent log-prob nan for rank 1 at row 0, completion position 1: a log-prob is a finite number <= 0"),
    (own_nan, r"sent log-prob nan for token 12 at row 1, completion position 0"),
    (positive, r"sent log-prob 0.7 for token 14 at row 1, completion position 2"),
    (minus_inf, r"sent log-prob -inf for rank 2 at row 0, completion position 0"),
], ids=["missing-rank", "rank-twice", "nan-topk", "nan-token", "positive", "minus-inf"])
def test_a_bad_answer_is_the_servers_error_naming_the_place(server, spoil, match):
    with pytest.raises(ReferenceServerError, match=match):
        ask(server, spoil)
