"""Prompt sources and the seeded, resumable prompt sampler.

An item is a dict with ``prompt`` (text, or a list of chat messages) and whatever columns
the reward functions need (``answer``, ...). The sampler hands every rank its slice of
one global batch; its state is just the number of prompts consumed, so a resumed run
sees exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from grpo.config import ConfigError, DataConfig, DigitsTaskConfig


class PromptSource(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> dict[str, Any]: ...


# --------------------------------------------------------------------------- the built-in task

_OPS = {"copy": "=", "reverse": "<", "add": "+", "successor": ">"}


def digits_example(rng: random.Random, op: str, digits: int) -> dict[str, str]:
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    x = rng.randint(lo, hi)
    if op == "copy":
        return {"prompt": f"{x}=", "answer": str(x)}
    if op == "reverse":
        return {"prompt": f"{x}<", "answer": str(x)[::-1]}
    if op == "successor":
        return {"prompt": f"{x}>", "answer": str(x + 1)}
    if op == "add":
        y = rng.randint(lo, hi)
        return {"prompt": f"{x}+{y}=", "answer": str(x + y)}
    raise ConfigError(f"data.builtin.op={op!r} is invalid: choose from {sorted(_OPS)}")


class DigitsTask:
    """Procedurally generated digit tasks with verifiable answers (seeded)."""

    def __init__(self, cfg: DigitsTaskConfig, seed: int = 0):
        rng = random.Random(seed)
        self.items = [digits_example(rng, cfg.op, cfg.digits) for _ in range(cfg.num_examples)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


# --------------------------------------------------------------------------- files and hub


class TableSource:
    """A JSONL / Parquet file or hub dataset with our column names mapped onto its own."""

    def __init__(self, cfg: DataConfig):
        import datasets

        try:
            if cfg.source == "hub":
                ds = datasets.load_dataset(cfg.path, split=cfg.split)
            else:
                kind = "json" if cfg.source == "jsonl" else "parquet"
                ds = datasets.load_dataset(kind, data_files=cfg.path, split="train")
        except FileNotFoundError as e:
            raise ConfigError(f"data.path={cfg.path!r}: no such file or dataset ({e})") from e
        if len(ds) == 0:
            raise ConfigError(f"data.path={cfg.path!r} holds no rows: the dataset is empty")
        mapping = {"prompt": "prompt", **cfg.columns}
        for ours, theirs in mapping.items():
            if theirs not in ds.column_names:
                raise ConfigError(
                    f"data.columns.{ours}={theirs!r}: the dataset {cfg.path!r} has no column {theirs!r}; "
                    f"its columns are {ds.column_names}"
                )
        self.ds, self.mapping = ds, mapping
        keep = set(mapping.values())
        self.passthrough = [c for c in ds.column_names if c not in keep]

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.ds[int(i)]
        item = {c: row[c] for c in self.passthrough}
        item.update({ours: row[theirs] for ours, theirs in self.mapping.items()})
        return item


def load_source(cfg: DataConfig, seed: int) -> PromptSource:
    if cfg.source == "builtin":
        return DigitsTask(cfg.builtin, seed=seed)
    return TableSource(cfg)


# --------------------------------------------------------------------------- prompt text -> ids


def prompt_ids(tokenizer: PreTrainedTokenizerBase, item: dict[str, Any], cfg: DataConfig) -> list[int]:
    prompt = item["prompt"]
    if isinstance(prompt, list) or cfg.chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if cfg.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}] + messages
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    text = (cfg.system_prompt + "\n" if cfg.system_prompt else "") + str(prompt)
    return tokenizer(text).input_ids


@dataclass
class PromptDataset:
    """Items with their prompt token ids; prompts over the length limit are dropped and counted."""

    items: list[dict[str, Any]]
    ids: list[list[int]]
    dropped: int = 0

    @classmethod
    def build(cls, source: PromptSource, tokenizer, cfg: DataConfig, max_prompt_length: int) -> "PromptDataset":
        items, ids, dropped = [], [], 0
        for i in range(len(source)):
            item = source[i]
            p = prompt_ids(tokenizer, item, cfg)
            if len(p) > max_prompt_length:
                dropped += 1
                continue
            items.append(item)
            ids.append(p)
        if not items:
            raise ConfigError(
                f"every prompt is longer than rollout.max_prompt_length={max_prompt_length} "
                f"({dropped} dropped): raise the limit"
            )
        return cls(items, ids, dropped)

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class PromptSampler:
    """Seeded epochs of shuffled indices; ``consumed`` is the whole state."""

    size: int
    seed: int
    shuffle: bool = True
    consumed: int = 0
    _perm_epoch: int = field(default=-1, repr=False)
    _perm: list[int] = field(default_factory=list, repr=False)

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                self._perm = torch.randperm(self.size, generator=g).tolist()
            else:
                self._perm = list(range(self.size))
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self, n: int) -> list[int]:
        """The next ``n`` indices of the global stream."""
        out = []
        for k in range(self.consumed, self.consumed + n):
            out.append(self._order(k // self.size)[k % self.size])
        self.consumed += n
        return out

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("size") != self.size:
            raise ConfigError(
                f"cannot resume: the checkpoint's dataset had {state.get('size')} prompts, this one has {self.size}"
            )
        self.consumed = int(state["consumed"])
