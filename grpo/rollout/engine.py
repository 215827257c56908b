"""The generation-engine protocol: what the rollout service needs from whatever samples tokens.

An engine turns prompts (token ids) into G completions each with given sampling settings,
and is told after every optimizer step that the policy's weights changed (``sync_weights``).
Today's engine is ``hf`` (grpo/rollout/hf.py: the training model itself, through transformers);
``rollout.engine`` names a registered engine or any ``package.module:Class`` with this shape.

Everything an engine returns is in :class:`Completions`: tokens up to and including EOS,
whether each row was truncated, and, when the engine has them, the sampler's log-prob of each
token it drew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, runtime_checkable

import torch

from grpo.foundation.config import Config, RolloutConfig


@dataclass(frozen=True)
class SamplingParams:
    """How one generation call samples (the rollout's settings, or evaluation's greedy ones)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    ignore_eos: bool = False  # benchmarks only: EOS does not end a completion
    forced_eos_lengths: tuple[int, ...] = ()  # benchmarks only: row i ends with EOS at [i % len] tokens
    topk_logprobs: int = 0  # the audit's steps: also the k most likely tokens of each step's distribution

    @classmethod
    def from_rollout(cls, cfg: RolloutConfig, **changes: Any) -> "SamplingParams":
        base = cls(max_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                   top_k=cfg.top_k, ignore_eos=cfg.ignore_eos, forced_eos_lengths=tuple(cfg.forced_eos_lengths or ()))
        return dataclasses.replace(base, **changes)

    def greedy(self) -> "SamplingParams":
        return dataclasses.replace(self, temperature=1.0, top_k=1, top_p=1.0)


@dataclass
class Completions:
    """Rows are group-major: row i belongs to prompt i // n."""

    tokens: list[list[int]]  # completion tokens up to and including EOS (or max_tokens tokens)
    truncated: torch.Tensor  # [R] bool: no EOS within max_tokens
    logprobs: Optional[list[list[float]]] = None  # the sampler's log-prob of each drawn token, if it has them
    reused: int = 0  # prompt positions whose KV came from the engine's earlier rows, not fed again
    # SamplingParams.topk_logprobs = k, when the engine has them: at each drawn token, the k most likely tokens of
    # the distribution it was drawn from (temperature applied, before top-k / top-p), [R, max_tokens, k] log-probs
    # and ids, zeros past each row's end
    topk_logprobs: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None
    # a call with ``stop`` (streaming: grpo/rollout/stream.py): [R] bool, rows the stop left unfinished (their
    # tokens so far, none when the row never started; truncated False); None: every row ran to its end
    stopped: Optional[torch.Tensor] = None

    def mask(self, width: int) -> torch.Tensor:
        return completion_mask([len(t) for t in self.tokens], width)

    @classmethod
    def empty(cls) -> "Completions":
        return cls(tokens=[], truncated=torch.zeros(0, dtype=torch.bool))


def forced_eos(params: SamplingParams, rows: int, device: torch.device) -> Optional[torch.Tensor]:
    """[rows + 1] long: the token count at which each row's EOS is forced (``forced_eos_lengths`` cycled over the
    rows; the last entry, 0, for padding rows), or None when nothing is forced."""
    if not params.forced_eos_lengths:
        return None
    at = [params.forced_eos_lengths[i % len(params.forced_eos_lengths)] for i in range(rows)] + [0]
    return torch.tensor(at, dtype=torch.long, device=device)


def completion_mask(lengths: list[int], width: int) -> torch.Tensor:
    """[R, width] float mask, 1 on the first ``lengths[i]`` columns."""
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths, dtype=torch.long).reshape(-1, 1)).float()


def cut_at_eos(tokens: list[int], eos_ids: set[int], max_len: int) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first EOS; truncated when none within ``max_len``."""
    for i, t in enumerate(tokens[:max_len]):
        if t in eos_ids:
            return tokens[: i + 1], False
    return tokens[:max_len], True


@dataclass
class EngineSetup:
    """What an engine is built from."""

    cfg: Config
    model: torch.nn.Module  # the policy being trained (under DeepSpeed: the engine's module)
    tokenizer: Any
    eos_ids: list[int]
    pad_id: int
    synced: bool = False  # ZeRO-3 over > 1 rank: every generation call is collective (see hf.needs_synced_generation)


def with_fetch(stop: Optional[Callable[..., bool]]) -> Optional[Callable[..., bool]]:
    """A streamed call's ``stop`` as the engines call it, ``stop(finished, fetch)`` (``fetch(rows)``: finished rows'
    tokens, grpo/rollout/stream.py's early scoring): one that takes the finished rows only is called without it."""
    if stop is None:
        return None
    params = list(inspect.signature(stop).parameters.values())
    if len(params) >= 2 or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return stop
    return lambda finished, fetch=None: stop(finished)


class DecodeTally:
    """An engine's decode figures (the static and hf engines'): the tokens drawn by decode steps, their slot-steps
    (each step counts every slot of its call, since a decode step reads every weight however few rows are left) and
    the decode steps since the last ``pop``; the time split of the generation calls between their prefill forwards
    and the rest (decode steps, slot refills, host reads) since the last ``pop_timings``. On CUDA a prefill is timed
    by events read at ``pop_timings``, so timing adds no synchronisation to the call."""

    def __init__(self):
        self.tokens = self.slot_steps = self.steps = 0
        self.prefill_s = self.call_s = 0.0
        self._events: list[tuple[Any, Any]] = []

    def add(self, tokens: int, slot_steps: int, steps: int) -> None:
        self.tokens, self.slot_steps, self.steps = self.tokens + tokens, self.slot_steps + slot_steps, self.steps + steps

    @contextlib.contextmanager
    def prefill(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self._events.append((a, b))
        else:
            t0 = time.perf_counter()
            yield
            self.prefill_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.call_s += time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        """``rollout/occupancy``, ``decode_steps`` and ``decoded_tokens``, then zero the counts."""
        out: dict[str, float] = {}
        if self.steps:
            out.update({"rollout/occupancy": self.tokens / self.slot_steps, "rollout/decode_steps": float(self.steps),
                        "rollout/decoded_tokens": float(self.tokens)})
        self.tokens = self.slot_steps = self.steps = 0
        return out

    def pop_timings(self) -> dict[str, float]:
        """The time split, seconds: ``generation_prefill`` and ``generation_decode`` (logged as ``time/...``, the
        slowest rank's), then zero it; empty when no call ran."""
        for a, b in self._events:
            b.synchronize()
            self.prefill_s += a.elapsed_time(b) / 1000
        out = ({"generation_prefill": self.prefill_s, "generation_decode": max(0.0, self.call_s - self.prefill_s)}
               if self.call_s else {})
        self.prefill_s = self.call_s = 0.0
        self._events = []
        return out


@runtime_checkable
class GenerationEngine(Protocol):
    """One file per engine; constructed as ``Engine(setup: EngineSetup)``."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> Completions:
        """``n`` completions for each prompt, group-major. Collective when ``setup.synced``: every rank
        calls it the same number of times, with or without prompts."""
        ...

    def sync_weights(self) -> None:
        """The policy's weights changed (after every optimizer step, a resume, a reference reset)."""
        ...
