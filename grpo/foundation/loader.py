"""The YAML-to-dataclass loader under grpo/foundation/config.py: YAML in and out (libyaml when present), a
typed dataclass tree built from plain data with every value coerced to its annotation, ``key=value`` overrides,
and the errors that name the bad key, the valid keys ("did you mean") and the fix. Nothing here knows the
trainer's config; config.py declares it and its rules.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import math
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

# libyaml's parser and emitter where PyYAML has them (its wheels do): the same documents and the same safe types,
# 4-10x faster than the pure-Python ones (a config is read and written at every start, and parsed per override)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _UniqueKeys(_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader, refusing a key given twice in one mapping (YAML keeps the last without a word: a second
    ``train:`` section dropped every key of the first)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor`` merges, and may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (list, dict)):
                    continue  # an unhashable key: the base constructor says so
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"found the key {key!r} twice (YAML would keep the last and drop the first without a word): "
                        f"merge the two into one", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, name: str = "") -> Any:
    """``yaml.safe_load``, with libyaml when present; a key given twice in one mapping is a YAMLError. ``name``: the
    file's, where an error says where (else "<unicode string>")."""
    stream: Any = text
    if name:
        stream = io.StringIO(text)
        stream.name = name
    return yaml.load(stream, Loader=_UniqueKeys)


