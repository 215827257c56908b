"""GRPO with process supervision: DeepSeekMath (Shao et al., 2024, arXiv 2402.03300), sec. 4.1.3.

A completion is cut into reasoning steps at ``separator`` (default "\\n\\n"); a step reward
function (``step_reward_fn``: a registered name or ``package.module:function``, called as
fn(prompt, steps, example) -> one score per step) scores each step. Step j of completion i ends
at token index(j) (the token that completes its separator; the last step ends at the last token,
EOS included) with reward r_i^j. Over all step rewards R of the group:
    r~ = (r - mean(R)) / (std(R) + eps)            std / eps: algo.adv_std / algo.adv_eps
    A_{i,t} = sum_{j: index(j) >= t} r~_i^j         the sum of the normalised rewards of later steps
The rest is GRPO (clip 0.2, k3 KL beta 0.04, seq-mean-token-mean). The outcome rewards still run
and are logged, but the advantages come from the step rewards only.

Formulas, defaults and decisions: docs/algorithms.md, section grpo-ps.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable

import torch

from algos.base import log_mean
from algos.grpo import GRPO
from grpo.foundation import rl_math
from grpo.foundation.config import ConfigError
from grpo.foundation.plugins import STEP_REWARDS


@dataclass
class GRPOPSOptions:
    step_reward_fn: str = "digits_step_match"  # registered name or package.module:function
    separator: str = "\n\n"  # text that ends a reasoning step


def step_ends(pieces: list[str], separator: str, n_tokens: int) -> list[int]:
    """Index of the last token of every step. ``pieces`` are the decoded text tokens (EOS excluded),
    ``n_tokens`` counts every completion token (EOS included). A separator that ends the text does
    not open an empty last step."""
    char_end, total = [], 0
    for p in pieces:
        total += len(p)
        char_end.append(total)
    text, ends, start = "".join(pieces), [], 0
    while (at := text.find(separator, start)) >= 0:
        start = at + len(separator)
        k = bisect_left(char_end, start)  # the token that completes this separator
        if k < len(pieces) - 1 and (not ends or k > ends[-1]):
            ends.append(k)
    return ends + [n_tokens - 1] if n_tokens > 0 else []


class GRPOPS(GRPO):
    name = "grpo-ps"
    paper = "DeepSeekMath sec. 4.1.3, process supervision (arXiv 2402.03300)"
    summary = "per-step rewards normalised over the group; token advantage = sum of later steps'"
    Options = GRPOPSOptions
    knobs = ("step_reward_fn", "separator", "beta")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.step_reward: Callable = self.resolve_step_reward(self.opt.step_reward_fn)
        self._tokenizer: Any = None

    @staticmethod
    def resolve_step_reward(name: str) -> Callable:
        return STEP_REWARDS.get(name)

    @classmethod
    def validate(cls, cfg) -> None:
        o = cfg.algo.options
        if not o.separator:
            raise ConfigError("algo.separator='' is invalid: give the text that ends a step (default '\\n\\n')")
        if cfg.algo.adv_scope != "group":
            raise ConfigError(f"algo.adv_scope={cfg.algo.adv_scope!r} is invalid for grpo-ps: choose from ['group']")
        cls.resolve_step_reward(o.step_reward_fn)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from grpo.foundation.modeling import load_tokenizer

            self._tokenizer = load_tokenizer(self.cfg.model.name_or_path, self.cfg.model.trust_remote_code)
        return self._tokenizer

    def process_batch(self, batch, ctx):
        """Cut every completion into steps and score them: extra["step_reward"] holds r_i^j at token
        index(j), extra["step_end"] marks those tokens."""
        rewards, ends_mask = torch.zeros(len(batch), batch.width), torch.zeros(len(batch), batch.width)
        sep = self.opt.separator
        for i, ids in enumerate(batch.completion_ids):
            text_ids = ids if bool(batch.truncated[i]) else ids[:-1]  # EOS ends every untruncated completion
            ends = step_ends(self.tokenizer.batch_decode([[t] for t in text_ids]), sep, len(ids))
            starts = [0] + [e + 1 for e in ends[:-1]]
            steps = [self.tokenizer.decode(text_ids[s : e + 1]).removesuffix(sep) for s, e in zip(starts, ends)]
            scores = [float(x) for x in self.step_reward(batch.prompt_text[i], steps, batch.items[i])]
            if len(scores) != len(steps):
                raise ValueError(f"algo.step_reward_fn={self.opt.step_reward_fn!r} returned {len(scores)} "
                                 f"scores for {len(steps)} steps")
            for e, r in zip(ends, scores):
                rewards[i, e], ends_mask[i, e] = r, 1.0
        batch.extra["step_reward"], batch.extra["step_end"] = rewards, ends_mask
        log_mean(ctx, "grpo_ps/step_reward", rewards, ends_mask)
        log_mean(ctx, "grpo_ps/steps_per_completion", ends_mask.sum(-1))
        return batch

    def advantages(self, batch, ctx) -> torch.Tensor:
        ends = batch.extra["step_end"]
        normed = rl_math.standardize(batch.extra["step_reward"], ends, batch.group_size, "group",
                                  self.a.adv_std, self.a.adv_eps)
        return rl_math.suffix_sum(normed, batch.mask).to(batch.rewards.dtype)
