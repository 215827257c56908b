"""Chunked completion log-probs and entropy equal a naive full-softmax computation in float64."""

from __future__ import annotations

import pytest
import torch

from grpo.logprobs import completion_logprobs, pack
from grpo.tiny import build_tiny


@pytest.fixture(scope="module")
def model_and_rows():
    model, _ = build_tiny(seed=3)
    model = model.double()
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    lens = [(3, 5), (7, 1), (1, 6), (4, 4), (2, 0)]  # (prompt, completion): ragged, one empty
    prompts = [torch.randint(4, V, (p,), generator=g).tolist() for p, _ in lens]
    completions = [torch.randint(4, V, (c,), generator=g).tolist() for _, c in lens]
    return model, prompts, completions


def naive(model, prompts, completions, width, temperature):
    """One unpadded forward per row; full-vocabulary log-softmax in float64."""
    lp = torch.zeros(len(prompts), width, dtype=torch.float64)
    ent = torch.zeros(len(prompts), width, dtype=torch.float64)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not c:
            continue
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0].double() / temperature
        logsm = torch.log_softmax(logits, -1)
        for t, tok in enumerate(c):
            row = logsm[len(p) + t - 1]
            lp[i, t] = row[tok]
            ent[i, t] = -(row.exp() * row).sum()
    return lp, ent


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive(model_and_rows, chunk_size, temperature):
    model, prompts, completions = model_and_rows
    packed = pack(prompts, completions, pad_id=0, width=8)
    with torch.no_grad():
        lp, ent = completion_logprobs(model, packed, temperature, chunk_size, with_entropy=True)
        ref_lp, ref_ent = naive(model, prompts, completions, 8, temperature)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-10, rtol=1e-10)


def test_gradient_matches_naive(model_and_rows):
    """The checkpointed chunked path gives the same parameter gradient as the naive one."""
    model, prompts, completions = model_and_rows
    packed = pack(prompts, completions, pad_id=0, width=8)
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64)
    model.zero_grad()
    lp, _ = completion_logprobs(model, packed, 1.0, chunk_size=2)
    (lp * weights).sum().backward()
    fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_lp, _ = naive(model, prompts, completions, 8, 1.0)
    (ref_lp * weights).sum().backward()
    for a, (name, p) in zip(fast, model.named_parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-8, rtol=1e-6, msg=name)


def test_padding_does_not_change_rows(model_and_rows):
    """A row's log-probs do not depend on what other rows are batched (padded) with it."""
    model, prompts, completions = model_and_rows
    with torch.no_grad():
        full, _ = completion_logprobs(model, pack(prompts, completions, 0, 8))
        alone, _ = completion_logprobs(model, pack(prompts[:1], completions[:1], 0, 8))
    torch.testing.assert_close(full[0], alone[0], atol=1e-10, rtol=0)
