"""Typed, validated configuration: one place for every knob.

Precedence (lowest to highest): dataclass defaults < the chosen algorithm's
defaults < YAML file < ``--algo NAME`` (picks the algorithm) < ``key=value``
overrides on the command line. Any unknown key, wrong type or invalid value
raises :class:`ConfigError` naming the key and the valid choices, before any
model is loaded. Every float-typed value, algorithm options included, must be finite:
nan and inf are refused where the value is read, before any range check.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message says how to fix it."""


class _NotFiniteError(ConfigError):
    """A float-typed key got nan or inf (raised by the coercion, whatever else the annotation allows)."""


# --------------------------------------------------------------------------- sections


@dataclass
class LoraConfig:
    """LoRA adapters through PEFT (``model.lora``; null = off, ``model.lora={}`` = on with these defaults).

    Only the adapters (and ``modules_to_save``) train and reach the optimizer; the base stays frozen
    (in ``model.dtype``: bf16 base, fp32 adapters). With beta > 0 and no ``ref.url`` / ``ref.model``,
    the reference is the policy with its adapters switched off: no second copy (grpo/foundation/lora.py).
    """

    r: int = 16
    alpha: float = 32.0  # the update is scaled by alpha / r
    dropout: float = 0.0
    # the linear layers that get adapters (names as in the model: Llama-style q_proj ... down_proj)
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    modules_to_save: list[str] = field(default_factory=list)  # whole modules trained and saved beside the adapters


@dataclass
class ModelConfig:
    """The policy model. ``builtin:tiny-char`` builds the tiny offline model in memory."""

    name_or_path: str = "builtin:tiny-char"
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    attn_implementation: Optional[str] = None
    freeze_bottom_layers: int = 0  # freeze embeddings + the first N decoder layers (cheaper steps on a CPU)
    lora: Optional[LoraConfig] = None  # LoRA adapters (PEFT); null = full fine-tuning


@dataclass
class DigitsTaskConfig:
    """The built-in procedurally generated task (see grpo/data/sources.py: DigitsTask)."""

    op: Literal["copy", "reverse", "add", "successor"] = "copy"
    digits: int = 2
    num_examples: int = 1000


@dataclass
class CountdownTaskConfig:
    """The seeded Countdown generator (``data.source: countdown``; see grpo/data/tasks.py)."""

    num_examples: int = 10000
    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 99  # numbers are drawn from 1..max_number
    max_target: int = 999


@dataclass
class ArithmeticTaskConfig:
    """The seeded arithmetic word-problem generator (``data.source: arithmetic``; see grpo/data/tasks.py)."""

    num_examples: int = 5000
    max_value: int = 50  # operands of + and - go up to this; of * and / up to max_value // 4 (at most 12)


@dataclass
class DataConfig:
    """Where prompts come from and how they become text.

    Sources: the built-in digits task, the Countdown and arithmetic word-problem generators, a local JSONL/Parquet file
    or a hub dataset. ``task`` presets the column mapping and prompt template of a known
    schema (gsm8k: question/answer, math: problem/solution, countdown: nums/target);
    ``columns`` and ``prompt_template`` override them.
    """

    # "env": the environment's own generated tasks (``env.name``; see envs/)
    source: Literal["builtin", "countdown", "arithmetic", "jsonl", "parquet", "hub", "env"] = "builtin"
    path: Optional[str] = None
    split: str = "train"
    hub_config: Optional[str] = None  # hub dataset configuration (gsm8k: "main")
    task: Literal["custom", "gsm8k", "math", "countdown"] = "custom"
    # Map of our column names (prompt, answer, ...) to the dataset's column names.
    columns: dict[str, str] = field(default_factory=dict)
    # Python format string over an item's columns, e.g. "{prompt}\nEnd with '#### <number>'."
    prompt_template: Optional[str] = None
    builtin: DigitsTaskConfig = field(default_factory=DigitsTaskConfig)
    countdown: CountdownTaskConfig = field(default_factory=CountdownTaskConfig)
    arithmetic: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    chat_template: bool = False  # apply the tokenizer's chat template to prompts (false: plain text)
    system_prompt: Optional[str] = None  # text, or the name of a ready one: "r1" (grpo/data/sources.py SYSTEM_PROMPTS)
    prefill: Optional[str] = None  # text the answer starts with (e.g. "<think>"), appended to every prompt
    shuffle: bool = True
    seed: int = 0  # the data's own seed: Countdown generation and the held-out split (not train.seed)
    # Held-out evaluation data: a file (same source kind and columns), a hub split, or
    # ``eval_holdout`` items held out of the training data (never trained on).
    eval_path: Optional[str] = None
    eval_split: Optional[str] = None
    eval_holdout: int = 0


