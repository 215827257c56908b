"""A deliberately stale sampler for the rollout-correction tests: the hf engine over a frozen copy of the policy
made when the engine is built, never synced (``rollout.engine: tests.stale_engine:StaleEngine``). Its log-probs are
those of the policy at step 0, so the gap to the trainer grows with every update."""

from __future__ import annotations

import copy
import dataclasses

from grpo.rollout.engine import EngineSetup
from grpo.rollout.hf import HFEngine


class StaleEngine(HFEngine):
    def __init__(self, setup: EngineSetup):
        frozen = copy.deepcopy(setup.model).eval()
        frozen.requires_grad_(False)
        super().__init__(dataclasses.replace(setup, model=frozen))
        self.logprobs = True


class SkewedEngine(HFEngine):
    """The policy's own weights, always in sync, sampled at 1.5x the temperature: a sampler that computes differently
    from the trainer from the first step on (a stand-in for another dtype or other kernels)."""

    def generate(self, prompts, params, n):
        return super().generate(prompts, dataclasses.replace(params, temperature=params.temperature * 1.5), n)
