"""The training loop on a DeepSpeed engine.

One step, on every rank:
  data -> rollout (the rollout service: generate, score) -> algorithm hook ``process_batch``
  (shaping / filtering / refill / correction / pruning) -> reference (async) -> old log-probs /
  entropy (only if needed) -> advantages -> mu optimizer passes over micro-batches -> weight sync
  to the generation engine -> metrics reduced over ranks -> ``on_step_end`` -> reference sync
  (``ref.sync_every``) -> checkpoint.

Algorithms see none of this class: their hooks get a StepContext (grpo/foundation/plugins.py). The
plug-ins (algorithm, engine, rewards, environment) come resolved from grpo/training/compose.py.
"""

from __future__ import annotations

import math
import time
import sys
from pathlib import Path
from typing import Optional

import torch

from grpo.data.sources import PromptDataset, PromptSampler, describe_unusable, load_source
from grpo.data.tasks import system_prompt
from grpo.foundation import core, dist
from grpo.foundation.batch import RolloutBatch, micro_batches
from grpo.foundation.config import Config, ConfigError, custom_chat_template, dump_config
from grpo.foundation.logprobs import completion_logprobs
from grpo.foundation import lora
from grpo.foundation.modeling import eos_token_ids, load_model, load_policy, load_tokenizer
from grpo.foundation.plugins import SERVICES, AlgorithmHooks, RewardServiceError, StepContext
from grpo.reference.handle import make_reference
from grpo.rollout.multiturn import MultiTurnRollout
from grpo.rollout.service import RolloutService
from grpo.training import deepspeed_engine as ds
from grpo.training.compose import Parts, compose
from grpo.training.configure import check_ranks
from grpo.training.checkpoint import (export_model, latest_checkpoint, load_checkpoint, prune_reference_folders,
                                     reference_folder, resume_mismatch, save_checkpoint, stored_folder, write_weights)
from grpo.training.evaluation import Evaluator
from grpo.training.health import LearningHealth, NonFiniteWatchdog, RewardFailureGuard
from grpo.training.metrics import MetricsLogger, SamplerGap, step_metrics
from grpo.training.partitioned import frozen_partitioned, load_partitioned
from grpo.training.steptime import GcTimer, MemoryPeaks, OutlierWatch, freeze_what_came_before
from grpo.reference.base import ReferenceServerError