@dataclass
class VllmConfig:
    """The ``vllm`` engine (``rollout.engine: vllm``; grpo/rollout/vllm_engine.py, extra ``.[vllm]``).

    Each rank holds its own vLLM engine next to its DeepSpeed engine; the trainer's weights are loaded
    into it after every optimizer step, after ``--resume`` and after a reference reset / adapter merge.
    """

    gpu_memory_utilization: float = 0.3  # CUDA: the share of the GPU vLLM may take (weights + KV cache)
    tensor_parallel_size: int = 1
    # CUDA: vLLM sleeps (weights offloaded, KV cache freed) during the training passes and wakes for the
    # next sync/generation, so both engines share the memory. Ignored on CPU.
    sleep: bool = True
    # every N weight syncs, a probe checks that vLLM serves the new weights (its log-probs of a few sampled
    # sequences against the trainer's); 0 = never. A gap above ``check_tolerance`` stops the run.
    check_every: int = 10
    # the largest allowed mean |log p_vllm - log p_trainer| over a rank's probed tokens (nats); null: 0.01 with
    # model.dtype fp32, 0.1 with bf16 / fp16 (measured gaps with the same weights: 1e-6 and 0.04, README)
    check_tolerance: Optional[float] = None
    check_rows: int = 2  # sequences per probe
    sync_bucket_mb: float = 256.0  # parameters are gathered (ZeRO-3) and loaded in buckets of at most this size
    cpu_kv_cache_gb: float = 1.0  # CPU: the KV cache's size (vLLM's VLLM_CPU_KVCACHE_SPACE)


@dataclass
class RolloutConfig:
    """Sampling: ``prompts_per_step`` prompts (over all ranks) x ``num_generations`` completions."""

    num_generations: int = 8
    prompts_per_step: int = 8
    max_prompt_length: int = 256
    max_completion_length: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # Benchmarking / profiling only: EOS does not end a completion, so every completion is exactly
    # max_completion_length tokens (as vLLM's ignore_eos). Never use it for real training.
    ignore_eos: bool = False
    # The generation engine (grpo/rollout/): a registered name ("hf": the training model itself) or
    # "package.module:Class" implementing grpo.rollout.engine.GenerationEngine.
    engine: str = "hf"
    # Multi-turn rollouts (only with ``env.name``): at most ``max_turns`` policy turns per trajectory, each
    # at most ``max_completion_length`` tokens; policy and environment tokens together at most
    # ``max_trajectory_tokens`` (the width L_max of the batch). Running out of either ends the trajectory.
    max_turns: int = 4
    max_trajectory_tokens: int = 128
    vllm: VllmConfig = field(default_factory=VllmConfig)  # settings of the ``vllm`` engine


@dataclass
class ToolSpec:
    """A tool an environment may call: a registered name or ``pkg.module:function`` (args text -> str);
    ``name`` is what the environment calls it (default: the function's name)."""

    fn: str = "calculator"
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: Optional[str] = None


