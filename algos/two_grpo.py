"""2-GRPO: "It Takes Two: Your GRPO Is Secretly DPO" (arXiv 2510.00977).

GRPO with G = 2 completions per prompt and the population std, so that

    A = (r - mean) / std_pop = +1 / -1 for a pair with different rewards, 0 for an equal pair

(adv_eps defaults to 0 here, which makes the +-1 exact; equal pairs are set to 0 by the shared
group advantage). Equal pairs are kept: they count in the 1/N of ``seq-mean-token-mean``.
The rest is grpo (token ratio, clip 0.2, k3 KL with beta 0.04). The paper compares against
G = 16 with 8x the prompts per step and 8x the learning rate; configs/2-grpo.yaml says so.

Formulas, defaults and decisions: docs/algorithms.md, section 2-grpo.
"""

from __future__ import annotations

from algos.grpo import GRPO
from grpo.foundation.config import Config, ConfigError


class TwoGRPO(GRPO):
    name = "2-grpo"
    paper = "It Takes Two: Your GRPO Is Secretly DPO (arXiv 2510.00977)"
    summary = "grpo with G = 2 and the population std: A = +-1 for mixed pairs, 0 otherwise (kept)"
    defaults = {**GRPO.defaults, "adv_std": "population", "adv_eps": 0.0}
    knobs = ("beta", "clip_eps_low", "clip_eps_high", "adv_std")

    @classmethod
    def validate(cls, cfg: Config) -> None:
        if cfg.rollout.num_generations != 2:
            raise ConfigError(
                f"rollout.num_generations={cfg.rollout.num_generations} is invalid for 2-grpo: it must be 2 "
                f"(the paper's 8x prompts per step keep the rollouts per step of G = 16)"
            )
