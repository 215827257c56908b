"""The rules of the configuration: each declared range checked (``check_ranges``), then the rules that relate keys
to each other (``validate`` and the section checks it calls), and the warnings of settings that run but likely do
not do what was meant (``config_warnings``). The schema, with each key's help and range on its field, is
grpo/foundation/config.py; the assembly from YAML and overrides, grpo/foundation/config_assembly.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from grpo.foundation.config import (FILE_SOURCES, HEALTH_CHECKS, MAX_TOP_K, RANGES, STATIC_MODES, TASK_SOURCES,
                                    AlgoConfig, Config, DataConfig, EnvConfig, RewardSpec, VllmConfig)
from grpo.foundation.loader import ConfigError, not_finite

def check_range(path: str, value: Any, within: str, hint: str = "") -> None:
    """``value`` (a number, or each item of a non-empty list) is finite and lies ``within`` (a key of RANGES)."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not math.isfinite(item):
            raise not_finite(path, value)
    if not items or not all(RANGES[within](v) for v in items):
        need = f"a non-empty list, each value {within}" if isinstance(value, list) else within
        raise ConfigError(f"{path}={value!r} is invalid: it must be {need}" + (f" ({hint})" if hint else ""))


def check_optimizer_states(cfg: Config) -> None:
    """bf16 optimizer states need bf16 weights (model.dtype auto is checked again once resolved)."""
    if cfg.train.optimizer_states == "bf16" and (cfg.model.dtype not in ("bf16", "auto") or cfg.model.lora is not None):
        raise ConfigError(
            f"train.optimizer_states='bf16' keeps Adam's state in the weights' dtype: it needs model.dtype='bf16' "
            f"(got {cfg.model.dtype!r}) and no model.lora (the adapters train in fp32); use optimizer_states='fp32'")


def custom_chat_template(data: "DataConfig") -> Optional[str]:
    """``data.chat_template`` as a Jinja template to install on the tokenizer: None for true/false, the string
    itself when it looks like a template ({{ or {%), else the contents of the file it names."""
    value = data.chat_template
    if isinstance(value, bool):
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.chat_template={value!r} is neither a Jinja template (no '{{{{' or '{{%') nor an "
                          f"existing file ({str(path.absolute())!r}); give true/false, a template, or its file's path")
    return path.read_text()


