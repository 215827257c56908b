"""Typed, validated configuration: one place for every knob. This module is the schema: every section's
dataclass, each key with its help (the comment beside or above it) and its range on its field (``ranged``,
``positive``, ``at_least_zero``). The rules between keys are grpo/foundation/config_rules.py (``validate``); the
assembly from YAML and overrides, grpo/foundation/config_assembly.py (``read_user_tree``, ``build_config``).

Precedence (lowest to highest): dataclass defaults < the chosen algorithm's
defaults < YAML file < ``--algo NAME`` (picks the algorithm) < ``key=value``
overrides on the command line. Any unknown key, wrong type or invalid value
raises :class:`ConfigError` naming the key and the valid choices, before any
model is loaded. Every float-typed value, algorithm options included, must be finite:
nan and inf are refused where the value is read, before any range check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


from grpo.foundation import loader

ConfigError = loader.ConfigError  # the configuration's error (grpo.foundation.loader's), imported from here too

# A key's range is declared on its field, beside its type and default: ``validate`` checks it (``check_ranges``,
# a key set to null skips it, a list is checked item by item) and scripts/gen_config_docs.py prints it in
# docs/config-reference.md. The ranges a field may declare, each with the test its value must pass:
RANGES: dict[str, Any] = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    "> 1": lambda v: v > 1,
    "<= 0": lambda v: v <= 0,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 64]": lambda v: 0 <= v <= 64,
    "in [1, 64]": lambda v: 1 <= v <= 64,
    "in [0, 65535]": lambda v: 0 <= v <= 65535,
    "in [1, 10000000]": lambda v: 1 <= v <= 10_000_000,
}
GENERATED = "generated tasks are made and tokenized whole at start"  # the hint of a generator's num_examples
MAX_TOP_K = 64  # top-k log-probs per position that a reference or a teacher sends at most (the wire's bound too)


def ranged(default: Any, within: str, hint: str = "", factory: Any = None) -> Any:
    """A field whose value must lie ``within`` one of RANGES; ``hint`` closes the error message (the paper's or a
    peer's value, what 0 means); ``factory`` instead of ``default`` for a list."""
    if within not in RANGES:
        raise ValueError(f"range {within!r} is not one of {list(RANGES)}")
    meta = {"range": within, **({"hint": hint} if hint else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def positive(default: Any, hint: str = "") -> Any:
    """A field whose value must be > 0."""
    return ranged(default, "> 0", hint)


def at_least_zero(default: Any, hint: str = "") -> Any:
    """A field whose value must be >= 0."""
    return ranged(default, ">= 0", hint)


# --------------------------------------------------------------------------- sections


@dataclass
class LoraConfig:
    """LoRA adapters through PEFT (``model.lora``; null = off, ``model.lora={}`` = on with these defaults).

    Only the adapters (and ``modules_to_save``) train and reach the optimizer; the base stays frozen
    (in ``model.dtype``: bf16 base, fp32 adapters). With beta > 0 and no ``ref.url`` / ``ref.model``,
    the reference is the policy with its adapters switched off: no second copy (grpo/foundation/lora.py).
    """

    r: int = positive(16)  # the adapters' rank
    alpha: float = positive(32.0)  # the update is scaled by alpha / r
    dropout: float = ranged(0.0, "in [0, 1)")  # dropout on the adapters' input (PEFT's lora_dropout)
    # the linear layers that get adapters (names as in the model: Llama-style q_proj ... down_proj)
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    modules_to_save: list[str] = field(default_factory=list)  # whole modules trained and saved beside the adapters


@dataclass
class ModelConfig:
    """The policy model. ``builtin:tiny-char`` builds the tiny offline model in memory."""

    name_or_path: str = "builtin:tiny-char"  # HF folder, hub name, or builtin:tiny-char / tiny-arith / tiny-char-h64
    # the weights' precision; DeepSpeed's mode follows it (bf16 / fp16 keep fp32 master weights). auto: bf16
    # where torch sees CUDA, fp32 elsewhere, resolved when the config loads (--print-config shows the result)
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # recompute activations in the backward pass (HF's gradient_checkpointing_enable): less memory, ~30% more compute
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False  # let transformers run the model folder's own code
    attn_implementation: Optional[str] = None  # transformers' attn_implementation (sdpa, eager, ...); null: its default (eager where attention is soft-capped: Gemma 2)
    freeze_bottom_layers: int = at_least_zero(0)  # freeze embeddings + the first N decoder layers (cheaper steps on a CPU)
    lora: Optional[LoraConfig] = None  # LoRA adapters (PEFT); null = full fine-tuning


@dataclass
class DigitsTaskConfig:
    """The built-in procedurally generated task (see grpo/data/sources.py: DigitsTask)."""

    # the answer: the number copied (47=), reversed (47<), plus one (47>), or two numbers added (47+12=)
    op: Literal["copy", "reverse", "add", "successor"] = "copy"
    digits: int = ranged(2, "in [1, 64]")  # digits per number
    num_examples: int = ranged(1000, "in [1, 10000000]", GENERATED)  # prompts generated


@dataclass
class CountdownTaskConfig:
    """The seeded Countdown generator (``data.source: countdown``; see grpo/data/tasks.py)."""

    num_examples: int = ranged(10000, "in [1, 10000000]", GENERATED)  # problems generated (seeded by data.seed)
    min_numbers: int = positive(3)  # fewest numbers given per problem
    max_numbers: int = ranged(4, "in [1, 64]")  # most numbers given per problem
    max_number: int = positive(99)  # numbers are drawn from 1..max_number
    max_target: int = positive(999)  # largest target


@dataclass
class ArithmeticTaskConfig:
    """The seeded arithmetic word-problem generator (``data.source: arithmetic``; see grpo/data/tasks.py)."""

    num_examples: int = ranged(5000, "in [1, 10000000]", GENERATED)  # problems generated (seeded by data.seed)
    max_value: int = 50  # operands of + and - go up to this; of * and / up to max_value // 4 (at most 12)


@dataclass
class CodeTaskConfig:
    """The built-in code task (``data.source: code``; grpo/data/code_task.py): write a named function, scored by
    the ``code_tests`` reward on generated assert tests."""

    num_examples: int = ranged(2000, "in [1, 10000000]", GENERATED)  # problems generated (seeded by data.seed)
    num_tests: int = ranged(4, "in [1, 64]")  # assert tests per problem
    families: list[str] = field(default_factory=lambda: ["add_k", "mul_k", "clamp", "count_c", "sum_list", "max_list",
                                                         "reverse", "is_mult_k"])  # kinds of function asked for


@dataclass
class DataConfig:
    """Where prompts come from and how they become text.

    Sources: the built-in digits task, the Countdown and arithmetic word-problem generators, a local JSONL/Parquet file
    or a hub dataset. ``task`` presets the column mapping and prompt template of a known
    schema (gsm8k: question/answer, math: problem/solution, countdown: nums/target);
    ``columns`` and ``prompt_template`` override them.
    """

    # "env": the environment's own generated tasks (``env.name``; see envs/)
    # "code": the built-in code task (data.code), scored by the code_tests reward
    # (left out with a data.path: read from the file's extension, .jsonl/.json -> jsonl, .parquet, .csv)
    source: Literal["builtin", "countdown", "arithmetic", "code", "jsonl", "parquet", "csv", "hub", "env"] = "builtin"
    path: Optional[str] = None  # file (jsonl, parquet, csv) or hub dataset name
    split: str = "train"  # hub split trained on
    hub_config: Optional[str] = None  # hub dataset configuration (gsm8k: "main")
    # column preset and prompt template of a known schema (custom: the column "prompt", no template)
    # mbpp: text/test_list (+ code_tests), humaneval: prompt/test/entry_point (+ code_tests)
    task: Literal["custom", "gsm8k", "math", "countdown", "mbpp", "humaneval"] = "custom"
    # Map of our column names (prompt, answer, ...) to the dataset's column names.
    columns: dict[str, str] = field(default_factory=dict)
    # Python format string over an item's columns, e.g. "{prompt}\nEnd with '#### <number>'."
    prompt_template: Optional[str] = None
    builtin: DigitsTaskConfig = field(default_factory=DigitsTaskConfig)
    countdown: CountdownTaskConfig = field(default_factory=CountdownTaskConfig)
    arithmetic: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    code: CodeTaskConfig = field(default_factory=CodeTaskConfig)
    # prompts through a chat template: true (the tokenizer's own), a Jinja template string, or the path of a file
    # holding one (it replaces the tokenizer's, in checkpoints too); false: plain text
    chat_template: Union[bool, str] = False
    # variables the chat template is rendered with besides the messages (TRL's chat_template_kwargs), e.g.
    # {enable_thinking: false} for Qwen3's; each must be one the template reads (checked when the prompts are built)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    system_prompt: Optional[str] = None  # text, or the name of a ready one: "r1" (grpo/data/sources.py SYSTEM_PROMPTS)
    prefill: Optional[str] = None  # text the answer starts with (e.g. "<think>"), appended to every prompt
    shuffle: bool = True  # sample prompts in a seeded random order (false: file order)
    seed: int = 0  # the data's own seed: Countdown generation and the held-out split (not train.seed)
    # Held-out evaluation data: a file (same source kind and columns), a hub split, or
    # ``eval_holdout`` items held out of the training data (never trained on).
    eval_path: Optional[str] = None
    eval_split: Optional[str] = None  # hub split held out for evaluation (e.g. test)
    eval_holdout: int = at_least_zero(0)  # hold this many items out of the training data


@dataclass
class VllmConfig:
    """The ``vllm`` engine (``rollout.engine: vllm``; grpo/rollout/vllm_engine.py, extra ``.[vllm]``).

    Each rank holds its own vLLM engine next to its DeepSpeed engine; the trainer's weights are loaded
    into it after every optimizer step, after ``--resume`` and after a reference reset / adapter merge.
    """

    gpu_memory_utilization: float = ranged(0.3, "in (0, 1]")  # CUDA: the share of the GPU vLLM may take (weights + KV cache)
    tensor_parallel_size: int = positive(1)  # ranks per vLLM engine (must divide the rank count)
    # CUDA: vLLM sleeps (weights offloaded, KV cache freed) during the training passes and wakes for the
    # next sync/generation, so both engines share the memory. Ignored on CPU.
    sleep: bool = True
    # every N weight syncs, a probe checks that vLLM serves the new weights (its log-probs of a few sampled
    # sequences against the trainer's); 0 = never. A gap above ``check_tolerance`` stops the run.
    check_every: int = at_least_zero(10)
    # the largest allowed mean |log p_vllm - log p_trainer| over a rank's probed tokens (nats); null: 0.01 with
    # model.dtype fp32, 0.1 with bf16 / fp16 (measured gaps with the same weights: 1e-6 and 0.04, README)
    check_tolerance: Optional[float] = positive(None)
    check_rows: int = positive(2)  # sequences per probe
    sync_bucket_mb: float = positive(256.0)  # parameters are gathered (ZeRO-3) and loaded in buckets of at most this size
    cpu_kv_cache_gb: float = positive(1.0)  # CPU: the KV cache's size (vLLM's VLLM_CPU_KVCACHE_SPACE)


# rollout.static.mode: how the static engine runs its decode step (grpo/rollout/static/)
STATIC_MODES = ("auto", "eager", "compile", "graphs", "compile+graphs")
# the checks of a run that looks stuck (grpo/training/health.py), by the name logging.health_skip gives them
HEALTH_CHECKS = ("reward_errors", "truncation", "zero_advantage", "sampler_mismatch", "zero_gradient")


@dataclass
class StaticConfig:
    """The ``static`` engine (``rollout.engine: static``, or ``auto`` on CUDA; grpo/rollout/static/)."""

    # auto: graphs on CUDA, eager elsewhere; eager: neither (debugging); compile: torch.compile of the
    # decode step; graphs: a CUDA graph per (rows bucket, length bucket) without compile; compile+graphs: both
    mode: str = "auto"
    # decode steps between the host's reads of which rows finished (early exit, compaction into a smaller
    # rows bucket); each read is a non-blocking copy waited for one step later
    check_every: int = positive(16)
    # decode steps read the keys up to the next multiple of this many columns (one compile and one graph per
    # length bucket); 0: always the whole buffer (fewer compiles, more memory read per step)
    length_bucket: int = at_least_zero(64)
    # compile modes: shapes (rows and length buckets) made symbolic once they change (torch.compile's automatic
    # dynamic shapes): 2-3 compiles a run instead of one per (rows, length) bucket; false: one per bucket
    compile_dynamic: bool = False
    # before the training passes: free the KV buffers and the CUDA graphs (their memory goes to training; the
    # graphs are captured again at the next generation), or keep them (no recapture, the memory stays held)
    offload: bool = True
    # after the offload: hand the freed memory back to the device (torch.cuda.empty_cache: a reference server or
    # vLLM on the same GPU can take it), or leave it in PyTorch's cache, where the training passes reuse it without
    # asking the device again (memory/train_device_allocs shows the difference)
    empty_cache: bool = True


@dataclass
class RolloutConfig:
    """Sampling: ``prompts_per_step`` prompts (over all ranks) x ``num_generations`` completions."""

    num_generations: int = positive(8)  # G: completions per prompt (the group)
    prompts_per_step: int = positive(8)  # prompts per optimizer step over all ranks
    max_prompt_length: int = positive(256)  # longer prompts are dropped and counted
    max_completion_length: int = positive(256)  # L_max: new tokens per completion (per turn with env.name); TRL's default
    temperature: float = positive(1.0)  # sampling temperature (log-probs use it too)
    top_p: float = ranged(1.0, "in (0, 1]")  # nucleus sampling; 1 = off
    top_k: int = at_least_zero(0)  # 0 = off
    # Benchmarking / profiling only: EOS does not end a completion, so every completion is exactly
    # max_completion_length tokens (as vLLM's ignore_eos). Never use it for real training.
    ignore_eos: bool = False
    # Benchmarking only: completion i of each generation call ends with an EOS forced after
    # forced_eos_lengths[i % len] tokens (unless it ended before), so that a model with random weights finishes
    # its rows at real, recorded lengths (scripts/benchmarks/bench.py --eos-lengths). Engines hf and static.
    forced_eos_lengths: Optional[list[int]] = ranged(None, "> 0")
    # The generation engine (grpo/rollout/): "auto" (static on CUDA for the models it supports, hf otherwise;
    # the choice and its reason are logged), "hf" (the training model through transformers), "static" (static
    # KV buffers, a functional decode step, compiled and CUDA-graphed on CUDA), "vllm", or
    # "package.module:Class" implementing grpo.rollout.engine.GenerationEngine.
    engine: str = "auto"
    # Continuous batching (rollout.engine: static or hf): the rows decoded at once; a finished row's slot is refilled
    # from the rows still waiting when the host next reads which rows finished (rollout.static.check_every: fewer
    # steps, fewer idle slot-steps), its prompt's KV copied in while the others decode on; the KV buffers hold this
    # many rows, not every row of a call. The static engine rounds it up to its row bucket (a power of two up to 64,
    # then a multiple of 64); the hf engine reads every step on a CPU, every 8 on an accelerator, and joins the
    # waiting rows' prefilled KV to its batch. 0: one slot per row of the call (every row starts at once).
    slots: int = at_least_zero(0)
    # Streaming rollouts (docs/streaming.md; every built-in engine): K >= 1 ends a step as soon as it has its
    # prompts_per_step whole groups, the other rows carrying on under the next weights, no token trained on more
    # than K optimizer steps after the weights that drew it. Needs algo.rollout_correction or algo.tis_cap (the
    # sampler is then up to K steps behind the trainer). 0: every step's groups drawn and finished within the step.
    max_staleness: int = at_least_zero(0)
    # Streaming rollouts: the KV of a row carried to the next step. "prefill": fed again as prompt under the new
    # weights (one compute-bound pass). "keep" (rollout.engine: hf): its cache kept from the call that cut it, through
    # the training passes, and only its last token fed: no prefill, but the row's attention then reads keys and values
    # of the weights before the update (docs/streaming.md measures both).
    carried_kv: Literal["prefill", "keep"] = "prefill"
    # Multi-turn rollouts (only with ``env.name``): at most ``max_turns`` policy turns per trajectory, each
    # at most ``max_completion_length`` tokens; policy and environment tokens together at most
    # ``max_trajectory_tokens`` (the width L_max of the batch). Running out of either ends the trajectory.
    max_turns: int = positive(4)
    max_trajectory_tokens: int = positive(1024)  # multi-turn: policy + environment tokens (>= max_completion_length)
    vllm: VllmConfig = field(default_factory=VllmConfig)  # settings of the ``vllm`` engine
    static: StaticConfig = field(default_factory=StaticConfig)  # settings of the ``static`` engine


@dataclass
class WorkerLimits:
    """Resource limits of a reward or tool worker process (grpo/workers/worker_pool.py): generous, against runaways only.

    Past ``memory_mb`` an allocation fails (MemoryError: the call is an error and the worker is replaced); past
    ``cpu_seconds`` of CPU in one call the kernel kills the worker (counted, replaced); past ``file_size_mb`` a
    write fails. 0 = no limit."""

    memory_mb: int = at_least_zero(8192)  # RLIMIT_AS of the worker (address space); math-verify peaks far below
    cpu_seconds: int = at_least_zero(300)  # CPU seconds one call may use (RLIMIT_CPU, re-armed before every call)
    file_size_mb: int = at_least_zero(1024)  # RLIMIT_FSIZE: the largest file a call may write


@dataclass
class ToolSpec:
    """A tool an environment may call: a registered name or ``pkg.module:function`` (args text -> str);
    ``name`` is what the environment calls it (default: the function's name)."""

    fn: str = "calculator"  # registered name or pkg.module:function
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the tool
    name: Optional[str] = None  # name the environment calls it by


@dataclass
class EnvConfig:
    """The environment of multi-turn rollouts (envs/). No ``name``: single-turn rollouts as always.

    ``name`` is a registered environment (``calculator``, ``maze``) or ``package.module:Class``;
    ``kwargs`` go to its constructor (and to its task generator with ``data.source: env``).
    ``tools`` (default: the environment's own) run in sandboxed worker processes, each call within
    ``tool_timeout`` seconds (``tool_workers: 0`` runs them in the trainer, without a timeout).
    ``stop``: strings that end a policy turn besides EOS (the turn is cut after the first one).
    """

    name: Optional[str] = None  # calculator, maze or pkg.module:Class; null: single-turn
    kwargs: dict[str, Any] = field(default_factory=dict)  # to the environment and its task generator
    tools: Optional[list[ToolSpec]] = None  # null: the environment's own tools
    stop: list[str] = field(default_factory=list)  # strings that end a policy turn besides EOS
    tool_timeout: float = positive(5.0)  # seconds per tool call
    # tool worker processes, and how many of a turn's environments step at once (threads; 0: tools in the
    # trainer, no timeout, one environment at a time)
    tool_workers: int = at_least_zero(1)
    max_tool_output_chars: int = positive(2000)  # a longer tool answer counts as an error (garbage)
    tool_limits: WorkerLimits = field(default_factory=WorkerLimits)  # memory / CPU / file-size limits of each tool worker
    num_examples: int = ranged(1000, "in [1, 10000000]", GENERATED)  # tasks generated with data.source: env
    watchdog_s: float = at_least_zero(60.0)  # a reset/step/reward_terms call running this long is named in the log (0 = off)


@dataclass
class RolloutCorrectionConfig:
    """Rollout correction (``algo.rollout_correction``; docs/algorithms.md, "Sampler and trainer"): each token's
    policy-gradient term times a weight from the ratio pi_old / pi_sampler of the engine's own log-probs, at the
    token, the sequence (the product over its tokens) or the geometric-mean level (exp of the mean log-ratio).
    truncate: the ratio clamped into [low, high]; mask: the ratio kept inside [low, high] and 0 outside (TRL's
    *_mask, IcePop at the token level with low = 1/beta, high = beta). ``algo.tis_cap: C`` is {level: token, mode:
    truncate, high: C}."""

    level: Literal["token", "sequence", "geometric"] = "token"  # where the ratio is taken (TRL's token_* / sequence_*)
    mode: Literal["truncate", "mask"] = "truncate"  # clamp the ratio, or zero the weight outside [low, high]
    high: float = positive(2.0)  # C_max (TRL's vllm_importance_sampling_clip_max, 3 there)
    low: Optional[float] = positive(None)  # C_min; null: no lower bound (TRL's default)


@dataclass
class AlgoConfig:
    """Shared algorithm knobs. Algorithm-specific keys (``algo.<key>``) are validated
    against the chosen algorithm's ``Options`` dataclass and stored in ``options``."""

    name: str = "grpo"  # the algorithm (--algo NAME; python train.py --list-algos)
    beta: float = at_least_zero(0.04)  # KL coefficient; 0: no reference model at all
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k1 = -d, k2 = d^2/2, k3 = e^d - d - 1 (d = ref - policy)
    clip_eps_low: float = ranged(0.2, "in [0, 1)")  # ratio clipped below at 1 - eps_low
    clip_eps_high: float = at_least_zero(0.2)  # ratio clipped above at 1 + eps_high
    dual_clip: Optional[float] = ranged(None, "> 1", "or null")  # c > 1: A < 0 tokens' loss bounded by c*A; null = off
    aggregation: Literal[
        "seq-mean-token-mean",
        "token-mean",
        "seq-mean-token-sum-norm",
        "seq-mean-token-sum",
        "seq-sum-token-mean",
    ] = "seq-mean-token-mean"  # how token losses become the step's loss (docs/algorithms.md)
    # the std the group advantage is divided by (none: A = r - mean)
    adv_std: Literal["unbiased", "population", "none"] = "unbiased"
    adv_eps: float = at_least_zero(1e-4)  # added to the std
    adv_scope: Literal["group", "batch"] = "group"  # batch: the std over the whole step, the mean per group
    num_iterations: int = positive(1)  # mu: optimizer passes per generation batch
    # Truncated importance sampling: each token's policy-gradient term times min(pi_old / pi_sampler, C),
    # pi_sampler from the generation engine's own log-probs (every built-in engine: hf, static, vllm).
    tis_cap: Optional[float] = positive(None)  # C; null = off
    # The general form (level token / sequence / geometric, mode truncate / mask, its bounds; null = off): its
    # weights come from a whole-batch old-policy pass, logged with the sampler/trainer mismatch (rollout_corr/*)
    rollout_correction: Optional[RolloutCorrectionConfig] = None
    # KL in the reward (verl's use_kl_in_reward, OpenRLHF's default): each token's reward gets
    # -kl_in_reward * k1 = -coef (l_old - l_ref) before the advantages (the outcome score r_i becomes
    # r_i - coef sum_t k1); 0 = off. Only for algorithms whose advantages come from the outcome score.
    kl_in_reward: float = at_least_zero(0.0)
    # Options of TRL's GRPOTrainer that apply to many losses (docs/algorithms.md, "Options for any loss"):
    delta: Optional[float] = None  # two-sided clip (INTELLECT-2): the unclipped branch's ratio capped at delta (> 1 + eps_high)
    off_policy_mask_threshold: Optional[float] = at_least_zero(None)  # DeepSeek-V3.2: drop sequences with A < 0 and mean KL > this
    top_entropy_quantile: float = ranged(1.0, "in [0, 1]", "1 = every token; the paper uses 0.2")  # "Beyond the 80/20 rule": policy gradient on the top share of tokens by entropy
    use_bias_correction_kl: bool = False  # the KL term per token times the ratio pi / pi_old
    mask_truncated_completions: bool = False  # truncated completions (no EOS) leave the loss and its normalisers
    # Entropy bonus: - alpha * H in the loss, H the current policy's entropy per token (with its gradient),
    # aggregated as the loss (algo.aggregation). Fixed alpha = entropy_coef; with entropy_target, Skywork-OR1's
    # adaptive coefficient: alpha_k = c_k [e_k < target], c_{k+1} = clip(c_k +- entropy_coef_delta) to
    # [entropy_coef_min, entropy_coef_max], c_0 = entropy_coef, e_k the step's mean entropy before its update.
    entropy_coef: float = at_least_zero(0.0)  # 0 and no target: off
    entropy_target: Optional[float] = positive(None)  # null: the coefficient is fixed
    entropy_coef_delta: float = positive(1e-4)  # adaptive only (Skywork-OR1's scripts: 1e-4)
    entropy_coef_min: float = at_least_zero(0.0)  # adaptive only
    entropy_coef_max: float = positive(5e-3)  # adaptive only (Skywork-OR1's scripts: 0.005)
    options: Any = None  # the algorithm's own Options instance (filled by load_config)


@dataclass
class StopWhen:
    """``train.stop_when``: end the run before ``train.max_steps`` once the mean of ``metric`` over the last
    ``window`` steps is at least ``at_least`` (a target reward, say); the run then ends as at ``max_steps``
    (final checkpoint, export, plot). Null (the default): always run to ``max_steps``."""

    metric: str = "reward/mean"  # a per-step metric (metrics.jsonl's names: docs/metrics.md)
    at_least: Optional[float] = None  # required: the target of the window's mean
    window: int = positive(5)  # steps averaged (the check starts once this many have run)
    min_steps: int = at_least_zero(0)  # never stop before this step (e.g. to compare a first window with a later one)


@dataclass
class TrainConfig:
    """Optimisation and the DeepSpeed engine."""

    max_steps: int = positive(100)  # optimizer steps
    lr: float = at_least_zero(1e-5)  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = at_least_zero(0)  # linear warm-up from 0 to lr
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after the warm-up
    micro_batch_size: int = positive(8)  # sequences per forward/backward on one rank
    # > 0: a micro-batch also ends before its padded tokens (rows x its longest prompt + completion) pass this
    # budget (at least one row each); under several ranks every rank runs as many passes as the busiest one
    micro_batch_tokens: int = at_least_zero(0)
    grad_clip: float = at_least_zero(1.0)  # 0 = off
    zero_stage: Literal[0, 1, 2, 3] = 0  # DeepSpeed ZeRO stage (3: weights partitioned)
    # ZeRO-3 over > 1 rank: build the policy and the in-process reference partitioned from the start
    # (deepspeed.zero.Init; an HF folder with safetensors weights). false: whole on every rank, then partitioned
    zero3_init: bool = True
    seed: int = 0  # torch's seed (plus the rank) and the prompt order
    output_dir: str = "runs/default"  # metrics, samples, checkpoints, config.yaml
    save_every: int = at_least_zero(100)  # a checkpoint every N steps (--resume continues from the latest); 0 = only at the end
    # keep only the newest N checkpoints/step-N folders (older ones are deleted; never the one `latest` names); 0 = all
    keep_checkpoints: int = at_least_zero(0)
    # at the end write OUT/final/: the model + tokenizer only, a plain HF folder for from_pretrained / vLLM (LoRA: merged)
    export_final: bool = True
    # completion tokens per LM-head chunk (one [chunk x vocab] fp32 buffer); 0 = by device: 256 on a CPU, 512 on a GPU
    logprob_chunk_size: int = at_least_zero(0)
    # the policy's passes (old log-probs and training): rows sharing a prompt (a group) run it once, the completions
    # on its keys and values (the same numbers, a G-th of the prompt's work); false: one forward over every
    # prompt + completion row, as TRL's (an A/B of the two paths' kernels on a GPU; the reference keeps the first)
    share_prompt: bool = True
    # Adam's state and the master weights of a bf16 model: fp32 (DeepSpeed's bf16 mode: fp32 master weights,
    # fp32 moments and gradients, about 16-20 bytes a parameter) or bf16 (pure bf16 as TRL's bf16 runs:
    # the moments in the weights' bf16, about 8 bytes a parameter; needs model.dtype bf16 and no LoRA)
    optimizer_states: Literal["fp32", "bf16"] = "fp32"
    max_nonfinite_steps: int = positive(3)  # stop after this many steps in a row with a NaN/inf loss or gradient norm
    # end early once the mean of a metric over the last steps reaches a target: {metric, at_least, window, min_steps}
    stop_when: Optional[StopWhen] = None


@dataclass
class RefConfig:
    """The frozen reference model: in-process copy, or an HTTP server (``url``)."""

    url: Optional[str] = None  # reference server (ref_client.py); null: in-process (with LoRA: the base)
    model: Optional[str] = None  # defaults to the policy's model
    token: Optional[str] = None  # bearer token; env GRPO_REF_TOKEN also works
    connect_timeout: float = positive(5.0)  # seconds, per attempt
    read_timeout: float = positive(120.0)  # seconds to wait for one answer
    retry_window: float = at_least_zero(60.0)  # seconds of retries before giving up
    # raise it when the server starts at the same time as the trainer (docs/troubleshooting.md)
    startup_wait: float = at_least_zero(5.0)  # seconds a refused connection at start is retried, then the run stops
    # Streamed rollouts (rollout.max_staleness >= 1): ask the server for each group as soon as it is whole, while the
    # other rows decode. With the server on a device of its own the wait for its answers falls; sharing the trainer's
    # CPU cores it slows the decode (docs/results.md): false asks for the step's groups after the engine call.
    ask_groups: bool = True
    host: str = "127.0.0.1"  # server side: bind address
    port: int = ranged(59875, "in [0, 65535]", "0 = any free port")  # server side: port (0 = any free one)
    max_batch_tokens: int = positive(16384)  # server side: tokens per forward pass
    max_queue: int = positive(64)  # server side: pending requests before 503
    max_request_mb: float = positive(64.0)  # server side: body size limit (413)
    # Periodic reference sync, for every algorithm: every ``sync_every`` steps (0 = off)
    # pi_ref <- mixup_alpha * pi_theta + (1 - mixup_alpha) * pi_ref (1 = a copy of the policy).
    sync_every: int = at_least_zero(0, "0 = off")
    mixup_alpha: float = ranged(1.0, "in (0, 1]", "1 = the reference becomes a copy of the policy")  # alpha (1 = copy)


@dataclass
class TeacherConfig:
    """On-policy distillation (docs/distillation.md): a teacher's per-token log-probs of the student's own samples.
    Off unless ``model`` or ``url`` names the teacher; its tokenizer must be the policy's (checked at start).

    Every token's advantage becomes A_t - coef * (log pi_student - log pi_teacher)_t (the reverse KL on the sampled
    token as a dense negative reward, slime's form) for any token-level algorithm; ``--algo opd`` is that term
    alone (no reward in the advantage). With ``top_k`` the term is instead GKD's divergence over the teacher's top-k
    next tokens at each position, added to the loss: coef * D_beta(teacher || student) (TRL's server distillation)."""

    model: Optional[str] = None  # the teacher in the trainer's process (an HF folder or name; small setups)
    url: Optional[str] = None  # a ref_client.py server holding the teacher (ref.token and ref.*_timeout apply)
    # what the server at url speaks: grpo (a ref_client.py server) or openai (vLLM's /v1/completions with
    # prompt_logprobs: log-probs at temperature 1, so rollout.temperature must be 1)
    api: Literal["grpo", "openai"] = "grpo"
    served_model: Optional[str] = None  # api openai: the model name in requests (default: the one /v1/models lists)
    # with model.lora: a LoRA adapter folder trained on the policy's base; the teacher is that base with this adapter,
    # in the trainer's process, sharing the base's weights with the policy (no second copy)
    adapter: Optional[str] = None
    coef: float = at_least_zero(1.0)  # lambda of the distillation term (slime's opd_kl_coef; 0 = the term off)
    # 0: the sampled-token term on the advantage; k: GKD's divergence over the teacher's k likeliest tokens (TRL's loss_top_k)
    top_k: int = ranged(0, "in [0, 64]", "0 = the sampled-token term; k = the teacher's k most likely tokens")
    # with top_k, GKD's beta: 0 = forward KL(teacher || student), 1 = reverse KL, between = the generalized JSD
    beta: float = ranged(0.0, "in [0, 1]", "GKD's beta: 0 = forward KL, 1 = reverse KL, between = the JSD")
    tail: bool = True  # with top_k: the mass outside the top-k as one more bucket (TRL's loss_add_tail)


@dataclass
class LoggingConfig:
    log_every: int = positive(1)  # steps between samples written to samples.jsonl (metrics: every step)
    samples_per_log: int = at_least_zero(2)  # completions written to samples.jsonl
    report_to: list[str] = field(default_factory=list)  # tensorboard, wandb
    progress_bar: bool = True  # tqdm progress bar on rank 0; false: one plain line per step on stdout (batch logs)
    plot: bool = True  # write metrics.png at the end
    wandb_project: str = "grpo"  # W&B project (with report_to: [wandb])
    wandb_name: Optional[str] = None  # W&B run name (null: W&B picks one)
    wandb_entity: Optional[str] = None  # W&B entity, a user or team (null: your default)
    wandb_tags: list[str] = field(default_factory=list)  # W&B run tags
    # warn when a run looks stuck (truncation, all-equal groups, zero gradient, a mismatched sampler) this many steps
    # in a row
    health_patience: int = positive(5)
    # checks that give no warning in this run (from HEALTH_CHECKS), for a condition the run expects: the demo's
    # truncation while its random model learns to stop within a cap that fits the answer. Said at the run's start
    health_skip: list[str] = field(default_factory=list)
    # the audit of whole next-token distributions (docs/metrics.md#audit): every this many steps, the top-k KL of the
    # sampler against the trainer and of the reference against the policy, on a few rows (0 = off)
    audit_every: int = at_least_zero(0)
    audit_top_k: int = ranged(8, "in [1, 64]")  # the support of each audited position: the k most likely tokens
    audit_rows: int = positive(8)  # rows of each rank's batch audited, drawn at random (what bounds its cost)
    audit_warn_kl: float = positive(0.05)  # nats: an audited KL above it prints a warning naming the likely causes
    # the pre-flight check (docs/metrics.md#pre-flight-check): before the first update of a run (or of a resumed
    # one), one audit of the sampler against the trainer (and, on a fresh run, of the reference against the policy);
    # a mean KL above preflight_kl stops the run naming the likely cause. false: no such audit
    preflight: bool = True
    preflight_kl: float = positive(0.1)  # nats, mean over the audited positions


@dataclass
class RewardSpec:
    """One reward source (docs/rewards.md): exactly one of ``fn`` (a function), ``model`` (a learned reward
    model) or ``url`` (a remote scoring endpoint); its weight in the sum; the keys of its kind."""

    fn: Optional[str] = None  # a registered name or ``pkg.module:function``
    model: Optional[str] = None  # a sequence-classification model: hub id or local folder
    url: Optional[str] = None  # a remote endpoint: JSON {"prompts", "completions", ...} in, a list of floats out
    weight: float = 1.0  # its weight in the sum of the reward sources
    name: Optional[str] = None  # the name in the metrics (default: the function / model / host name)
    kwargs: dict[str, Any] = field(default_factory=dict)  # fn: extra keyword arguments; url: extra JSON fields
    # --- functions
    style: Literal["auto", "trl", "plain"] = "auto"  # how it is called (auto: by its signature; docs/rewards.md)
    isolation: Literal["process", "inline"] = "process"  # worker pool with a timeout, or in the trainer process
    timeout: Optional[float] = positive(None)  # seconds per call (fn, url); default reward_pool.timeout
    batch_size: Optional[int] = positive(None)  # rows per call (fn, url); default reward_pool.chunk_size
    # --- reward models
    label: Optional[str] = None  # the output label to read (default: the only logit)
    normalize: Literal["none", "running", "fixed"] = "none"  # running mean/std, or (x - shift) / scale
    shift: float = 0.0  # normalize: fixed: (score - shift) / scale
    scale: float = positive(1.0)  # normalize: fixed: the divisor
    clamp: Optional[list[float]] = None  # [low, high] after normalising
    batch_tokens: int = positive(4096)  # padded tokens per forward pass
    where: Literal["trainer", "server"] = "trainer"  # in-process, or on the reference server (ref.url)
    dtype: Optional[Literal["fp32", "bf16", "fp16"]] = None  # default: bf16 on CUDA, fp32 on CPU
    chat_template: Optional[bool] = None  # format conversations with the RM's template (default: when it has one)
    # --- remote endpoints
    retry_window: float = at_least_zero(30.0)  # seconds of retries (connection errors, timeouts, 5xx) before failing the run
    token_env: str = "GRPO_REWARD_TOKEN"  # environment variable holding the endpoint's bearer token

    @property
    def kind(self) -> str:
        return "model" if self.model else "url" if self.url else "fn"


@dataclass
class EvalConfig:
    """Held-out evaluation (grpo/training/evaluation.py): greedy accuracy, and mean@k / pass@k when k > 1.

    ``correctness`` decides a completion is right when its value >= ``threshold`` (default:
    the first entry of ``rewards``); ``format`` gives the format rate (none: not reported).
    """

    every: int = at_least_zero(0)  # steps between evaluations during training; 0 = off
    limit: Optional[int] = positive(None)  # first N held-out items (None = all)
    k: int = positive(1)  # samples per problem for mean@k / pass@k (1 = greedy only)
    temperature: float = positive(1.0)  # sampling temperature of the k samples
    max_completion_length: Optional[int] = positive(None)  # None = rollout.max_completion_length
    batch_size: int = positive(64)  # prompts per generation call
    correctness: Optional[RewardSpec] = None
    threshold: float = 1.0  # correctness value counted as right
    format: Optional[RewardSpec] = None


@dataclass
class SandboxConfig:
    """Limits of untrusted, model-written code: the ``code_tests`` reward and the ``python`` tool run each
    program through grpo/workers/sandbox.py under these (docs/sandbox.md). 0 = no limit for the numeric ones."""

    timeout: float = positive(5.0)  # wall-clock seconds per execution; then the run is killed, every process of it
    cpu_seconds: int = at_least_zero(5)  # RLIMIT_CPU per process (killed past it: reason cpu)
    memory_mb: int = at_least_zero(512)  # the run's memory, all its processes together, in MiB (see memory below); per
    # process RLIMIT_AS = this (+ 1024 for thread stacks where a cgroup holds; half of it without one): reason memory
    file_size_mb: int = at_least_zero(16)  # RLIMIT_FSIZE: the largest file it may write, in MiB
    open_files: int = at_least_zero(64)  # RLIMIT_NOFILE: open file descriptors per process
    processes: int = at_least_zero(256)  # processes and threads of one run at once (cgroup pids.max and/or RLIMIT_NPROC of the
    # run's own uid or user namespace; never the trainer's uid): no fork bomb
    max_output_bytes: int = positive(65536)  # stdout and stderr are each kept up to this; a program writing more is killed
    tmp_mb: int = positive(64)  # size of the run's private /tmp and of its /dev/shm (each; in memory; gone with the run)
    network: Literal["auto", "required", "allowed"] = "auto"  # auto: own network namespace where the kernel
    # allows it, else logged once; required: refuse to start instead; allowed: keep the trainer's network
    isolation: Literal["auto", "required", "none"] = "auto"  # own PID and mount namespaces (every process ends
    # with its run; only its folder writable): auto: where the kernel allows (what holds is logged at start);
    # required: refuse to start without them; none: never (rlimits, a uid and a process group only)
    user: str = "auto"  # as root: auto = a uid of its own per concurrent run (uid_base + slot, no account
    # needed); a user name = that user for every run; "" = stay root (not advised). Not root: ignored (the
    # trainer's uid, inside a user namespace where the kernel allows one)
    uid_base: int = 2_100_000_000  # the first of the per-run uids of user: auto (4096 of them)
    # interpreter for Python code ("" = the trainer's; its folders are mounted read-only in the run's root)
    python: str = ""
    # the run's memory as a whole: auto: its cgroup where one can be made, else (a plain user) at most 4 processes
    # and threads of memory_mb / 2 address space each (2 x memory_mb in all) where a process cap holds per run, else
    # per process only (said at start); required: refuse to start without a whole-run bound
    memory: Literal["auto", "required"] = "auto"


@dataclass
class RewardPoolConfig:
    """Where reward functions run: worker processes with a hard per-call timeout (grpo/workers/worker_pool.py)."""

    num_workers: int = at_least_zero(2)  # 0 = in the trainer process, without a timeout (debugging only)
    timeout: float = positive(10.0)  # seconds per call; a call past it scores 0 and is counted
    chunk_size: int = at_least_zero(0)  # rows per call (a timeout or error zeroes the whole chunk); 0 = the step's rows split
    # evenly over the workers (one call per worker and function); math_correct defaults to 1 (it can hang)
    max_failing_steps: int = positive(2)  # stop the run when a function fails on > half its rows this many steps in a row
    limits: WorkerLimits = field(default_factory=WorkerLimits)  # memory / CPU / file-size limits of each worker


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation; off by default
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec(fn="digits_match")])
    reward_pool: RewardPoolConfig = field(default_factory=RewardPoolConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def auto_dtype(device_type: Optional[str] = None) -> str:
    """The precision ``auto`` stands for on a device of this type (None: CUDA when torch sees it): bf16 on
    CUDA, fp32 elsewhere."""
    if device_type is None:
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return "bf16" if device_type == "cuda" else "fp32"


# --------------------------------------------------------------------------- validation


FILE_SOURCES = ("jsonl", "parquet", "csv")  # data.source values read from a local file
TASK_SOURCES = ("builtin", "countdown", "arithmetic", "code", "env")  # generated tasks: no data.path


