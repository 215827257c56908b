"""The audit of whole next-token distributions (``logging.audit_every``; docs/metrics.md#audit).

The rollout-correction metrics compare the sampler and the trainer on the sampled token alone. Every
``audit_every`` steps (step 0 included), on ``audit_rows`` rows of each rank's batch drawn at random (seeded by
``train.seed``, the step and the rank), this compares
whole next-token distributions at every completion position, over the k most likely tokens (``audit_top_k``) plus
one bucket for the rest (rl_math.topk_divergence, beta 0):

    audit/sampler_kl     KL(pi_sampler || pi_trainer) on the sampler's top-k: the engine's distribution at each
                         drawn token (temperature applied; hf, static and vllm return it: SamplingParams.topk_logprobs)
                         against the trainer's forward with the same weights
    audit/reference_kl   KL(pi_ref || pi_theta) on the reference's top-k (a run with a reference)
    audit/sampler_kl_behind_S  streamed rollouts (rollout.max_staleness K): audit/sampler_kl over the tokens drawn
                         S = 0..K steps before the weights audited (the staleness the correction then weighs)

with their maxima over positions (``.../max``) and the audit's seconds (``time/audit``). Both come from one
forward pass of the policy without gradient over the audited rows, which scores it on both supports (the
reference's top-k comes from the reference's own pass, in-process or from its server). The policy audited is the
one that sampled the step (before its update). A KL past ``audit_warn_kl`` prints a warning naming the likely
cause: for the sampler, its dtype or kernels when the gap was there at the run's first audit (before any update),
weights the engine did not get (a missed sync) when it grew since; for the reference at step 0, a reference that is
not the policy's starting weights.
"""

from __future__ import annotations

import time
import warnings
import torch

from grpo.foundation.console import say
from grpo.foundation import dist, rl_math
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config
from grpo.foundation.logprobs import completion_scores


class PreflightError(RuntimeError):
    """The pre-flight audit found the sampler (or the reference) far from the trainer's policy before any update."""


