"""The algorithm interface: what every file in algos/ implements.

An algorithm declares what it needs (reference, old log-probs, entropy) so the trainer
computes nothing unused, may change the batch before advantages (``process_batch``),
computes advantages, and turns per-token log-probs of a micro-batch into its share of the
step loss (see grpo.foundation.core.aggregate for why shares add up exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch

from grpo.foundation import core
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config, ConfigError


@dataclass
class NoOptions:
    """This algorithm has no options of its own."""


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
    ctx.metrics[name] = float(core.global_mean_std(x.detach(), mask=mask)[0])


class StepContext:
    """What an algorithm's hooks see of the run: nothing of the trainer itself.

    cfg, step            the config; optimizer steps completed so far (in ``on_step_end``: this one included)
    rollout              the rollout service (grpo.rollout.service): generate, continue_sequences, score, decode
    reference            the reference handle (grpo.reference.handle), or None when beta = 0
    generate_more(n)     rolls out and scores this rank's share of the next ``n`` prompts of the global
                         stream (default ``rollout.prompts_per_step``); every rank calls it equally often
    reset_reference()    pi_ref <- pi_theta now (collective); returns (folder holding it, new version)
    reset_optimizer()    the optimizer state (Adam moments, step counts) starts afresh at the next step
    metrics              values to log with the step (every rank sets the same keys)
    skip_update          set alike on every rank: no optimizer step this time
    scored               the batch the step's reward and advantage metrics describe (default: the batch
                         ``process_batch`` returns; CPPO points it at the batch before pruning)
    """

    def __init__(self, cfg: Config, step: int, generate_more: Optional[Callable[..., RolloutBatch]] = None,
                 rollout: Any = None, reference: Any = None,
                 reset_reference: Optional[Callable[[], tuple[str, int]]] = None,
                 reset_optimizer: Optional[Callable[[], None]] = None):
        self.cfg, self.step, self.generate_more = cfg, step, generate_more
        self.rollout, self.reference = rollout, reference
        self._reset_reference, self._reset_optimizer = reset_reference, reset_optimizer
        self.metrics: dict[str, float] = {}
        self.skip_update = False
        self.scored: Optional[RolloutBatch] = None

    def reset_reference(self) -> tuple[str, int]:
        if self._reset_reference is None:
            raise RuntimeError("this context cannot reset the reference (built without a trainer)")
        return self._reset_reference()

    def reset_optimizer(self) -> None:
        if self._reset_optimizer is None:
            raise RuntimeError("this context cannot reset the optimizer (built without a trainer)")
        self._reset_optimizer()


def check_max_gen_batches(value: int) -> None:
    """The resampling budget of ``resample``: generation batches per step, 0 = unlimited."""
    if value < 0:
        raise ConfigError(f"algo.max_gen_batches={value} is invalid: it must be >= 0 (0 = unlimited)")


def resample(state: Any, ctx: StepContext, done: Callable[[Any], bool], add: Callable[[Any, RolloutBatch], Any],
             max_gen_batches: int) -> tuple[Any, int, bool]:
    """Generate further batches until ``done(state)`` (one resampling loop for every algorithm).

    ``state`` already holds the first generation batch; each further one (``ctx.generate_more()``)
    is folded in with ``state = add(state, batch)``. At most ``max_gen_batches`` batches in all,
    the first included (0 = unlimited). Returns (state, batches generated, done). ``done`` and
    ``add`` must give the same answer on every rank (reduce over ranks inside them), so that all
    ranks generate equally often.
    """
    rounds = 1
    while not done(state):
        if max_gen_batches and rounds >= max_gen_batches:
            return state, rounds, False
        state = add(state, ctx.generate_more())
        rounds += 1
    return state, rounds, True


class Algorithm:
    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    tag: ClassVar[str] = "paper"  # paper | code | unverified (docs/algorithms.md)
    summary: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    defaults: ClassVar[dict[str, Any]] = {}  # overrides of AlgoConfig's shared defaults
    knobs: ClassVar[tuple[str, ...]] = ()  # main knobs shown by --list-algos
    group_relative: ClassVar[bool] = True  # advantages compare a prompt's completions: needs G >= 2
    token_level_pg: ClassVar[bool] = True  # the loss has a per-token policy-gradient term (algo.tis_cap applies)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.a = cfg.algo
        self.opt = cfg.algo.options

    @classmethod
    def validate(cls, cfg: Config) -> None:
        """Algorithm-specific config checks (raise grpo.foundation.config.ConfigError)."""

    # ----------------------------------------------------------------- needs
    @property
    def needs_reference(self) -> bool:
        return self.a.beta > 0

    @property
    def needs_old_logprobs(self) -> bool:
        """With mu = 1 and on-policy data, l_old = sg[l]: no extra forward pass."""
        return self.a.num_iterations > 1

    @property
    def needs_entropy(self) -> bool:
        return False

    # ----------------------------------------------------------------- hooks
    def process_batch(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        """Reward shaping / group filtering / refill / pruning, before any forward pass. Default: unchanged.
        Advantages are computed after the old-policy pass unless this hook already set ``batch.advantages``."""
        return batch

    def attach(self, ctx: StepContext) -> None:
        """Called once when the run is ready (after a resume restored ``load_state_dict``)."""

    def on_step_end(self, ctx: StepContext, metrics: dict[str, float]) -> None:
        """Called on every rank after each step, before logging and checkpointing; may add metrics."""

    def advantages(self, batch: RolloutBatch, ctx: StepContext) -> torch.Tensor:
        return core.group_advantages(batch.rewards, batch.group_size, self.a.adv_std, self.a.adv_eps, self.a.adv_scope)

    def loss(self, logp: torch.Tensor, mb: RolloutBatch, norms: core.StepNorms) -> LossOutput:
        raise NotImplementedError

    # ----------------------------------------------------------------- state (checkpointed)
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ----------------------------------------------------------------- shared pieces
    def old_logp(self, logp: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
        return mb.old_logp if mb.old_logp is not None else logp.detach()

    def token_advantages(self, mb: RolloutBatch) -> torch.Tensor:
        adv = mb.advantages
        return adv.unsqueeze(-1) if adv.dim() == 1 else adv

    def ppo_token_loss(self, logp: torch.Tensor, mb: RolloutBatch, ratio: Optional[torch.Tensor] = None,
                       eps_low: Optional[float | torch.Tensor] = None,
                       eps_high: Optional[float | torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
        """-(clipped surrogate - beta KL) per token, with the standard statistics.

        ``eps_low``/``eps_high`` override the configured clip range (tensors: per-token bounds).
        """
        old = self.old_logp(logp, mb)
        ratio = core.token_ratio(logp, old) if ratio is None else ratio
        eps_low = self.a.clip_eps_low if eps_low is None else eps_low
        eps_high = self.a.clip_eps_high if eps_high is None else eps_high
        surr = core.clipped_surrogate(ratio, self.token_advantages(mb), eps_low, eps_high, self.a.dual_clip)
        per_token, stats = self.tis(-surr.value, logp, mb)
        stats.update({
            "clip_frac_low": masked_stat(surr.clipped_low.float(), mb.mask),
            "clip_frac_high": masked_stat(surr.clipped_high.float(), mb.mask),
            "ratio_mean": masked_stat(ratio, mb.mask),
        })
        per_token, kl_stats = self.add_kl(per_token, logp, mb)
        stats.update(kl_stats)
        return per_token, stats

    def sequence_ppo_loss(
        self,
        ratio: torch.Tensor,
        logp: torch.Tensor,
        mb: RolloutBatch,
        norms: core.StepNorms,
        eps_low: Optional[float] = None,
        scale: Optional[torch.Tensor] = None,
    ) -> LossOutput:
        """Sequence-level surrogate (GSPO, GRPO-S, TIC-GRPO): -(1/N) sum_i scale_i min(s_i A_i, clip(s_i) A_i),
        ``ratio`` [rows]; plus beta KL aggregated per token when beta > 0. N is the whole step's,
        so micro-batch shares add up exactly (core.sequence_mean)."""
        adv = mb.advantages
        if adv.dim() != 1:
            raise ValueError(f"{self.name}: a sequence-level loss needs one advantage per completion")
        low = self.a.clip_eps_low if eps_low is None else eps_low
        surr = core.clipped_surrogate(ratio, adv, low, self.a.clip_eps_high, self.a.dual_clip)
        value = surr.value if scale is None else surr.value * scale
        loss = -core.sequence_mean(value, norms)
        rows = torch.ones_like(ratio)
        stats = {
            "clip_frac_low": masked_stat(surr.clipped_low.float(), rows),
            "clip_frac_high": masked_stat(surr.clipped_high.float(), rows),
            "ratio_mean": masked_stat(ratio, rows),
        }
        if self.a.beta > 0:
            kl_tok, kl_stats = self.add_kl(torch.zeros_like(logp), logp, mb)
            loss = loss + core.aggregate(kl_tok, mb.mask, self.a.aggregation, norms)
            stats.update(kl_stats)
        return LossOutput(loss, stats)

    def tis(self, per_token: torch.Tensor, logp: torch.Tensor, mb: RolloutBatch) -> tuple[torch.Tensor, dict]:
        """``algo.tis_cap``: the policy-gradient term per token times min(pi_old / pi_sampler, C) (the KL term
        is not weighted). pi_sampler is what the generation engine reported when it drew the token."""
        cap = self.a.tis_cap
        if cap is None:
            return per_token, {}
        if mb.sampler_logp is None:
            raise RuntimeError(
                f"algo.tis_cap={cap} needs the sampler's log-probs, but the generation engine "
                f"(rollout.engine={self.cfg.rollout.engine!r}) returned none: use an engine that reports them "
                f"(rollout.engine=vllm) or set algo.tis_cap=null"
            )
        w = core.tis_weight(self.old_logp(logp, mb), mb.sampler_logp, mb.mask, cap)
        return per_token * w, {"tis/weight_mean": masked_stat(w, mb.mask),
                               "tis/capped_frac": masked_stat((w >= cap).float(), mb.mask)}

    def add_kl(self, per_token: torch.Tensor, logp: torch.Tensor, mb: RolloutBatch) -> tuple[torch.Tensor, dict]:
        if self.a.beta <= 0:
            return per_token, {}
        kl = core.kl_estimate(logp, mb.ref_logp, self.a.kl_estimator)
        return per_token + self.a.beta * kl, {"kl": masked_stat(kl, mb.mask)}