@dataclass
class EnvConfig:
    """The environment of multi-turn rollouts (envs/). No ``name``: single-turn rollouts as always.

    ``name`` is a registered environment (``calculator``, ``maze``) or ``package.module:Class``;
    ``kwargs`` go to its constructor (and to its task generator with ``data.source: env``).
    ``tools`` (default: the environment's own) run in sandboxed worker processes, each call within
    ``tool_timeout`` seconds (``tool_workers: 0`` runs them in the trainer, without a timeout).
    ``stop``: strings that end a policy turn besides EOS (the turn is cut after the first one).
    """

    name: Optional[str] = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    tools: Optional[list[ToolSpec]] = None
    stop: list[str] = field(default_factory=list)
    tool_timeout: float = 5.0
    tool_workers: int = 1
    max_tool_output_chars: int = 2000  # a longer tool answer counts as an error (garbage)
    num_examples: int = 1000  # tasks generated with data.source: env


@dataclass
class AlgoConfig:
    """Shared algorithm knobs. Algorithm-specific keys (``algo.<key>``) are validated
    against the chosen algorithm's ``Options`` dataclass and stored in ``options``."""

    name: str = "grpo"
    beta: float = 0.04
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: Optional[float] = None
    aggregation: Literal[
        "seq-mean-token-mean",
        "token-mean",
        "seq-mean-token-sum-norm",
        "seq-mean-token-sum",
        "seq-sum-token-mean",
    ] = "seq-mean-token-mean"
    adv_std: Literal["unbiased", "population", "none"] = "unbiased"
    adv_eps: float = 1e-4
    adv_scope: Literal["group", "batch"] = "group"
    num_iterations: int = 1  # mu: optimizer passes per generation batch
    # Truncated importance sampling: each token's policy-gradient term times min(pi_old / pi_sampler, C),
    # pi_sampler from the generation engine's own log-probs (engines that return them, e.g. vllm).
    tis_cap: Optional[float] = None  # C; null = off
    options: Any = None  # the algorithm's own Options instance (filled by load_config)


@dataclass
class TrainConfig:
    """Optimisation and the DeepSpeed engine."""

    max_steps: int = 100
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    grad_clip: float = 1.0  # 0 = off
    zero_stage: Literal[0, 1, 2, 3] = 0
    # ZeRO-3 over > 1 rank: build the policy and the in-process reference partitioned from the start
    # (deepspeed.zero.Init; an HF folder with safetensors weights). false: whole on every rank, then partitioned
    zero3_init: bool = True
    seed: int = 0
    output_dir: str = "runs/default"
    save_every: int = 0  # 0 = only at the end
    logprob_chunk_size: int = 256  # completion tokens per LM-head chunk (one [chunk x vocab] fp32 buffer)
    max_nonfinite_steps: int = 3  # stop after this many steps in a row with a NaN/inf loss or gradient norm


@dataclass
class RefConfig:
    """The frozen reference model: in-process copy, or an HTTP server (``url``)."""

    url: Optional[str] = None
    model: Optional[str] = None  # defaults to the policy's model
    token: Optional[str] = None  # bearer token; env GRPO_REF_TOKEN also works
    connect_timeout: float = 5.0
    read_timeout: float = 120.0
    retry_window: float = 60.0  # seconds of retries before giving up
    host: str = "127.0.0.1"  # server side: bind address
    port: int = 59875
    max_batch_tokens: int = 16384  # server side: tokens per forward pass
    max_queue: int = 64  # server side: pending requests before 503
    max_request_mb: float = 64.0  # server side: body size limit (413)
    # Periodic reference sync, for every algorithm: every ``sync_every`` steps (0 = off)
    # pi_ref <- mixup_alpha * pi_theta + (1 - mixup_alpha) * pi_ref (1 = a copy of the policy).
    sync_every: int = 0
    mixup_alpha: float = 1.0


@dataclass
class LoggingConfig:
    log_every: int = 1
    samples_per_log: int = 2
    report_to: list[str] = field(default_factory=list)  # tensorboard, wandb
    progress_bar: bool = True
    plot: bool = True
    wandb_project: str = "grpo"
    health_patience: int = 5  # warn when a run looks stuck (truncation, all-equal groups, zero gradient) this many steps in a row