def check_ranges(node: Any, path: str = "") -> None:
    """Every field's declared range (``ranged``, ``positive``, ``at_least_zero``) in this dataclass and the ones
    inside it, rewards[i] and the algorithm's options (keys ``algo.<name>``) included."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{path}.{f.name}" if path else f.name
        if value is None:
            continue
        if "range" in f.metadata:
            check_range(key, value, f.metadata["range"], f.metadata.get("hint", ""))
        elif f.name == "options" and dataclasses.is_dataclass(value):
            check_ranges(value, path)  # an algorithm's own keys live beside the shared ones: algo.<name>
        elif dataclasses.is_dataclass(value):
            check_ranges(value, key)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_ranges(item, f"{key}[{i}]")


def _validate_streaming(cfg: Config) -> None:
    """rollout.max_staleness >= 1 (streaming rollouts): what it needs and what it cannot run with yet. (Every built-in
    engine streams; a custom one must take generate(..., room=, stop=): grpo/rollout/stream.py checks it.)"""
    r, K = cfg.rollout, cfg.rollout.max_staleness
    if r.engine == "vllm" and r.vllm.tensor_parallel_size > 1:
        raise ConfigError(f"rollout.max_staleness={K} with rollout.vllm.tensor_parallel_size="
                          f"{r.vllm.tensor_parallel_size}: the ranks of a tensor-parallel group share one engine, and "
                          f"streamed calls end at different steps on each rank; set tensor_parallel_size=1 or "
                          f"rollout.max_staleness=0")
    if cfg.algo.rollout_correction is None and cfg.algo.tis_cap is None:
        raise ConfigError(f"rollout.max_staleness={K} trains on tokens drawn up to {K} optimizer steps before the "
                          f"weights they train: without a correction such runs collapse. Set "
                          f"algo.rollout_correction={{mode: truncate}} (or {{mode: mask}}, or algo.tis_cap=2.0)")
    if cfg.env.name:
        raise ConfigError(f"rollout.max_staleness={K} with env.name={cfg.env.name!r}: multi-turn trajectories are not "
                          f"streamed (their turns wait on the environment); set rollout.max_staleness=0")
    if r.carried_kv == "keep" and r.engine not in ("hf", "auto"):
        raise ConfigError(f"rollout.carried_kv='keep' keeps carried rows' caches in the hf engine, and rollout.engine="
                          f"{r.engine!r} prefills them again: set rollout.engine=hf, or rollout.carried_kv=prefill")


def validate(cfg: Config) -> None:
    """Checks on values that types alone cannot express: the declared ranges first, then the rules that relate
    keys to each other."""
    check_ranges(cfg)
    r, t, a = cfg.rollout, cfg.train, cfg.algo
    if not t.output_dir.strip():
        raise ConfigError("train.output_dir is empty: name the run's folder (metrics, checkpoints, config.yaml), e.g. "
                          "train.output_dir=runs/my-run")
    if not r.engine.strip():
        raise ConfigError("rollout.engine is empty: name an engine ('auto', 'hf', 'static', 'vllm') or give "
                          "'package.module:Class'")
    if r.forced_eos_lengths is not None:
        if r.ignore_eos:
            raise ConfigError("rollout.forced_eos_lengths ends rows with an EOS and rollout.ignore_eos=true ignores it: "
                              "set one of them")
        if r.engine == "vllm":
            raise ConfigError("rollout.forced_eos_lengths is not supported by rollout.engine=vllm: use hf or static")
    if r.slots and r.engine == "vllm":
        raise ConfigError(f"rollout.slots={r.slots} is continuous batching in the static and hf engines, and "
                          f"rollout.engine='vllm' schedules its own batch: set rollout.slots=0, or "
                          f"rollout.engine=static or hf")
    if r.max_staleness:
        _validate_streaming(cfg)
    elif r.carried_kv != "prefill":
        raise ConfigError(f"rollout.carried_kv={r.carried_kv!r} with rollout.max_staleness=0: no row is carried to "
                          f"another step; set rollout.max_staleness >= 1 (streaming), or rollout.carried_kv=prefill")
    if r.static.mode not in STATIC_MODES:
        raise ConfigError(f"rollout.static.mode={r.static.mode!r} is invalid: choose from {list(STATIC_MODES)}")
    check_optimizer_states(cfg)
    if t.stop_when is not None:
        if t.stop_when.at_least is None:
            raise ConfigError("train.stop_when.at_least is missing: give the target, e.g. "
                              "train.stop_when={metric: reward/mean, at_least: 0.9, window: 5}")
        if not t.stop_when.metric.strip():
            raise ConfigError("train.stop_when.metric is empty: name a per-step metric such as reward/mean")
    if a.rollout_correction is not None:
        rc = a.rollout_correction
        if a.tis_cap is not None:
            raise ConfigError(f"algo.tis_cap={a.tis_cap!r} and algo.rollout_correction: tis_cap is rollout_correction="
                              f"{{level: token, mode: truncate, high: {a.tis_cap}}}; set one of them")
        if rc.low is not None and rc.low >= rc.high:
            raise ConfigError(f"algo.rollout_correction.low={rc.low!r} must be < algo.rollout_correction.high="
                              f"{rc.high!r}")
        if rc.mode == "mask" and (rc.high <= 1 or (rc.low is not None and rc.low >= 1)):
            bad = f"high={rc.high!r}" if rc.high <= 1 else f"low={rc.low!r}"
            raise ConfigError(f"algo.rollout_correction.{bad} with mode=mask would mask every on-policy token (their "
                              f"ratio is 1): mask mode keeps the ratio inside [low, high], which needs low < 1 < high "
                              f"(e.g. {{mode: mask, high: 2.0, low: 0.5}})")
        if cfg.env.name:
            raise ConfigError(f"algo.rollout_correction is not supported with multi-turn rollouts (env.name="
                              f"{cfg.env.name!r}): set algo.rollout_correction=null")
    if a.tis_cap is not None:
        if cfg.env.name:
            raise ConfigError(
                f"algo.tis_cap={a.tis_cap!r} is not supported with multi-turn rollouts (env.name={cfg.env.name!r}): "
                f"set algo.tis_cap=null"
            )
    for i, target in enumerate(cfg.logging.report_to):
        if target not in ("tensorboard", "wandb"):
            raise ConfigError(
                f"logging.report_to[{i}]={target!r} is invalid: choose from ['tensorboard', 'wandb']"
            )
    for i, name in enumerate(cfg.logging.health_skip):
        if name not in HEALTH_CHECKS:
            raise ConfigError(f"logging.health_skip[{i}]={name!r} is not a check: choose from {list(HEALTH_CHECKS)}")
    _validate_teacher(cfg)  # (an empty rewards list: the algorithm's check_capabilities decides)
    _validate_lora(cfg)
    _validate_data(cfg.data)
    _validate_eval(cfg)
    for i, spec in enumerate(cfg.rewards):
        _validate_reward(f"rewards[{i}]", spec, cfg)
    check_url("ref.url", cfg.ref.url)
    _validate_ref_sync(cfg)
    _validate_env(cfg)
    _validate_limits(cfg)


def check_url(key: str, url: Optional[str]) -> None:
    """An http:// or https:// URL with a host and, if it names one, a port in 1-65535 (None: not set). A port out of
    range or not a number was a ValueError from inside the HTTP client once the run had started."""
    if url is None:
        return
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or port == 0:
        raise ConfigError(f"{key}={url!r} is invalid: give an http:// or https:// URL with a host and, optionally, a "
                          f"port from 1 to 65535 (e.g. http://127.0.0.1:59875)")


def _validate_reward(path: str, s: RewardSpec, cfg: Config) -> None:
    given = [k for k in ("fn", "model", "url") if getattr(s, k)]
    if len(given) != 1:
        raise ConfigError(f"{path} must name exactly one of fn, model or url (got {given or 'none'}), e.g. "
                          "{fn: math_correct}, {model: path/or/hub-id}, {url: http://host:port/score}")
    check_url(f"{path}.url", s.url)
    if s.clamp is not None and (len(s.clamp) != 2 or not s.clamp[0] < s.clamp[1]):
        raise ConfigError(f"{path}.clamp={s.clamp!r} is invalid: give [low, high] with low < high")
    if s.where == "server" and s.kind != "model":
        raise ConfigError(f"{path}.where=server is for reward models (model: ...); a function runs in the trainer")
    if s.where == "server" and cfg.ref.url is None:
        raise ConfigError(f"{path}.where=server needs ref.url: the reference server (ref_client.py --reward-model "
                          f"{s.model}) hosts the reward model")
    own = {"fn": ("style", "isolation"), "model": ("label", "normalize", "clamp", "where", "dtype", "chat_template"),
           "url": ("retry_window",)}
    defaults = RewardSpec()
    for kind, keys in own.items():
        for k in keys:
            if kind != s.kind and getattr(s, k) != getattr(defaults, k):
                raise ConfigError(f"{path}.{k} is a key of {kind} rewards; this entry is a {s.kind} reward "
                                  f"({s.kind}: {getattr(s, s.kind)!r})")


def _validate_lora(cfg: Config) -> None:
    lora = cfg.model.lora
    if lora is None:
        return
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
    if r.mixup_alpha != 1.0 and not r.sync_every:
        raise ConfigError(f"ref.mixup_alpha={r.mixup_alpha!r} has no effect without ref.sync_every > 0: "
                          "set ref.sync_every or leave ref.mixup_alpha at 1")
    if r.sync_every and cfg.algo.beta <= 0:
        raise ConfigError(f"ref.sync_every={r.sync_every} needs a reference, but algo.beta={cfg.algo.beta} "
                          "(no KL term): set algo.beta > 0 or ref.sync_every=0")


MAX_TOOL_WORKERS = 256  # processes: more is a typo, not a setting


def _validate_env(cfg: Config) -> None:
    e, r = cfg.env, cfg.rollout
    if e.name is None:
        if cfg.data.source == "env":
            raise ConfigError("data.source='env' needs an environment: set env.name (e.g. calculator or maze)")
        changed = [f.name for f in dataclasses.fields(e) if getattr(e, f.name) != getattr(EnvConfig(), f.name)]
        if changed:  # they would do nothing: only a forgotten env.name makes sense of them
            raise ConfigError(f"env.{', env.'.join(changed)} set without env.name, so nothing would use "
                              f"{'them' if len(changed) > 1 else 'it'}: set env.name (calculator, maze, or "
                              f"package.module:Class), or remove the env settings")
        return
    if e.tool_workers > MAX_TOOL_WORKERS:
        raise ConfigError(f"env.tool_workers={e.tool_workers} is invalid: at most {MAX_TOOL_WORKERS} worker processes")
    names = [s.name or s.fn.split(":")[-1] for s in (e.tools or [])]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"env.tools names {twice} twice; the environment calls a tool by its name, so one "
                          f"would be dropped: give each its own name (env.tools: [{{fn: ..., name: ...}}])")
    if not e.name.strip():
        raise ConfigError("env.name is empty: name an environment (calculator, maze) or give 'package.module:Class'")
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


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are valid but do nothing in this run (a preset switched to another engine, a reference
    sync that never comes): train.py prints them once, before any model loads."""
    out = []
    if cfg.rollout.engine != "vllm" and cfg.rollout.vllm != VllmConfig():
        changed = [f.name for f in dataclasses.fields(VllmConfig)
                   if getattr(cfg.rollout.vllm, f.name) != getattr(VllmConfig(), f.name)]
        out.append(f"rollout.vllm.{', rollout.vllm.'.join(changed)} ignored: rollout.engine={cfg.rollout.engine!r}, "
                   f"not 'vllm'")
    if not cfg.ref.ask_groups and not (cfg.ref.url and cfg.rollout.max_staleness):
        out.append(f"ref.ask_groups=false ignored: groups are asked one by one only of a reference server "
                   f"(ref.url={cfg.ref.url!r}) in streamed rollouts (rollout.max_staleness="
                   f"{cfg.rollout.max_staleness})")
    if cfg.data.eval_path and not cfg.eval.every:
        out.append(f"data.eval_path={cfg.data.eval_path!r} is never evaluated: eval.every=0 (set eval.every=N to "
                   f"evaluate it every N steps)")
    if cfg.rollout.top_k == 1 and cfg.rollout.num_generations > 1 and not cfg.env.name:
        out.append(f"rollout.top_k=1 samples greedily: the {cfg.rollout.num_generations} completions of a prompt are "
                   f"the same, so their rewards are equal and every group-relative advantage is 0 (nothing is "
                   f"learned); leave rollout.top_k at 0 (off) or give it > 1")
    rc = cfg.algo.rollout_correction
    if rc is not None and rc.mode == "truncate" and (rc.high < 1 or (rc.low is not None and rc.low > 1)):
        bad = f"high={rc.high!r} < 1" if rc.high < 1 else f"low={rc.low!r} > 1"
        out.append(f"algo.rollout_correction.{bad} with mode=truncate: every on-policy token's weight (ratio 1) is "
                   f"clamped to {rc.high if rc.high < 1 else rc.low!r}, a rescaled gradient, not a correction; the "
                   f"bounds usually hold 1 (low <= 1 <= high)")
    t = cfg.teacher
    named = [f"teacher.{k}={getattr(t, k)!r}" for k in ("model", "url", "adapter") if getattr(t, k)]
    if named and t.coef <= 0:
        out.append(f"{named[0]} is never asked: teacher.coef={t.coef}, so the distillation term is off and no "
                   f"teacher loads or gets a request; set teacher.coef > 0 (e.g. 1.0) to distil from it, or leave it out")
    if cfg.ref.sync_every > cfg.train.max_steps:
        out.append(f"ref.sync_every={cfg.ref.sync_every} > train.max_steps={cfg.train.max_steps}: the reference is "
                   f"never synced in this run")
    return out