def make_env_setup(cfg: Config, setup: Optional[type] = None):
    """The run's environment and tool box (``setup``: the environment service, default the registered one),
    or None for single-turn rollouts."""
    if not cfg.env.name:
        return None
    setup = setup or SERVICES.get("environment")
    try:
        return setup(cfg.env, cfg.sandbox)
    except ValueError as e:  # a bad option value of the environment's own
        raise ConfigError(str(e)) from e


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, parts: Optional[Parts] = None):
        self.cfg = cfg
        self.parts = parts = parts or compose(cfg)  # an unknown name fails before any model loads
        freeze_what_came_before()  # the libraries (plug-ins included), once per process: out of the collector's passes
        ds.init_distributed()
        self.rank, self.world = dist.rank(), dist.world_size()
        ds.share_cpu_threads()
        check_ranks(cfg, self.world)
        torch.manual_seed(cfg.train.seed + self.rank)
        self.out = Path(cfg.train.output_dir)
        if dist.is_main():
            self.out.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.out / "config.yaml")

        self.algo: AlgorithmHooks = parts.algorithm(cfg)
        self.tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
        if (template := custom_chat_template(cfg.data)) is not None:  # data.chat_template: a template or a file
            self.tokenizer.chat_template = template
        self.env = make_env_setup(cfg, parts.env)  # multi-turn rollouts when env.name is set (None: single-turn)
        if cfg.data.source == "env":
            source = self.env.tasks(cfg.env.num_examples, cfg.data.seed)
        else:
            source = load_source(cfg.data, cfg.train.seed)
        self.dataset = PromptDataset.build(source, self.tokenizer, cfg.data, cfg.rollout.max_prompt_length)
        self.sampler = PromptSampler(len(self.dataset), cfg.train.seed, cfg.data.shuffle)
        # with an environment the rewards are its own: no reward functions, no reward workers
        self.rewards = (parts.rewards(cfg.rewards, cfg.reward_pool, ref=cfg.ref, sandbox=cfg.sandbox)
                        if self.env is None else None)
        if self.rewards is not None:  # a reward that cannot take these columns fails now, not on every row
            self.rewards.check_columns([k for k in self.dataset.items[0] if k != "prompt"])

        # ZeRO-3 over several ranks: built partitioned, so no rank ever holds the whole model (LoRA, which
        # ZeRO-3 refuses, loads through load_policy)
        zero3 = ds.deepspeed_config(cfg) if cfg.train.zero_stage == 3 and cfg.train.zero3_init and self.world > 1 else None
        model = load_policy(cfg.model) if zero3 is None else load_partitioned(cfg, cfg.model.name_or_path, zero3)
        self.eos_ids = eos_token_ids(model, self.tokenizer)
        self.engine, self.scheduler = ds.build_engine(cfg, model)
        self.model = self.engine.module
        self.device = self.engine.device
        self.rollout = RolloutService.build(cfg, self.model, self.tokenizer, self.eos_ids, scorer=self.rewards,
                                             make_engine=parts.engine)
        self.multiturn = None
        self._early = None  # this step's early reference request: (prompts, completions, future)
        if self.env is not None:
            self.multiturn = MultiTurnRollout(
                self.rollout, self.env.factory, cfg.rollout.max_turns, cfg.rollout.max_trajectory_tokens,
                stop=cfg.env.stop, system_prompt=system_prompt(cfg.data.system_prompt), prefill=cfg.data.prefill or "",
                tool_counts=self.env.toolbox.pop_counts, watchdog_s=cfg.env.watchdog_s,
                max_prompt_length=cfg.rollout.max_prompt_length, env_threads=cfg.env.tool_workers)
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        longest = cfg.rollout.max_prompt_length + (cfg.rollout.max_trajectory_tokens if self.env is not None
                                                   else cfg.rollout.max_completion_length)
        if dist.is_main() and context and longest > context:
            print(f"config warning: rollout.max_prompt_length + rollout."
                  f"{'max_trajectory_tokens' if self.env is not None else 'max_completion_length'} = {longest} "
                  f"tokens, beyond the model's context of {context} (max_position_embeddings): the longest "
                  f"sequences would run past the positions it was trained on", file=sys.stderr, flush=True)
        self.evaluator = Evaluator(cfg, self.rollout, rewards=parts.rewards) if cfg.eval.every else None
        # with LoRA (and no ref.url / ref.model) the reference is self.model with its adapters off: no copy
        self.reference = make_reference(
            cfg, self.algo.needs_reference, self.device, self.tokenizer,
            vocab_size=model.config.get_text_config().vocab_size, policy=self.model, synced=zero3 is not None,
            load=None if zero3 is None else (lambda source: frozen_partitioned(cfg, source, zero3)))
        if self.reference is not None and self.reference.remote:  # a server: ask it while the rewards run
            self.rollout.on_generated = self._early_reference
        if cfg.ref.sync_every and self.reference is None:
            raise ConfigError(f"ref.sync_every={cfg.ref.sync_every}: algorithm {cfg.algo.name!r} uses no reference "
                              "here; set ref.sync_every=0")

        self.step = 0
        self._saved_step = 0  # the step of the newest checkpoint (a resumed run's own)
        self._last_batch: Optional[RolloutBatch] = None
        if resume:
            ckpt = latest_checkpoint(self.out)
            if ckpt is None:
                raise ConfigError(f"--resume: no checkpoint in {self.out / 'checkpoints'}; start without --resume")
            mismatch = resume_mismatch(self.model, ckpt)
            if mismatch:
                raise ConfigError(f"--resume from {ckpt}: the run is not set up as the checkpoint was ({mismatch}); "
                                  f"resume with the checkpoint's settings, or start a new train.output_dir")
            state = load_checkpoint(self.engine, ckpt)
            self.step = int(state["step"])
            self._saved_step = self.step
            self.sampler.load_state_dict(state["sampler"])
            self.algo.load_state_dict(state.get("algo", {}))
            self.algo.load_options_state_dict(state.get("algo_options", {}))
            ref_state = state.get("reference") or {}
            if self.reference is not None and ref_state.get("folder"):  # it had been synced: bring it back
                folder = reference_folder(self.out, ref_state["folder"])
                self.reference.restore(folder, ref_state.get("version"))
                if self.reference.kind == "adapters-off":
                    lora.set_base_name(self.model, folder)
            self.rollout.sync_weights()  # the engine generates with the restored weights
            if dist.is_main():
                print(f"resumed from {ckpt} at step {self.step}", flush=True)
        self.algo.attach(self.context())
        self.logger = MetricsLogger(cfg, start_step=self.step)
        self.health = LearningHealth(cfg, cfg.logging.health_patience, dist.is_main())
        self.gc_timer = GcTimer()  # time/gc: the garbage collector's pauses inside each step
        self.memory = MemoryPeaks(self.device)  # memory/<phase>_gib on CUDA: where a step's peak comes from
        self.step_watch = OutlierWatch(verbose=dist.is_main())  # a step > 1.5x the running median is named
        self.watchdog = NonFiniteWatchdog(cfg, cfg.train.max_nonfinite_steps)
        self.reward_guard = RewardFailureGuard(cfg.reward_pool.max_failing_steps)
        if dist.is_main():
            print(f"policy {cfg.model.name_or_path}: {cfg.model.dtype} on {self.device}"
                  f"{', gradient checkpointing' if cfg.model.gradient_checkpointing else ''}", flush=True)
        if dist.is_main() and self.dataset.dropped:
            print(f"dropped {self.dataset.dropped} prompts longer than rollout.max_prompt_length", flush=True)
        if dist.is_main() and self.dataset.unusable:
            print(f"data: {describe_unusable(self.dataset.unusable)}: null, empty or not text", flush=True)

    # ------------------------------------------------------------------ what algorithms see
    def context(self) -> StepContext:
        """The narrow view of the run that algorithm hooks get (step = steps completed so far)."""
        return StepContext(self.cfg, self.step, generate_more=lambda n=None: self.generate(self._rank_indices(n)),
                           rollout=self.rollout, reference=self.reference, reset_reference=self.reset_reference,
                           reset_optimizer=lambda: ds.reset_optimizer_state(self.engine))

    def reset_reference(self) -> tuple[str, int]:
        """pi_ref <- pi_theta (collective; ProRL's resets): ``sync_reference(1.0)``."""
        return self.sync_reference(1.0)

    def sync_reference(self, alpha: float = 1.0) -> tuple[str, int]:
        """pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref, whatever the reference's kind (collective).

        The new reference's weights are written to OUT/reference/step-N (an HF folder: what a resumed run
        reloads, and what a reference server loads). In-process copy: mixed in place. Server: rank 0 mixes
        the server's present weights (the folder of the last sync, or the initial model) with the policy's
        and the server reloads the folder (alpha = 1: the policy's export). LoRA's adapters-off reference:
        the mix is merged into the policy's base and the adapter keeps the rest, so the policy itself does
        not change (grpo.foundation.lora.sync_base). Returns (that folder, the reference's new version).
        """
        # absolute: a reference server resolves the folder on its side, not in this run's working directory
        folder = str((self.out / "reference" / f"step-{self.step}").resolve())
        ref = self.reference
        if ref is None:
            raise RuntimeError("sync_reference: this run has no reference (beta = 0)")
        if ref.kind == "adapters-off":
            lora.sync_base(self.model, alpha)  # the same arithmetic on every rank
            if dist.is_main():
                write_weights(self.model, lora.base_state_dict(self.model), self.tokenizer, folder)
            dist.barrier()
            lora.set_base_name(self.model, folder)  # adapters saved from now on name their new base
            self.rollout.sync_weights()  # the merged policy is the same up to rounding: the engine gets it exactly
            return folder, ref.synced(folder)
        if alpha == 1.0 and (ref.remote or ref.partitioned or ds.partitions_weights(self.engine)):
            export_model(self.engine, self.tokenizer, folder)
            whole = None if ref.remote or ref.partitioned else self._whole_policy(folder)
            return folder, ref.load_policy(folder, whole)
        need = dist.is_main() or not ref.remote or ds.partitions_weights(self.engine)  # (ZeRO-3: collective)
        policy = self._whole_policy(folder) if need else None
        version = ref.mix(policy, alpha, folder, self._write_reference, self._current_reference)
        return folder, version

    def _whole_policy(self, folder: str) -> dict[str, torch.Tensor]:
        """The policy's weights under transformers' names (LoRA: merged), whole. Under ZeRO-3 they are
        exported to ``folder`` first (collective) and read back."""
        if ds.partitions_weights(self.engine):
            export_model(self.engine, self.tokenizer, folder)
            return load_model(self.cfg.model, folder, apply_freeze=False).state_dict()
        return lora.merged_state_dict(self.model) if lora.has_lora(self.model) else self.model.state_dict()

    def _write_reference(self, state_dict: dict[str, torch.Tensor], folder: str) -> None:
        write_weights(self.model, state_dict, self.tokenizer, folder)

    def _current_reference(self) -> dict[str, torch.Tensor]:
        """A server's present weights (rank 0): the folder of the last sync, else the model it started with."""
        source = self.reference.folder or self.cfg.ref.model or self.cfg.model.name_or_path
        return load_model(self.cfg.model, source, apply_freeze=False).state_dict()

    # ------------------------------------------------------------------ data -> rollout -> rewards
    def _rank_indices(self, n: Optional[int] = None) -> list[int]:
        """This rank's slice of the next global batch of ``n`` prompts (default prompts_per_step)."""
        n = self.cfg.rollout.prompts_per_step if n is None else n
        if n % self.world:
            raise ValueError(f"{n} prompts cannot be split evenly over {self.world} ranks")
        per_rank = n // self.world
        batch = self.sampler.next_batch(n)
        return batch[self.rank * per_rank : (self.rank + 1) * per_rank]

    def generate(self, indices: list[int]) -> RolloutBatch:
        """G scored completions (multi-turn trajectories with an environment) for each of these dataset prompts."""
        if self.multiturn is not None:
            return self.multiturn.rollout([self.dataset.ids[i] for i in indices],
                                          [self.dataset.items[i] for i in indices], indices)
        return self.rollout.rollout([self.dataset.ids[i] for i in indices], [self.dataset.items[i] for i in indices],
                                    indices)

    # ------------------------------------------------------------------ log-probs
    def micro_batches(self, batch: RolloutBatch) -> list[list[int]]:
        """This rank's micro-batches (``train.micro_batch_size`` rows, ``train.micro_batch_tokens`` padded
        tokens). Under several ranks, as many as the busiest rank's: the missing ones are empty lists, run as
        zero-weight passes (ZeRO-3 gathers weights inside every forward and backward: every rank must run the
        same number of them)."""
        t = self.cfg.train
        chunks = micro_batches(self._total_lengths(batch), t.micro_batch_size, t.micro_batch_tokens)
        if self.world > 1:
            most = int(dist.all_reduce_max(torch.tensor([float(len(chunks))], dtype=torch.float64))[0])
            chunks += [[] for _ in range(most - len(chunks))]
        return chunks

    @torch.no_grad()
    def policy_logprobs(self, batch: RolloutBatch, with_entropy: bool,
                        sum_pi_squared: bool = False) -> tuple[Optional[torch.Tensor], ...]:
        """Current policy's log-probs (and entropy; and sum_v pi_v^2 as a third tensor with ``sum_pi_squared``)
        for the whole batch, micro-batch by micro-batch. The results stay on the device until the last
        micro-batch: one copy to the host, no wait per micro-batch."""
        lp = torch.zeros(len(batch), batch.width, device=self.device)
        ent = torch.zeros(len(batch), batch.width, device=self.device) if with_entropy else None
        sq = torch.zeros(len(batch), batch.width, device=self.device) if sum_pi_squared else None
        for rows in self.micro_batches(batch):
            out_lp, out_ent, *out_sq = completion_logprobs(
                self.model, batch.packed(rows or [0], self.tokenizer.pad_token_id), self.cfg.rollout.temperature,
                self.cfg.train.logprob_chunk_size, with_entropy, sum_pi_squared=sum_pi_squared,
            )
            if not rows:  # an empty micro-batch (another rank's extra one): the forward only joins in
                continue
            idx = torch.tensor(rows, device=self.device)
            lp[idx] = out_lp.float()
            if ent is not None:
                ent[idx] = out_ent.float()
            if sq is not None:
                sq[idx] = out_sq[0].float()
        out = (lp.cpu(), (ent.cpu() if ent is not None else None))
        return (*out, sq.cpu()) if sq is not None else out

    def step_norms(self, batch: RolloutBatch) -> core.StepNorms:
        """Sequence and token counts of the whole step, over all ranks."""
        counts = dist.all_reduce_sum(torch.tensor([float(len(batch)), float(batch.mask.sum())], dtype=torch.float64))
        # L_max: the batch's width (max_trajectory_tokens for multi-turn trajectories)
        L_max = self.cfg.rollout.max_trajectory_tokens if self.multiturn else self.cfg.rollout.max_completion_length
        return core.StepNorms(float(counts[0]), float(counts[1]), L_max)

    @staticmethod
    def _total_lengths(batch: RolloutBatch) -> list[int]:
        return [len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids)]

    # ------------------------------------------------------------------ the reference request
    def _early_reference(self, batch: RolloutBatch) -> None:
        """rollout's on_generated: a reference server gets the step's rows right after generation, so its
        answer is computed while the rewards, the algorithm's batch changes and the old log-probs run. Once a
        step: an algorithm's extra generations (refills) do not send more."""
        if self._early is not None:
            return
        future = self.reference.submit(batch.packed(None, self.tokenizer.pad_token_id), self.cfg.rollout.temperature)
        self._early = ([list(p) for p in batch.prompt_ids], [list(c) for c in batch.completion_ids], future)

    def _reference_request(self, batch: RolloutBatch, ctx: StepContext):
        """The future of the reference log-probs of ``batch``: the early request when the batch's rows are still
        the ones it sent (``ref/early_request`` 1), else a request now (an algorithm filtered, refilled or
        rewrote rows; an in-process reference computes here)."""
        early, self._early = self._early, None
        if self.reference is None:
            return None
        if early is not None and early[0] == batch.prompt_ids and early[1] == batch.completion_ids:
            ctx.metrics["ref/early_request"] = 1.0
            return early[2]
        if self.reference.remote:
            ctx.metrics["ref/early_request"] = 0.0
        return self.reference.submit(batch.packed(None, self.tokenizer.pad_token_id), self.cfg.rollout.temperature)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        cfg, algo = self.cfg, self.algo
        t_start = time.perf_counter()
        self.rollout.pop_timings()  # evaluation's generation is not this step's
        self._early = None
        self.gc_timer.pop()
        self.memory.begin()
        if self.rewards is not None:
            self.rewards.set_state(self.step, cfg.train.max_steps)
        batch = self._together(lambda: self.generate(self._rank_indices()))  # generation and the rewards
        ctx = self.context()
        # The one place where algorithms change the batch (shaping, filtering + refill, correction, pruning).
        batch = algo.process_batch(batch, ctx)
        scored = ctx.scored or batch  # what the step's reward / advantage metrics describe
        timings = self.rollout.pop_timings()
        self.memory.end("generate")
        self.rollout.offload()  # vllm on CUDA: its memory is the training passes' until the next sync

        t0 = time.perf_counter()
        ref_future = self._reference_request(batch, ctx)
        if algo.needs_sum_pi_squared:  # verl's optimal token baseline
            old, ent, sq = self.policy_logprobs(batch, algo.needs_entropy, sum_pi_squared=True)
            batch.extra = {**batch.extra, "sum_pi_squared": sq}
            batch.old_logp, batch.entropy = old, ent
        elif algo.needs_old_logprobs or algo.needs_entropy:
            old, ent = self.policy_logprobs(batch, algo.needs_entropy)
            batch.old_logp = old if algo.needs_old_logprobs else None
            batch.entropy = ent
        t1 = time.perf_counter()
        if ref_future is not None:
            batch.ref_logp = self._together(ref_future.result).float() * batch.mask
        t2 = time.perf_counter()
        timings["old_logprobs"] = t1 - t0
        timings["reference"] = t2 - t1
        self.memory.end("logprobs")

        if batch.advantages is None:  # a hook may have set them already (CPPO, before pruning)
            batch.advantages = algo.advantages(batch, ctx)
        batch = algo.prepare_loss(batch, ctx)  # options acting on the whole batch (masks), before the normalisers
        norms = self.step_norms(batch)

        t3 = time.perf_counter()
        stats: dict[str, list[torch.Tensor]] = {}
        loss_sum = torch.zeros((), dtype=torch.float64)
        grad_norm = float("nan")
        finite = True
        gap = SamplerGap() if batch.sampler_logp is not None else None
        if not ctx.skip_update:
            for i in range(cfg.algo.num_iterations):
                stats = {}
                loss_sum = self.accumulate_gradients(batch, norms, stats, gap if i == 0 else None)
                finite, grad_norm = self.optimizer_step(loss_sum)
                if not finite:
                    break
            t_sync = time.perf_counter()
            if finite or i > 0:
                self.rollout.sync_weights()
        else:
            ctx.metrics["update_skipped"] = 1.0
            t_sync = time.perf_counter()
        t4 = time.perf_counter()
        timings.update(self.rollout.pop_timings())
        timings["train"] = t_sync - t3  # the passes and the optimizer step; the engine's sync is weight_sync
        timings["gc"] = self.gc_timer.pop()
        timings["step"] = t4 - t_start
        self.memory.end("train")

        self._last_batch = scored
        lr = float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else cfg.train.lr
        m = step_metrics(scored, stats, loss_sum, grad_norm, lr, ctx.metrics, timings,
                         entropy=batch.entropy, mask=batch.mask)
        if self.rewards is not None:
            if any(t.kind == "model" for t in self.rewards.terms):  # the same on every rank (collective below)
                m["reward/model_time_frac"] = float(dist.all_reduce_max(torch.tensor(
                    [self.rewards.model_seconds()], dtype=torch.float64))[0]) / max(m["time/step"], 1e-9)
            m.update(self.rewards.pop_metrics())
            self.reward_guard.check(self.step + 1, m, self.rewards)  # may stop the run
        if self.multiturn is not None:
            m.update(self.multiturn.pop_metrics())
        if self.reference is not None:
            m.update(self.reference.pop_metrics())
        if gap is not None:
            m.update(gap.metrics())
        m.update(self.rollout.pop_metrics())
        m.update(self.memory.pop())
        self.watchdog.record(self.step + 1, finite, m["loss"], grad_norm)  # may stop the run
        m["nonfinite_steps"] = float(self.watchdog.total)
        self.health.check(self.step + 1, m)
        return m

    @staticmethod
    def _together(fn):
        """``fn()``, where a failure of an outside service (the reference server, a reward server or endpoint) on
        any rank is raised on every rank at this one point: the ranks leave the step together, before its
        training passes, and can save a checkpoint together (``_train``)."""
        failed, out = None, None
        try:
            out = fn()
        except (ReferenceServerError, RewardServiceError) as e:
            failed = e
        code = 0.0 if failed is None else 1.0 if isinstance(failed, ReferenceServerError) else 2.0
        worst = code
        if dist.is_initialized() and dist.world_size() > 1:
            worst = float(dist.all_reduce_max(torch.tensor([code], dtype=torch.float64))[0])
        if failed is not None:
            raise failed
        if worst == 1.0:
            raise ReferenceServerError("another rank could not reach the reference server (its error is in that "
                                       "rank's output)")
        if worst == 2.0:
            raise RewardServiceError("another rank's reward service failed (its error is in that rank's output)")
        return out

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

    def accumulate_gradients(self, batch: RolloutBatch, norms: core.StepNorms, stats: dict,
                             gap: Optional[SamplerGap] = None) -> torch.Tensor:
        """Backward over every micro-batch of this rank; returns this rank's share of the loss.
        ``gap``: the first pass of the step measures the sampler/trainer gap on the way.

        The loss and the stats are summed on the device and read once, after the last micro-batch (a
        read per micro-batch would make the host wait for each backward before queueing the next)."""
        cfg = self.cfg
        chunks = self.micro_batches(batch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, list[torch.Tensor]] = {}
        for k, rows in enumerate(chunks):
            self.engine.set_gradient_accumulation_boundary(k == len(chunks) - 1)
            ds.begin_micro_batch(self.engine)
            mb = batch.select(rows or [0]).to(self.device)
            logp, ent = completion_logprobs(self.model, mb.packed(None, self.tokenizer.pad_token_id),
                                            cfg.rollout.temperature, cfg.train.logprob_chunk_size,
                                            entropy_grad=self.algo.entropy_bonus)
            if not rows:  # another rank's extra micro-batch: a pass of weight 0 through the same modules
                self.engine.backward(logp.sum() * 0.0, scale_wrt_gas=False)
                continue
            if gap is not None:  # before any update of this step: logp is pi_old
                gap.add(mb.old_logp if mb.old_logp is not None else logp, mb.sampler_logp, mb.mask)
            out = self.algo.loss_with_bonus(logp.float(), ent.float() if ent is not None else None, mb, norms)
            # DeepSpeed averages gradients over ranks: multiply by the world size so the
            # summed shares give exactly the gradient of the whole step's loss.
            self.engine.backward(out.loss * self.world, scale_wrt_gas=False)
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

    # ------------------------------------------------------------------ loop
    def save(self) -> Path:
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "algo": self.algo.state_dict(),
                 "algo_options": self.algo.options_state_dict()}
        if self.reference is not None and self.reference.folder:
            # relative to the run folder when inside it: a run folder moved (or copied) still resumes
            state["reference"] = {"folder": stored_folder(self.out, self.reference.folder),
                                  "version": self.reference.version}
        path = save_checkpoint(self.engine, self.tokenizer, self.out, self.step, state, keep=self.cfg.train.keep_checkpoints)
        self._saved_step = self.step
        return path

    def train(self) -> list[dict]:
        """Run to ``train.max_steps``; worker processes (reward pool, evaluation) end with it."""
        try:
            return self._train()
        finally:
            self.close()

    def close(self) -> None:
        """Stop the reward and evaluation worker pools and the generation engine's resources (idempotent)."""
        self.gc_timer.close()
        self.rollout.close()
        if self.rewards is not None:
            self.rewards.close()
        if self.env is not None:
            self.env.close()
        if self.evaluator is not None:
            self.evaluator.close()

    def evaluate(self) -> dict[str, float]:
        return self.evaluator(self.step, self.out)

    def _stop_reached(self, history: list[dict]) -> bool:
        """``train.stop_when``: whether the mean of its metric over the last ``window`` steps of this run reached
        ``at_least``. Decided on rank 0 and shared, so every rank leaves the loop after the same step; a metric
        the steps do not log stops the run with the names they do log."""
        sw = self.cfg.train.stop_when
        if dist.any_rank(sw.metric not in history[-1]):
            if self.evaluator is not None and sw.metric.startswith("eval/") and not self.evaluator.due(self.step):
                return False  # an evaluation's metric: decided at the steps that evaluate (eval.every)
            known = sorted(k for k, v in history[-1].items() if isinstance(v, (int, float)) and k != "step")
            raise ConfigError(f"train.stop_when.metric={sw.metric!r} is not logged by this run's steps; choose "
                              f"from {known}")
        window = [h[sw.metric] for h in history if sw.metric in h][-sw.window:]  # the last `window` times logged
        mean = sum(window) / len(window)
        reached = dist.any_rank(dist.is_main() and len(window) == sw.window and self.step >= sw.min_steps
                                and mean >= sw.at_least)
        if reached and dist.is_main():
            print(f"train.stop_when: the mean of {sw.metric} over the last {sw.window} steps is {mean:.4g} >= "
                  f"{sw.at_least:g} at step {self.step}: stopping before train.max_steps={self.cfg.train.max_steps}",
                  flush=True)
        return reached

    def _train(self) -> list[dict]:
        cfg = self.cfg
        history = []
        last_saved = None
        if self.evaluator is not None and self.step == 0:  # the starting point, logged as step 0
            self.logger.log(0, self.evaluate(), advance=False)
        while self.step < cfg.train.max_steps:
            try:
                metrics = self.train_step()
            except (ReferenceServerError, RewardServiceError):
                # an outside service is gone for good: keep the steps done since the last checkpoint (every rank
                # is here: Trainer._together), then stop with its error
                if self.step > self._saved_step:
                    path = self.save()
                    if dist.is_main():
                        print(f"saved the last finished step before stopping: {path} (continue with --resume "
                              f"once the service is back)", file=sys.stderr, flush=True)
                raise
            self.step += 1
            self.step_watch.check(self.step, metrics)  # time/outlier; names the phase of a slow step
            if self.evaluator is not None and self.evaluator.due(self.step):
                metrics.update(self.evaluate())
            self.algo.on_step_end(self.context(), metrics)  # may add metrics (e.g. ProRL's reference version)
            synced = cfg.ref.sync_every and self.step % cfg.ref.sync_every == 0
            if synced:
                _, metrics["ref/version"] = self.sync_reference(cfg.ref.mixup_alpha)
            history.append({"step": self.step, **metrics})
            self.logger.log(self.step, metrics, self._samples_for_log())
            saved = cfg.train.save_every and self.step % cfg.train.save_every == 0
            if saved:
                last_saved = self.save()
            if (synced or saved) and dist.is_main() and self.reference is not None:
                prune_reference_folders(self.out, self.reference.folder)  # only what the run may still read
            if cfg.train.stop_when is not None and self._stop_reached(history):
                break
        if last_saved is None or not last_saved.name.endswith(f"-{self.step}"):
            last_saved = self.save()
            if dist.is_main() and self.reference is not None:
                prune_reference_folders(self.out, self.reference.folder)
        final = export_model(self.engine, self.tokenizer, self.out / "final") if cfg.train.export_final else None
        plot = self.logger.close()
        if dist.is_main():
            print(f"final checkpoint: {last_saved}", flush=True)
            if final is not None:
                print(f"final model (from_pretrained): {final}", flush=True)
            if plot:
                print(f"plot: {plot}", flush=True)
        return history

    def _samples_for_log(self) -> list[dict]:
        """A few (prompt, completion, reward) triples from rank 0 every ``log_every`` steps."""
        b, n = self._last_batch, self.cfg.logging.samples_per_log
        if b is None or not n or self.step % self.cfg.logging.log_every:
            return []
        return [
            {"prompt": b.prompt_text[i], "completion": b.completion_text[i], "reward": float(b.rewards[i])}
            for i in range(min(n, len(b)))
        ]
