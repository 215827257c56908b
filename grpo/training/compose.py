"""The run composed from its config, once: each plug-in the config names (grpo/foundation/plugins.py) is
resolved here and handed to the start-up checks, the trainer and the evaluator, which know them only by
their protocols.

    compose(cfg) -> Parts(algorithm, engine, rewards, env)

The algorithm is looked up and built here once a run: train.py and grpo.train hand the Parts that the start-up
checks (check_run) made to the Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from grpo.foundation.config import Config
from grpo.foundation.plugins import ALGORITHMS, AlgorithmHooks
from grpo.rollout.environment import EnvSetup
from grpo.rollout.service import engine_class
from grpo.scoring.combined import CombinedReward


@dataclass(frozen=True)
class Parts:
    algorithm: AlgorithmHooks  # algo.name's algorithm, built with the config
    engine: Callable[..., Any]  # rollout.engine's class (or builder) of an EngineSetup
    rewards: type  # CombinedReward: rewards(specs, pool, ref=, sandbox=) scores with those sources;
    # rewards.check_sandbox(sandbox settings) refuses what the machine cannot give
    env: Optional[type]  # with env.name: EnvSetup (the environment and its tool box), None for single-turn runs


def compose(cfg: Config) -> Parts:
    """The run's plug-ins; a name that does not resolve raises ConfigError naming the choices (so does what the
    algorithm names when built: grpo-ps's step reward)."""
    return Parts(algorithm=ALGORITHMS.get(cfg.algo.name)(cfg), engine=engine_class(cfg.rollout.engine),
                 rewards=CombinedReward, env=EnvSetup if cfg.env.name else None)