def _validate_limits(cfg: Config) -> None:
    """The sandbox's limits beyond their ranges (0 = none): enough to start an interpreter."""
    sb = cfg.sandbox
    if 0 < sb.memory_mb < 64:
        raise ConfigError(f"sandbox.memory_mb={sb.memory_mb} is invalid: the interpreter alone needs ~30 MiB; give "
                          f">= 64 (or 0 = no limit)")
    if 0 < sb.open_files < 16:
        raise ConfigError(f"sandbox.open_files={sb.open_files} is invalid: give >= 16 (or 0 = no limit)")
    if not 1 <= sb.uid_base <= 2**31 - 1 - 4096:
        raise ConfigError(f"sandbox.uid_base={sb.uid_base} is invalid: give a uid from 1 to {2**31 - 1 - 4096} with "
                          f"the 4096 after it unused by any account on the machine")
    if 0 < sb.processes < 4:
        raise ConfigError(f"sandbox.processes={sb.processes} is invalid: the launcher and the program need 2 of the "
                          f"sandbox user's processes; give >= 4 (or 0 = no limit)")


def require_rewards(user_tree: dict, cfg: Config) -> None:
    """A run on anything but the built-in digits task (or an environment, which scores itself) must name its
    rewards: the default ``digits_match`` only fits the digits task."""
    if user_tree.get("rewards") is not None or cfg.data.source == "builtin" or cfg.env.name:
        return
    d = cfg.data
    if d.source == "countdown" or d.task == "countdown":
        example = "rewards: [{fn: countdown}]"
    elif d.source == "code" or d.task in ("mbpp", "humaneval"):
        example = "rewards: [{fn: code_tests}]"
    elif d.source == "arithmetic":
        example = "rewards: [{fn: math_correct, kwargs: {extract: last_number, gold: plain}}]"
    elif d.task in ("gsm8k", "math"):
        example = "rewards: [{fn: math_correct}]"
    else:
        example = "rewards: [{fn: my_package.my_module:my_reward}] or a built-in such as [{fn: math_correct}]"
    raise ConfigError(
        f"no rewards: section, and data.source={d.source!r} is not the built-in digits task whose default reward "
        f"(digits_match) it would silently train against. Name the reward in the YAML, e.g. {example}, or on the "
        f"command line: 'rewards=[{{fn: NAME}}]' (docs/troubleshooting.md)")


