"""The algorithm interface: what every file in algos/ implements (the options every algorithm takes, whatever its
loss, are algos/loss_options.py's, which Algorithm inherits).

An algorithm declares what it needs (reference, old log-probs, entropy) so the trainer
computes nothing unused, may change the batch before advantages (``process_batch``),
computes advantages, and turns per-token log-probs of a micro-batch into its share of the
step loss (see grpo.foundation.rl_math.aggregate for why shares add up exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from algos.loss_options import LossOptions, LossOutput, log_mean, masked_stat  # noqa: F401 (their names here too)
from grpo.foundation import rl_math
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config, ConfigError
from grpo.foundation.config_rules import distilling
from grpo.foundation.plugins import ALGORITHMS, StepContext


@dataclass
class NoOptions:
    """This algorithm has no options of its own."""


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


class Algorithm(LossOptions):
    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    tag: ClassVar[str] = "paper"  # paper | peer (a peer's code: verl, TRL) | code | unverified (docs/algorithms.md)
    summary: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    defaults: ClassVar[dict[str, Any]] = {}  # overrides of AlgoConfig's shared defaults
    knobs: ClassVar[tuple[str, ...]] = ()  # main knobs shown by --list-algos
    group_relative: ClassVar[bool] = True  # advantages compare a prompt's completions: needs G >= 2
    token_level_pg: ClassVar[bool] = True  # the loss has a per-token policy-gradient term (algo.tis_cap applies)
    advantages_after_forward: ClassVar[bool] = True  # False: process_batch sets them before l_old / l_ref exist
    ratio_clip: ClassVar[bool] = True  # the loss is PPO's clipped surrogate (ppo_token_loss / sequence_ppo_loss)
    multi_turn: ClassVar[bool] = False  # needs multi-turn rollouts (env.name): per-turn credit assignment
    needs_sum_pi_squared: ClassVar[bool] = False  # the old-policy pass also gives sum_v pi_v^2 (batch.extra)
    learns_from_rewards: ClassVar[bool] = True  # False: its advantages use no reward (opd); rewards may be empty

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.a = cfg.algo
        self.opt = cfg.algo.options
        # the entropy bonus's coefficient: alpha this step, and Skywork-OR1's c_k (algo.entropy_target)
        self.entropy_alpha = cfg.algo.entropy_coef if cfg.algo.entropy_target is None else 0.0
        self.entropy_c = cfg.algo.entropy_coef

    @classmethod
    def validate(cls, cfg: Config) -> None:
        """Algorithm-specific config checks (raise grpo.foundation.config.ConfigError)."""

    @classmethod
    def check_capabilities(cls, cfg: Config) -> None:
        """Whether this algorithm has what the config asks of it (its class flags: multi_turn, group_relative,
        token_level_pg, ratio_clip, takes_kl_in_reward): multi-turn rollouts, groups of >= 2, a per-token
        policy-gradient term for TIS and the token masks, a ratio clip for algo.delta, advantages from the outcome
        score for KL in the reward. ConfigError naming the fix otherwise."""
        name, a = cfg.algo.name, cfg.algo
        if cls.learns_from_rewards and not cfg.rewards:
            raise ConfigError("rewards is empty: name at least one reward function")
        if cls.multi_turn and not cfg.env.name:
            raise ConfigError(
                f"{name} needs multi-turn rollouts, and env.name is not set: set env.name (a registered environment, "
                f"e.g. env.name=calculator with data.source=env; see docs/agents.md), or choose a single-turn algorithm")
        if cls.group_relative and cfg.rollout.num_generations < 2:
            raise ConfigError(
                f"rollout.num_generations={cfg.rollout.num_generations} cannot learn with {name}: its advantages "
                f"compare the completions of one prompt, so with fewer than 2 every advantage is 0. Set "
                f"rollout.num_generations >= 2 (papers use 8 to 64)")
        weights = {f"algo.tis_cap={a.tis_cap!r}": a.tis_cap is not None,
                   "algo.rollout_correction": a.rollout_correction is not None}
        for key, on in weights.items():
            if on and not cls.token_level_pg:
                raise ConfigError(f"{key} weights each token's policy-gradient term, and {name} has a sequence-level "
                                  f"loss: set {key.split('=')[0]}=null, or pick a token-level algorithm")
        if a.kl_in_reward and not cls.takes_kl_in_reward():
            raise ConfigError(
                f"algo.kl_in_reward={a.kl_in_reward!r} does not apply to {name}: its advantages are not computed "
                f"from the outcome score alone. Set algo.kl_in_reward=0, or choose an algorithm that takes it "
                f"({', '.join(cls.kl_in_reward_algorithms())})")
        if a.delta is not None and not cls.ratio_clip:
            raise ConfigError(f"algo.delta={a.delta!r} caps PPO's clipped ratio, and {name} has no ratio clip: "
                              f"set algo.delta=null or choose an algorithm with one (grpo, dapo, gspo, ...)")
        if distilling(cfg) and not cls.token_level_pg:
            raise ConfigError(f"teacher: on-policy distillation adds a term to each token's advantage, and {name} has "
                              f"a sequence-level loss: pick a token-level algorithm (grpo, dapo, opd, ...), or set "
                              f"teacher.coef=0")
        masks = {"off_policy_mask_threshold": a.off_policy_mask_threshold is not None,
                 "top_entropy_quantile": a.top_entropy_quantile != 1.0}
        for key, on in masks.items():
            if on and not cls.token_level_pg:
                raise ConfigError(f"algo.{key} masks per-token policy-gradient terms, and {name} has a sequence-level "
                                  f"loss: leave algo.{key} at its default, or pick a token-level algorithm")

    # ----------------------------------------------------------------- needs
    @classmethod
    def takes_kl_in_reward(cls) -> bool:
        """``algo.kl_in_reward`` applies: the advantages come from ``scores`` after the old/reference passes."""
        return getattr(cls.advantages, "uses_scores", False) and cls.advantages_after_forward

    @classmethod
    def kl_in_reward_algorithms(cls) -> list[str]:
        """The registered algorithms that take ``algo.kl_in_reward``."""
        return sorted(n for n, c in ALGORITHMS.items() if c.takes_kl_in_reward())

    @classmethod
    def option_owners(cls, key: str) -> list[str]:
        """The registered algorithms that have ``algo.<key>`` among their own options."""
        import dataclasses

        return sorted(n for n, c in ALGORITHMS.items()
                      if dataclasses.is_dataclass(c.Options) and key in {f.name for f in dataclasses.fields(c.Options)})

    @property
    def needs_reference(self) -> bool:
        return self.a.beta > 0 or self.a.kl_in_reward > 0

    @property
    def needs_old_logprobs(self) -> bool:
        """With mu = 1 and on-policy data, l_old = sg[l]: no extra forward pass (KL in the reward needs l_old
        before the loss)."""
        return (self.a.num_iterations > 1 or self.a.kl_in_reward > 0 or distilling(self.cfg)  # distillation: l_old
                or self.a.rollout_correction is not None)  # its weights are the whole batch's, before the loss

    @property
    def needs_entropy(self) -> bool:
        """The old policy's entropy before the loss (detached): the top-entropy mask, the adaptive entropy bonus."""
        return self.a.top_entropy_quantile < 1.0 or self.a.entropy_target is not None

    @property
    def entropy_bonus(self) -> bool:
        """The loss has the term -alpha * H: the training forward computes the entropy with its gradient."""
        return self.a.entropy_coef > 0 or self.a.entropy_target is not None

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
        return rl_math.group_advantages(self.scores(batch, ctx), batch.group_size, self.a.adv_std, self.a.adv_eps,
                                     self.a.adv_scope)

    advantages.uses_scores = True  # type: ignore[attr-defined]

    def loss(self, logp: torch.Tensor, mb: RolloutBatch, norms: rl_math.StepNorms) -> LossOutput:
        raise NotImplementedError

    # ----------------------------------------------------------------- state (checkpointed)
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ----------------------------------------------------------------- shared pieces
    def ppo_token_loss(self, logp: torch.Tensor, mb: RolloutBatch, ratio: Optional[torch.Tensor] = None,
                       eps_low: Optional[float | torch.Tensor] = None,
                       eps_high: Optional[float | torch.Tensor] = None,
                       weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
        """-(clipped surrogate - beta KL) per token, with the standard statistics.

        ``eps_low``/``eps_high`` override the configured clip range (tensors: per-token bounds);
        ``weight`` multiplies the policy-gradient term only (not the KL).
        """
        old = self.old_logp(logp, mb)
        ratio = rl_math.token_ratio(logp, old) if ratio is None else ratio
        eps_low = self.a.clip_eps_low if eps_low is None else eps_low
        eps_high = self.a.clip_eps_high if eps_high is None else eps_high
        surr = rl_math.clipped_surrogate(ratio, self.token_advantages(mb), eps_low, eps_high, self.a.dual_clip,
                                      self.a.delta)
        pg = -surr.value if weight is None else -surr.value * weight
        per_token, stats = self.tis(pg, logp, mb)
        stats.update({
            "clip_frac_low": masked_stat(surr.clipped_low.float(), mb.mask),
            "clip_frac_high": masked_stat(surr.clipped_high.float(), mb.mask),
            "ratio_mean": masked_stat(ratio, mb.mask),
        })
        per_token, kl_stats = self.add_kl(per_token, logp, mb)
        stats.update(kl_stats)
        return per_token, stats

    def token_pg_loss(self, pg: torch.Tensor, logp: torch.Tensor, mb: RolloutBatch, norms: rl_math.StepNorms,
                      stats: Optional[dict] = None) -> LossOutput:
        """A per-token policy-gradient loss ``pg`` [rows, T] (what to minimise) -> algo.tis_cap weight,
        + beta KL, aggregated with ``algo.aggregation`` over the whole step (shares add up exactly)."""
        per_token, tis_stats = self.tis(pg, logp, mb)
        per_token, kl_stats = self.add_kl(per_token, logp, mb)
        return LossOutput(rl_math.aggregate(per_token, mb.mask, self.a.aggregation, norms),
                          {**(stats or {}), **tis_stats, **kl_stats})

    def sequence_ppo_loss(
        self,
        ratio: torch.Tensor,
        logp: torch.Tensor,
        mb: RolloutBatch,
        norms: rl_math.StepNorms,
        eps_low: Optional[float] = None,
        scale: Optional[torch.Tensor] = None,
    ) -> LossOutput:
        """Sequence-level surrogate (GSPO, GRPO-S, TIC-GRPO): -(1/N) sum_i scale_i min(s_i A_i, clip(s_i) A_i),
        ``ratio`` [rows]; plus beta KL aggregated per token when beta > 0. N is the whole step's,
        so micro-batch shares add up exactly (rl_math.sequence_mean)."""
        adv = mb.advantages
        if adv.dim() != 1:
            raise ValueError(f"{self.name}: a sequence-level loss needs one advantage per completion")
        low = self.a.clip_eps_low if eps_low is None else eps_low
        surr = rl_math.clipped_surrogate(ratio, adv, low, self.a.clip_eps_high, self.a.dual_clip, self.a.delta)
        value = surr.value if scale is None else surr.value * scale
        loss = -rl_math.sequence_mean(value, norms)
        rows = torch.ones_like(ratio)
        stats = {
            "clip_frac_low": masked_stat(surr.clipped_low.float(), rows),
            "clip_frac_high": masked_stat(surr.clipped_high.float(), rows),
            "ratio_mean": masked_stat(ratio, rows),
        }
        if self.a.beta > 0:
            kl_tok, kl_stats = self.add_kl(torch.zeros_like(logp), logp, mb)
            loss = loss + rl_math.aggregate(kl_tok, mb.mask, self.a.aggregation, norms)
            stats.update(kl_stats)
        return LossOutput(loss, stats)