def dump_yaml(tree: Any) -> str:
    """``yaml.safe_dump(tree, sort_keys=False)``, with libyaml when present."""
    return yaml.dump(tree, Dumper=_DUMPER, sort_keys=False)


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message says how to fix it."""


class NotFiniteError(ConfigError):
    """A float-typed key got nan or inf (raised by the coercion, whatever else the annotation allows)."""


def not_finite(path: str, value: float) -> ConfigError:
    return NotFiniteError(
        f"{path}={value!r} is invalid: it must be a finite number (nan and inf are not allowed); "
        f"set a finite value or leave {path} out to use its default"
    )


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


# other spellings of a choice (torch's and TRL's dtype names)
_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
            "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
            "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32"}


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert it (str->float/int/bool)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, str) and _ALIASES.get(value.lower()) in choices:  # model.dtype=bfloat16 (TRL's)
            value = _ALIASES[value.lower()]
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
            except NotFiniteError:
                raise  # the type fits; the value does not
            except ConfigError as e:
                errors.append(str(e))
        real = [a for a in args if a is not type(None)]
        if len(real) == 1 and dataclasses.is_dataclass(real[0]):  # e.g. Optional[LoraConfig]: its own error as
            return _coerce(path, value, real[0])  # raised (UnknownKeys: every unknown key in it, gathered above)
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
                value = load_yaml(value)
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
            raise not_finite(path, number)
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


# TRL's names (GRPOConfig's fields, GRPOTrainer's arguments) and what they are here (docs/python-api.md's table): an
# unknown key that is one of them gets this instead of the closest spelling
TRL_NAMES = {
    "learning_rate": "train.lr (default 1e-5; TRL's 1e-6)",
    "loss_type": ("the algorithm: --algo NAME (TRL's 'grpo' is --algo grpo, 'dr_grpo' --algo drgrpo, 'bnpo', 'cispo', "
                  "'sapo', 'luspo', 'vespo' the same names; its default 'dapo' is --algo grpo algo.aggregation=token-mean "
                  "algo.beta=0)"),
    "scale_rewards": "algo.adv_std ('group': unbiased, the default; 'none': none) or algo.adv_scope: batch ('batch')",
    "epsilon": "algo.clip_eps_low", "epsilon_high": "algo.clip_eps_high",
    "per_device_train_batch_size": "train.micro_batch_size (completions per forward/backward pass)",
    "gradient_accumulation_steps": ("none: one optimizer step per rollout batch (rollout.prompts_per_step x "
                                    "rollout.num_generations completions), in train.micro_batch_size passes"),
    "generation_batch_size": "rollout.prompts_per_step (prompts a step, over all ranks) x rollout.num_generations",
    "importance_sampling_level": "--algo gspo (TRL's 'sequence')",
    "reward_weights": "each rewards entry's weight",
    "use_vllm": "rollout.engine: vllm",
    "vllm_importance_sampling_correction": "algo.tis_cap (the truncation), or algo.rollout_correction",
    "vllm_importance_sampling_cap": "algo.tis_cap", "vllm_importance_sampling_clip_max": "algo.tis_cap",
    "vllm_importance_sampling_mode": "algo.rollout_correction: {level, mode, low, high}",
    "sync_ref_model": "ref.sync_every (steps; 0 = off)", "ref_model_sync_steps": "ref.sync_every",
    "ref_model_mixup_alpha": "ref.mixup_alpha",
    "bf16": "model.dtype: bf16 (auto: bf16 on CUDA)", "logging_steps": "none: every step is logged (metrics.jsonl)",
    "max_prompt_length": "rollout.max_prompt_length", "max_completion_length": "rollout.max_completion_length",
    "num_generations": "rollout.num_generations", "temperature": "rollout.temperature", "top_p": "rollout.top_p",
    "top_k": "rollout.top_k", "mask_truncated_completions": "algo.mask_truncated_completions",
    "num_train_epochs": "train.max_steps (steps, not epochs)", "max_grad_norm": "train.grad_clip",
    "lr_scheduler_type": "train.lr_schedule", "warmup_steps": "train.warmup_steps", "output_dir": "train.output_dir",
    "seed": "train.seed", "weight_decay": "train.weight_decay",
    "train_dataset": "dataset= (the Python API) or data.path", "reward_funcs": "rewards",
    "chat_template_kwargs": "data.chat_template_kwargs (e.g. {enable_thinking: false})",
}


def unknown_key(path: str, key: str, valid: list[str]) -> ConfigError:
    key = key if isinstance(key, str) else repr(key)  # a YAML key may be a number or null (``1: 2``)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    name, colon, value = key.partition(":")
    if colon and name.strip() in valid:  # {fn:math_correct}: YAML reads one key without a value
        hint = (f" YAML needs a space after the colon: write '{name.strip()}: {value.strip()}' ('{key}' is read as one "
                f"key with no value).")
    if key in TRL_NAMES:  # (a TRL name that is also ours under the same section never gets here)
        hint = (f" {key!r} is TRL's name (GRPOConfig, GRPOTrainer): here it is {TRL_NAMES[key]} "
                f"(docs/python-api.md).")
    where = f"{path}.{key}" if path else key
    return ConfigError(f"unknown config key {where!r}.{hint} Valid keys: {sorted(valid)}")


class UnknownKeys(ConfigError):
    """Every unknown key of a config at once (a YAML with three typos is one error naming the three)."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__(errors[0] if len(errors) == 1 else
                         f"{len(errors)} unknown config keys:\n  - " + "\n  - ".join(errors))


def build_dataclass(cls: type, values: dict, path: str = "") -> Any:
    """Build ``cls`` from a (partial) mapping, validating every key and type; the unknown keys of every section
    are reported together (``UnknownKeys``), before any other error."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs, unknown = {}, []
    for key, value in values.items():
        if key not in names:
            unknown.append(str(unknown_key(path, str(key), names)))
            continue
        try:
            kwargs[key] = _coerce(f"{path}.{key}" if path else key, value, hints[key])
        except UnknownKeys as e:  # a section's own: gathered with the others
            unknown += e.errors
    if unknown:
        raise UnknownKeys(unknown)
    return cls(**kwargs)


def deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("columns", "kwargs"):
            out[k] = deep_merge(out[k], v)
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
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.constructor.ConstructorError as e:  # YAML, but a key twice (or a tag the safe loader refuses)
            raise ConfigError(f"override {item!r}: {e.problem}") from e
        except yaml.YAMLError:  # not YAML (a Jinja template: '{% ...'): the text itself, checked by its key's type
            value = raw
        _set_dotted(tree, key, value)
    return tree


def to_tree(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_tree(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_tree(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_tree(v) for k, v in obj.items()}
    return obj
