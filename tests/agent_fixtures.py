"""Helpers of the multi-turn tests: a scripted multi-turn engine, misbehaving tools and environments."""

from __future__ import annotations

import torch

from grpo.rollout.engine import Completions, EngineSetup, SamplingParams
from grpo.rollout.multiturn import StepResult


class ScriptedTurns:
    """Answers every generation call with ``script(decoded prompt + prefix, row) -> text`` (+ EOS unless the
    text ends with '~', which is dropped: a turn without EOS), cut at ``params.max_tokens``."""

    def __init__(self, setup: EngineSetup, script):
        self.setup, self.script, self.calls = setup, script, []

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> Completions:
        self.calls.append((len(prompts), n, params.max_tokens))
        tok, eos = self.setup.tokenizer, self.setup.eos_ids[0]
        out = []
        for p in prompts:
            for r in range(n):
                text = self.script(tok.decode(p), r)
                ids = tok(text.rstrip("~"), add_special_tokens=False).input_ids + ([] if text.endswith("~") else [eos])
                out.append(ids[: params.max_tokens])
        return Completions(tokens=out, truncated=torch.tensor([not t or t[-1] != eos for t in out]))

    def sync_weights(self) -> None:
        pass


class RaisingEnv:
    """Raises in ``step`` on the rows whose prompt says so."""

    def __init__(self, **_):
        pass

    def reset(self, row):
        self.row = row
        return row["prompt"]

    def step(self, action):
        if self.row.get("explode"):
            raise RuntimeError("environment failure")
        return StepResult(None, 1.0, True)


class BadValueEnv:
    """Returns the bad value its row names (``row["bad"]``) from reset, step or reward_terms; 1.0 otherwise."""

    STEP = {"reward_none": StepResult(None, None, True), "reward_text": StepResult(None, "1.0x", True),
            "reward_nan": StepResult(None, float("nan"), True), "reward_inf": StepResult(None, float("inf"), True),
            "info_none": StepResult(None, 1.0, True, None), "not_a_result": (None, 1.0, True)}

    def __init__(self, **_):
        pass

    def reset(self, row):
        self.bad = row.get("bad")
        return None if self.bad == "reset_none" else row["prompt"]

    def step(self, action):
        return self.STEP.get(self.bad, StepResult(None, 1.0, True))

    def reward_terms(self):
        return {"env": None} if self.bad == "terms_none" else {"env": 1.0}


class HugeObservationEnv:
    """Answers every step with a 16 MiB observation: text, or (``shape``) one message or a list of them."""

    def __init__(self, shape="text", **_):
        self.shape = shape

    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        text = "x" * (16 << 20)
        message = {"role": "tool", "content": text}
        return StepResult({"text": text, "message": message, "messages": [message]}[self.shape], 0.0, False)


class SlowEnv:
    """Its step blocks for ``row["sleep"]`` seconds."""

    def __init__(self, **_):
        pass

    def reset(self, row):
        self.sleep = row.get("sleep", 0.0)
        return row["prompt"]

    def step(self, action):
        import time

        time.sleep(self.sleep)
        return StepResult(None, 1.0, True)
