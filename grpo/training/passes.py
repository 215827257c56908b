"""The step's passes over the policy on its DeepSpeed engine: the micro-batches, the log-probs without gradient
(old policy, entropy), the training passes with their backward, and the optimizer step; and ``Step``, what one
step carries from phase to phase (grpo/training/trainer.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from grpo.foundation import rl_math, dist
from grpo.foundation.batch import RolloutBatch, micro_batches
from grpo.foundation.config import Config
from grpo.foundation.plugins import StepContext
from grpo.foundation.logprobs import completion_scores
from grpo.training import deepspeed_engine as ds
from grpo.training.metrics import SamplerGap


def total_lengths(batch: RolloutBatch) -> list[int]:
    """Each row's prompt + completion tokens (what a micro-batch pads to)."""
    return [len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids)]


class PolicyPasses:
    def __init__(self, cfg: Config, engine: Any, algo: Any, pad_id: int, world: int, multi_turn: bool):
        self.cfg, self.engine, self.model, self.algo = cfg, engine, engine.module, algo
        self.pad_id, self.world, self.device = pad_id, world, engine.device
        # L_max of the step's norms: the batch's width (max_trajectory_tokens for multi-turn trajectories)
        self.L_max = cfg.rollout.max_trajectory_tokens if multi_turn else cfg.rollout.max_completion_length

    def micro_batches(self, batch: RolloutBatch) -> list[list[int]]:
        """This rank's micro-batches (``train.micro_batch_size`` rows, ``train.micro_batch_tokens`` padded
        tokens). Under several ranks, as many as the busiest rank's: the missing ones are empty lists, run as
        zero-weight passes (ZeRO-3 gathers weights inside every forward and backward: every rank must run the
        same number of them)."""
        t = self.cfg.train
        chunks = micro_batches(total_lengths(batch), t.micro_batch_size, t.micro_batch_tokens)
        if self.world > 1:
            most = int(dist.all_reduce_max(torch.tensor([float(len(chunks))], dtype=torch.float64))[0])
            chunks += [[] for _ in range(most - len(chunks))]
        return chunks

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, with_entropy: bool,
                 sum_pi_squared: bool = False) -> tuple[Optional[torch.Tensor], ...]:
        """Current policy's log-probs (and entropy; and sum_v pi_v^2 as a third tensor with ``sum_pi_squared``)
        for the whole batch, micro-batch by micro-batch. The results stay on the device until the last
        micro-batch: one copy to the host, no wait per micro-batch."""
        lp = torch.zeros(len(batch), batch.width, device=self.device)
        ent = torch.zeros(len(batch), batch.width, device=self.device) if with_entropy else None
        sq = torch.zeros(len(batch), batch.width, device=self.device) if sum_pi_squared else None
        for rows in self.micro_batches(batch):
            scores = completion_scores(
                self.model, batch.packed(rows or [0], self.pad_id), self.cfg.rollout.temperature,
                self.cfg.train.logprob_chunk_size, with_entropy, share_prefix=self.cfg.train.share_prompt,
                sum_pi_squared=sum_pi_squared,
            )
            if not rows:  # an empty micro-batch (another rank's extra one): the forward only joins in
                continue
            idx = torch.tensor(rows, device=self.device)
            lp[idx] = scores.logprobs.float()
            if ent is not None:
                ent[idx] = scores.entropy.float()
            if sq is not None:
                sq[idx] = scores.sum_pi_squared.float()
        out = (lp.cpu(), (ent.cpu() if ent is not None else None))
        return (*out, sq.cpu()) if sq is not None else out

    def step_norms(self, batch: RolloutBatch) -> rl_math.StepNorms:
        """Sequence and token counts of the whole step, over all ranks."""
        counts = dist.all_reduce_sum(torch.tensor([float(len(batch)), float(batch.mask.sum())], dtype=torch.float64))
        return rl_math.StepNorms(float(counts[0]), float(counts[1]), self.L_max)

    def accumulate_gradients(self, batch: RolloutBatch, norms: rl_math.StepNorms, stats: dict,
                             gap: Optional[SamplerGap] = None) -> torch.Tensor:
        """Backward over every micro-batch of this rank; returns this rank's share of the loss.
        ``gap``: the first pass of the step measures the sampler/trainer gap on the way.

        The loss and the stats are summed on the device and read once, after the last micro-batch (a
        read per micro-batch would make the host wait for each backward before queueing the next)."""
        cfg, engine = self.cfg, self.engine
        chunks = self.micro_batches(batch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, list[torch.Tensor]] = {}
        for k, rows in enumerate(chunks):
            engine.set_gradient_accumulation_boundary(k == len(chunks) - 1)
            ds.begin_micro_batch(engine)
            mb = batch.select(rows or [0]).to(self.device)
            s = completion_scores(self.model, mb.packed(None, self.pad_id), cfg.rollout.temperature,
                                  cfg.train.logprob_chunk_size, share_prefix=cfg.train.share_prompt,
                                  entropy_grad=self.algo.entropy_bonus,
                                  gather_ids=mb.extra.get("teacher_topk_ids"))  # teacher.top_k: its support
            logp, ent = s.logprobs, s.entropy
            if not rows:  # another rank's extra micro-batch: a pass of weight 0 through the same modules
                engine.backward(logp.sum() * 0.0 + (0.0 if s.gathered is None else s.gathered.sum() * 0.0),
                                scale_wrt_gas=False)
                continue
            if gap is not None:  # before any update of this step: logp is pi_old
                gap.add(mb.old_logp if mb.old_logp is not None else logp, mb.sampler_logp, mb.sampled_mask())
            out = self.algo.loss_with_bonus(logp.float(), ent.float() if ent is not None else None, mb, norms,
                                            s.gathered.float() if s.gathered is not None else None)
            # DeepSpeed averages gradients over ranks: multiply by the world size so the
            # summed shares give exactly the gradient of the whole step's loss.
            engine.backward(out.loss * self.world, scale_wrt_gas=False)
            loss_sum += out.loss.detach().double()
            for name, (s, c) in out.stats.items():
                acc = sums.setdefault(name, [torch.zeros((), dtype=torch.float64, device=self.device),
                                             torch.zeros((), dtype=torch.float64, device=self.device)])
                acc[0] += s.detach().double().to(self.device)
                acc[1] += c.detach().double().to(self.device)
        names = list(sums)
        host = torch.stack([loss_sum, *(x for n in names for x in sums[n])]).cpu()  # the pass's one read
        for j, name in enumerate(names):
            acc = stats.setdefault(name, [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)])
            acc[0] += host[1 + 2 * j]
            acc[1] += host[2 + 2 * j]
        return host[0]

    def optimizer_step(self, loss_sum: torch.Tensor) -> tuple[bool, float]:
        """One optimizer step, unless the step's loss (over all ranks) or gradient norm is not finite:
        then no weight moves. Returns (finite, gradient norm). Without ZeRO the gradients are checked
        here and dropped; under ZeRO, DeepSpeed skips an update whose gradient norm is not finite
        (reported as inf; bf16 runs ask it to check, see deepspeed_engine.deepspeed_config)."""
        loss = float(dist.all_reduce_sum(loss_sum.reshape(1)))
        stage0 = ds.stage0_grad_norm(self.engine, self.cfg.train.zero_stage)
        if stage0 is not None and not (math.isfinite(loss) and math.isfinite(stage0)):
            ds.discard_gradients(self.engine)
            return False, stage0
        self.engine.step()
        gn = ds.grad_norm(self.engine, stage0)
        return math.isfinite(loss) and math.isfinite(gn), gn


@dataclass
class Step:
    """One step's state between the trainer's phases."""

    batch: RolloutBatch  # this rank's rows, as the algorithm left them
    ctx: StepContext
    scored: RolloutBatch  # the batch the step's reward and advantage metrics describe
    timings: dict[str, float]
    t_start: float
    norms: Optional[rl_math.StepNorms] = None
    stats: dict = field(default_factory=dict)
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    grad_norm: float = float("nan")
    finite: bool = True
    gap: Optional[SamplerGap] = None
