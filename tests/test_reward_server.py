"""A reward model hosted by the reference server beside the reference model (ref_client.py --reward-model),
as a real subprocess on loopback: same scores as in-process, interleaved with log-prob requests under load,
bad requests refused with 4xx while the server keeps serving, and an atomic reload.

Tolerance: the server and this process both run fp32 on CPU with one thread and the same code
(grpo/scoring/models.py), one request at a time, so the scores are expected bit-identical; the comparison with
the in-process model allows 1e-6 all the same (documented in docs/rewards.md)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from grpo.foundation.config import RewardPoolConfig, RewardSpec
from grpo.foundation.tiny import make_char_tokenizer, write_tiny, write_tiny_classifier
from grpo.reference.http import HTTPReference
from grpo.reference.launch import ServerProcess, free_port
from grpo.training.configure import load_config
from grpo.scoring.combined import CombinedReward
from grpo.scoring.models import RewardModel
from tests.ref_support import one_thread, ragged_batch  # noqa: F401 (one_thread: autouse)
from tests.patience import SERVER_S

pytestmark = pytest.mark.slow

TOKEN = "rm-token-456"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = ["12=", "345=", "6+7=", "1=", "99<", "a long prompt with many characters="]
COMPLETIONS = ["12", "543", "13", "", "99 and some more text", "x"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_server")
    return {"root": root, "model": write_tiny(root / "tiny"), "rm": write_tiny_classifier(root / "rm", seed=3),
            "rm2": write_tiny_classifier(root / "rm2", seed=9), "log": root / "server.log"}


@pytest.fixture(scope="module")
def server(dirs):
    srv = ServerProcess(["--model", str(dirs["model"]), "--reward-model", str(dirs["rm"]), "--max-request-mb", "0.1",
                         "--max-queue", "16"], port=free_port(), token=TOKEN, log_path=dirs["log"],
                        env={"OMP_NUM_THREADS": "1"})
    srv.start(timeout=SERVER_S)
    yield srv
    srv.stop()


def cfg(server, dirs):
    return load_config(None, None, [f"ref.url={server.url}", f"ref.token={TOKEN}", f"model.name_or_path={dirs['model']}",
                                    "ref.retry_window=30"])


def score(server, prompts, completions, token=TOKEN) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(server.url + "/v1/reward", json={"prompts": prompts, "completions": completions},
                         headers=headers, timeout=60)


def test_server_scores_equal_in_process_and_the_trainer_entry_uses_them(server, dirs):
    local = RewardModel(str(dirs["rm"]), "cpu")
    want = local.score_texts(local.texts(PROMPTS, COMPLETIONS))
    got = score(server, PROMPTS, COMPLETIONS).json()
    assert got["version"] == 0 and got["rows"] == 6
    assert max(abs(a - b) for a, b in zip(got["scores"], want)) <= 1e-6
    chat = [[{"role": "user", "content": p}] for p in PROMPTS]
    got_chat = score(server, chat, COMPLETIONS).json()["scores"]
    want_chat = local.score_texts(local.texts(chat, COMPLETIONS))
    assert max(abs(a - b) for a, b in zip(got_chat, want_chat)) <= 1e-6
    c = cfg(server, dirs)
    r = CombinedReward([RewardSpec(model=str(dirs["rm"]), where="server", normalize="fixed", shift=1.0, scale=2.0)],
                       RewardPoolConfig(num_workers=0), ref=c.ref)
    total, per_fn = r(["t"] * 6, COMPLETIONS, {}, raw_prompts=PROMPTS)
    assert max(abs(t - (w - 1.0) / 2.0) for t, w in zip(total, want)) <= 1e-5
    r.close()


def test_reference_and_reward_requests_interleaved_under_load_answer_as_alone(server, dirs):
    c = cfg(server, dirs)
    tok = make_char_tokenizer()
    batches = [ragged_batch(200 + i, rows=2 + i % 5, vocab=93) for i in range(6)]
    alone_ref = HTTPReference(c, tok, 93)
    want_lp = [alone_ref.submit(p, 1.0).result() for p in batches]
    rows = [(PROMPTS[i:] + PROMPTS[:i], COMPLETIONS[i:] + COMPLETIONS[:i]) for i in range(6)]
    want_rm = [score(server, p, q).json()["scores"] for p, q in rows]
    start = threading.Barrier(8)

    def hammer(k: int) -> int:
        start.wait()
        wrong = 0
        ref = HTTPReference(c, tok, 93) if k % 2 else None
        for j in range(12):
            i = (k + j) % 6
            if ref is not None:
                wrong += not torch.equal(ref.submit(batches[i], 1.0).result(), want_lp[i])
            else:
                wrong += score(server, *rows[i]).json()["scores"] != want_rm[i]
        if ref is not None:
            ref.close()
        return wrong

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(hammer, range(8))) == 0, "every answer must equal the one given alone"
    alone_ref.close()


def test_bad_reward_requests_get_4xx_and_the_server_keeps_serving(server):
    good = score(server, PROMPTS[:2], COMPLETIONS[:2]).json()["scores"]
    cases = [
        ("not json", b"{nope", 400, "body"),
        ("completions not strings", {"prompts": ["a"], "completions": [1]}, 400, "completions"),
        ("lengths differ", {"prompts": ["a", "b"], "completions": ["x"]}, 400, "prompts"),
        ("no rows", {"prompts": [], "completions": []}, 400, "completions"),
        ("bad message", {"prompts": [[{"role": "user"}]], "completions": ["x"]}, 400, "prompts"),
        ("huge body", {"prompts": ["a"], "completions": ["x" * 200_000]}, 413, "body"),
    ]
    for name, body, status, field in cases:
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        r = requests.post(server.url + "/v1/reward", headers=AUTH, timeout=60, **kw)
        assert r.status_code == status and r.json()["field"] == field, (name, r.status_code, r.text)
        assert score(server, PROMPTS[:2], COMPLETIONS[:2]).json()["scores"] == good, name
    assert score(server, PROMPTS[:2], COMPLETIONS[:2], token=None).status_code == 401
    assert score(server, PROMPTS[:2], COMPLETIONS[:2], token="wrong").status_code == 403
    assert requests.get(server.url + "/health", headers=AUTH, timeout=10).json()["status"] == "ok"


def test_reloading_the_reward_model_is_atomic(server, dirs):
    old = RewardModel(str(dirs["rm"]), "cpu")
    new = RewardModel(str(dirs["rm2"]), "cpu")
    want = {0: old.score_texts(old.texts(PROMPTS, COMPLETIONS)), 1: new.score_texts(new.texts(PROMPTS, COMPLETIONS))}
    assert max(abs(a - b) for a, b in zip(want[0], want[1])) > 1e-3  # two different models
    r = requests.post(server.url + "/v1/reward/reload", json={"checkpoint": str(dirs["rm2"])}, timeout=10)
    assert r.status_code == 401  # admin: the token is required
    r = requests.post(server.url + "/v1/reward/reload", json={"checkpoint": str(dirs["root"] / "missing")},
                      headers=AUTH, timeout=60)
    assert r.status_code == 400 and "not a folder" in r.json()["error"]
    answers, stop = [], threading.Event()

    def stream() -> None:
        while not stop.is_set():
            answers.append(score(server, PROMPTS, COMPLETIONS).json())

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    info = requests.post(server.url + "/v1/reward/reload", json={"checkpoint": str(dirs["rm2"])}, headers=AUTH,
                         timeout=120).json()
    after = [score(server, PROMPTS, COMPLETIONS).json() for _ in range(3)]
    stop.set()
    for t in threads:
        t.join()
    assert info["reward"]["version"] == 1 and info["reward"]["model"] == str(dirs["rm2"])
    assert info["version"] == 0  # the reference model is untouched
    for a in answers + after:  # every answer is wholly the old model's or wholly the new one's
        assert max(abs(x - y) for x, y in zip(a["scores"], want[a["version"]])) <= 1e-6
    assert all(a["version"] == 1 for a in after)
