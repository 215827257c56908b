"""ProRL: Prolonged Reinforcement Learning (Liu et al., 2025, arXiv 2505.24864).

DAPO (algos/dapo.py: clip-higher, token-mean, dynamic sampling, overlong shaping) plus a k3 KL
penalty to a reference policy,

    L_i,t = -(min(rho A, clip(rho, 1 - 0.2, 1 + 0.4) A) - beta KL_k3),   beta = 1e-3,

and reference resets: pi_ref <- pi_theta (optionally also resetting the optimizer state:
the ProRL paper does, ProRL-v2 does not). A reset happens after every ``reset_every`` steps,
and when ``reset_metric`` (a logged metric, higher is better; e.g. an eval metric) has not
improved for ``reset_patience`` consecutive steps that logged it. Both triggers are off (0)
by default: the paper resets by hand when validation stalls (configs/prorl.yaml sets one).

A reset asks the run for it (``ctx.reset_reference()``, the same mechanism as ``ref.sync_every``
with alpha = 1): the policy is written to ``OUT/reference/step-N`` (an HF folder) and the reference
takes it, whatever kind it is (an in-process copy, a server told to reload the folder, or with LoRA
the policy's base, into which the adapter is merged). The folder and the reference version go
into checkpoints, so a resumed run restores the reset reference; with a server, the weights' hash
is kept too, and a resumed run reloads the server (the initial model, when a later reset had moved
it on) and checks that hash before its first step.

Formulas, defaults and decisions: docs/algorithms.md, section prorl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from algos.base import StepContext
from algos.dapo import DAPO, DAPOOptions
from grpo.foundation.config import Config, ConfigError, at_least_zero


@dataclass
class ProRLOptions(DAPOOptions):
    reset_every: int = at_least_zero(0, "0 = off")  # steps between reference resets; 0 = off
    reset_patience: int = at_least_zero(0, "0 = off")  # reset after this many logged values of reset_metric without improvement; 0 = off
    reset_metric: str = "reward/mean"  # higher is better; set it to an eval metric when one is logged
    reset_optimizer: bool = True  # ProRL: yes; ProRL-v2: no


class ProRL(DAPO):
    name = "prorl"
    paper = "ProRL (arXiv 2505.24864)"
    summary = "dapo + k3 KL (beta 1e-3, eps_high 0.4) with reference (and optimizer) resets"
    Options = ProRLOptions
    defaults = {**DAPO.defaults, "beta": 1e-3, "kl_estimator": "k3", "clip_eps_high": 0.4}
    knobs = ("beta", "clip_eps_high", "reset_every", "reset_patience", "reset_optimizer", "dynamic_sampling")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.ref_version: Optional[int] = None
        self.ref_dir: Optional[str] = None  # where the current reference's weights are (None: the initial model)
        self.ref_hash: Optional[str] = None  # a reference server's hash of those weights (None in-process)
        self.resumed = False
        self.best: Optional[float] = None
        self.since_best = 0
        self.resets = 0

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        if cfg.algo.beta <= 0:
            raise ConfigError(
                f"algo.beta={cfg.algo.beta} is invalid for prorl: its KL term and reference resets need beta > 0 "
                f"(paper: 1e-3); without them use --algo dapo"
            )

    # ----------------------------------------------------------------- hooks
    def attach(self, ctx: StepContext) -> None:
        ref = ctx.reference
        if not self.resumed:
            self.ref_version, self.ref_hash = ref.version, ref.weights_hash()
            return
        # A resumed run: the reference must be the one the checkpoint trained against. A server may have
        # moved on since (a reset after the checkpoint was written), so it is brought back and checked.
        if self.ref_dir is not None and ref.folder != self.ref_dir:  # after a reset: its exported policy
            # (the trainer restores a reference synced by any algorithm itself: then folder == ref_dir)
            self.ref_version = ref.restore(self.ref_dir, self.ref_version)
        elif self.ref_dir is None and self.ref_hash is not None and ref.weights_hash() != self.ref_hash:
            self.ref_version = ref.reload(self.cfg.ref.model or self.cfg.model.name_or_path)  # the initial model
        if self.ref_hash is not None and (now := ref.weights_hash()) != self.ref_hash:
            raise ConfigError(
                f"--resume: the reference server serves weights {now} ({ref.source}), but this checkpoint trained "
                f"against {self.ref_hash} ({self.ref_dir or 'the initial model'}); the folder changed since. "
                f"Restore it, or start the run afresh"
            )

    def on_step_end(self, ctx: StepContext, metrics: dict[str, float]) -> None:
        o = self.opt
        metrics["prorl/ref_version"] = float(self.ref_version or 0)
        trigger = bool(o.reset_every) and ctx.step % o.reset_every == 0
        value = metrics.get(o.reset_metric)
        if o.reset_patience and value is not None:
            if self.best is None or value > self.best:
                self.best, self.since_best = value, 0
            else:
                self.since_best += 1
                trigger = trigger or self.since_best >= o.reset_patience
        metrics["prorl/reset"] = float(trigger)
        if trigger:
            self.reset(ctx)
        metrics["prorl/resets"] = float(self.resets)

    def reset(self, ctx: StepContext) -> None:
        """pi_ref <- pi_theta (collective: every rank calls it); optionally reset the optimizer."""
        self.ref_dir, self.ref_version = ctx.reset_reference()
        self.ref_hash = ctx.reference.weights_hash()
        if self.opt.reset_optimizer:
            ctx.reset_optimizer()  # Adam moments and step counts start afresh at the next step
        self.best, self.since_best = None, 0
        self.resets += 1

    # ----------------------------------------------------------------- state (checkpointed)
    def state_dict(self) -> dict:
        return {"ref_version": self.ref_version, "ref_dir": self.ref_dir, "ref_hash": self.ref_hash, "best": self.best,
                "since_best": self.since_best, "resets": self.resets}

    def load_state_dict(self, state: dict) -> None:
        self.ref_version = state.get("ref_version")
        self.ref_dir = state.get("ref_dir")
        self.ref_hash = state.get("ref_hash")
        self.resumed = True
        self.best = state.get("best")
        self.since_best = int(state.get("since_best", 0))
        self.resets = int(state.get("resets", 0))
