"""DCPO: Dynamic Clipping Policy Optimization (arXiv 2509.02333).

Dynamic adaptive clipping, per token, from the old probability q = exp(l_old):

    r_low  = 0.5 + 0.5 sqrt(max(1 - 4 eps_low / q, 0))
    r_high = min(0.5 + 0.5 sqrt(1 + 4 eps_high / q), 10)        eps_low = 0.16, eps_high = 0.2
    l      = min(rho A, clip(rho, r_low, r_high) A), and max(l, 10 A) for A < 0 (dual clip 10)

Smooth advantage standardisation: i = times this prompt has been sampled (now included); the
statistics of all G * i rewards are pooled (population variances, for which this is exact):

    mu_tot  = ((i-1) mu_old + mu_new) / i
    var_tot = [(i-1) var_old + var_new + ((i-1)/i)(mu_old - mu_new)^2] / i
    A_new = (r - mu_new) / sd_new,   A_tot = (r - mu_tot) / sd_tot      (0 where sd = 0)
    SA_new = ((i-1)/i) A_new + (1/i) A_tot,   SA_tot = (1/i) A_new + ((i-1)/i) A_tot
    A = whichever of SA_new, SA_tot has the smaller |.| (SA_new on a tie)

The per-prompt statistics (keyed by dataset index) are kept identical on every rank and saved
in checkpoints. Loss ``seq-sum-token-mean``; beta = 0.

Formulas, defaults and decisions: docs/algorithms.md, section dcpo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import Algorithm, LossOutput, StepContext
from grpo.foundation import rl_math, dist
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config, ConfigError, ranged


@dataclass
class DCPOOptions:
    max_ratio: float = ranged(10.0, "> 1", "paper: 10")  # cap of r_high (paper: 10)


def smooth_advantages(
    r: torch.Tensor, i: int, mu_new: float, sd_new: float, mu_tot: float, sd_tot: float
) -> torch.Tensor:
    """DCPO's smooth standardisation of one group's rewards ``r``."""
    a_new = (r - mu_new) / sd_new if sd_new > 0 else torch.zeros_like(r)
    a_tot = (r - mu_tot) / sd_tot if sd_tot > 0 else torch.zeros_like(r)
    sa_new = ((i - 1) / i) * a_new + (1 / i) * a_tot
    sa_tot = (1 / i) * a_new + ((i - 1) / i) * a_tot
    return torch.where(sa_tot.abs() < sa_new.abs(), sa_tot, sa_new)


class DCPO(Algorithm):
    name = "dcpo"
    paper = "DCPO (arXiv 2509.02333)"
    summary = "per-token clip bounds from the old probability, dual clip 10, smooth advantages over a prompt's history"
    Options = DCPOOptions
    defaults = {"beta": 0.0, "clip_eps_low": 0.16, "clip_eps_high": 0.2, "dual_clip": 10.0,
                "aggregation": "seq-sum-token-mean", "adv_std": "population", "adv_eps": 0.0, "kl_estimator": "k3"}
    knobs = ("clip_eps_low", "clip_eps_high", "dual_clip", "max_ratio")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.prompt_stats: dict[int, tuple[int, float, float]] = {}  # prompt -> (i, mean, population variance)

    @classmethod
    def validate(cls, cfg: Config) -> None:
        if cfg.algo.adv_std != "population":
            raise ConfigError(
                f"algo.adv_std={cfg.algo.adv_std!r} is invalid for dcpo: it must be 'population' (the pooled "
                f"statistics over a prompt's history are population variances)"
            )

    def advantages(self, batch: RolloutBatch, ctx: StepContext) -> torch.Tensor:
        G = batch.group_size
        r = rl_math.group_view(batch.rewards.double(), G)
        mu, var = r.mean(1), r.var(1, unbiased=False)
        keys = [int(batch.prompt_index[g * G]) for g in range(r.shape[0])]
        mine = list(zip(keys, mu.tolist(), var.tolist()))
        # Every rank folds every group in, in the same order, so the statistics stay identical.
        pooled: list[tuple[int, float, float]] = []
        for rank, groups in enumerate(dist.all_gather_object(mine)):
            for key, m_new, v_new in groups:
                i, m_old, v_old = self.prompt_stats.get(key, (0, 0.0, 0.0))
                i += 1
                m_tot = ((i - 1) * m_old + m_new) / i
                v_tot = ((i - 1) * v_old + v_new + ((i - 1) / i) * (m_old - m_new) ** 2) / i
                self.prompt_stats[key] = (i, m_tot, v_tot)
                if rank == dist.rank():
                    pooled.append((i, m_tot, v_tot))
        adv = torch.stack([
            smooth_advantages(r[g], i, float(mu[g]), float(var[g]) ** 0.5, m_tot, v_tot ** 0.5)
            for g, (i, m_tot, v_tot) in enumerate(pooled)
        ])
        ctx.metrics["dcpo/times_sampled_mean"] = float(
            rl_math.global_mean_std(torch.tensor([float(p[0]) for p in pooled]))[0]
        )
        return adv.reshape(-1).to(batch.rewards.dtype)

    def loss(self, logp, mb, norms):
        low, high = rl_math.dynamic_clip_bounds(self.old_logp(logp, mb), self.a.clip_eps_low, self.a.clip_eps_high,
                                             self.opt.max_ratio)
        per_token, stats = self.ppo_token_loss(logp, mb, eps_low=1.0 - low, eps_high=high - 1.0)
        return LossOutput(rl_math.aggregate(per_token, mb.mask, self.a.aggregation, norms), stats)

    def state_dict(self) -> dict:
        return {"prompt_stats": {k: list(v) for k, v in self.prompt_stats.items()}}

    def load_state_dict(self, state: dict) -> None:
        stats = state.get("prompt_stats", {})
        self.prompt_stats = {int(k): (int(v[0]), float(v[1]), float(v[2])) for k, v in stats.items()}
