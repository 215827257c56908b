"""Rewards scored over HTTP: a user's endpoint (``url:``), and a reward model on the reference server.

Remote endpoint (OpenRLHF's ``remote_rm_url`` shape). The trainer POSTs JSON, one request per chunk of
``batch_size`` rows (default: the step's rows in one request)::

    {"query": [prompt + completion, ...],        # OpenRLHF's field: the whole text
     "prompts": [prompt, ...],                   # the dataset's prompts (texts, or lists of messages)
     "completions": [completion, ...],           # texts
     "labels": [...],                            # the dataset's "answer" column when there is one (OpenRLHF)
     "columns": {"answer": [...], ...},          # every other dataset column
     ...the entry's kwargs}

and takes back a JSON list of numbers (``null`` = not scored), or ``{"rewards": [...]}`` (``"scores"`` too),
one per row. ``Authorization: Bearer $GRPO_REWARD_TOKEN`` (``token_env``) when the variable is set; every
attempt of one request carries the same ``Idempotency-Key``. Connection errors, timeouts (``timeout``, default
``reward_pool.timeout``), 5xx / 429, a body that is not such a list, or the wrong number of scores are retried
with backoff for ``retry_window`` seconds; then the run stops with :class:`~grpo.foundation.plugins.RewardServiceError`
naming the URL and the last problem. A 4xx (a request the endpoint refuses) stops it at once. Never a silent 0.

Reference server: ``POST {ref.url}/v1/reward`` with ``{"prompts", "completions"}`` -> ``{"scores", "version"}``
(grpo/reference/server/app.py), with the reference client's token, timeouts and retry window.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any, Optional

import requests

from grpo.foundation.config import ConfigError, RewardPoolConfig, RewardSpec
from grpo.foundation.plugins import RewardServiceError
from grpo.scoring.calls import FLOAT32_MAX, Rows

BACKOFF_BASE, BACKOFF_CAP = 0.1, 2.0
REF_TOKEN_ENV = "GRPO_REF_TOKEN"


class JSONPoster:
    """POST JSON with retries on transient failures; ``check`` validates an answer (ValueError: retry)."""

    def __init__(self, url: str, token: Optional[str], timeout: float, retry_window: float, what: str,
                 connect_timeout: float = 5.0):
        self.url, self.token, self.timeout, self.retry_window, self.what = url, token, timeout, retry_window, what
        self.connect_timeout = min(connect_timeout, timeout)
        self.session = requests.Session()
        self.retries = 0

    def post(self, payload: dict, check) -> Any:
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + self.retry_window
        attempt, last = 0, ""
        while True:
            attempt += 1
            try:
                resp = self.session.post(self.url, json=payload, headers=headers,
                                         timeout=(self.connect_timeout, self.timeout))
                if resp.status_code == 200:
                    return check(resp.json())
                last = f"HTTP {resp.status_code}: {resp.text[:300]}"
                if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                    raise RewardServiceError(f"{self.what} at {self.url} refused the request ({last}); the run stops")
            except requests.Timeout:
                last = f"no answer within {self.timeout}s (timeout)"
            except requests.ConnectionError as e:
                last = f"cannot connect ({type(e).__name__})"
            except ValueError as e:  # not JSON, or check() refused the answer
                last = f"a wrong answer: {e}"
            if time.monotonic() >= deadline:
                raise RewardServiceError(f"{self.what} at {self.url} failed {attempt} time(s) over {self.retry_window:g}s "
                               f"of retries; last: {last}. The run stops rather than score these rows 0.")
            self.retries += 1
            time.sleep(min(max(0.0, deadline - time.monotonic()),
                           min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)))

    def close(self) -> None:
        self.session.close()


def score_list(answer: Any, n: int, keys: tuple[str, ...] = ("rewards", "scores")) -> list[Optional[float]]:
    """The scores of an answer (a list, or a mapping holding one under ``keys``); ValueError when wrong."""
    if isinstance(answer, dict):
        answer = next((answer[k] for k in keys if k in answer), None)
    if not isinstance(answer, list):
        raise ValueError(f"expected a JSON list of {n} numbers (or {{\"rewards\": [...]}}), got {str(answer)[:100]}")
    if len(answer) != n:
        raise ValueError(f"{len(answer)} scores for {n} rows")
    out = []
    for v in answer:
        if v is None:
            out.append(None)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= FLOAT32_MAX:  # (nan is not)
            out.append(float(v))
        else:
            raise ValueError(f"score {str(v)[:40]} is not a number finite in float32 (|r| <= 3.4e38) or null")
    return out


def _text(prompt: Any) -> str:
    if isinstance(prompt, list):
        return "".join(str(m.get("content", "")) for m in prompt)
    return str(prompt)


class RemoteTerm:
    """A reward source at a URL (``rewards: [{url: ...}]``)."""

    kind = "url"
    concurrent = True

    def __init__(self, name: str, spec: RewardSpec, pool: RewardPoolConfig):
        self.name, self.spec, self.weight = name, spec, spec.weight
        self.rows_per_call = spec.batch_size or pool.chunk_size or 0
        self.poster = JSONPoster(spec.url, os.environ.get(spec.token_env) or None,
                                 spec.timeout if spec.timeout is not None else pool.timeout,
                                 spec.retry_window, f"reward endpoint {name!r}")

    def score(self, rows: Rows) -> list[Optional[float]]:
        n = len(rows)
        size = self.rows_per_call or max(n, 1)
        out: list[Optional[float]] = []
        for s in range(0, n, size):
            part = rows.slice(s, min(n, s + size))
            payload = {"query": [_text(p) + c for p, c in zip(part.raw_prompts, part.completions)],
                       "prompts": part.raw_prompts, "completions": part.completions, "columns": part.columns,
                       **dict(self.spec.kwargs)}
            if "answer" in part.columns:
                payload.setdefault("labels", part.columns["answer"])
            out.extend(self.poster.post(payload, lambda a, k=len(part): score_list(a, k)))
        return out

    def pop_metrics(self) -> dict[str, float]:
        retries, self.poster.retries = self.poster.retries, 0
        return {f"reward/{self.name}/retries": float(retries)}

    def close(self) -> None:
        self.poster.close()


class ServerRewardClient:
    """The trainer's client of a reward model hosted by the reference server (``where: server``)."""

    def __init__(self, ref_cfg: Any, spec: RewardSpec):
        base = ref_cfg.url.rstrip("/")
        token = ref_cfg.token or os.environ.get(REF_TOKEN_ENV) or None
        self.poster = JSONPoster(f"{base}/v1/reward", token, ref_cfg.read_timeout, ref_cfg.retry_window,
                                 "the reference server's reward model", ref_cfg.connect_timeout)
        try:
            info = self.poster.session.get(f"{base}/v1/info", timeout=ref_cfg.connect_timeout,
                                           headers={"Authorization": f"Bearer {token}"} if token else {}).json()
        except (requests.RequestException, ValueError) as e:
            raise ConfigError(f"rewards: model {spec.model!r} with where=server: the reference server at {base} "
                              f"does not answer ({type(e).__name__}); start it with `python ref_client.py "
                              f"--reward-model {spec.model} ...`") from e
        reward = info.get("reward") if isinstance(info, dict) else None
        if not reward:
            raise ConfigError(f"rewards: model {spec.model!r} with where=server, but the reference server at {base} "
                              f"hosts no reward model: restart it with --reward-model {spec.model}")
        self.version: Optional[int] = reward.get("version")

    def score(self, prompts: list[Any], completions: list[str]) -> list[float]:
        n = len(completions)

        def check(answer: Any) -> list[float]:
            scores = score_list(answer, n, keys=("scores",))
            if any(v is None for v in scores):
                raise ValueError("the server's reward model returned null")
            if isinstance(answer, dict):
                self.version = answer.get("version", self.version)
            return scores  # type: ignore[return-value]

        return self.poster.post({"prompts": prompts, "completions": list(completions)}, check)

    def close(self) -> None:
        self.poster.close()
