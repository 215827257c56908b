"""The rollout batch that flows from generation to the loss, and its micro-batch views."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from grpo.foundation.logprobs import Packed, pack


@dataclass(frozen=True)
class Turn:
    """One policy turn of a multi-turn trajectory (grpo/rollout/multiturn.py), in completion columns.

    The policy wrote columns [start, end) (mask 1); the environment's answer to it, when one was
    appended, fills [end, obs_end) (mask 0); ``reward`` is the environment's step reward for this
    action and ``state`` the observation the action was taken in (exact-match key of GiGPO's anchor
    states; the first turn's is the reset observation).
    """

    start: int
    end: int
    obs_end: int
    reward: float
    state: str


@dataclass
class RolloutBatch:
    """One rank's rows, group-major (row i belongs to group i // group_size).

    Per-token tensors are [rows, L_max] with L_max = max_completion_length; ``mask`` is 1
    on completion tokens up to and including EOS.

    Multi-turn trajectories (``env.name`` set): the completion is every token after the prompt, the
    policy's turns and the environment's observations interleaved; L_max = rollout.max_trajectory_tokens,
    ``mask`` is 1 on the policy's tokens only (observations are out of the loss, the KL and the entropy),
    ``turns`` holds each row's :class:`Turn` list, ``rewards`` the sum of its step rewards.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    mask: torch.Tensor
    truncated: torch.Tensor
    group_size: int
    prompt_index: list[int]  # dataset index of each row's prompt
    items: list[dict[str, Any]]  # dataset columns of each row's prompt
    prompt_text: list[str]
    completion_text: list[str]
    rewards: Optional[torch.Tensor] = None  # [rows]
    reward_terms: dict[str, torch.Tensor] = field(default_factory=dict)
    advantages: Optional[torch.Tensor] = None  # [rows] or [rows, L_max]
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    teacher_logp: Optional[torch.Tensor] = None  # on-policy distillation: the teacher's log-probs of the tokens
    entropy: Optional[torch.Tensor] = None  # old policy's, detached
    sampler_logp: Optional[torch.Tensor] = None  # the generation engine's per-token log-probs, when it has them
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per-row algorithm tensors
    turns: Optional[list[list[Turn]]] = None  # multi-turn rollouts: each row's turns (None: single-turn)

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)

    def sampled_mask(self) -> torch.Tensor:
        """``mask`` without the rows an algorithm rewrote (``extra["rewritten"]``: EDGE-GRPO's corrections), whose
        tokens the engine did not draw: where the sampler's log-probs and top-k say something of the tokens."""
        rewritten = self.extra.get("rewritten")
        return self.mask if rewritten is None else self.mask * (1 - rewritten.to(self.mask.dtype)).unsqueeze(-1)

    def packed(self, rows: Optional[list[int]] = None, pad_id: int = 0) -> Packed:
        rows = list(range(len(self))) if rows is None else rows
        return pack([self.prompt_ids[i] for i in rows], [self.completion_ids[i] for i in rows], pad_id, self.width)

    def select(self, rows: list[int]) -> "RolloutBatch":
        """A new batch holding ``rows`` (in that order); tensors are indexed, lists picked."""
        idx = torch.tensor(rows, dtype=torch.long)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[idx.to(v.device)]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in rows]
            elif isinstance(v, dict):
                out[f.name] = {k: t[idx.to(t.device)] for k, t in v.items()}
            else:
                out[f.name] = v
        return RolloutBatch(**out)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """Every tensor field (those in ``reward_terms`` and ``extra`` too) on ``device``, in place."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                setattr(self, f.name, v.to(device))
            elif isinstance(v, dict):
                setattr(self, f.name, {k: t.to(device) if isinstance(t, torch.Tensor) else t for k, t in v.items()})
        return self

    def select_groups(self, groups: list[int]) -> "RolloutBatch":
        """A new batch holding whole groups (in that order)."""
        G = self.group_size
        return self.select([g * G + j for g in groups for j in range(G)])

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        first = batches[0]
        out = {}
        for f in fields(first):
            vals = [getattr(b, f.name) for b in batches]
            if isinstance(vals[0], torch.Tensor):
                out[f.name] = torch.cat(vals)
            elif isinstance(vals[0], list):
                out[f.name] = [x for v in vals for x in v]
            elif isinstance(vals[0], dict):
                out[f.name] = {k: torch.cat([v[k] for v in vals]) for k in vals[0]}
            else:
                out[f.name] = vals[0]
        return RolloutBatch(**out)

    def columns(self) -> dict[str, list]:
        """Dataset columns aligned with the rows (for reward functions)."""
        keys = [k for k in self.items[0] if k != "prompt"] if self.items else []
        return {k: [it.get(k) for it in self.items] for k in keys}


def micro_batches(lengths: list[int], micro_batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """Row indices sorted by total length and cut into micro-batches, so each pads only to its own longest.

    A micro-batch holds at most ``micro_batch_size`` rows and, when ``max_tokens`` > 0, at most that many
    padded tokens (its rows times its longest row; a row longer than the budget goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if not max_tokens:
        return [order[s : s + micro_batch_size] for s in range(0, len(order), micro_batch_size)]
    out: list[list[int]] = []
    for i in order:  # ascending: row i is the longest of any micro-batch it joins
        if out and len(out[-1]) < micro_batch_size and (len(out[-1]) + 1) * lengths[i] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out