def _validate_teacher(cfg: Config) -> None:
    t = cfg.teacher
    named = [f"teacher.{k}={v!r}" for k, v in (("model", t.model), ("url", t.url), ("adapter", t.adapter)) if v]
    if len(named) > 1:
        raise ConfigError(f"{' and '.join(named)}: name one teacher (in-process, the server at url, or the policy's "
                          f"base with an adapter)")
    if (t.api != "grpo" or t.served_model) and not t.url:
        key = f"teacher.api={t.api!r}" if t.api != "grpo" else f"teacher.served_model={t.served_model!r}"
        raise ConfigError(f"{key} describes the server at teacher.url, and teacher.url is not set: set it, or leave "
                          f"{key.split('=')[0]} at its default")
    if t.adapter and cfg.model.lora is None:
        raise ConfigError(f"teacher.adapter={t.adapter!r} is a LoRA adapter on the policy's base, and the policy has no "
                          f"LoRA (model.lora is null): set model.lora, or name the teacher with teacher.model (a whole "
                          f"model, or an adapter folder merged into its base)")
    if t.adapter and cfg.ref.sync_every:
        raise ConfigError(f"teacher.adapter={t.adapter!r} shares the policy's base, which ref.sync_every="
                          f"{cfg.ref.sync_every} moves toward the policy (LoRA's reference is that base): name the "
                          f"reference apart (ref.model or ref.url), or set ref.sync_every=0")
    check_url("teacher.url", t.url)
    if not t.top_k and (t.beta != 0.0 or not t.tail):
        key = f"teacher.beta={t.beta!r}" if t.beta != 0.0 else f"teacher.tail={t.tail!r}"
        raise ConfigError(f"{key} shapes the divergence over the teacher's top-k tokens, and teacher.top_k=0 (the "
                          f"sampled-token term): set teacher.top_k (1 to {MAX_TOP_K}), or leave {key.split('=')[0]} "
                          f"at its default")
    if t.top_k == 1 and not t.tail:
        raise ConfigError("teacher.top_k=1 with teacher.tail=false: a distribution over one token is always the "
                          "teacher's, so the divergence is 0 and nothing is learnt; keep teacher.tail=true or raise "
                          "teacher.top_k")


