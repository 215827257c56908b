"""scripts/benchmarks/bench.py's real lengths (issue 41, item 4): the recorded distribution, and TRL's side of it
(a logits processor on ``model.generate``) ending rows exactly where ours does (``rollout.forced_eos_lengths``,
tests/test_static_engine.py)."""

from __future__ import annotations

import torch

from grpo.foundation.tiny import build_tiny
from scripts.benchmarks.bench import force_eos_lengths, reasoning_lengths


def test_reasoning_lengths_are_seeded_bounded_and_recorded():
    a, b = reasoning_lengths(512, 256, seed=3), reasoning_lengths(512, 256, seed=3)
    assert a == b and a != reasoning_lengths(512, 256, seed=4)
    n = a["lengths"]
    assert len(n) == 512 and min(n) >= 1 and max(n) == 256
    assert 0.05 < a["share_at_cap"] < 0.15  # the tail that runs to the cap
    assert a["p50"] < 256 / 4 < a["mean"] < 256 / 2  # many short rows, a long tail
    assert a["share_at_cap"] == sum(x == 256 for x in n) / 512 and a["cap"] == 256 and a["seed"] == 3


def test_trl_side_forces_eos_at_the_recorded_lengths():
    """Greedy rows with an EOS the model never picks on its own: every row ends exactly at its recorded length, in
    whatever order generate's rows come (row i takes lengths[i % len])."""
    model, tok = build_tiny(seed=1)
    prompts = torch.tensor([tok("12+3=").input_ids, tok("45+6=").input_ids, tok("7+80=").input_ids])
    plain = model.generate(input_ids=prompts, max_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=tok.pad_token_id)[:, prompts.shape[1]:]
    eos = next(t for t in range(len(tok)) if t not in plain.tolist()[0] + plain.tolist()[1] + plain.tolist()[2]
               and t != tok.pad_token_id)
    lengths = [4, 1, 9, 2]
    force_eos_lengths(model, lengths, eos)
    out = model.generate(input_ids=prompts.repeat_interleave(2, 0), max_new_tokens=10, do_sample=False,
                         eos_token_id=eos, pad_token_id=tok.pad_token_id)[:, prompts.shape[1]:].tolist()
    for i, row in enumerate(out):
        n = lengths[i % len(lengths)]
        assert row[n - 1] == eos and eos not in row[: n - 1], (i, row)
        assert row[: n - 1] == plain.tolist()[i // 2][: n - 1]  # greedy until then: the same tokens


def test_the_matmul_floor_is_measured_on_the_models_own_shapes(tmp_path):
    """Issue 41, item 6: the floor's GEMM rate comes from the model's own shapes (its config.json: hidden, MLP and
    vocabulary sizes; the step's decode rows), not SmolLM2-135M's whatever the model."""
    from grpo.foundation.tiny import write_tiny
    from scripts.benchmarks.bench import matmul_rate, model_shape

    shape = model_shape(write_tiny(tmp_path / "m"))
    rate = matmul_rate(1, shape=shape, decode_rows=8, repeat=1)
    d, ff, V = shape["d"], shape["ff"], shape["vocab"]
    assert set(rate["shapes"]) == {f"qkvo/mlp [2048x{d}]x[{d}x{ff}]", f"mlp down [2048x{ff}]x[{ff}x{d}]",
                                   f"lm head [2048x{d}]x[{d}x{V}]", f"decode [8x{d}]x[{d}x{ff}]"}
    assert rate["peak"] == max(v for k, v in rate["shapes"].items() if not k.startswith("decode")) > 0
