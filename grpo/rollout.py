"""Sampling G completions per prompt.

Each prompt is prefilled once; its KV cache is repeated for the G samples of its group,
and sequences that have emitted EOS leave the decode batch, so they stop costing compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from grpo.config import RolloutConfig


@dataclass
class Completions:
    """Rows are group-major: row i belongs to prompt i // G."""

    tokens: list[list[int]]  # completion tokens up to and including EOS (or L_max tokens)
    truncated: torch.Tensor  # [R] bool: no EOS within max_completion_length

    def mask(self, width: int) -> torch.Tensor:
        return completion_mask([len(t) for t in self.tokens], width)


def completion_mask(lengths: list[int], width: int) -> torch.Tensor:
    """[R, width] float mask, 1 on the first ``lengths[i]`` columns."""
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


def cut_at_eos(tokens: list[int], eos_ids: set[int], max_len: int) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first EOS; truncated when none within ``max_len``."""
    for i, t in enumerate(tokens[:max_len]):
        if t in eos_ids:
            return tokens[: i + 1], False
    return tokens[:max_len], True


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """One token per row from temperature / top-k / top-p filtered logits."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    cfg: RolloutConfig,
    eos_ids: list[int],
    pad_id: int,
    num_generations: int | None = None,
) -> Completions:
    """G completions per prompt (``num_generations`` overrides cfg's G)."""
    G = num_generations or cfg.num_generations
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    eos = torch.tensor(sorted(eos_ids), device=device)
    P, Lp = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((P, Lp), pad_id, dtype=torch.long, device=device)
    att = torch.zeros((P, Lp), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at column Lp - 1
        ids[i, Lp - len(p) :] = torch.tensor(p, dtype=torch.long)
        att[i, Lp - len(p) :] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(G)
    logits = out.logits[:, -1].repeat_interleave(G, dim=0)
    att = att.repeat_interleave(G, dim=0)
    next_pos = pos[:, -1].repeat_interleave(G) + 1

    R, T = P * G, cfg.max_completion_length
    result = torch.full((R, T), pad_id, dtype=torch.long, device=device)
    lengths = torch.full((R,), T, dtype=torch.long, device=device)
    active = torch.arange(R, device=device)
    for t in range(T):
        tok = sample_next(logits, cfg.temperature, cfg.top_p, cfg.top_k)
        result[active, t] = tok
        done = torch.isin(tok, eos)
        if done.any():
            lengths[active[done]] = t + 1
        keep = ~done
        if t == T - 1 or not keep.any():
            break
        if not keep.all():  # finished rows leave the batch and its KV cache
            idx = keep.nonzero(as_tuple=True)[0]
            cache.batch_select_indices(idx)
            active, tok, att, next_pos = active[idx], tok[idx], att[idx], next_pos[idx]
        att = torch.cat([att, att.new_ones(att.shape[0], 1)], dim=1)
        out = model(
            input_ids=tok.unsqueeze(1), attention_mask=att, position_ids=next_pos.unsqueeze(1),
            past_key_values=cache, use_cache=True,
        )
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    if was_training:
        model.train()
    lengths_l = lengths.tolist()
    rows = result.tolist()
    tokens = [row[:n] for row, n in zip(rows, lengths_l)]
    eos_set = set(int(e) for e in eos_ids)
    truncated = torch.tensor([not (len(tk) and tk[-1] in eos_set) for tk in tokens])
    return Completions(tokens=tokens, truncated=truncated)


def decode_completions(tokenizer, tokens: list[list[int]], eos_ids: list[int]) -> list[str]:
    """Text the rewards see: everything the model wrote except the final EOS (special tokens stay
    visible, so a policy cannot hide filler in tokens that decoding would skip)."""
    eos = set(eos_ids)
    return tokenizer.batch_decode([t[:-1] if t and t[-1] in eos else t for t in tokens])