class Audit:
    def __init__(self, cfg: Config, first_step: int = 0, fresh: bool = True):
        """``first_step``: the run's first step (a resumed run's is its checkpoint's); ``fresh``: the policy is the
        starting weights there (not resumed), so the reference should equal it."""
        self.cfg, self.every, self.k = cfg, cfg.logging.audit_every, cfg.logging.audit_top_k
        self._said_no_sampler = False
        self._first: float | None = None  # audit/sampler_kl at this run's first audit (before any of its updates)
        self._kept_told = False  # rollout.carried_kv=keep: its designed divergence said once
        self.preflight_step = first_step if cfg.logging.preflight else None
        self.fresh = fresh

    def top_k(self, step: int) -> int:
        """The engine's top-k to ask for in this step's rollout (0: no audit this step)."""
        return self.k if (self.every and step % self.every == 0) or step == self.preflight_step else 0

    def run(self, step: int, batch: RolloutBatch, model: torch.nn.Module, reference, pad_id: int,
            metrics: dict[str, float]) -> None:
        """On an audit step, the audit's metrics into ``metrics``. Collective: every rank calls it every step."""
        if not self.top_k(step):
            return
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step * 131 + dist.rank())
        rows = sorted(torch.randperm(len(batch), generator=g)[: self.cfg.logging.audit_rows].tolist())
        sub = batch.select(rows or [0])
        mask = sub.mask.double() * (1.0 if rows else 0.0)  # a rank without rows joins the collectives with none
        packed, temperature = sub.packed(None, pad_id), self.cfg.rollout.temperature
        ref = None if reference is None else reference.submit_topk(packed, temperature, self.k)
        sampler = sub.extra.get("sampler_topk_ids")
        if sampler is None and self.every:  # the pre-flight alone checks what the rollout has, quietly
            self._no_sampler()
        ref_scores = None if ref is None else ref.result()
        supports = [x for x in (sampler, None if ref_scores is None else ref_scores.topk_ids) if x is not None]
        if not supports:
            return
        with torch.no_grad():
            s = completion_scores(model, packed, temperature, self.cfg.train.logprob_chunk_size,
                                  gather_ids=torch.cat(supports, dim=-1))
        policy = s.gathered.double().cpu()
        if sampler is not None:
            kl = rl_math.topk_divergence(policy[..., : self.k], sub.extra["sampler_topk_logp"].double(), 0.0)
            drawn = mask * sub.sampled_mask().double()  # not the rows an algorithm rewrote (the engine's top-k is
            # of the tokens it drew)
            self._log(metrics, "audit/sampler_kl", kl, drawn)
            behind = sub.extra.get("versions_behind")
            for s in range(self.cfg.rollout.max_staleness + 1 if behind is not None else 0):  # streamed rollouts
                self._log(metrics, f"audit/sampler_kl_behind_{s}", kl, drawn * (behind == s).double())
        if ref_scores is not None:
            kl = rl_math.topk_divergence(policy[..., -self.k:], ref_scores.topk_logprobs.double(), 0.0)
            self._log(metrics, "audit/reference_kl", kl, mask)
        metrics["time/audit"] = time.perf_counter() - t0
        if step == self.preflight_step:
            self._preflight(step, metrics)
        self._warn(step, metrics)

    def _preflight(self, step: int, m: dict[str, float]) -> None:
        """Stop the run when the sampler (or, fresh, the reference) disagrees with the policy before any update. Every
        rank holds the same all-reduced means, so every rank stops alike."""
        cfg, limit = self.cfg, self.cfg.logging.preflight_kl
        off = f"(logging.preflight_kl={limit:g} nats; logging.preflight=false runs anyway)"
        name = "audit/sampler_kl_behind_0" if "audit/sampler_kl_behind_0" in m else "audit/sampler_kl"
        if m.get(name, 0.0) > limit:
            raise PreflightError(
                f"pre-flight check, step {step}, before any update: {name}={m[name]:.4g} nats between the generation "
                f"engine's next-token distributions and the trainer's, with the same weights {off}. Likely cause: the "
                f"engine computes differently from the trainer: its dtype (bf16 / fp16 sampling against model.dtype="
                f"{cfg.model.dtype!r}), its kernels (rollout.engine={cfg.rollout.engine!r}: CUDA graphs, vLLM), a "
                f"head transform it lacks (logit scaling, soft-capping), or it never got the trainer's weights. Try "
                f"rollout.engine=hf (the training model itself samples) to tell which")
        if self.fresh and m.get("audit/reference_kl", 0.0) > limit:
            raise PreflightError(
                f"pre-flight check, step {step}, before any update: audit/reference_kl={m['audit/reference_kl']:.4g} "
                f"nats between the reference and the policy's starting weights {off}. Likely cause: the reference is "
                f"another model (ref.model={cfg.ref.model!r}, ref.url={cfg.ref.url!r}: another checkpoint, or a "
                f"server started with another --model), or another dtype than model.dtype={cfg.model.dtype!r}. The "
                f"KL penalty (algo.beta) would pull the policy towards it from the first step")

    @staticmethod
    def _log(metrics: dict[str, float], name: str, kl: torch.Tensor, mask: torch.Tensor) -> None:
        metrics[name] = float(rl_math.global_mean_std(kl, mask=mask)[0])
        top = (kl * mask).max() if kl.numel() else torch.zeros((), dtype=torch.float64)
        metrics[f"{name}_max"] = float(dist.all_reduce_max(top.reshape(1))[0])

    def _no_sampler(self) -> None:
        if not self._said_no_sampler and dist.is_main():
            say(f"audit: the rollout returned no top-k log-probs (rollout.engine={self.cfg.rollout.engine!r}; the "
                f"built-in engines' single-turn rollouts have them), so audit/sampler_kl is not measured; the "
                f"reference's audit runs when the run has a reference")
        self._said_no_sampler = True

    def _warn(self, step: int, m: dict[str, float]) -> None:
        limit, cfg = self.cfg.logging.audit_warn_kl, self.cfg
        if not dist.is_main():
            return
        # streamed rollouts: tokens drawn by earlier weights differ from the trainer's by design (their correction
        # weighs them); only the current weights' tokens say whether the engine computes as the trainer does
        name = "audit/sampler_kl_behind_0" if "audit/sampler_kl_behind_0" in m else "audit/sampler_kl"
        kl, first = m.get(name), self._first
        if kl is not None and first is None:
            self._first = first = kl  # the first audit of this run: before any of its updates, fresh weights
        kept = cfg.rollout.carried_kv == "keep" and first is not None and first <= limit
        if kl is not None and kl > limit and kept:
            if not self._kept_told:  # by design, said once: every step of such a run would say it again
                self._kept_told = True
                warnings.warn(
                    f"step {step}: {name}={kl:.4g} nats > logging.audit_warn_kl={limit:g}: with "
                    f"rollout.carried_kv=keep a carried row's tokens drawn under these weights attend to keys and "
                    f"values of earlier ones, so the sampler's distributions are not the trainer's (the correction "
                    f"weighs those tokens), and this check cannot tell a missed weight sync from it; "
                    f"rollout.carried_kv=prefill removes it (docs/streaming.md).", RuntimeWarning, stacklevel=2)
        elif kl is not None and kl > limit:
            computes = (f"the engine computes differently from the trainer: its dtype (bf16 / fp16 sampling against "
                        f"model.dtype={cfg.model.dtype!r}) or its kernels (CUDA graphs, vLLM)")
            stale = f"stale weights: the engine missed a weight sync (rollout.engine={cfg.rollout.engine!r})"
            if first > limit:  # there before any update
                cause = f"it was there at this run's first audit, before any update, so {computes}, or it never got " \
                        f"the trainer's weights"
            else:  # it grew since
                cause = f"it grew since this run's first audit ({first:.3g} nats, before any update), so {stale}"
            warnings.warn(
                f"step {step}: {name}={kl:.4g} nats > logging.audit_warn_kl={limit:g}: the generation "
                f"engine's next-token distributions are not the trainer's. Likely cause: {cause}. "
                f"algo.rollout_correction corrects or masks the affected tokens.", RuntimeWarning, stacklevel=2)
        if step == 0 and m.get("audit/reference_kl", 0.0) > limit:
            warnings.warn(
                f"step 0: audit/reference_kl={m['audit/reference_kl']:.4g} nats > logging.audit_warn_kl={limit:g} "
                f"before any update: the reference is not the policy's starting weights (ref.model="
                f"{cfg.ref.model!r}, ref.url={cfg.ref.url!r}: another checkpoint, or another dtype than "
                f"model.dtype={cfg.model.dtype!r}).", RuntimeWarning, stacklevel=2)

