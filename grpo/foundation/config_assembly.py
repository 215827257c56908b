"""The assembly of a configuration: the user's tree from a YAML file, Python data, ``--algo`` and ``key=value``
overrides (``read_user_tree``), merged over the defaults and the algorithm's into a validated ``Config``
(``build_config``); back to plain data (``to_dict``, ``dump_config``). The schema is grpo/foundation/config.py; the
rules it checks, grpo/foundation/config_rules.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import yaml

from grpo.foundation.config import TASK_SOURCES, AlgoConfig, Config
from grpo.foundation.config_rules import require_rewards, validate_loss_options, validate
from grpo.foundation.loader import (ConfigError, UnknownKeys, build_dataclass, deep_merge, dump_yaml, load_yaml,
                                    parse_overrides, to_tree, unknown_key)

_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}


def _infer_data_source(tree: dict) -> dict:
    """A ``data.path`` without ``data.source``: the source from the file's extension (a compression suffix
    such as .gz is looked through), or a ConfigError saying which source to set."""
    data = tree.get("data")
    if not isinstance(data, dict) or data.get("source") is not None or data.get("path") in (None, ""):
        return tree
    path = str(data["path"])
    suffixes = [x.lower() for x in Path(path).suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst"):
        suffixes = suffixes[:-1]
    source = _EXTENSIONS.get(suffixes[-1]) if suffixes else None
    if source is None:
        raise ConfigError(
            f"data.path={path!r} is set without data.source, and its extension does not say its format: set "
            f"data.source=jsonl (.jsonl / .json), parquet, csv, or hub for a Hugging Face dataset (e.g. "
            f"data.source=hub data.path=openai/gsm8k data.hub_config=main)")
    return {**tree, "data": {**data, "source": source}}


def to_dict(cfg: Config) -> dict:
    """The resolved config as plain data (algorithm options flattened into ``algo``)."""
    tree = to_tree(cfg)
    options = tree["algo"].pop("options") or {}
    tree["algo"].update(options)
    return tree


def read_user_tree(
    path: Optional[str | Path] = None,
    algo: Optional[str] = None,
    overrides: Optional[list[str]] = None,
    tree: Optional[dict] = None,
) -> tuple[dict, str]:
    """The user's settings as a tree (YAML < ``tree``, the same as a mapping < --algo < key=value overrides)
    and the algorithm's name."""
    file_tree: dict = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            yamls = sorted(x.name for x in p.glob("*.y*ml"))[:8]
            raise ConfigError(f"config file {str(p)!r} is a folder: name a YAML file in it"
                              + (f" ({', '.join(yamls)})" if yamls else ""))
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            file_tree = load_yaml(p.read_text(), str(p)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(file_tree, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at top level")
    if tree is not None and not isinstance(tree, dict):
        raise ConfigError(f"a config given as Python data must be a mapping of sections (like the YAML file), "
                          f"not {type(tree).__name__}")
    file_tree = deep_merge(file_tree, tree or {})
    cli_tree = parse_overrides(overrides or [])

    user_tree = deep_merge(file_tree, cli_tree)
    cli_data, file_data = cli_tree.get("data"), file_tree.get("data")
    if (isinstance(cli_data, dict) and cli_data.get("path") and "source" not in cli_data and isinstance(file_data, dict)
            and file_data.get("source") in TASK_SOURCES):
        # a file named on the command line over a preset's generated task (configs/demo.yaml): its format follows its
        # extension, as without the preset (the preset's own task keys are left unused)
        user_tree["data"] = {k: v for k, v in user_tree["data"].items() if k != "source"}
    if algo is not None:
        # --algo beats the YAML's algo.name; only an explicit algo.name=... override beats --algo.
        cli_name = cli_tree.get("algo", {}).get("name") if isinstance(cli_tree.get("algo"), dict) else None
        user_tree = deep_merge(user_tree, {"algo": {"name": cli_name or algo}})
    sections = [f.name for f in dataclasses.fields(Config)]
    unknown = [str(unknown_key("", key, sections)) for key in user_tree if key not in sections]
    if unknown:
        raise UnknownKeys(unknown)
    algo_tree = user_tree.get("algo", {}) or {}
    if not isinstance(algo_tree, dict):
        raise ConfigError(f"algo must be a mapping, got {algo_tree!r}")
    return user_tree, str(algo_tree.get("name", AlgoConfig.name))


def build_config(user_tree: dict, algorithm: Any) -> Config:
    """The validated config: defaults < the algorithm's defaults < the user's tree. ``algorithm`` is the
    chosen algorithm's class (its ``Options`` dataclass, ``defaults``, ``option_owners``, ``check_capabilities``
    and ``validate``: algos/base.py); grpo/training/configure.py finds it by name (ALGORITHMS)."""
    algo_tree = user_tree.get("algo", {}) or {}
    name = str(algo_tree.get("name", AlgoConfig.name))
    common = {f.name for f in dataclasses.fields(AlgoConfig)} - {"options"}
    option_names = [f.name for f in dataclasses.fields(algorithm.Options)]
    common_user = {k: v for k, v in algo_tree.items() if k in common}
    option_user, unknown = {}, []
    for k, v in algo_tree.items():
        if k in common:
            continue
        if k not in option_names:
            owners = algorithm.option_owners(k) if hasattr(algorithm, "option_owners") else []
            if owners:
                raise ConfigError(
                    f"algo.{k} is an option of {' and '.join(owners)}, not of {name}: choose "
                    f"{'that algorithm' if len(owners) == 1 else 'one of them'} (--algo {owners[0]}) or drop "
                    f"algo.{k}. {name}'s own options: {option_names or 'none'}")
            unknown.append(str(unknown_key("algo", k, sorted(common) + option_names)))
            continue
        option_user[k] = v

    user_tree = _infer_data_source(user_tree)
    tree = deep_merge(user_tree, {"algo": deep_merge(dict(algorithm.defaults), common_user)})
    tree["algo"] = {k: v for k, v in tree["algo"].items() if k in common}  # options go to cfg.algo.options
    tree["algo"]["name"] = name
    try:  # every unknown key at once: the algorithm's section's and the others'
        cfg = build_dataclass(Config, tree)
    except UnknownKeys as e:
        raise UnknownKeys(unknown + e.errors) from None
    if unknown:
        raise UnknownKeys(unknown)
    cfg.algo.options = build_dataclass(algorithm.Options, option_user, "algo")
    validate(cfg)
    require_rewards(user_tree, cfg)
    algorithm.check_capabilities(cfg)  # what the algorithm's loss has for the options and rollouts asked of it
    validate_loss_options(cfg)
    algorithm.validate(cfg)
    return cfg


def dump_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(dump_yaml(to_dict(cfg)))