def distilling(cfg: Config) -> bool:
    """A teacher is named and its term is on."""
    return bool(cfg.teacher.model or cfg.teacher.url or cfg.teacher.adapter) and cfg.teacher.coef > 0


# what apply_chat_template sets itself, and the tokenizer's special tokens it hands the template: never a
# data.chat_template_kwargs key (it would clash with the trainer's rendering, or change what a token means)
TEMPLATE_OWN = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
                "unk_token", "sep_token", "pad_token", "cls_token", "mask_token", "additional_special_tokens")


def _validate_data(d: DataConfig) -> None:
    own = [k for k in d.chat_template_kwargs if k in TEMPLATE_OWN]
    if own:
        raise ConfigError(f"data.chat_template_kwargs sets {own}: the trainer renders prompts with those itself (the "
                          f"messages, the generation prompt, the tokenizer's special tokens); give only the "
                          f"template's own variables, e.g. data.chat_template_kwargs={{enable_thinking: false}}")
    if d.source in FILE_SOURCES and not d.path:
        raise ConfigError(f"data.path is required when data.source={d.source!r}")
    if d.path and d.source in TASK_SOURCES:
        raise ConfigError(f"data.path={d.path!r} is not read with data.source={d.source!r} (a generated task): set "
                          f"data.source to one of {list(FILE_SOURCES)} or hub to train on it, or drop data.path")
    if d.source == "hub" and not d.path:
        raise ConfigError("data.path (the hub dataset name) is required when data.source='hub'")
    c = d.countdown
    if c.min_numbers < 2 or c.max_numbers < c.min_numbers:
        raise ConfigError(
            f"data.countdown.min_numbers={c.min_numbers}, max_numbers={c.max_numbers} are invalid: "
            "need 2 <= min_numbers <= max_numbers"
        )
    if d.arithmetic.max_value < 4:
        raise ConfigError(f"data.arithmetic.max_value={d.arithmetic.max_value} is invalid: it must be >= 4")
    chosen = [k for k in ("eval_path", "eval_split") if getattr(d, k) is not None] + (["eval_holdout"] if d.eval_holdout else [])
    if len(chosen) > 1:
        raise ConfigError(f"data.{' and data.'.join(chosen)} are both set: choose one source of held-out data")
    if d.eval_split is not None and d.source != "hub":
        raise ConfigError(f"data.eval_split={d.eval_split!r} needs data.source='hub'; use data.eval_path for a file "
                          "or data.eval_holdout to hold items out")
    if d.eval_path is not None and d.source not in FILE_SOURCES:
        raise ConfigError(f"data.eval_path={d.eval_path!r} needs data.source {' or '.join(map(repr, FILE_SOURCES))}")