@dataclass
class RewardSpec:
    """One reward function: a registered name or ``pkg.module:function``; its weight; its kwargs."""

    fn: str = "digits_match"
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalConfig:
    """Held-out evaluation (grpo/training/evaluation.py): greedy accuracy, and mean@k / pass@k when k > 1.

    ``correctness`` decides a completion is right when its value >= ``threshold`` (default:
    the first entry of ``rewards``); ``format`` gives the format rate (none: not reported).
    """

    every: int = 0  # steps between evaluations during training; 0 = off
    limit: Optional[int] = None  # first N held-out items (None = all)
    k: int = 1  # samples per problem for mean@k / pass@k (1 = greedy only)
    temperature: float = 1.0  # sampling temperature of the k samples
    max_completion_length: Optional[int] = None  # None = rollout.max_completion_length
    batch_size: int = 64  # prompts per generation call
    correctness: Optional[RewardSpec] = None
    threshold: float = 1.0
    format: Optional[RewardSpec] = None


@dataclass
class RewardPoolConfig:
    """Where reward functions run: worker processes with a hard per-call timeout (rewards/pool.py)."""

    num_workers: int = 2  # 0 = in the trainer process, without a timeout (debugging only)
    timeout: float = 10.0  # seconds per call; a call past it scores 0 and is counted
    chunk_size: int = 1  # completions per call (a timeout or error zeroes the whole chunk)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    reward_pool: RewardPoolConfig = field(default_factory=RewardPoolConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)


# --------------------------------------------------------------------------- validation


def _not_finite(path: str, value: float) -> ConfigError:
    return _NotFiniteError(
        f"{path}={value!r} is invalid: it must be a finite number (nan and inf are not allowed); "
        f"set a finite value or leave {path} out to use its default"
    )


def _positive(path: str, value: float, allow_zero: bool = False) -> None:
    if not math.isfinite(value):
        raise _not_finite(path, value)
    if value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{path}={value!r} is invalid: it must be {need}")


