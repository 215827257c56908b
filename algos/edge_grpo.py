"""EDGE-GRPO: entropy-driven advantage and guided error correction (arXiv 2507.21848).

Entropy-driven advantage (EDA), with H the old policy's per-token entropy (detached):

    P_i = (1/|o_i|) sum_t H_i,t,   P^_i = P_i / mean_g P,   A^_i = A_i / P^_i

(A_i the grpo group advantage; P_i is floored at 1e-6 so that a zero-entropy completion
cannot divide by zero). The loss is grpo's with beta = 0.

Guided error correction (option ``guided_correction``; the data needs reference solutions):
every incorrect completion (reward < ``correct_threshold``) is, with probability
  0.5   its text + ``reflection_cue``, then continued by the policy (the rollout service's continue_sequences);
  0.25  its text + ``reflection_cue`` + the correct final answer (``answer_column``) + EOS;
  0.25  replaced by the reference solution (``solution_column``) + EOS;
then re-scored with the trainer's reward functions, before advantages. Everything stays within
``rollout.max_completion_length`` tokens: the original text is cut from its end to make room
for what is appended (a completion is left as it is when even the appended part cannot fit),
and a reference solution that is too long is truncated.

Formulas, defaults and decisions: docs/algorithms.md, section edge-grpo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import StepContext
from algos.grpo import GRPO
from grpo.foundation import rl_math, dist
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config, ConfigError

CONTINUE, HINT, REPLACE = 0, 1, 2


def correction_case(u: float) -> int:
    """The correction for a uniform draw u in [0, 1): CONTINUE (0.5), HINT (0.25), REPLACE (0.25)."""
    return CONTINUE if u < 0.5 else HINT if u < 0.75 else REPLACE


@dataclass
class EdgeOptions:
    guided_correction: bool = False  # correct wrong completions
    solution_column: str = "solution"  # reference solutions (replacement)
    answer_column: str = "answer"  # correct final answers (hint)
    reflection_cue: str = "\nWait, let me check that again.\n"  # the paper's cue is not given: Decision
    correct_threshold: float = 1.0  # reward >= this counts as correct


class EdgeGRPO(GRPO):
    name = "edge-grpo"
    paper = "EDGE-GRPO (arXiv 2507.21848)"
    summary = "advantage divided by the completion's normalised mean entropy; optional guided error correction"
    Options = EdgeOptions
    defaults = {**GRPO.defaults, "beta": 0.0}
    knobs = ("guided_correction", "reflection_cue", "clip_eps_low", "clip_eps_high")

    @classmethod
    def validate(cls, cfg: Config) -> None:
        if cfg.algo.options.guided_correction and not cfg.algo.options.reflection_cue:
            raise ConfigError("algo.reflection_cue is empty: guided correction appends it to incorrect completions")
        if cfg.algo.options.guided_correction and cfg.algo.tis_cap is not None:
            # the rewritten rows' tokens were not sampled by the engine: their sampler log-probs would be the old
            # row's, a TIS weight of about p_old (~0.01) on each correction token (issue 30, item 12)
            raise ConfigError(f"algo.tis_cap={cfg.algo.tis_cap!r} with algo.guided_correction: the corrected "
                              "completions were not sampled by the engine, so they have no sampler log-probs to "
                              "weight by; set algo.tis_cap=null or algo.guided_correction=false")
        if cfg.algo.options.guided_correction and cfg.algo.rollout_correction is not None:
            raise ConfigError("algo.rollout_correction with algo.guided_correction: the corrected completions were not "
                              "sampled by the engine, so they have no sampler log-probs to weight by; set "
                              "algo.rollout_correction=null or algo.guided_correction=false")

    @property
    def needs_entropy(self) -> bool:
        return True

    def advantages(self, batch: RolloutBatch, ctx: StepContext) -> torch.Tensor:
        adv = super().advantages(batch, ctx).double()
        p = rl_math.masked_mean(batch.entropy.double(), batch.mask.double(), dim=-1).clamp(min=1e-6)
        p_hat = p / rl_math.group_view(p, batch.group_size).mean(1).repeat_interleave(batch.group_size)
        return (adv / p_hat).to(batch.rewards.dtype)

    # ----------------------------------------------------------------- guided error correction
    def process_batch(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        if not self.opt.guided_correction:
            return batch
        wrong = (batch.rewards < self.opt.correct_threshold).nonzero(as_tuple=True)[0].tolist()
        self.correct(batch, wrong, ctx)  # on every rank, with or without rows: continuing is collective under ZeRO-3
        c = dist.all_reduce_sum(torch.tensor([len(wrong), len(batch)], dtype=torch.float64))
        ctx.metrics["edge/corrected_frac"] = float(c[0] / c[1])
        return batch

    def correct(self, batch: RolloutBatch, rows: list[int], ctx: StepContext) -> None:
        """Rewrite the incorrect ``rows`` of ``batch`` in place and re-score them."""
        ro, o, L = ctx.rollout, self.opt, batch.width
        tok, eos_ids = ro.tokenizer, ro.eos_ids
        eos, eos_set = eos_ids[0], set(eos_ids)
        for col in {o.solution_column, o.answer_column}:
            if any(col not in batch.items[i] for i in rows):
                raise ConfigError(
                    f"algo.guided_correction needs the dataset column {col!r} (algo.solution_column / "
                    f"algo.answer_column); the data has {sorted(batch.items[rows[0]])}"
                )
        encode = lambda text: tok(str(text), add_special_tokens=False).input_ids  # noqa: E731
        cue = encode(o.reflection_cue)
        gen = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + ctx.step * 1009 + dist.rank())
        u = torch.rand(len(rows), generator=gen).tolist()
        new: dict[int, tuple[list[int], bool]] = {}
        to_continue: list[tuple[int, list[int]]] = []
        for i, ui in zip(rows, u):
            own = batch.completion_ids[i]
            own = own[:-1] if own and own[-1] in eos_set else own
            case = correction_case(ui)
            if case == REPLACE:
                sol = encode(batch.items[i][o.solution_column]) + [eos]
                new[i] = (sol[:L], len(sol) > L)
                continue
            tail = cue if case == CONTINUE else cue + encode(batch.items[i][o.answer_column]) + [eos]
            room = L - len(tail) - (1 if case == CONTINUE else 0)  # CONTINUE leaves >= 1 token to the policy
            if room < 0:
                continue  # the cue (and answer) cannot fit: leave this completion as it is
            prefix = own[:room] + tail
            if case == HINT:
                new[i] = (prefix, False)
            else:
                to_continue.append((i, prefix))
        cont = ro.continue_sequences([batch.prompt_ids[i] for i, _ in to_continue], [p for _, p in to_continue],
                                     [L - len(p) for _, p in to_continue])
        for (i, p), (toks, truncated) in zip(to_continue, cont):
            new[i] = (p + toks, truncated)
        changed = sorted(new)
        ro.rewrite(batch, changed, [new[i] for i in changed])