def _validate_eval(cfg: Config) -> None:
    e = cfg.eval
    for key in ("correctness", "format"):
        if getattr(e, key) is not None:
            _validate_reward(f"eval.{key}", getattr(e, key), cfg)
    d = cfg.data
    custom_chat_template(d)  # a template file that is not there fails here
    if e.every and d.eval_path is None and d.eval_split is None and not d.eval_holdout:
        raise ConfigError(f"eval.every={e.every} needs held-out data: set data.eval_path, data.eval_split "
                          "or data.eval_holdout")
    if e.every and e.correctness is None and not cfg.rewards:
        raise ConfigError(f"eval.every={e.every} scores with the first reward function, and rewards is empty: set "
                          "eval.correctness, e.g. eval.correctness={fn: math_correct}")


def validate_loss_options(cfg: Config) -> None:
    """The options of TRL's trainer that apply to many losses (algos/loss_options.py): their ranges and how they
    relate to other keys. Whether the chosen loss has what they act on is the algorithm's check_capabilities."""
    a = cfg.algo
    if a.delta is not None and a.delta <= 1 + a.clip_eps_high:
        raise ConfigError(f"algo.delta={a.delta!r} is invalid: it must be > 1 + algo.clip_eps_high = "
                          f"{1 + a.clip_eps_high} (INTELLECT-2 uses 4), or null")
    if a.use_bias_correction_kl and a.beta <= 0:
        raise ConfigError(f"algo.use_bias_correction_kl=true weights the KL term, and algo.beta={a.beta} (no KL "
                          f"term): set algo.beta > 0 or algo.use_bias_correction_kl=false")
    _validate_entropy_bonus(a)


def _validate_entropy_bonus(a: AlgoConfig) -> None:
    """``algo.entropy_coef`` and Skywork-OR1's adaptive coefficient (``algo.entropy_target`` and its keys)."""
    adaptive = ("entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")
    if a.entropy_target is None:
        changed = [k for k in adaptive if getattr(a, k) != getattr(AlgoConfig, k)]
        if changed:
            raise ConfigError(f"algo.{changed[0]}={getattr(a, changed[0])!r} tunes the adaptive entropy coefficient, "
                              f"and algo.entropy_target is null (a fixed algo.entropy_coef): set algo.entropy_target "
                              f"(Skywork-OR1 uses 0.2), or leave {', '.join('algo.' + k for k in adaptive)} at "
                              f"their defaults")
        return
    if a.entropy_coef_min > a.entropy_coef_max:
        raise ConfigError(f"algo.entropy_coef_min={a.entropy_coef_min!r} is invalid: it must be <= "
                          f"algo.entropy_coef_max={a.entropy_coef_max!r}")