def validate(cfg: Config) -> None:
    """Checks on values that types alone cannot express."""
    r, t, a = cfg.rollout, cfg.train, cfg.algo
    _positive("rollout.num_generations", r.num_generations)
    _positive("rollout.prompts_per_step", r.prompts_per_step)
    _positive("rollout.max_completion_length", r.max_completion_length)
    _positive("rollout.max_prompt_length", r.max_prompt_length)
    _positive("rollout.temperature", r.temperature)
    if not r.engine.strip():
        raise ConfigError("rollout.engine is empty: name an engine ('hf') or give 'package.module:Class'")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p!r} is invalid: it must be in (0, 1]")
    _positive("rollout.top_k", r.top_k, allow_zero=True)
    _validate_vllm(r.vllm)
    _positive("train.max_steps", t.max_steps)
    _positive("train.lr", t.lr, allow_zero=True)
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.grad_clip", t.grad_clip, allow_zero=True)
    _positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    _positive("train.save_every", t.save_every, allow_zero=True)
    _positive("train.logprob_chunk_size", t.logprob_chunk_size)
    _positive("train.max_nonfinite_steps", t.max_nonfinite_steps)
    _positive("algo.beta", a.beta, allow_zero=True)
    _positive("algo.clip_eps_low", a.clip_eps_low, allow_zero=True)
    _positive("algo.clip_eps_high", a.clip_eps_high, allow_zero=True)
    if a.clip_eps_low >= 1:
        raise ConfigError(f"algo.clip_eps_low={a.clip_eps_low!r} is invalid: it must be < 1")
    if a.tis_cap is not None:
        _positive("algo.tis_cap", a.tis_cap)
        if r.engine == "hf":
            raise ConfigError(
                f"algo.tis_cap={a.tis_cap!r} needs the sampler's own log-probs, and rollout.engine=hf samples with "
                f"the training model itself (there is no sampler/trainer gap to correct): use rollout.engine=vllm "
                f"or set algo.tis_cap=null"
            )
        if cfg.env.name:
            raise ConfigError(
                f"algo.tis_cap={a.tis_cap!r} is not supported with multi-turn rollouts (env.name={cfg.env.name!r}): "
                f"set algo.tis_cap=null"
            )
    if a.dual_clip is not None and a.dual_clip <= 1:
        raise ConfigError(f"algo.dual_clip={a.dual_clip!r} is invalid: it must be > 1 (or null)")
    _positive("algo.adv_eps", a.adv_eps, allow_zero=True)
    _positive("algo.num_iterations", a.num_iterations)
    _positive("logging.log_every", cfg.logging.log_every)
    _positive("logging.samples_per_log", cfg.logging.samples_per_log, allow_zero=True)
    _positive("logging.health_patience", cfg.logging.health_patience)
    for i, target in enumerate(cfg.logging.report_to):
        if target not in ("tensorboard", "wandb"):
            raise ConfigError(
                f"logging.report_to[{i}]={target!r} is invalid: choose from ['tensorboard', 'wandb']"
            )
    if not cfg.rewards:
        raise ConfigError("rewards is empty: name at least one reward function")
    _positive("model.freeze_bottom_layers", cfg.model.freeze_bottom_layers, allow_zero=True)
    _validate_lora(cfg)
    _validate_data(cfg.data)
    _validate_eval(cfg)
    _positive("reward_pool.num_workers", cfg.reward_pool.num_workers, allow_zero=True)
    _positive("reward_pool.timeout", cfg.reward_pool.timeout)
    _positive("reward_pool.chunk_size", cfg.reward_pool.chunk_size)
    if cfg.ref.url is not None and not cfg.ref.url.startswith(("http://", "https://")):
        raise ConfigError(f"ref.url={cfg.ref.url!r} is invalid: it must start with http:// or https://")
    _positive("ref.connect_timeout", cfg.ref.connect_timeout)
    _positive("ref.read_timeout", cfg.ref.read_timeout)
    _positive("ref.retry_window", cfg.ref.retry_window, allow_zero=True)
    _positive("ref.max_batch_tokens", cfg.ref.max_batch_tokens)
    _positive("ref.max_queue", cfg.ref.max_queue)
    _positive("ref.max_request_mb", cfg.ref.max_request_mb)
    if not 0 <= cfg.ref.port <= 65535:
        raise ConfigError(f"ref.port={cfg.ref.port!r} is invalid: it must be in [0, 65535] (0 = any free port)")
    _validate_ref_sync(cfg)
    _validate_env(cfg)


def _validate_vllm(v: VllmConfig) -> None:
    if not 0 < v.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.vllm.gpu_memory_utilization={v.gpu_memory_utilization!r} is invalid: "
                          "it must be in (0, 1]")
    _positive("rollout.vllm.tensor_parallel_size", v.tensor_parallel_size)
    _positive("rollout.vllm.check_every", v.check_every, allow_zero=True)
    if v.check_tolerance is not None:
        _positive("rollout.vllm.check_tolerance", v.check_tolerance)
    _positive("rollout.vllm.check_rows", v.check_rows)
    _positive("rollout.vllm.sync_bucket_mb", v.sync_bucket_mb)
    _positive("rollout.vllm.cpu_kv_cache_gb", v.cpu_kv_cache_gb)


def _validate_lora(cfg: Config) -> None:
    lora = cfg.model.lora
    if lora is None:
        return
    _positive("model.lora.r", lora.r)
    _positive("model.lora.alpha", lora.alpha)
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout={lora.dropout!r} is invalid: it must be in [0, 1)")
    if not lora.target_modules:
        raise ConfigError("model.lora.target_modules is empty: name the linear layers that get adapters "
                          "(e.g. [q_proj, k_proj, v_proj, o_proj] for Llama-style models)")
    for key in ("target_modules", "modules_to_save"):
        for i, name in enumerate(getattr(lora, key)):
            if not name.strip():
                raise ConfigError(f"model.lora.{key}[{i}]={name!r} is invalid: give a module name (e.g. q_proj)")
    if cfg.train.zero_stage == 3:
        raise ConfigError("model.lora with train.zero_stage=3 is not supported: use train.zero_stage 0, 1 or 2 "
                          "(the frozen base is not worth partitioning next to the adapters' small optimizer "
                          "state, and the free reference needs the whole base on every rank)")
    if cfg.model.dtype == "fp16":
        raise ConfigError("model.lora with model.dtype='fp16' is not supported: use bf16 (a bf16 base with fp32 "
                          "adapters) or fp32; fp16 would train without loss scaling")


