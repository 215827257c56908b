"""Prompt sources, prompt text, held-out splits, and the seeded, resumable prompt sampler.

An item is a dict with ``prompt`` (text, or a list of chat messages) and whatever columns
the reward functions need (``answer``, ...). The sampler hands every rank its slice of
one global batch; its state is just the number of prompts consumed, so a resumed run
sees exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from grpo.foundation.config import ConfigError, DataConfig, DigitsTaskConfig
from grpo.foundation.config_rules import TEMPLATE_OWN
from grpo.foundation.console import no_dataset_bars
from grpo.foundation.modeling import max_token_chars
from grpo.data.tasks import TASKS, ArithmeticTask, CountdownTask, system_prompt


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


def _column_mapping(cfg: DataConfig) -> dict[str, str]:
    """The task's preset mapping with the user's ``columns`` on top (a template needs no prompt column)."""
    preset = dict(TASKS[cfg.task].columns)
    if cfg.prompt_template is not None and cfg.task == "custom":
        preset = {}
    return {**preset, **cfg.columns}


def _empty_file(path: Path, source: str) -> bool:
    """A local file with no rows (``datasets`` fails on those with unhelpful messages)."""
    if not path.is_file():
        return False
    if source == "parquet":
        return _parquet_rows(path) == 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _check_first_row(path: Path, where: str) -> None:
    """The first row of a JSON Lines file must be a JSON object. pyarrow's reader under ``datasets`` kills the
    process (a segmentation fault, pyarrow 26) when the first line is ``null``, and names a number, a string or a
    boolean there only as "Column() changed from object to ..."; a first line it cannot parse alone (a JSON
    array file, one object over several lines) is left to ``datasets``."""
    import bz2
    import gzip
    import json
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix.lower(), open)
    try:
        with opener(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    break
            else:
                return
        value = json.loads(line)
    except (OSError, EOFError, lzma.LZMAError, ValueError):  # not readable, or not one value: datasets says why
        return
    if value is None or isinstance(value, (bool, int, float, str)):
        raise ConfigError(f"data: {where}, line {n} is {line.strip()[:60].decode('utf-8', 'replace')}, not a JSON "
                          f"object: each line of a JSON Lines file is one row, such as {{\"prompt\": \"...\"}}; fix or "
                          f"drop that line")


def _parquet_rows(path: Path) -> int:
    """Rows of a Parquet file, from its footer; a corrupt or truncated file is a ConfigError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as e:  # bad magic bytes: ArrowInvalid; a garbled footer: OSError
        raise ConfigError(
            f"data: {str(path)!r} is not a readable Parquet file ({' '.join(str(e).split())}); it is corrupt or truncated "
            f"(an interrupted download or copy?): write it again or point the config at a good copy"
        ) from e


class TableSource:
    """A JSONL / Parquet / CSV file or hub dataset with our column names mapped onto its own."""

    def __init__(self, cfg: DataConfig, path: Optional[str] = None, split: Optional[str] = None):
        import datasets

        path = path or cfg.path
        where = f"{path!r}" + (f" (split {split!r})" if split else "")
        if cfg.source != "hub" and _empty_file(Path(path), cfg.source):
            raise ConfigError(f"data: {where} holds no rows: the dataset is empty")
        try:
            if cfg.source == "hub":
                ds = datasets.load_dataset(path, cfg.hub_config, split=split or cfg.split)
            else:
                if cfg.source == "jsonl" and Path(path).is_file():
                    _check_first_row(Path(path), where)
                kind = {"jsonl": "json", "parquet": "parquet", "csv": "csv"}[cfg.source]
                with no_dataset_bars():  # a local file: no "Generating train split" bar at every run
                    ds = datasets.load_dataset(kind, data_files=path, split="train")
        except FileNotFoundError as e:
            raise ConfigError(f"data: {where}: no such file or dataset ({e})") from e
        except datasets.exceptions.DatasetGenerationError as e:
            raise ConfigError(f"data: {where} cannot be read as {cfg.source} ({e.__cause__ or e})") from e
        except (OSError, RecursionError) as e:  # a .gz that is not gzip; values nested past Python's recursion limit
            raise ConfigError(f"data: {where} cannot be read as {cfg.source} ({type(e).__name__}: {e})") from e
        if len(ds) == 0:
            raise ConfigError(f"data: {where} holds no rows: the dataset is empty")
        mapping = _column_mapping(cfg)
        for ours, theirs in mapping.items():
            if theirs not in ds.column_names:
                raise ConfigError(
                    f"data.columns.{ours}={theirs!r}: the dataset {where} has no column {theirs!r}; "
                    f"its columns are {ds.column_names} (map ours onto theirs with data.columns)"
                )
        self.ds, self.mapping, self.where = ds, mapping, where
        # a mapping adds our name and keeps the dataset's own (``answer: solution``: a built-in reward reads
        # ``answer``, a TRL one ``solution``); ours wins where both name one column
        self.passthrough = list(ds.column_names)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        try:
            row = self.ds[int(i)]
        except UnicodeDecodeError as e:  # a byte that is not UTF-8 (pyarrow decodes a row's text when it is read)
            raise ConfigError(f"data: {self.where}, row {int(i)}: its text is not UTF-8 ({e.reason} at byte "
                              f"{e.start}: {e.object[e.start:e.start + 1]!r}); write the file as UTF-8, e.g. "
                              f"iconv -f latin1 -t utf-8") from e
        item = {c: row[c] for c in self.passthrough}
        item.update({ours: row[theirs] for ours, theirs in self.mapping.items()})
        return item


