"""What the engine (grpo/) knows of its plug-ins: their protocols and the registries they join.

    algos/     ALGORITHMS     an :class:`AlgorithmHooks` class per ``--algo NAME`` (algos/base.py: Algorithm)
    rewards/   REWARDS        reward functions (``rewards: [{fn: NAME}]``), STEP_REWARDS (grpo-ps's steps)
    envs/      ENVS, TOOLS    environments of multi-turn rollouts (envs/base.py: Environment) and the tools they call
    grpo/rollout/service.py   ENGINES (``rollout.engine``)

Each plug-in package registers itself when imported (grpo/foundation/registry.py); the registries import it
at their first lookup. What calls and combines reward functions (grpo/scoring/) and builds environments
(grpo/rollout/environment.py) is the engine's own: the trainer composes the run once (grpo/training/compose.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from grpo.foundation.config import Config
from grpo.foundation.registry import Registry, must_be_callable

if TYPE_CHECKING:  # light to import: tool workers import envs/, which registers here
    from grpo.foundation.batch import RolloutBatch

ALGORITHMS = Registry("algorithm", "algo.name", home="algos", unknown="unknown algorithm {name!r}")
REWARDS = Registry("reward function", "rewards fn", home="rewards", paths="function", check=must_be_callable)
STEP_REWARDS = Registry("step reward", "algo.step_reward_fn", home="rewards", paths="function",
                        check=must_be_callable)
ENVS = Registry("environment", "env.name", home="envs", paths="Class")
TOOLS = Registry("tool", "env.tools fn", home="envs", paths="function", check=must_be_callable)


class RewardServiceError(RuntimeError):
    """A reward model server or remote endpoint still failed after its retries: the run stops."""


# (prompt texts, completion texts, dataset columns, raw_prompts=dataset prompts, completion_ids=token ids)
#   -> (total reward per row, {source: values, nan where the source skipped the row}); grpo/scoring/combined.py
Scorer = Callable[..., tuple[list[float], dict[str, list[float]]]]


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


class AlgorithmHooks(Protocol):
    """What the trainer calls on an algorithm (algos/base.py's Algorithm implements it), in step order."""

    name: str
    needs_sum_pi_squared: bool

    def __init__(self, cfg: Config) -> None: ...
    @property
    def needs_reference(self) -> bool: ...
    @property
    def needs_old_logprobs(self) -> bool: ...
    @property
    def needs_entropy(self) -> bool: ...
    @property
    def entropy_bonus(self) -> bool: ...
    def attach(self, ctx: StepContext) -> None: ...
    def process_batch(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch: ...
    def advantages(self, batch: RolloutBatch, ctx: StepContext) -> Any: ...
    def prepare_loss(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch: ...
    def loss_with_bonus(self, logp: Any, entropy: Any, mb: RolloutBatch, norms: Any) -> Any: ...
    def on_step_end(self, ctx: StepContext, metrics: dict[str, float]) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def options_state_dict(self) -> dict: ...
    def load_options_state_dict(self, state: dict) -> None: ...