def _validate_ref_sync(cfg: Config) -> None:
    r = cfg.ref
    if r.sync_every < 0:
        raise ConfigError(f"ref.sync_every={r.sync_every!r} is invalid: it must be >= 0 (0 = off)")
    if not 0 < r.mixup_alpha <= 1:
        raise ConfigError(f"ref.mixup_alpha={r.mixup_alpha!r} is invalid: it must be in (0, 1] "
                          "(1 = the reference becomes a copy of the policy)")
    if r.mixup_alpha != 1.0 and not r.sync_every:
        raise ConfigError(f"ref.mixup_alpha={r.mixup_alpha!r} has no effect without ref.sync_every > 0: "
                          "set ref.sync_every or leave ref.mixup_alpha at 1")
    if r.sync_every and cfg.algo.beta <= 0:
        raise ConfigError(f"ref.sync_every={r.sync_every} needs a reference, but algo.beta={cfg.algo.beta} "
                          "(no KL term): set algo.beta > 0 or ref.sync_every=0")


def _validate_env(cfg: Config) -> None:
    e, r = cfg.env, cfg.rollout
    _positive("rollout.max_turns", r.max_turns)
    _positive("rollout.max_trajectory_tokens", r.max_trajectory_tokens)
    if e.name is None:
        if cfg.data.source == "env":
            raise ConfigError("data.source='env' needs an environment: set env.name (e.g. calculator or maze)")
        return
    if not e.name.strip():
        raise ConfigError("env.name is empty: name an environment (calculator, maze) or give 'package.module:Class'")
    _positive("env.tool_timeout", e.tool_timeout)
    _positive("env.tool_workers", e.tool_workers, allow_zero=True)
    _positive("env.max_tool_output_chars", e.max_tool_output_chars)
    _positive("env.num_examples", e.num_examples)
    if any(not s for s in e.stop):
        raise ConfigError("env.stop holds an empty string: every stop string must be non-empty")
    if r.max_trajectory_tokens < r.max_completion_length:
        raise ConfigError(
            f"rollout.max_trajectory_tokens={r.max_trajectory_tokens} is smaller than rollout.max_completion_length="
            f"{r.max_completion_length}: the trajectory (all turns and observations) must hold at least one turn"
        )
    if cfg.eval.every:
        raise ConfigError(f"eval.every={cfg.eval.every}: held-out evaluation of multi-turn environments is not "
                          "implemented; set eval.every=0 (the training reward is the environment's)")


def _validate_data(d: DataConfig) -> None:
    if d.source in ("jsonl", "parquet") and not d.path:
        raise ConfigError(f"data.path is required when data.source={d.source!r}")
    if d.source == "hub" and not d.path:
        raise ConfigError("data.path (the hub dataset name) is required when data.source='hub'")
    _positive("data.builtin.digits", d.builtin.digits)
    _positive("data.builtin.num_examples", d.builtin.num_examples)
    c = d.countdown
    _positive("data.countdown.num_examples", c.num_examples)
    _positive("data.countdown.min_numbers", c.min_numbers)
    if c.min_numbers < 2 or c.max_numbers < c.min_numbers:
        raise ConfigError(
            f"data.countdown.min_numbers={c.min_numbers}, max_numbers={c.max_numbers} are invalid: "
            "need 2 <= min_numbers <= max_numbers"
        )
    _positive("data.countdown.max_number", c.max_number)
    _positive("data.countdown.max_target", c.max_target)
    _positive("data.arithmetic.num_examples", d.arithmetic.num_examples)
    if d.arithmetic.max_value < 4:
        raise ConfigError(f"data.arithmetic.max_value={d.arithmetic.max_value} is invalid: it must be >= 4")
    _positive("data.eval_holdout", d.eval_holdout, allow_zero=True)
    chosen = [k for k in ("eval_path", "eval_split") if getattr(d, k) is not None] + (["eval_holdout"] if d.eval_holdout else [])
    if len(chosen) > 1:
        raise ConfigError(f"data.{' and data.'.join(chosen)} are both set: choose one source of held-out data")
    if d.eval_split is not None and d.source != "hub":
        raise ConfigError(f"data.eval_split={d.eval_split!r} needs data.source='hub'; use data.eval_path for a file "
                          "or data.eval_holdout to hold items out")
    if d.eval_path is not None and d.source not in ("jsonl", "parquet"):
        raise ConfigError(f"data.eval_path={d.eval_path!r} needs data.source 'jsonl' or 'parquet'")


