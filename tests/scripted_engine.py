"""A generation engine that writes scripted completions: proof that an engine plugs in through
``rollout.engine: tests.scripted_engine:ScriptedEngine`` without touching the trainer.

Row r of a group answers the prompt's digits when r is even and "0" otherwise, then EOS; it
reports a made-up sampler log-prob per token, and counts its calls.
"""

from __future__ import annotations

import torch

from grpo.rollout.engine import Completions, EngineSetup, SamplingParams

CALLS: dict[str, list] = {"generate": [], "sync_weights": []}


class ScriptedEngine:
    def __init__(self, setup: EngineSetup):
        self.setup = setup
        self.tok = setup.tokenizer

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> Completions:
        CALLS["generate"].append((len(prompts), n, params))
        eos = self.setup.eos_ids[0]
        tokens = []
        for p in prompts:
            digits = "".join(ch for ch in self.tok.decode(p) if ch.isdigit())
            for r in range(n):
                text = digits if r % 2 == 0 else "0"
                tokens.append((self.tok(text, add_special_tokens=False).input_ids + [eos])[: params.max_tokens])
        truncated = torch.tensor([t[-1] != eos for t in tokens], dtype=torch.bool)
        return Completions(tokens=tokens, truncated=truncated, logprobs=[[-0.5] * len(t) for t in tokens])

    def sync_weights(self) -> None:
        CALLS["sync_weights"].append(True)