class Subset:
    """The items of ``source`` at ``indices`` (a held-out split or its complement)."""

    def __init__(self, source: PromptSource, indices: list[int]):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.source[self.indices[i]]


class Templated:
    """Items whose ``prompt`` is the template filled with the item's columns."""

    def __init__(self, source: PromptSource, template: str):
        self.source, self.template = source, template
        self[0]  # a template naming a missing column fails now, with the columns listed

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.source[i]
        try:
            return {**item, "prompt": self.template.format_map(item)}
        except KeyError as e:
            raise ConfigError(
                f"data.prompt_template names the column {e.args[0]!r}, which the items lack; "
                f"their columns are {sorted(item)}"
            ) from e
        except ValueError as e:
            raise ConfigError(f"data.prompt_template={self.template!r} is not a valid format string ({e})") from e
        except (IndexError, AttributeError, TypeError, OverflowError, MemoryError) as e:
            # a field the row's value cannot give ({nums[5]} of a shorter list, {prompt.x}) or a width past memory
            raise ConfigError(f"data.prompt_template={self.template!r} cannot be filled from row {i} "
                              f"({type(e).__name__}: {e}); its columns: "
                              f"{ {k: str(v)[:40] for k, v in item.items()} }") from e


def _raw_source(cfg: DataConfig, seed: int, eval_file: bool = False) -> PromptSource:
    if cfg.source == "builtin":
        return DigitsTask(cfg.builtin, seed=seed)
    if cfg.source == "countdown":
        return CountdownTask(cfg.countdown, seed=cfg.seed)
    if cfg.source == "arithmetic":
        return ArithmeticTask(cfg.arithmetic, seed=cfg.seed)
    if cfg.source == "code":
        from grpo.data.code_task import CodeTask

        try:
            return CodeTask(cfg.code, seed=cfg.seed)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    if eval_file:
        return TableSource(cfg, path=cfg.eval_path or cfg.path, split=cfg.eval_split)
    return TableSource(cfg)


