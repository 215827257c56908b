"""The Python API: a run started from a notebook or a script, the way a TRL user starts one.

    from grpo import train

    def exact(completions, answer, **kwargs):          # a reward function as TRL calls it
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    result = train("configs/demo.yaml", algo="dapo", rewards=[exact],
                   dataset=[{"prompt": "2 + 2 =", "answer": "4"}, ...],
                   train={"max_steps": 50, "output_dir": "runs/notebook"})
    result.output_dir, result.metrics["reward/mean"], result.history

The config is a YAML path, a mapping of the YAML's shape, or None (the defaults); sections given as keywords
(``train={...}``) go over it and ``overrides`` (``["train.lr=1e-5"]`` or ``{"train.lr": 1e-5}``) over those,
as on the command line. The run is the one ``train.py`` makes of the same settings (docs/python-api.md).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from grpo.foundation.config import Config, ConfigError
from grpo.foundation.loader import deep_merge
from grpo.foundation.plugins import REWARDS

ConfigLike = Union[None, str, Path, dict]


@dataclass
class RunResult:
    """What a finished run leaves: its folder (config.yaml, metrics.jsonl, checkpoints/) and its metrics."""

    output_dir: Path
    metrics: dict[str, Any]  # the last step's metrics (those of metrics.jsonl's last line)
    history: list[dict[str, Any]] = field(default_factory=list)  # every step's, in order
    config: Optional[Config] = None  # the resolved config the run trained with


def make_config(config: ConfigLike = None, *, algo: Union[None, str, dict[str, Any]] = None,
                overrides: Union[None, list[str], dict[str, Any]] = None, **sections: Any) -> Config:
    """The validated config of these settings (a ConfigError names a wrong key or value and the choices). ``algo``:
    the algorithm's name, or the ``algo:`` section as a mapping (its ``name`` the algorithm), as every section."""
    from grpo.training.configure import load_config

    if isinstance(algo, dict):  # the algo section, like every other section's keyword
        sections["algo"] = dict(algo)
        algo = algo.get("name")
    elif algo is not None and not isinstance(algo, str):
        raise ConfigError(f"algo={algo!r}: give the algorithm's name ('dapo') or the algo section as a mapping "
                          f"({{'name': 'dapo', 'beta': 0.0}})")
    path, tree = (None, dict(config)) if isinstance(config, dict) else (config, {})
    if path is not None and not isinstance(path, (str, Path)):
        raise ConfigError(f"config={config!r}: give a YAML path, a mapping of the YAML's shape, or None")
    tree = deep_merge(tree, {k: v for k, v in sections.items() if v is not None})
    return load_config(path, algo, _override_list(overrides), tree)


def train(config: ConfigLike = None, *, algo: Union[None, str, dict[str, Any]] = None, rewards: Optional[list] = None,
          dataset: Any = None, eval_dataset: Any = None, resume: bool = False,
          overrides: Union[None, list[str], dict[str, Any]] = None, **sections: Any) -> RunResult:
    """Train to ``train.max_steps`` (or ``train.stop_when``) and return the run's folder and metrics.

    rewards       the ``rewards:`` list, where an entry may be a Python callable (TRL's shape, or
                  ``fn(prompts, completions, **columns)``), a registered name, or a mapping with ``fn`` a
                  callable or a name (``{"fn": f, "weight": 0.5}``); callables run in the reward worker pool,
                  with its timeouts, sent there by value (a notebook's function, a lambda, a closure)
    dataset       the training prompts: a list of dicts, a ``datasets.Dataset``, a pandas DataFrame, columns
                  (``{"prompt": [...], "answer": [...]}``), or a file path; rows are
                  written to OUTPUT_DIR/data/train.jsonl, which the run's config.yaml then names
    eval_dataset  held-out prompts for ``eval.every``, the same kinds (OUTPUT_DIR/data/eval.jsonl)
    resume        continue from the newest checkpoint in ``train.output_dir``
    Errors: ConfigError for a wrong setting; the reference or reward service's error when one is gone;
    TrainingStopped from the watchdogs. The process group is torn down either way, so a second call trains.
    """
    from grpo.foundation import dist
    from grpo.training.configure import check_run, probe_services, run_warnings
    from grpo.training.trainer import Trainer

    if rewards is not None:
        sections["rewards"] = reward_entries(rewards)
    cfg = make_config(config, algo=algo, overrides=overrides, **sections)
    if eval_dataset is not None and not cfg.eval.every:
        raise ConfigError("eval_dataset is given and eval.every=0, so it would never be evaluated: pass "
                          "eval={'every': N} to evaluate it every N steps (and at the start), or leave eval_dataset out")
    if dataset is not None or eval_dataset is not None:
        data = _data_section(sections.get("data"), Path(cfg.train.output_dir), dataset, eval_dataset)
        cfg = make_config(config, algo=algo, overrides=overrides, **{**sections, "data": data})
    parts = check_run(cfg, resume=resume)
    if dist.is_main():
        for warning in run_warnings(cfg, parts):
            print(f"config warning: {warning}", file=sys.stderr)
    probe_services(cfg, parts)
    finished = False
    try:
        history = Trainer(cfg, resume=resume, parts=parts).train()
        finished = True
    finally:
        dist.shutdown(wait=finished)  # as train.py: a second run in this process starts a fresh group
    return RunResult(Path(cfg.train.output_dir), dict(history[-1]) if history else {}, list(history), cfg)


