"""A teacher behind an OpenAI-compatible server (``teacher.api: openai``): vLLM's ``/v1/completions`` with
``prompt_logprobs`` (tested against ``vllm serve``; another server that answers ``prompt_logprobs`` the same way works
too).

Each row (prompt + completion, as token ids) is sent as a prompt with ``max_tokens: 1`` and ``prompt_logprobs: k``;
the answer holds, at every prompt position, the log-prob of the token there and the k most likely tokens (rank 1..k).
The completion's positions are kept. vLLM computes prompt log-probs from the raw logits (temperature 1, whatever the
request says), so the run's sampling temperature must be 1 (refused at start otherwise). At start the client checks
the server's health, finds the served model (``teacher.served_model``, or the one /v1/models lists) and compares
its tokenizer with the policy's on a probe text (``/tokenize``). The transport, retries, timeouts and auth are the
reference client's (grpo/reference/http.py; ``ref.*`` apply).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Optional

import torch

from grpo.foundation.config import Config, ConfigError
from grpo.foundation.logprobs import Packed, Scores
from grpo.reference.http import HTTPReference
from grpo.reference.protocol import ReferenceServerError

PROBE = "Twelve apples, 3 pears = 15 fruit!\n"  # a text whose token ids two tokenizers rarely share by chance


class OpenAITeacher(HTTPReference):
    def __init__(self, cfg: Config, tokenizer=None, vocab_size: Optional[int] = None):
        if cfg.rollout.temperature != 1.0:
            raise ConfigError(f"teacher.api='openai' with rollout.temperature={cfg.rollout.temperature}: an "
                              f"OpenAI-compatible server's prompt_logprobs are of the teacher's raw distribution "
                              f"(temperature 1), and the student's log-probs are at the sampling temperature. Set "
                              f"rollout.temperature=1, or serve the teacher with ref_client.py (teacher.api='grpo')")
        self._connect(cfg, tokenizer, cfg.teacher.url)
        self.vocab_size = vocab_size
        self._request("GET", "/health")
        self.model = cfg.teacher.served_model or self._only_model()
        self.server_info = {"model": self.model, "version": 0}
        if tokenizer is not None:
            self._check_tokenizer(tokenizer, cfg.data.chat_template, cfg.data.chat_template_kwargs)

    def _only_model(self) -> str:
        models = [m.get("id") for m in self._request("GET", "/v1/models").json().get("data", [])]
        if len(models) != 1:
            raise ConfigError(f"teacher.url={self.url!r} serves {models}: name the teacher with teacher.served_model")
        return str(models[0])

    def _check_tokenizer(self, tokenizer, chat_template: bool, template_kwargs: Optional[dict] = None) -> None:
        """The server's tokenizer (``/tokenize``) gives the policy's ids for a probe text led by every special token,
        and, where prompts use the chat template, for the probe as a templated user turn (rendered with
        ``template_kwargs``, data.chat_template_kwargs, on both sides)."""
        probe = "".join(tokenizer.all_special_tokens) + PROBE
        checks = [("the text " + repr(probe), list(tokenizer(probe)["input_ids"]), {"prompt": probe})]
        if chat_template:
            turn = [{"role": "user", "content": PROBE}]
            ids = tokenizer.apply_chat_template(turn, tokenize=True, add_generation_prompt=True,
                                                **(template_kwargs or {}))
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            extra = {"chat_template_kwargs": dict(template_kwargs)} if template_kwargs else {}
            checks.append(("the chat-templated turn " + repr(PROBE), list(ids),
                           {"messages": turn, "add_generation_prompt": True, **extra}))
        for what, mine, body in checks:
            theirs = list(self._request("POST", "/tokenize", json={"model": self.model, **body}).json()["tokens"])
            if mine != theirs:
                raise ConfigError(
                    f"teacher.url={self.url!r} serves {self.model!r}, whose tokenizer is not the policy's "
                    f"({tokenizer.name_or_path!r}): {what} is {theirs[:12]} there and {mine[:12]} here. On-policy "
                    f"distillation compares log-probs token by token: serve a teacher of the policy's family (the "
                    f"same tokenizer, special tokens and chat template)")

    def info(self) -> dict:
        return dict(self.server_info)

    def reload(self, checkpoint_dir: str) -> dict:
        raise ReferenceServerError(f"the teacher at {self.url} is an OpenAI-compatible server: it is not reloaded")

    def scores(self, packed: Packed, temperature: float, with_entropy: bool = False, top_k: int = 0) -> Scores:
        """[rows, width] log-probs of ``packed``'s completion tokens, and the ``top_k`` most likely tokens at each of
        their positions ([rows, width, top_k]); no entropy (the server does not send it)."""
        if with_entropy:
            raise ValueError("an OpenAI-compatible teacher sends no entropy")
        rows = [packed.input_ids[i, : int(packed.start[i] + packed.length[i])].tolist() for i in range(len(packed.start))]
        body = {"model": self.model, "prompt": rows, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": top_k}
        t0 = time.perf_counter()
        answer = self._request("POST", "/v1/completions", json=body, key=uuid.uuid4().hex).json()
        t1 = time.perf_counter()
        B, W = len(rows), packed.width
        out = Scores(torch.zeros(B, W))
        if top_k:
            out.topk_logprobs, out.topk_ids = torch.zeros(B, W, top_k), torch.zeros(B, W, top_k, dtype=torch.long)
        choices = sorted(answer.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != B:
            raise ReferenceServerError(f"the teacher at {self.url} answered {len(choices)} choices for {B} rows")
        for i, (row, choice) in enumerate(zip(rows, choices)):
            steps = choice.get("prompt_logprobs") or []
            if len(steps) != len(row):
                raise ReferenceServerError(f"the teacher at {self.url} sent {len(steps)} prompt_logprobs for row {i} of "
                                           f"{len(row)} tokens")
            start = int(packed.start[i])
            for t in range(int(packed.length[i])):
                self._take(out, i, t, row[start + t], steps[start + t], top_k)
        with self._lock:
            self._metrics["ref/latency"] += t1 - t0
            self._metrics["ref/requests"] += 1
        return out

    def _take(self, out: Scores, i: int, t: int, token: int, step: dict, top_k: int) -> None:
        """Row ``i``'s completion position ``t`` from one prompt_logprobs entry {token id: {logprob, rank}}: the
        sampled token's log-prob and the tokens of ranks 1..top_k, each exactly once, every log-prob finite and <= 0
        (anything else is the server's fault, named: a missing rank would leave log-prob 0 on token 0)."""
        where = f"row {i}, completion position {t}"
        if not isinstance(step, dict):
            raise ReferenceServerError(f"the teacher at {self.url} sent {type(step).__name__} as the prompt_logprobs of "
                                       f"{where}: expected an object of token ids")
        entry = step.get(str(token))
        if not isinstance(entry, dict):
            raise ReferenceServerError(f"the teacher at {self.url} sent no log-prob for token {token} of row {i}")
        out.logprobs[i, t] = self._logprob(entry.get("logprob"), f"token {token} at {where}")
        seen: dict[int, str] = {}
        for tok, e in step.items():
            rank = e.get("rank") if isinstance(e, dict) else None
            if not (isinstance(rank, int) and 1 <= rank <= top_k):
                continue
            if rank in seen:
                raise ReferenceServerError(f"the teacher at {self.url} sent rank {rank} twice at {where} (tokens "
                                           f"{seen[rank]} and {tok})")
            seen[rank] = tok
            try:
                tid = int(tok)
            except ValueError:
                raise ReferenceServerError(f"the teacher at {self.url} sent token id {tok!r} at {where}") from None
            if not 0 <= tid < (self.vocab_size if self.vocab_size is not None else 2**63):
                raise ReferenceServerError(f"the teacher at {self.url} sent token id {tok}, outside the policy's "
                                           f"vocabulary [0, {self.vocab_size})")
            out.topk_logprobs[i, t, rank - 1] = self._logprob(e.get("logprob"), f"rank {rank} at {where}")
            out.topk_ids[i, t, rank - 1] = tid
        missing = [r for r in range(1, top_k + 1) if r not in seen]
        if missing:
            raise ReferenceServerError(f"the teacher at {self.url} sent no token of rank {missing} at {where} (asked "
                                       f"for prompt_logprobs={top_k}): its answer is incomplete")

    def _logprob(self, value, what: str) -> float:
        """A log-prob from the answer: a finite number <= 0 (1e-4 of rounding above 0 allowed)."""
        try:
            v = float(value)
        except (TypeError, ValueError):
            v = math.nan
        if not math.isfinite(v) or v > 1e-4:
            raise ReferenceServerError(f"the teacher at {self.url} sent log-prob {value!r} for {what}: a log-prob is a "
                                       f"finite number <= 0")
        return min(v, 0.0)