def _holdout_split(n: int, holdout: int, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): a seeded choice of ``holdout`` items, disjoint from the rest."""
    if holdout >= n:
        raise ConfigError(f"data.eval_holdout={holdout} leaves no training data: the source has {n} items")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[holdout:]), sorted(order[:holdout])


def _finish(source: PromptSource, cfg: DataConfig) -> PromptSource:
    # the Countdown generator's rows (nums, target) take TinyZero's prompt unless a task or template says otherwise
    task = "countdown" if cfg.source == "countdown" and cfg.task == "custom" else cfg.task
    template = cfg.prompt_template or TASKS[task].template
    if template is not None:
        return Templated(source, template)
    if "prompt" not in source[0]:
        raise ConfigError(
            f"data: the items have no 'prompt' column (columns: {sorted(source[0])}); "
            "map one with data.columns.prompt or set data.prompt_template"
        )
    return source


def load_source(cfg: DataConfig, seed: int) -> PromptSource:
    """The training prompts (without the held-out items when ``data.eval_holdout`` is set)."""
    source = _raw_source(cfg, seed)
    if cfg.eval_holdout:
        source = Subset(source, _holdout_split(len(source), cfg.eval_holdout, cfg.seed)[0])
    return _finish(source, cfg)


def load_eval_source(cfg: DataConfig, seed: int) -> Optional[PromptSource]:
    """The held-out prompts (``eval_path``, ``eval_split`` or ``eval_holdout``); None when none is configured."""
    if cfg.eval_holdout:
        source = _raw_source(cfg, seed)
        return _finish(Subset(source, _holdout_split(len(source), cfg.eval_holdout, cfg.seed)[1]), cfg)
    if cfg.eval_path is not None or cfg.eval_split is not None:
        return _finish(_raw_source(cfg, seed, eval_file=True), cfg)
    return None


# --------------------------------------------------------------------------- prompt text -> ids


def prompt_text(tokenizer: PreTrainedTokenizerBase, item: dict[str, Any], cfg: DataConfig) -> str:
    """The exact text the model is given: chat template (or plain text), system prompt, prefill."""
    prompt = item["prompt"]
    system = system_prompt(cfg.system_prompt)
    if isinstance(prompt, list) or cfg.chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if system and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system}] + messages
        if not getattr(tokenizer, "chat_template", None):
            why = ("the prompts are chat messages" if isinstance(prompt, list) else
                   f"data.chat_template={cfg.chat_template!r}")
            raise ConfigError(f"{why}, and the tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} has no chat "
                              f"template (a base model's has none): give one with data.chat_template (a Jinja template "
                              f"or its file), or train on plain-text prompts with data.chat_template=false")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **cfg.chat_template_kwargs)
    else:
        text = (system + "\n" if system else "") + str(prompt)
    return text + (cfg.prefill or "")


def template_variables(template: str) -> list[str]:
    """The variables a Jinja chat template reads that it does not set itself ([] where jinja2 cannot parse it:
    a template of transformers' own tags is checked by name alone)."""
    import jinja2
    from jinja2 import meta, sandbox

    env = sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:  # transformers' {% generation %} tag marks assistant text only: it reads no variable
        ast = env.parse(re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", template))
    except jinja2.TemplateSyntaxError:
        return []
    return sorted(meta.find_undeclared_variables(ast))


def check_template_kwargs(tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, used: bool) -> None:
    """``data.chat_template_kwargs`` against the template it is rendered with (``used``: a prompt goes through the
    template, or turns do): a key the template never reads, or one no prompt is rendered with, would be ignored
    without a word (a misspelt ``enable_thinking`` leaves Qwen3 thinking)."""
    kwargs = cfg.chat_template_kwargs
    if not kwargs:
        return
    if not used:
        raise ConfigError(f"data.chat_template_kwargs={kwargs!r} is set, but no prompt goes through the chat "
                          f"template: the prompts are plain text and data.chat_template is false. Set "
                          f"data.chat_template=true (or give chat messages as prompts), or drop "
                          f"data.chat_template_kwargs")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError(f"data.chat_template_kwargs={kwargs!r} is set, but the tokenizer has no chat template: give "
                          f"one with data.chat_template (a template or its file)")
    text = template if isinstance(template, str) else "\n".join(template.values())  # a tokenizer's named templates
    unread = [k for k in kwargs if not re.search(rf"\b{re.escape(k)}\b", text)]
    if unread:
        reads = [v for v in template_variables(text) if v not in TEMPLATE_OWN]
        raise ConfigError(f"data.chat_template_kwargs: the chat template never reads {unread}, so they would change "
                          f"nothing; the variables it reads besides the messages and special tokens: "
                          f"{reads or 'none'}. Fix the name, or drop the key")


def is_chat(item: dict[str, Any], cfg: DataConfig) -> bool:
    """Whether the prompt is rendered by the chat template, which holds its special tokens (BOS included where
    the model wants one): its ids get no others."""
    return isinstance(item["prompt"], list) or bool(cfg.chat_template)  # (a template of its own, or a file's path)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, item: dict[str, Any], cfg: DataConfig) -> list[int]:
    return tokenizer(prompt_text(tokenizer, item, cfg), add_special_tokens=not is_chat(item, cfg)).input_ids


ENCODE_BATCH = 1024  # texts per tokenizer call when a dataset is built


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str], chat: list[bool]) -> list[list[int]]:
    """The ids of each text, as ``tokenizer(text, add_special_tokens=not chat[i]).input_ids``, in batches of
    ENCODE_BATCH texts with the same flag (a fast tokenizer encodes a batch in one call: 1,000 short prompts
    in ~10 ms against ~60 ms one by one)."""
    out: list[Optional[list[int]]] = [None] * len(texts)
    for flag in (False, True):
        rows = [i for i, c in enumerate(chat) if c == flag]
        for s in range(0, len(rows), ENCODE_BATCH):
            part = rows[s:s + ENCODE_BATCH]
            for i, ids in zip(part, tokenizer([texts[i] for i in part], add_special_tokens=not flag).input_ids):
                out[i] = ids
    return out  # type: ignore[return-value]


