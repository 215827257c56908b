"""The training loop on a DeepSpeed engine.

One step, on every rank (``train_step``: one call per phase, in this order):
  rollout     data -> generate -> score (the rollout service), then the algorithm's ``process_batch``
              (shaping / filtering / refill / correction / pruning)
  logprobs    the reference's request (a server's sent right after generation) and the teacher's -> old
              log-probs / entropy (if needed) -> reference and teacher log-probs -> the audit (grpo/training/audit.py)
  advantages  the algorithm's advantages and its whole-batch options -> the step's norms
  update      mu optimizer passes over micro-batches (grpo/training/passes.py) -> weight sync to the engine
  metrics     reduced over ranks; the watchdogs
Then, in the loop: ``on_step_end`` -> evaluation -> reference sync (``ref.sync_every``,
grpo/training/reference_sync.py) -> log -> checkpoint (grpo/training/resume.py, which ``--resume`` reads).

Algorithms see none of this class: their hooks get a StepContext (grpo/foundation/plugins.py). The
plug-ins (algorithm, engine, rewards, environment) come resolved from grpo/training/compose.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from grpo.foundation import rl_math, dist
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config
from grpo.foundation.config_assembly import dump_config
from grpo.foundation.modeling import eos_token_ids, load_policy
from grpo.foundation.plugins import AlgorithmHooks, RewardServiceError, StepContext
from grpo.reference.handle import make_reference
from grpo.reference.protocol import ReferenceServerError
from grpo.reference.teacher import ask_teacher, make_teacher, take_answer
from grpo.rollout.service import RolloutService
from grpo.training import build, deepspeed_engine as ds
from grpo.training.compose import Parts, compose
from grpo.training.configure import check_ranks
from grpo.training import resume as checkpoints
from grpo.training.checkpoint import prune_reference_folders
from grpo.training.evaluation import Evaluator
from grpo.training.audit import Audit
from grpo.training.health import (AgreedRollout, CtrlC, Interrupted, LearningHealth, NonFiniteWatchdog,
                                  RewardFailureGuard, stop_reached, together)
from grpo.training.metrics import MetricsLogger, SamplerGap, log_samples, step_metrics
from grpo.training.partitioned import frozen_partitioned
from grpo.training.passes import PolicyPasses, Step, total_lengths
from grpo.training.reference_requests import ReferenceRequests
from grpo.training.reference_sync import sync_reference
from grpo.training.steptime import GcTimer, MemoryPeaks, OutlierWatch, freeze_what_came_before


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, parts: Optional[Parts] = None):
        # what close() stops, None until built: a failure while building stops what was started (the reward
        # workers, a server client) before it is raised, so a notebook's failed call leaves no process behind
        self.rollout = self.rewards = self.env = self.evaluator = self.reference = self.teacher = None
        self.gc_timer: Optional[GcTimer] = None
        try:
            self._build(cfg, resume, parts)
        except BaseException as failure:
            try:
                self.close()
            except Exception as e:  # noqa: BLE001 - the build's own error is the one raised
                failure.add_note(f"(stopping what was started before the failure also failed: {e!r})")
            raise

    def _build(self, cfg: Config, resume: bool, parts: Optional[Parts]) -> None:
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

        self.algo: AlgorithmHooks = parts.algorithm
        self.env = build.make_env_setup(cfg, parts.env)  # multi-turn rollouts when env.name is set (None: single-turn)
        self.tokenizer, self.dataset, self.sampler = build.data(cfg, self.env)
        # with an environment the rewards are its own: no reward functions, no reward workers
        self.rewards = (parts.rewards(cfg.rewards, cfg.reward_pool, ref=cfg.ref, sandbox=cfg.sandbox)
                        if self.env is None and cfg.rewards else None)  # (none for opd with rewards: [])
        if self.rewards is not None:  # a reward that cannot take these columns fails now, not on every row
            self.rewards.check_columns([k for k in self.dataset.items[0] if k != "prompt"])

        model, zero3 = build.policy(cfg, self.world, load_policy)  # (the module's name: tests wrap it)
        self.eos_ids = eos_token_ids(model, self.tokenizer)
        self.engine, self.scheduler = ds.build_engine(cfg, model)
        self.model, self.device = self.engine.module, self.engine.device
        self.passes = PolicyPasses(cfg, self.engine, self.algo, self.tokenizer.pad_token_id, self.world,
                                   multi_turn=self.env is not None)
        self.rollout = RolloutService.build(cfg, self.model, self.tokenizer, self.eos_ids, scorer=self.rewards,
                                             make_engine=parts.engine)
        self.multiturn = build.multiturn(cfg, self.rollout, self.env)
        self.stream = build.stream(cfg, self.rollout, self.dataset, self.sampler, self.rank, self.world)  # K >= 1
        self.evaluator = Evaluator(cfg, self.rollout, rewards=parts.rewards) if cfg.eval.every else None
        # with LoRA (and no ref.url / ref.model) the reference is self.model with its adapters off: no copy
        load, vocab = (None if zero3 is None else (lambda source: frozen_partitioned(cfg, source, zero3)),
                       model.config.get_text_config().vocab_size)
        self.reference = make_reference(cfg, self.algo.needs_reference, self.device, self.tokenizer, vocab_size=vocab,
                                        policy=self.model, synced=zero3 is not None, load=load)
        self.teacher = make_teacher(cfg, self.device, self.tokenizer, vocab, load=load, synced=zero3 is not None,
                                    policy=self.model, reference=self.reference)  # on-policy distillation's (grpo/reference/teacher.py); or None
        self.asked = None  # a reference server's requests, asked as early as the rows exist (reference_requests.py)
        if self.reference is not None and self.reference.remote:  # a server: ask it while the rewards run
            self.asked = ReferenceRequests(self.reference, cfg.rollout.num_generations, self.tokenizer.pad_token_id,
                                           cfg.rollout.temperature, cfg.rollout.max_completion_length,
                                           keep_steps=cfg.rollout.max_staleness)
            self.rollout.on_generated = self.asked.early
            if cfg.ref.ask_groups:  # streamed: each group as it is whole, while the rest decode
                self.rollout.on_group = self.asked.group

        self.step = 0
        self._saved_step = 0  # the step of the newest checkpoint (a resumed run's own)
        self._last_batch: Optional[RolloutBatch] = None
        if resume:
            checkpoints.resume(self)
            self._saved_step = self.step
        self.algo.attach(self.context())
        self.logger = MetricsLogger(cfg, start_step=self.step)
        self.health = LearningHealth(cfg, cfg.logging.health_patience, dist.is_main())
        self.gc_timer = GcTimer()  # time/gc: the garbage collector's pauses inside each step
        # whole next-token distributions, every logging.audit_every steps, and once before the first update
        self.audit = Audit(cfg, first_step=self.step, fresh=self.step == 0)
        self.memory = MemoryPeaks(self.device)  # memory/<phase>_gib on CUDA: where a step's peak comes from
        self.step_watch = OutlierWatch(verbose=dist.is_main())  # a step > 1.5x the running median is named
        self.watchdog = NonFiniteWatchdog(cfg, cfg.train.max_nonfinite_steps)
        self.reward_guard = RewardFailureGuard(cfg.reward_pool.max_failing_steps)
        build.announce(cfg, model, self.device, self.dataset, multi_turn=self.env is not None)

    # ------------------------------------------------------------------ what algorithms see
    def context(self) -> StepContext:
        """The narrow view of the run that algorithm hooks get (step = steps completed so far)."""
        # a further batch inside process_batch (dapo's refill): every rank asks for it together (resample), so an
        # outside service's failure on one rank is agreed right there, before the hook's next collective
        more = lambda n=None: together(lambda: self.generate(self._rank_indices(n)))  # noqa: E731
        if self.stream is not None:  # streamed: a refill takes whole groups from the stream (this rank's share)
            share = lambda n: (self.cfg.rollout.prompts_per_step if n is None else n) // self.world  # noqa: E731
            more = lambda n=None: together(lambda: self._streamed(share(n)))  # noqa: E731
        return StepContext(self.cfg, self.step, generate_more=more, rollout=AgreedRollout(self.rollout),
                           reference=self.reference, reset_reference=self.reset_reference,
                           reset_optimizer=lambda: ds.reset_optimizer_state(self.engine))

    def reset_reference(self) -> tuple[str, int]:
        """pi_ref <- pi_theta (collective; ProRL's resets): ``sync_reference(1.0)``."""
        return self.sync_reference(1.0)

    def sync_reference(self, alpha: float = 1.0) -> tuple[str, int]:
        """pi_ref <- alpha pi_theta + (1 - alpha) pi_ref, any kind (collective): (OUT/reference/step-N, version)."""
        return sync_reference(self.reference, alpha, self.out, self.step, self.cfg, self.engine, self.tokenizer,
                              self.rollout)

    # ------------------------------------------------------------------ data -> rollout -> rewards
    def _rank_indices(self, n: Optional[int] = None) -> list[int]:
        """This rank's slice of the next global batch of ``n`` prompts (default prompts_per_step)."""
        return self.sampler.rank_batch(self.cfg.rollout.prompts_per_step if n is None else n, self.rank, self.world)

    def _streamed(self, need: Optional[int] = None) -> RolloutBatch:
        """``need`` (default: the step's share) whole groups from the stream, scored."""
        return self.rollout.rollout_stream(self.stream, self.step, lambda i: self.dataset.items[i], need)

    def generate(self, indices: list[int]) -> RolloutBatch:
        """G scored completions (multi-turn trajectories with an environment) for each of these dataset prompts."""
        rollout = self.multiturn if self.multiturn is not None else self.rollout
        return rollout.rollout([self.dataset.ids[i] for i in indices], [self.dataset.items[i] for i in indices],
                               indices)

    # ------------------------------------------------------------------ passes over the policy (passes.py)
    _total_lengths = staticmethod(total_lengths)

    def micro_batches(self, batch: RolloutBatch) -> list[list[int]]:
        return self.passes.micro_batches(batch)

    def policy_logprobs(self, batch: RolloutBatch, with_entropy: bool, sum_pi_squared: bool = False) -> tuple:
        return self.passes.logprobs(batch, with_entropy, sum_pi_squared)

    def step_norms(self, batch: RolloutBatch) -> rl_math.StepNorms:
        return self.passes.step_norms(batch)

    def accumulate_gradients(self, batch: RolloutBatch, norms: rl_math.StepNorms, stats: dict,
                             gap: Optional[SamplerGap] = None) -> torch.Tensor:
        return self.passes.accumulate_gradients(batch, norms, stats, gap)

    def optimizer_step(self, loss_sum: torch.Tensor) -> tuple[bool, float]:
        return self.passes.optimizer_step(loss_sum)

    # ------------------------------------------------------------------ the reference request
    def _reference_request(self, batch: RolloutBatch, ctx: StepContext):
        """The future of the reference log-probs of ``batch``: a server's from the requests that asked its groups
        early (``ref/early_request``: the share of rows they answered), the rest asked now; an in-process
        reference computes here."""
        if self.reference is None:
            return None
        if self.asked is not None:
            return self.asked.request(batch, ctx.metrics)
        return self.reference.submit(batch.packed(None, self.tokenizer.pad_token_id), self.cfg.rollout.temperature)

    # ------------------------------------------------------------------ one step, phase by phase
    def train_step(self) -> dict[str, float]:
        """One step on every rank: the phases of the module's docstring; returns the step's metrics."""
        step = self.rollout_phase()
        self.logprob_phase(step)
        self.advantage_phase(step)
        self.update_phase(step)
        return self.metrics_phase(step)

    def rollout_phase(self) -> Step:
        """Generate and score this rank's prompts; the algorithm's one hook that changes the batch."""
        t_start = time.perf_counter()
        self.rollout.pop_timings()  # evaluation's generation is not this step's
        self.gc_timer.pop()
        self.memory.begin()
        if self.rewards is not None:
            self.rewards.set_state(self.step, self.cfg.train.max_steps)
        self.rollout.audit_top_k = self.audit.top_k(self.step)  # the engine's top-k, on the audit's steps
        if self.stream is None:
            batch = together(lambda: self.generate(self._rank_indices()))  # generation and the rewards
        else:  # streamed: whole groups, drawn by the weights of at most max_staleness steps ago
            batch = together(self._streamed)
        ctx = self.context()
        # The one place where algorithms change the batch (shaping, filtering + refill, correction, pruning).
        # (a failure of an outside service inside the hook, remax's greedy scoring, agreed by every rank as above)
        batch = together(lambda: self.algo.process_batch(batch, ctx))
        step = Step(batch, ctx, ctx.scored or batch, self.rollout.pop_timings(), t_start)
        self.memory.end("generate")
        self.rollout.offload()  # vllm on CUDA: its memory is the training passes' until the next sync
        return step

    def logprob_phase(self, step: Step) -> None:
        """The reference's and the teacher's log-probs (asked first: a server computes them meanwhile) and, only if
        the algorithm needs them, the old policy's log-probs and entropy."""
        algo, batch = self.algo, step.batch
        t0 = time.perf_counter()
        ref_future = self._reference_request(batch, step.ctx)
        teacher, tt = ask_teacher(self.teacher, batch, self.tokenizer.pad_token_id, self.cfg.rollout.temperature)
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
            batch.ref_logp = together(ref_future.result).float() * batch.mask
        step.timings["old_logprobs"], t2 = t1 - t0 - tt, time.perf_counter()
        step.timings["reference"] = t2 - t1
        if teacher is not None:
            take_answer(batch, together(teacher.result))
            step.timings["teacher"] = tt + time.perf_counter() - t2
        self.audit.run(self.step, batch, self.model, self.reference, self.tokenizer.pad_token_id, step.ctx.metrics)
        self.memory.end("logprobs")

    def advantage_phase(self, step: Step) -> None:
        if step.batch.advantages is None:  # a hook may have set them already (CPPO, before pruning)
            step.batch.advantages = self.algo.advantages(step.batch, step.ctx)
        # options acting on the whole batch (masks), before the normalisers
        step.batch = self.algo.prepare_loss(step.batch, step.ctx)
        step.norms = self.step_norms(step.batch)

    def update_phase(self, step: Step) -> None:
        """mu optimizer steps (none when the algorithm skips this one), then the weights to the engine."""
        t3 = time.perf_counter()
        step.gap = SamplerGap() if step.batch.sampler_logp is not None else None
        if not step.ctx.skip_update:
            for i in range(self.cfg.algo.num_iterations):
                step.stats = {}
                step.loss_sum = self.accumulate_gradients(step.batch, step.norms, step.stats,
                                                          step.gap if i == 0 else None)
                step.finite, step.grad_norm = self.optimizer_step(step.loss_sum)
                if not step.finite:
                    break
            t_sync = time.perf_counter()
            if step.finite or i > 0:
                self.rollout.sync_weights()
        else:
            step.ctx.metrics["update_skipped"] = 1.0
            t_sync = time.perf_counter()
        t4 = time.perf_counter()
        step.timings.update(self.rollout.pop_timings())
        step.timings["train"] = t_sync - t3  # the passes and the optimizer step; the engine's sync is weight_sync
        step.timings["gc"] = self.gc_timer.pop()
        step.timings["step"] = t4 - step.t_start
        self.memory.end("train")

    def metrics_phase(self, step: Step) -> dict[str, float]:
        """The step's metrics, reduced over ranks; the watchdogs may stop the run here."""
        self._last_batch = scored = step.scored
        lr = float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else self.cfg.train.lr
        m = step_metrics(scored, step.stats, step.loss_sum, step.grad_norm, lr, step.ctx.metrics, step.timings,
                         entropy=step.batch.entropy, mask=step.batch.mask)
        if self.rewards is not None:
            if any(t.kind == "model" for t in self.rewards.terms):  # the same on every rank (collective below)
                m["reward/model_time_frac"] = float(dist.all_reduce_max(torch.tensor(
                    [self.rewards.model_seconds()], dtype=torch.float64))[0]) / max(m["time/step"], 1e-9)
            m.update(self.rewards.pop_metrics())
            self.reward_guard.check(self.step + 1, m, self.rewards)  # may stop the run
        for source in (self.multiturn, self.reference, self.teacher):
            if source is not None:
                m.update(source.pop_metrics())
        m.update(step.gap.metrics() if step.gap is not None else {})
        m.update(self.rollout.pop_metrics())
        m.update(self.memory.pop())
        self.watchdog.record(self.step + 1, step.finite, m["loss"], step.grad_norm)  # may stop the run
        m["nonfinite_steps"] = float(self.watchdog.total)
        self.health.check(self.step + 1, m)
        return m

    # ------------------------------------------------------------------ loop
    def save(self) -> Path:
        path = checkpoints.save(self)
        self._saved_step = self.step
        return path

    def train(self) -> list[dict]:
        """Run to ``train.max_steps``; worker processes (reward pool, evaluation) end with it."""
        try:
            return self._train()
        finally:
            self.close()

    def close(self) -> None:
        """Stop the worker pools, the engine's resources, the reference's and teacher's clients (idempotent; what
        was built, when building failed)."""
        if self.gc_timer is not None:
            self.gc_timer.close()
        for part in (self.rollout, self.rewards, self.env, self.evaluator, self.reference, self.teacher):
            if part is not None:
                part.close()

    def evaluate(self) -> dict[str, float]:
        return self.evaluator(self.step, self.out)

    def _train(self) -> list[dict]:
        with CtrlC() as ctrl_c:
            return self._steps(ctrl_c)

    def _steps(self, ctrl_c: CtrlC) -> list[dict]:
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
                # is here: health.together), then stop with its error
                checkpoints.save_before_stopping(self)
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
            self.logger.log(self.step, metrics, log_samples(self._last_batch, cfg, self.step))
            saved = cfg.train.save_every and self.step % cfg.train.save_every == 0
            if saved:
                last_saved = self.save()
            if (synced or saved) and dist.is_main() and self.reference is not None:
                prune_reference_folders(self.out, self.reference.folder)  # only what the run may still read
            if cfg.train.stop_when is not None and stop_reached(cfg, self.step, history, self.evaluator):
                break
            if dist.any_rank(ctrl_c.requested):  # Ctrl-C on any rank: every rank stops after this step, saved
                path = last_saved if last_saved is not None and self._saved_step == self.step else self.save()
                self.logger.close()
                raise Interrupted(self.step, path)
        checkpoints.finish(self, last_saved)
        return history

