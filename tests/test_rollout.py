"""Completion masks and truncation flags: hand-made sequences and real generation."""

from __future__ import annotations

import torch

from grpo.config import RolloutConfig
from grpo.rollout import completion_mask, cut_at_eos, generate, sample_next
from grpo.tiny import build_tiny

EOS = 2


def test_cut_at_eos_keeps_the_eos_token():
    assert cut_at_eos([5, 6, EOS, 7, EOS], {EOS}, 10) == ([5, 6, EOS], False)
    assert cut_at_eos([EOS, 5], {EOS}, 10) == ([EOS], False)


def test_cut_at_eos_truncates_without_eos():
    assert cut_at_eos([5, 6, 7, 8], {EOS}, 3) == ([5, 6, 7], True)
    assert cut_at_eos([5, 6, EOS], {EOS}, 3) == ([5, 6, EOS], False)  # EOS exactly at L_max
    assert cut_at_eos([5, 6, 7, EOS], {EOS}, 3) == ([5, 6, 7], True)  # EOS one past L_max


def test_cut_at_eos_with_several_eos_ids():
    assert cut_at_eos([5, 9, 6], {EOS, 9}, 5) == ([5, 9], False)


def test_completion_mask_by_hand():
    mask = completion_mask([3, 1, 0, 4], 4)
    expected = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    assert torch.equal(mask, expected)


def test_generate_masks_and_flags_are_consistent():
    model, tok = build_tiny(seed=1)
    torch.manual_seed(0)
    prompts = [tok("12=").input_ids, tok("3456=").input_ids]
    cfg = RolloutConfig(num_generations=6, max_completion_length=5)
    comp = generate(model, prompts, cfg, [tok.eos_token_id], tok.pad_token_id)
    assert len(comp.tokens) == 12
    for tokens, truncated in zip(comp.tokens, comp.truncated.tolist()):
        assert 1 <= len(tokens) <= 5
        assert tok.eos_token_id not in tokens[:-1]  # nothing after the first EOS
        assert truncated == (tokens[-1] != tok.eos_token_id)
        if truncated:
            assert len(tokens) == 5
    mask = comp.mask(5)
    assert mask.sum(-1).tolist() == [len(t) for t in comp.tokens]


def test_generate_stops_finished_rows_and_matches_forced_eos():
    """Make EOS certain after one token: every completion is [x, EOS], none truncated."""
    model, tok = build_tiny(seed=1)
    calls = {"n": 0}
    orig = model.forward

    def forward(*args, **kwargs):
        out = orig(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] > 1:  # after the prefill: force EOS
            out.logits[..., :] = -1e9
            out.logits[..., tok.eos_token_id] = 0
        return out

    model.forward = forward
    comp = generate(model, [tok("1=").input_ids], RolloutConfig(num_generations=4, max_completion_length=6),
                    [tok.eos_token_id], tok.pad_token_id)
    assert all(len(t) == 2 and t[-1] == tok.eos_token_id for t in comp.tokens)
    assert not comp.truncated.any()
    assert calls["n"] == 2  # one prefill for the group, one decode step, then every row left


def test_generation_reuses_one_prefill_per_prompt():
    model, tok = build_tiny(seed=1)
    seen = []
    orig = model.forward

    def forward(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape)
        return orig(*args, **kwargs)

    model.forward = forward
    generate(model, [tok("12=").input_ids, tok("7=").input_ids], RolloutConfig(num_generations=8, max_completion_length=3),
             [tok.eos_token_id], tok.pad_token_id)
    assert seen[0] == (2, 3)  # the prefill: 2 prompts, not 16 rows
    assert all(s[1] == 1 for s in seen[1:])  # then one token per active row


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    torch.manual_seed(0)
    assert set(sample_next(logits, 1.0, 1.0, top_k=2).tolist()) == {2, 3}
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 3.0]), -1)  # [0.032, 0.087, 0.237, 0.644]
    assert p[3] < 0.7 < p[3] + p[2]
    assert set(sample_next(logits, 1.0, 0.7, top_k=0).tolist()) == {2, 3}
    assert set(sample_next(logits, 1.0, 0.5, top_k=0).tolist()) == {3}
