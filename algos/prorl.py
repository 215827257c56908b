"""ProRL: Prolonged Reinforcement Learning (Liu et al., 2025, arXiv 2505.24864).

DAPO (algos/dapo.py: clip-higher, token-mean, dynamic sampling, overlong shaping) plus a k3 KL
penalty to a reference policy,

    L_i,t = -(min(rho A, clip(rho, 1 - 0.2, 1 + 0.4) A) - beta KL_k3),   beta = 1e-3,

and reference resets: pi_ref <- pi_theta (optionally also resetting the optimizer state:
the ProRL paper does, ProRL-v2 does not). A reset happens after every ``reset_every`` steps,
and when ``reset_metric`` (a logged metric, higher is better; e.g. an eval metric) has not
improved for ``reset_patience`` consecutive steps that logged it. Both triggers are off (0)
by default: the paper resets by hand when validation stalls (configs/prorl.yaml sets one).

At a reset the policy is written to ``OUT/reference/step-N`` (an HF folder). An in-process
reference copies the policy's weights (from that folder under ZeRO-3); a reference server is
told to load the folder through its ``reload`` call, made once, from rank 0. The folder and the
reference version go into checkpoints, so a resumed run restores the reset reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from algos.dapo import DAPO, DAPOOptions
from grpo.foundation import dist
from grpo.training.checkpoint import export_model
from grpo.foundation.config import Config, ConfigError
from grpo.reference.base import InProcessReference


@dataclass
class ProRLOptions(DAPOOptions):
    reset_every: int = 0  # steps between reference resets; 0 = off
    reset_patience: int = 0  # reset after this many logged values of reset_metric without improvement; 0 = off
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
        self.best: Optional[float] = None
        self.since_best = 0
        self.resets = 0

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        o = cfg.algo.options
        if cfg.algo.beta <= 0:
            raise ConfigError(
                f"algo.beta={cfg.algo.beta} is invalid for prorl: its KL term and reference resets need beta > 0 "
                f"(paper: 1e-3); without them use --algo dapo"
            )
        for key in ("reset_every", "reset_patience"):
            if getattr(o, key) < 0:
                raise ConfigError(f"algo.{key}={getattr(o, key)} is invalid: it must be >= 0 (0 = off)")

    # ----------------------------------------------------------------- hooks
    def attach(self, trainer: Any) -> None:
        ref = trainer.reference
        if self.ref_dir is not None:  # resumed after a reset: bring the reference back to it
            version = self.ref_version
            self._load_reference(trainer, self.ref_dir)
            if isinstance(ref, InProcessReference) and version is not None:
                ref.version = self.ref_version = version
        elif self.ref_version is None:
            self.ref_version = ref.info().get("version", 0) if dist.is_main() else None
            self.ref_version = dist.broadcast_object(self.ref_version)

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        o = self.opt
        metrics["prorl/ref_version"] = float(self.ref_version or 0)
        trigger = bool(o.reset_every) and trainer.step % o.reset_every == 0
        value = metrics.get(o.reset_metric)
        if o.reset_patience and value is not None:
            if self.best is None or value > self.best:
                self.best, self.since_best = value, 0
            else:
                self.since_best += 1
                trigger = trigger or self.since_best >= o.reset_patience
        metrics["prorl/reset"] = float(trigger)
        if trigger:
            self.reset(trainer)
        metrics["prorl/resets"] = float(self.resets)

    def reset(self, trainer: Any) -> None:
        """pi_ref <- pi_theta (collective: every rank calls it); optionally reset the optimizer."""
        folder = export_model(trainer.engine, trainer.tokenizer, trainer.out / "reference" / f"step-{trainer.step}")
        ref = trainer.reference
        if isinstance(ref, InProcessReference) and not trainer.engine.zero_optimization_partition_weights():
            ref.model.load_state_dict(trainer.model.state_dict())
            ref.version += 1
            ref.source = str(folder)
            self.ref_version = ref.version
        else:
            self._load_reference(trainer, str(folder))
        self.ref_dir = str(folder)
        if self.opt.reset_optimizer:
            opt = trainer.engine.optimizer
            base = getattr(opt, "optimizer", opt)  # ZeRO wraps the torch optimizer
            base.state.clear()  # Adam moments and step counts start afresh at the next step
        self.best, self.since_best = None, 0
        self.resets += 1

    def _load_reference(self, trainer: Any, folder: str) -> None:
        ref = trainer.reference
        if isinstance(ref, InProcessReference):
            info = ref.reload(folder)
        else:  # a reference server: one (admin) reload call, from rank 0
            info = ref.reload(folder) if dist.is_main() else None
            info = dist.broadcast_object(info)
        self.ref_version = int(info.get("version", 0)) if isinstance(info, dict) else self.ref_version

    # ----------------------------------------------------------------- state (checkpointed)
    def state_dict(self) -> dict:
        return {"ref_version": self.ref_version, "ref_dir": self.ref_dir, "best": self.best,
                "since_best": self.since_best, "resets": self.resets}

    def load_state_dict(self, state: dict) -> None:
        self.ref_version = state.get("ref_version")
        self.ref_dir = state.get("ref_dir")
        self.best = state.get("best")
        self.since_best = int(state.get("since_best", 0))
        self.resets = int(state.get("resets", 0))