def _validate_eval(cfg: Config) -> None:
    e = cfg.eval
    _positive("eval.every", e.every, allow_zero=True)
    _positive("eval.k", e.k)
    _positive("eval.temperature", e.temperature)
    _positive("eval.batch_size", e.batch_size)
    if e.limit is not None:
        _positive("eval.limit", e.limit)
    if e.max_completion_length is not None:
        _positive("eval.max_completion_length", e.max_completion_length)
    d = cfg.data
    if e.every and d.eval_path is None and d.eval_split is None and not d.eval_holdout:
        raise ConfigError(f"eval.every={e.every} needs held-out data: set data.eval_path, data.eval_split "
                          "or data.eval_holdout")


# --------------------------------------------------------------------------- typed loading


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + repr(list(get_args(tp)))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert it (str->float/int/bool)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        for c in choices:
            if value == c and type(value) is type(c):
                return c
            if isinstance(value, str) and str(c) == value:
                return c
        raise ConfigError(f"{path}={value!r} is invalid: choose from {list(choices)}")
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(path, value, a)
            except _NotFiniteError:
                raise  # the type fits; the value does not
            except ConfigError as e:
                errors.append(str(e))
        real = [a for a in args if a is not type(None)]
        if len(real) == 1 and dataclasses.is_dataclass(real[0]):  # e.g. Optional[LoraConfig]: its own message
            raise ConfigError(errors[0])
        raise ConfigError(f"{path}={value!r} has the wrong type: expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping of keys ({_field_names(tp)}), got {value!r}")
        return build_dataclass(tp, value, path)
    if origin is list:
        (item_tp,) = get_args(tp) or (Any,)
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            if isinstance(value, str) and value.startswith("["):
                value = yaml.safe_load(value)
            else:
                raise ConfigError(f"{path}={value!r} has the wrong type: expected a list")
        return [_coerce(f"{path}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        kt, vt = get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} has the wrong type: expected a mapping")
        return {_coerce(path, k, kt): _coerce(f"{path}.{k}", v, vt) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{path}={value!r} has the wrong type: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}={value!r} has the wrong type: expected an integer")
    if tp is float:
        number = _to_float(path, value)
        if not math.isfinite(number):  # every float in the config, algorithm options included
            raise _not_finite(path, number)
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}={value!r} has the wrong type: expected a string")
    raise ConfigError(f"{path}: unsupported type {tp!r}")