def reward_entries(rewards: Iterable[Any]) -> list[dict[str, Any]]:
    """The ``rewards:`` entries of a list whose entries may be callables (registered for this process)."""
    if isinstance(rewards, (str, dict)) or callable(rewards):
        rewards = [rewards]
    out = []
    for i, entry in enumerate(rewards):
        entry = {"fn": entry} if callable(entry) or isinstance(entry, str) else entry
        if not isinstance(entry, dict):
            raise ConfigError(f"rewards[{i}]={entry!r}: give a function, a registered name, or a mapping "
                              f"({{'fn': f, 'weight': 1.0}}, or 'model' / 'url' as in the YAML)")
        entry = dict(entry)
        if callable(entry.get("fn")):
            fn = entry["fn"]
            entry["fn"] = function_name(fn)
            entry.setdefault("name", _metric_name(fn))
        out.append(entry)
    return out


_COUNT = [0]


def function_name(fn: Callable) -> str:
    """``rewards fn`` for a Python callable: ``package.module:function`` when a fresh process imports it by
    that name; otherwise (``__main__``'s, a lambda, a closure, a bound method) a name registered in this process
    (the workers get the function by value, grpo/scoring/calls.py)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module not in ("__main__", "__mp_main__") and re.fullmatch(r"[A-Za-z_]\w*", qualname or ""):
        if getattr(sys.modules.get(module), qualname, None) is fn:
            return f"{module}:{qualname}"
    _COUNT[0] += 1
    name = f"{_metric_name(fn)}#{_COUNT[0]}"  # unique: a notebook may define a function again between runs
    REWARDS.register(name, fn)
    return name


def _metric_name(fn: Callable) -> str:
    return re.sub(r"\W+", "_", getattr(fn, "__name__", type(fn).__name__)).strip("_") or "reward"


def _override_list(overrides: Union[None, list[str], dict[str, Any]]) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]  # JSON is YAML: the value keeps its type
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"overrides={overrides!r}: give a list of 'key=value' strings or a mapping "
                          f"{{'train.lr': 1e-5}}")
    return list(overrides)


def _data_section(data: Optional[dict], out: Path, dataset: Any, eval_dataset: Any) -> dict:
    """The ``data:`` section with the given rows as files of the run (``data.path`` / ``data.eval_path``)."""
    data = dict(data or {})
    if eval_dataset is not None and not isinstance(eval_dataset, (str, Path)) and (
            dataset is None or isinstance(dataset, (str, Path))) and data.get("source", "jsonl") != "jsonl":
        raise ConfigError(f"eval_dataset as rows is written as JSONL, and the training data is data.source="
                          f"{data['source']!r}: give eval_dataset as a file of that kind, or the dataset as rows too")
    for rows, key, name in ((dataset, "path", "train"), (eval_dataset, "eval_path", "eval")):
        if rows is None:
            continue
        if isinstance(rows, (str, Path)):
            data[key] = str(rows)
            continue
        data[key] = str(write_rows(rows, out / "data" / f"{name}.jsonl", "dataset" if name == "train"
                                   else "eval_dataset"))
        data["source"] = "jsonl"
    return data


def write_rows(rows: Any, path: Path, what: str) -> Path:
    """A list of dicts, a ``datasets.Dataset``, a pandas DataFrame or columns (``{"prompt": [...], "answer": [...]}``,
    TRL's ``Dataset.from_dict`` shape) as a JSONL file, written whole or not at all."""
    if hasattr(rows, "to_list"):
        rows = rows.to_list()
    elif hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # a pandas DataFrame: a row a dict
        rows = rows.to_dict("records")
    elif isinstance(rows, dict):
        rows = _column_rows(rows, what)
    rows = list(rows)
    if not rows or not all(isinstance(r, dict) for r in rows):
        bad = next((r for r in rows if not isinstance(r, dict)), None)
        raise ConfigError(f"{what}: give a non-empty list of dicts (one per prompt, with a 'prompt' column) or a "
                          f"datasets.Dataset" + (f"; found {type(bad).__name__} {bad!r:.80}" if rows else ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            for i, row in enumerate(rows):
                f.write(json.dumps(row, default=lambda v, i=i: _plain(v, what, i)) + "\n")
        os.replace(tmp, path)  # every rank writes the same rows; none reads a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _column_rows(columns: dict, what: str) -> list[dict]:
    """``{"prompt": [...], "answer": [...]}`` as rows; columns of unequal lengths, or a value that is not a column,
    are refused (rows would be lost or misaligned)."""
    lengths = {k: len(v) for k, v in columns.items() if isinstance(v, (list, tuple)) or hasattr(v, "tolist")}
    if not columns or len(lengths) < len(columns) or len(set(lengths.values())) != 1:
        raise ConfigError(f"{what}: a mapping is read as columns, each a list of equal length ({{'prompt': [...], "
                          f"'answer': [...]}}); got lengths {lengths} of {list(columns)}: give equal lists, or a "
                          f"list of dicts (one per prompt)")
    keys, values = list(columns), [list(v.tolist() if hasattr(v, "tolist") else v) for v in columns.values()]
    return [dict(zip(keys, row)) for row in zip(*values)]


def _plain(value: Any, what: str, row: int) -> Any:
    """A numpy or torch value as JSON data; anything else is refused (its row would not come back)."""
    for attr in ("tolist", "item"):
        if callable(getattr(value, attr, None)):
            return getattr(value, attr)()
    raise ConfigError(f"{what}[{row}] holds a {type(value).__name__} ({value!r:.80}), which a JSONL file cannot "
                      f"hold: give text, numbers, lists or dicts")