def unusable_prompt(prompt: Any) -> Optional[str]:
    """Why a row's prompt cannot be trained on and is left out (None: it can): a null, an empty text or
    message list, or something that is neither text nor chat messages (it would become the text "None",
    or a generation sampled from padding alone)."""
    if prompt is None:
        return "null"
    if isinstance(prompt, str):
        return None if prompt.strip() else "empty"
    if isinstance(prompt, list):
        return None if prompt else "empty"
    return "not text"


def describe_unusable(unusable: dict[str, int]) -> str:
    """``{"null": 2, "empty": 1}`` -> "3 prompts left out (empty 1, null 2)"."""
    parts = ", ".join(f"{k} {v}" for k, v in sorted(unusable.items()))
    return f"{sum(unusable.values())} prompts left out ({parts})"

def check_messages(prompt: list, row: int, cfg: DataConfig) -> None:
    """Chat messages must be {role, content} dicts: a ConfigError naming the file, the row and the message."""
    for k, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            where = f"data.path={cfg.path!r}, " if cfg.path else ""
            raise ConfigError(f"{where}row {row}: prompt message {k} is {str(m)[:120]!r}: chat messages need a "
                              f"'role' (system, user, assistant, tool) and a 'content'")


@dataclass
class PromptDataset:
    """Items with their prompt token ids; prompts over the length limit are dropped and counted (``dropped``),
    and so are unusable ones (``unusable``: null, empty or not text, by reason)."""

    items: list[dict[str, Any]]
    ids: list[list[int]]
    dropped: int = 0
    unusable: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, source: PromptSource, tokenizer, cfg: DataConfig, max_prompt_length: int) -> "PromptDataset":
        kept, texts, dropped, unusable = [], [], 0, {}
        for i in range(len(source)):
            item = source[i]
            why = unusable_prompt(item.get("prompt"))
            if why is not None:
                unusable[why] = unusable.get(why, 0) + 1
                continue
            if isinstance(item["prompt"], list):
                check_messages(item["prompt"], i, cfg)
            text = prompt_text(tokenizer, item, cfg)
            if len(text) > max_prompt_length * max_token_chars(tokenizer):
                dropped += 1  # surely too long: not tokenized (an 8 MiB row cost ~10 s and 1.3 GB at start)
                continue
            kept.append(item)
            texts.append(text)
        items, ids = [], []
        for item, p in zip(kept, encode_texts(tokenizer, texts, [is_chat(item, cfg) for item in kept])):
            if len(p) > max_prompt_length:
                dropped += 1
                continue
            items.append(item)
            ids.append(p)
        if not items and unusable:
            raise ConfigError(f"no usable prompt: {describe_unusable(unusable)} (and {dropped} longer than "
                              f"rollout.max_prompt_length={max_prompt_length}); check data.columns.prompt")
        if not items:
            raise ConfigError(
                f"every prompt is longer than rollout.max_prompt_length={max_prompt_length} "
                f"({dropped} dropped): raise the limit"
            )
        return cls(items, ids, dropped, unusable)


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

    def rank_batch(self, n: int, rank: int, world: int) -> list[int]:
        """This rank's slice of the next ``n`` indices of the global stream (every rank draws all ``n``)."""
        if n % world:
            raise ValueError(f"{n} prompts cannot be split evenly over {world} ranks")
        per_rank = n // world
        return self.next_batch(n)[rank * per_rank: (rank + 1) * per_rank]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("size") != self.size:
            raise ConfigError(
                f"cannot resume: the checkpoint's dataset had {state.get('size')} prompts, this one has {self.size}"
            )
        self.consumed = int(state["consumed"])