def _to_float(path: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int too large for a float
            return math.inf
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{path}={value!r} has the wrong type: expected a number")


def _field_names(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if f.name != "options")


def _unknown_key(path: str, key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    where = f"{path}.{key}" if path else key
    return ConfigError(f"unknown config key {where!r}.{hint} Valid keys: {sorted(valid)}")


def build_dataclass(cls: type, values: dict, path: str = "") -> Any:
    """Build ``cls`` from a (partial) mapping, validating every key and type."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise _unknown_key(path, str(key), names)
        kwargs[key] = _coerce(f"{path}.{key}" if path else key, value, hints[key])
    return cls(**kwargs)


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("columns", "kwargs"):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> dict:
    """``["train.lr=1e-5", "rollout.num_generations=4"]`` -> nested dict (values parsed as YAML)."""
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=1e-5)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        value = yaml.safe_load(raw) if raw.strip() else ""
        _set_dotted(tree, key, value)
    return tree


def _to_tree(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_tree(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_tree(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_tree(v) for k, v in obj.items()}
    return obj


def to_dict(cfg: Config) -> dict:
    """The resolved config as plain data (algorithm options flattened into ``algo``)."""
    tree = _to_tree(cfg)
    options = tree["algo"].pop("options") or {}
    tree["algo"].update(options)
    return tree


def read_user_tree(
    path: Optional[str | Path] = None,
    algo: Optional[str] = None,
    overrides: Optional[list[str]] = None,
) -> tuple[dict, str]:
    """The user's settings as a tree (YAML < --algo < key=value overrides) and the algorithm's name."""
    file_tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            file_tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(file_tree, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at top level")
    cli_tree = parse_overrides(overrides or [])

    user_tree = _deep_merge(file_tree, cli_tree)
    if algo is not None:
        # --algo beats the YAML's algo.name; only an explicit algo.name=... override beats --algo.
        cli_name = cli_tree.get("algo", {}).get("name") if isinstance(cli_tree.get("algo"), dict) else None
        user_tree = _deep_merge(user_tree, {"algo": {"name": cli_name or algo}})
    for key in user_tree:
        if key not in [f.name for f in dataclasses.fields(Config)]:
            raise _unknown_key("", key, [f.name for f in dataclasses.fields(Config)])
    algo_tree = user_tree.get("algo", {}) or {}
    if not isinstance(algo_tree, dict):
        raise ConfigError(f"algo must be a mapping, got {algo_tree!r}")
    return user_tree, str(algo_tree.get("name", AlgoConfig.name))


def build_config(user_tree: dict, algorithm: Any) -> Config:
    """The validated config: defaults < the algorithm's defaults < the user's tree. ``algorithm`` is the
    chosen algorithm's class (its ``Options`` dataclass, ``defaults`` and ``validate``); the registry
    that finds it by name is in algos/ (grpo/training/configure.py puts the two together)."""
    algo_tree = user_tree.get("algo", {}) or {}
    name = str(algo_tree.get("name", AlgoConfig.name))
    common = {f.name for f in dataclasses.fields(AlgoConfig)} - {"options"}
    option_names = [f.name for f in dataclasses.fields(algorithm.Options)]
    common_user = {k: v for k, v in algo_tree.items() if k in common}
    option_user = {}
    for k, v in algo_tree.items():
        if k in common:
            continue
        if k not in option_names:
            raise _unknown_key("algo", k, sorted(common) + option_names)
        option_user[k] = v

    tree = _deep_merge(user_tree, {"algo": _deep_merge(dict(algorithm.defaults), common_user)})
    tree["algo"] = {k: v for k, v in tree["algo"].items() if k in common}  # options go to cfg.algo.options
    tree["algo"]["name"] = name
    cfg = build_dataclass(Config, tree)
    cfg.algo.options = build_dataclass(algorithm.Options, option_user, "algo")
    validate(cfg)
    if getattr(algorithm, "group_relative", False) and cfg.rollout.num_generations < 2:
        raise ConfigError(
            f"rollout.num_generations={cfg.rollout.num_generations} cannot learn with {name}: its advantages "
            f"compare the completions of one prompt, so with fewer than 2 every advantage is 0. Set "
            f"rollout.num_generations >= 2 (papers use 8 to 64)"
        )
    if cfg.algo.tis_cap is not None and not getattr(algorithm, "token_level_pg", True):
        raise ConfigError(
            f"algo.tis_cap={cfg.algo.tis_cap!r} weights each token's policy-gradient term, and {name} has a "
            f"sequence-level loss: set algo.tis_cap=null, or pick a token-level algorithm"
        )
    algorithm.validate(cfg)
    return cfg


def dump_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
