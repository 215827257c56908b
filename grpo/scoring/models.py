"""Learned reward models: a sequence classifier scores (prompt, completion) texts.

``rewards: [{model: <hub id or folder>, weight, label?, normalize?, clamp?, batch_tokens?, where?}]``

The model is loaded with ``AutoModelForSequenceClassification`` and its own tokenizer. A row's text is, when
the dataset's prompts are conversations and the reward model's tokenizer has a chat template (or
``chat_template: true``), that template applied to the prompt's messages plus ``{"role": "assistant",
"content": completion}``; otherwise the prompt text followed by the completion (TRL's ``prompt + completion``).
The score is the logit of ``label`` (a name in the model's ``id2label``), or the only logit.

Rows are sorted by length and cut into forward passes of at most ``batch_tokens`` padded tokens. Padding
follows the tokenizer's ``padding_side``; position ids count only real tokens and the score is read at each
row's last real token, so a row scores the same alone, in any batch, left- or right-padded (to float
rounding). Weights are bf16 on CUDA, fp32 on CPU (``dtype`` overrides).

``where: trainer`` scores on the trainer's device (each rank its own rows); ``where: server`` sends the rows
to the reference server (``ref_client.py --reward-model ...``; grpo/scoring/remote.py posts them), which scores
them with this same code. Either way the trainer then normalises (``running``: by the mean and std of every
score seen so far, over all ranks; ``fixed``: ``(x - shift) / scale``) and clamps.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional

import torch

from grpo.foundation.config import ConfigError, RewardSpec, auto_dtype
from grpo.foundation.modeling import DTYPES
from grpo.scoring.calls import Rows



def default_device(device: Optional[str] = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class RewardModel:
    """A sequence classifier and its tokenizer: texts -> scores, batched by a token budget."""

    def __init__(self, source: str, device: Optional[str] = None, dtype: Optional[str] = None,
                 label: Optional[str] = None, batch_tokens: int = 4096, chat_template: Optional[bool] = None,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from grpo.foundation.modeling import check_model_path

        self.source, self.batch_tokens = str(source), batch_tokens
        self.device = default_device(device)
        name = dtype or auto_dtype(self.device.type)
        check_model_path("reward model", str(source))
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                source, dtype=DTYPES[name], trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward model {source!r} cannot be loaded as a sequence classifier: {e}") from e
        self.model.eval().requires_grad_(False).to(self.device)
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ConfigError(f"reward model {source!r}: its tokenizer has neither a pad nor an EOS token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.index = self._label_index(label)
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if chat_template and not has_template:
            raise ConfigError(f"reward model {source!r}: chat_template: true, but its tokenizer has no chat template")
        self.use_template = has_template if chat_template is None else chat_template
        # decoder classifiers (Llama, Qwen, Mistral...): base model + score head, read at the last real token
        self.base = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        self.head = getattr(self.model, "score", None)
        self.takes_positions = "position_ids" in inspect.signature(self.model.forward).parameters

    def _label_index(self, label: Optional[str]) -> int:
        cfg = self.model.config
        if label is not None:
            names = {str(v): int(k) for k, v in (cfg.id2label or {}).items()}
            if label not in names:
                raise ConfigError(f"reward model {self.source!r} has no label {label!r}: its labels are "
                                  f"{sorted(names)}")
            return names[label]
        if cfg.num_labels != 1:
            raise ConfigError(f"reward model {self.source!r} has {cfg.num_labels} labels "
                              f"{sorted(map(str, (cfg.id2label or {}).values()))}: name one with label:")
        return 0

    def texts(self, prompts: list[Any], completions: list[str]) -> list[str]:
        """The text each row is scored on (conversations through the model's chat template)."""
        out = []
        for p, c in zip(prompts, completions):
            if isinstance(p, list) and self.use_template:
                out.append(self.tokenizer.apply_chat_template(list(p) + [{"role": "assistant", "content": c}],
                                                              tokenize=False))
            elif isinstance(p, list):
                out.append("".join(str(m.get("content", "")) for m in p) + c)
            else:
                out.append(str(p) + c)
        return out

    @torch.inference_mode()
    def score_texts(self, texts: list[str]) -> list[float]:
        """One float per text, in float32."""
        templated = self.use_template
        ids = [self.tokenizer(t, add_special_tokens=not templated)["input_ids"] for t in texts]
        out = [0.0] * len(ids)
        for rows in token_batches([len(x) for x in ids], self.batch_tokens):
            for i, v in zip(rows, self._forward([ids[i] for i in rows])):
                out[i] = v
        return out

    def _forward(self, rows: list[list[int]]) -> list[float]:
        width = max(len(r) for r in rows)
        pad, left = self.tokenizer.pad_token_id, self.tokenizer.padding_side == "left"
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            sl = slice(width - len(r), width) if left else slice(0, len(r))
            input_ids[i, sl] = torch.tensor(r, dtype=torch.long)
            mask[i, sl] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        input_ids, mask, positions = input_ids.to(self.device), mask.to(self.device), positions.to(self.device)
        last = (torch.arange(width, device=self.device) * mask).argmax(-1)  # each row's last real token
        if self.base is not None and self.head is not None:
            hidden = self.base(input_ids=input_ids, attention_mask=mask, position_ids=positions).last_hidden_state
            logits = self.head(hidden[torch.arange(len(rows), device=self.device), last])
        else:  # encoders pool for themselves
            extra = {"position_ids": positions} if self.takes_positions else {}
            logits = self.model(input_ids=input_ids, attention_mask=mask, **extra).logits
        return logits[:, self.index].float().cpu().tolist()


def token_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices sorted by length, cut so each batch's rows x longest row <= budget (one row at least)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class Normalizer:
    """``none``, ``fixed`` ((x - shift) / scale) or ``running`` (by the mean and std, over every rank, of all
    scores seen so far, this step's included); then the clamp."""

    def __init__(self, kind: str, shift: float = 0.0, scale: float = 1.0, clamp: Optional[list[float]] = None):
        self.kind, self.shift, self.scale, self.clamp = kind, shift, scale, clamp
        self.n, self.total, self.total_sq = 0.0, 0.0, 0.0

    def __call__(self, scores: list[float]) -> list[float]:
        x = torch.tensor(scores, dtype=torch.float64)
        if self.kind == "fixed":
            x = (x - self.shift) / self.scale
        elif self.kind == "running":
            from grpo.foundation import dist

            s = dist.all_reduce_sum(torch.stack([torch.tensor(float(len(x)), dtype=torch.float64), x.sum(),
                                                 (x * x).sum()]))
            self.n, self.total, self.total_sq = self.n + float(s[0]), self.total + float(s[1]), self.total_sq + float(s[2])
            mean = self.total / max(self.n, 1.0)
            std = math.sqrt(max(self.total_sq / max(self.n, 1.0) - mean * mean, 0.0))
            x = (x - mean) / (std + 1e-6)
        if self.clamp is not None:
            x = x.clamp(self.clamp[0], self.clamp[1])
        return x.tolist()

    def state_dict(self) -> dict:
        return {"n": self.n, "total": self.total, "total_sq": self.total_sq}


class ModelTerm:
    """A reward source backed by a reward model: in this process, or on the reference server."""

    kind = "model"

    def __init__(self, name: str, spec: RewardSpec, device: Optional[str], ref_cfg: Any):
        self.name, self.spec, self.weight = name, spec, spec.weight
        self.normalizer = Normalizer(spec.normalize, spec.shift, spec.scale, spec.clamp)
        self.concurrent = spec.where == "server"  # a server request runs while the functions do
        if spec.where == "server":
            from grpo.scoring.remote import ServerRewardClient

            self.client: Any = ServerRewardClient(ref_cfg, spec)
            self.model = None
        else:
            self.model = RewardModel(spec.model, device, spec.dtype, spec.label, spec.batch_tokens,
                                     spec.chat_template)

    def score(self, rows: Rows) -> list[Optional[float]]:
        if self.model is not None:
            raw = self.model.score_texts(self.model.texts(rows.raw_prompts, rows.completions))
        else:
            raw = self.client.score(rows.raw_prompts, rows.completions)
        return self.normalizer(raw)

    def close(self) -> None:
        if self.model is None:
            self.client.close()
