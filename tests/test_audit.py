"""The audit of whole next-token distributions (issue 45 item 3, ``logging.audit_every``): the hf engine's top-k of
each drawn token's distribution equals the trainer's full softmax; a fresh sampler audits at ~0 and a deliberately
stale one (tests/stale_engine.py: the policy of step 0, never synced) is flagged with the likely causes; the
reference's audit is ~0 before any update and positive once the policy moved; a reference of other weights is
flagged at step 0; the audit runs only on its steps."""

from __future__ import annotations

import pytest
import torch

from grpo.foundation.tiny import build_tiny
from grpo.rollout.engine import SamplingParams
from grpo.rollout.hf import generate


def test_the_hf_engines_top_k_is_the_trainers_full_softmax():
    """At each drawn token, the k most likely tokens of the distribution it was drawn from (temperature applied),
    against one full forward per row in float64; zeros past each row's end."""
    model, tok = build_tiny(seed=2)
    model = model.double()
    prompts = [[5, 6, 7], [8, 9]]
    params = SamplingParams(max_tokens=6, temperature=0.7, topk_logprobs=4)
    torch.manual_seed(0)
    out = generate(model, prompts, params, [tok.eos_token_id], tok.pad_token_id, n=2)
    assert out.topk_logprobs.shape == (4, 6, 4) and out.topk_ids.shape == (4, 6, 4)
    for r, comp in enumerate(out.tokens):
        p = prompts[r // 2]
        logits = model(input_ids=torch.tensor([p + comp])).logits[0].double() / 0.7
        logsm = torch.log_softmax(logits, -1)
        for t in range(6):
            if t >= len(comp):
                assert not out.topk_logprobs[r, t].any() and not out.topk_ids[r, t].any()
                continue
            top = logsm[len(p) + t - 1].topk(4)
            torch.testing.assert_close(out.topk_logprobs[r, t].double(), top.values, rtol=0, atol=1e-6)
            assert out.topk_ids[r, t].tolist() == top.indices.tolist()
    plain = generate(model, prompts, SamplingParams(max_tokens=6, temperature=0.7), [tok.eos_token_id],
                     tok.pad_token_id, n=2)
    assert plain.topk_logprobs is None


def run(tmp_path, *extra):
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    cfg = load_config("configs/demo.yaml", "grpo", [
        f"train.output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.num_generations=2",
        "reward_pool.num_workers=0", "logging.progress_bar=false", "logging.plot=false", "train.lr=3e-2",
        "logging.audit_every=2", "logging.audit_rows=4", *extra])
    tr = Trainer(cfg)
    return tr, tr.train()


def test_a_fresh_sampler_is_not_flagged_and_the_reference_moves_away(single_rank_env, tmp_path, recwarn):
    """The hf engine samples with the trainer's weights: audit/sampler_kl ~ 0 on every audited step, no warning.
    The reference (the starting weights) audits at ~0 at step 0 and above 0 once the policy has moved."""
    tr, history = run(tmp_path, "train.max_steps=5", "algo.beta=0.04")
    audited = [h for i, h in enumerate(history) if i % 2 == 0]
    assert all("audit/sampler_kl" not in h for i, h in enumerate(history) if i % 2)
    for h in audited:
        assert 0 <= h["audit/sampler_kl"] < 1e-5 and h["audit/sampler_kl_max"] < 1e-4 and h["time/audit"] > 0
    assert audited[0]["audit/reference_kl"] < 1e-5
    assert audited[-1]["audit/reference_kl"] > 1e-4
    assert not [w for w in recwarn if "audit/" in str(w.message)]


def test_a_stale_sampler_is_flagged_naming_the_causes(single_rank_env, tmp_path):
    with pytest.warns(RuntimeWarning, match=r"audit/sampler_kl=\S+ nats > logging.audit_warn_kl=0.01: the generation "
                                            r"engine's next-token distributions are not the trainer's\. Likely cause: "
                                            r"it grew since this run's first audit \(\S+ nats, before any update\), so "
                                            r"stale weights"):
        tr, history = run(tmp_path, "train.max_steps=5", "algo.beta=0", "logging.audit_warn_kl=0.01",
                          "rollout.engine=tests.stale_engine:StaleEngine", "algo.rollout_correction={mode: mask}")
    assert history[0]["audit/sampler_kl"] < 1e-5  # step 0: the frozen copy is still the policy
    assert history[4]["audit/sampler_kl"] > 0.01
    assert "audit/reference_kl" not in history[0]  # no reference in this run (beta 0)


def test_a_reference_of_other_weights_is_flagged_at_step_0(single_rank_env, tmp_path):
    from grpo.foundation.tiny import write_tiny

    other = write_tiny(tmp_path / "other", seed=11)
    with pytest.warns(RuntimeWarning, match=r"step 0: audit/reference_kl=\S+ nats > logging.audit_warn_kl=0.02 "
                                            r"before any update: the reference is not the policy's starting weights"):
        _, history = run(tmp_path, "train.max_steps=1", "algo.beta=0.04", f"ref.model={other}",
                         "logging.audit_top_k=64", "logging.audit_warn_kl=0.02")
    # the top-k KL is a lower bound of the whole KL (the rest lumped in one bucket): a large k for these flat models
    assert 0.02 < history[0]["audit/reference_kl"] < 1.0


def test_a_sampler_that_computes_differently_is_named_so(single_rank_env, tmp_path):
    """A sampler off from the first step (tests/stale_engine.py:SkewedEngine: in sync, another temperature, like
    another dtype or other kernels): the warning says the gap was there before any update, not a missed sync."""
    with pytest.warns(RuntimeWarning, match=r"step 0: audit/sampler_kl=\S+ nats > logging.audit_warn_kl=0.0005: .* Likely "
                                            r"cause: it was there at this run's first audit, before any update, so the "
                                            r"engine computes differently from the trainer: its dtype") as caught:
        _, history = run(tmp_path, "train.max_steps=1", "algo.beta=0", "logging.audit_warn_kl=0.0005",
                         "rollout.engine=tests.stale_engine:SkewedEngine")
    assert history[0]["audit/sampler_kl"] > 0.0005  # (the tiny model's flat distributions: a small KL, measured 1e-3)
    assert not [w for w in caught if "stale weights" in str(w.message)]
