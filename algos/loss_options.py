"""The options every algorithm takes, whatever its loss (TRL's options that apply to many losses; docs/algorithms.md,
"Options for any loss"): the KL term and its bias correction (``algo.beta``, ``algo.use_bias_correction_kl``), KL
in the reward (``algo.kl_in_reward``), truncated importance sampling (``algo.tis_cap``), the off-policy mask
(``algo.off_policy_mask_threshold``), the top-entropy mask (``algo.top_entropy_quantile``), masking truncated
completions, the entropy bonus and its adaptive coefficient (``algo.entropy_coef``, ``algo.entropy_target``).
``Algorithm`` (algos/base.py) inherits them; an algorithm's own loss calls ``tis`` and ``add_kl``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import math

import torch

from grpo.foundation import rl_math, dist
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.plugins import StepContext


@dataclass
class LossOutput:
    loss: torch.Tensor  # this micro-batch's share of the step loss
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name -> (sum, count)


def masked_stat(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of x over the mask, detached, for rank-reduced means."""
    m = mask.detach().float()
    return (x.detach().float() * m).sum(), m.sum()


def log_mean(ctx: "StepContext", name: str, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
    """ctx.metrics[name] = mean of x (over the mask) on all ranks; every rank must call it."""
    ctx.metrics[name] = float(rl_math.global_mean_std(x.detach(), mask=mask)[0])


class LossOptions:
    """The shared options' part of an algorithm (self.a: the ``algo`` section; self.cfg: the config)."""

    def token_rewards(self, batch: RolloutBatch, ctx: Optional[StepContext] = None) -> torch.Tensor:
        """[rows, T] float64: the outcome reward on each row's last token, minus ``algo.kl_in_reward`` * k1 on
        every token (k1 = l_old - l_ref, verl's ``apply_kl_penalty``)."""
        out = rl_math.outcome_token_rewards(batch.rewards, batch.mask)
        coef = self.a.kl_in_reward
        if coef > 0:
            k1 = (batch.old_logp.double() - batch.ref_logp.double()) * batch.mask.double()
            out = out - coef * k1
            if ctx is not None:
                log_mean(ctx, "kl_in_reward", k1, batch.mask)
        return out

    def scores(self, batch: RolloutBatch, ctx: Optional[StepContext] = None) -> torch.Tensor:
        """The outcome score r_i, or r_i - kl_in_reward * sum_t k1 with KL in the reward (``batch.rewards``'s dtype)."""
        if self.a.kl_in_reward <= 0:
            return batch.rewards
        return self.token_rewards(batch, ctx).sum(-1).to(batch.rewards.dtype)

    def prepare_loss(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        """After the advantages, before the step's normalisers and the loss (every rank, the whole batch):
        ``algo.mask_truncated_completions``, on-policy distillation's term (``teacher``) and
        ``algo.top_entropy_quantile``'s threshold over all ranks."""
        if self.a.mask_truncated_completions:
            batch.mask = batch.mask * (~batch.truncated.bool()).unsqueeze(1).to(batch.mask.dtype)
        if batch.teacher_logp is not None:
            self.distill(batch, ctx)
        if self.a.rollout_correction is not None:
            self.correct_rollout(batch, ctx)
        rho = self.a.top_entropy_quantile
        if rho < 1.0:
            ent, valid = batch.entropy.double(), batch.mask.bool()
            pool = torch.cat([torch.as_tensor(v) for v in dist.all_gather_object(ent[valid].cpu())])
            if pool.numel():
                threshold = torch.quantile(pool, 1.0 - rho)
                keep = (ent >= threshold) & valid
            else:
                keep = torch.zeros_like(valid)
            batch.extra = {**batch.extra, "entropy_keep": keep.to(batch.mask.dtype)}
            log_mean(ctx, "entropy_mask/kept_frac", keep.double(), batch.mask)
        if self.a.entropy_target is not None:
            self.adapt_entropy_coef(float(rl_math.global_mean_std(batch.entropy.double(), mask=batch.mask)[0]))
        if self.entropy_bonus:
            ctx.metrics["entropy_bonus/coef"] = self.entropy_alpha
        return batch

    def distill(self, batch: RolloutBatch, ctx: StepContext) -> None:
        """``teacher``: A_t <- A_t - coef * (l_old - l_teacher)_t (rl_math.distilled_advantages), per token; with
        ``teacher.top_k`` the advantages stay (the divergence joins the loss: :meth:`loss_with_bonus`). Logged:
        ``distill/reverse_kl`` (the mean of l_old - l_teacher over the tokens, the sampled-token estimate of
        KL(student || teacher)), ``distill/teacher_prob`` (the teacher's mean probability of the student's tokens),
        ``distill/share`` (the distillation term's share of the advantages' magnitude, sum over tokens; with top_k,
        of the loss's: logged by the training pass)."""
        coef, mask = self.cfg.teacher.coef, batch.mask
        gap = (batch.old_logp.double() - batch.teacher_logp.double()) * mask.double()
        log_mean(ctx, "distill/reverse_kl", gap, mask)
        log_mean(ctx, "distill/teacher_prob", batch.teacher_logp.double().exp(), mask)
        if self.cfg.teacher.top_k:
            return
        before = batch.advantages
        batch.advantages = rl_math.distilled_advantages(before, batch.old_logp, batch.teacher_logp, mask, coef)
        task = (before.unsqueeze(-1) if before.dim() == 1 else before).double().abs() * mask.double()
        term = float(rl_math.global_mean_std((coef * gap).abs(), mask=mask)[0])
        total = term + float(rl_math.global_mean_std(task.expand_as(gap), mask=mask)[0])
        ctx.metrics["distill/share"] = term / total if total > 0 else 0.0

    def correct_rollout(self, batch: RolloutBatch, ctx: StepContext) -> None:
        """``algo.rollout_correction``: the whole batch's weights (rl_math.rollout_ratio bounded by bound_ratio, applied to each
        token's policy-gradient term in ``tis``) and the sampler/trainer mismatch, over all ranks: ``rollout_corr/k1``
        and ``/k3`` (estimates of KL(pi_sampler || pi_old) on the sampled tokens), the token ratio's ``/ratio_max``
        and ``/ratio_min``, ``/weight_mean``, and the share of tokens ``/masked_frac`` (mode mask: weight 0) or
        ``/truncated_frac`` (mode truncate: ratio clamped)."""
        rc, mask = self.a.rollout_correction, batch.mask
        if batch.sampler_logp is None:
            raise RuntimeError(f"algo.rollout_correction needs the sampler's log-probs, but the generation engine "
                               f"(rollout.engine={self.cfg.rollout.engine!r}) returned none: use a built-in engine "
                               f"(hf, static, vllm) or set algo.rollout_correction=null")
        ratio = rl_math.rollout_ratio(batch.old_logp, batch.sampler_logp, mask, rc.level)
        w = rl_math.bound_ratio(ratio, rc.mode, rc.high, rc.low)
        batch.extra = {**batch.extra, "rollout_weight": w.to(mask.dtype)}
        d = (batch.old_logp.double() - batch.sampler_logp.double()) * mask.double()
        log_mean(ctx, "rollout_corr/k1", -d, mask)
        log_mean(ctx, "rollout_corr/k3", torch.exp(d) - d - 1, mask)
        log_mean(ctx, "rollout_corr/weight_mean", w.double(), mask)
        valid = mask.bool()
        top = d[valid].max() if valid.any() else torch.tensor(-math.inf, dtype=torch.float64)
        bottom = d[valid].min() if valid.any() else torch.tensor(math.inf, dtype=torch.float64)
        ctx.metrics["rollout_corr/ratio_max"] = math.exp(float(dist.all_reduce_max(top.reshape(1))[0]))
        ctx.metrics["rollout_corr/ratio_min"] = math.exp(-float(dist.all_reduce_max(-bottom.reshape(1))[0]))
        if rc.mode == "mask":
            log_mean(ctx, "rollout_corr/masked_frac", (w == 0).double(), mask)
        else:
            out = (ratio > rc.high) | (ratio < (rc.low if rc.low is not None else -math.inf))
            log_mean(ctx, "rollout_corr/truncated_frac", out.double(), mask)

    def adapt_entropy_coef(self, mean_entropy: float) -> None:
        """Skywork-OR1's adaptive entropy control (arXiv 2505.22312, §3.2.5), once per step, from the step's
        token-mean entropy e_k before its update: alpha_k = c_k if e_k < target else 0, then c_{k+1} = c_k + delta
        if e_k < target else c_k - delta, clipped to [entropy_coef_min, entropy_coef_max]."""
        a = self.a
        below = mean_entropy < a.entropy_target
        self.entropy_alpha = self.entropy_c if below else 0.0
        step = a.entropy_coef_delta if below else -a.entropy_coef_delta
        self.entropy_c = min(max(self.entropy_c + step, a.entropy_coef_min), a.entropy_coef_max)

    def loss_with_bonus(self, logp: torch.Tensor, entropy: Optional[torch.Tensor], mb: RolloutBatch,
                        norms: rl_math.StepNorms, student_topk: Optional[torch.Tensor] = None) -> LossOutput:
        """The algorithm's loss, minus alpha * H aggregated as the loss (``algo.aggregation``) when the entropy
        bonus is on (``entropy``: the current policy's, with its gradient; None otherwise), plus the teacher's
        top-k divergence (``student_topk``: the current policy's log-probs of the teacher's top-k tokens [rows, T,
        k], with their gradient; None without ``teacher.top_k``)."""
        out = self.loss(logp, mb, norms)
        if entropy is not None:
            bonus = rl_math.aggregate(-self.entropy_alpha * entropy, mb.mask, self.a.aggregation, norms)
            out = LossOutput(out.loss + bonus, {**out.stats, "entropy_bonus/entropy": masked_stat(entropy, mb.mask)})
        if student_topk is not None:
            out = self.add_topk_divergence(out, student_topk, mb, norms)
        return out

    def add_topk_divergence(self, out: LossOutput, student_topk: torch.Tensor, mb: RolloutBatch,
                            norms: rl_math.StepNorms) -> LossOutput:
        """+ coef * D_beta(teacher || student) over the teacher's top-k tokens (rl_math.topk_divergence), aggregated
        as the loss. Logged: ``distill/divergence`` (its mean over the tokens) and ``distill/share`` (|the term| over
        |the term| + |the rest of the loss|, summed over the micro-batches)."""
        t = self.cfg.teacher
        div = rl_math.topk_divergence(student_topk, mb.extra["teacher_topk_logp"], t.beta, t.tail)
        term = t.coef * rl_math.aggregate(div, mb.mask, self.a.aggregation, norms)
        size = term.detach().abs().double()
        stats = {**out.stats, "distill/divergence": masked_stat(div, mb.mask),
                 "distill/share": (size, size + out.loss.detach().abs().double())}
        return LossOutput(out.loss + term, stats)

    def options_state_dict(self) -> dict:
        """The shared options' state (every algorithm): the adaptive entropy coefficient c_k."""
        return {"entropy_c": self.entropy_c}

    def load_options_state_dict(self, state: dict) -> None:
        self.entropy_c = float(state.get("entropy_c", self.entropy_c))

    def old_logp(self, logp: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
        return mb.old_logp if mb.old_logp is not None else logp.detach()

    def token_advantages(self, mb: RolloutBatch) -> torch.Tensor:
        adv = mb.advantages
        return adv.unsqueeze(-1) if adv.dim() == 1 else adv

    def tis(self, per_token: torch.Tensor, logp: torch.Tensor, mb: RolloutBatch) -> tuple[torch.Tensor, dict]:
        """The per-token weights of the policy-gradient term (never of the KL term): ``algo.tis_cap``,
        ``algo.off_policy_mask_threshold`` and ``algo.top_entropy_quantile`` (the last two: 0/1 masks)."""
        per_token, stats = self.tis_weight(per_token, logp, mb)
        if "rollout_weight" in mb.extra:  # algo.rollout_correction (prepare_loss)
            per_token = per_token * mb.extra["rollout_weight"]
        if self.a.off_policy_mask_threshold is not None:
            ref = mb.sampler_logp if mb.sampler_logp is not None else self.old_logp(logp, mb)
            seq_kl = rl_math.masked_mean(ref - logp.detach(), mb.mask, dim=-1).unsqueeze(-1)
            keep = ((self.token_advantages(mb) >= 0) | (seq_kl <= self.a.off_policy_mask_threshold)).to(logp.dtype)
            keep = keep.expand_as(logp)
            per_token = per_token * keep
            stats["off_policy_mask/kept_frac"] = masked_stat(keep, mb.mask)
        if self.a.top_entropy_quantile < 1.0:
            per_token = per_token * mb.extra["entropy_keep"]
        return per_token, stats

    def tis_weight(self, per_token: torch.Tensor, logp: torch.Tensor, mb: RolloutBatch) -> tuple[torch.Tensor, dict]:
        """``algo.tis_cap``: the policy-gradient term per token times min(pi_old / pi_sampler, C).
        pi_sampler is what the generation engine reported when it drew the token."""
        cap = self.a.tis_cap
        if cap is None:
            return per_token, {}
        if mb.sampler_logp is None:
            raise RuntimeError(
                f"algo.tis_cap={cap} needs the sampler's log-probs, but the generation engine "
                f"(rollout.engine={self.cfg.rollout.engine!r}) returned none: use an engine that reports them "
                f"(every built-in one: hf, static, vllm) or set algo.tis_cap=null"
            )
        w = rl_math.tis_weight(self.old_logp(logp, mb), mb.sampler_logp, mb.mask, cap)
        return per_token * w, {"tis/weight_mean": masked_stat(w, mb.mask),
                               "tis/capped_frac": masked_stat((w >= cap).float(), mb.mask)}

    def add_kl(self, per_token: torch.Tensor, logp: torch.Tensor, mb: RolloutBatch) -> tuple[torch.Tensor, dict]:
        if self.a.beta <= 0:
            return per_token, {}
        kl = rl_math.kl_estimate(logp, mb.ref_logp, self.a.kl_estimator)
        stats = {"kl": masked_stat(kl, mb.mask)}
        if self.a.use_bias_correction_kl:  # TRL: the KL estimate is pi_old's sample; reweight it to pi's
            kl = kl * rl_math.token_ratio(logp, self.old_logp(logp, mb))
        return per_token + self.a.beta * kl, stats
