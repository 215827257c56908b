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


def test_the_preflight_check_stops_a_sampler_that_computes_differently_before_any_update(single_rank_env, tmp_path):
    """issue 60 item 20: on by default, one audit before the first update (audit_every 0 here): a sampler off from
    the first step (SkewedEngine, measured ~1e-3 nats on these flat models) stops the run naming the likely causes
    and the way out; under the default limit it runs, the pre-flight's metrics at step 0 only."""
    from grpo.training.audit import PreflightError

    with pytest.raises(PreflightError, match=r"pre-flight check, step 0, before any update: audit/sampler_kl=\S+ nats "
                                             r"between the generation engine's next-token distributions and the "
                                             r"trainer's, with the same weights \(logging.preflight_kl=0.0005 nats; "
                                             r"logging.preflight=false runs anyway\). Likely cause: the engine computes "
                                             r"differently from the trainer: its dtype"):
        run(tmp_path / "a", "train.max_steps=2", "algo.beta=0", "logging.audit_every=0",
            "logging.preflight_kl=0.0005", "rollout.engine=tests.stale_engine:SkewedEngine")
    _, history = run(tmp_path / "b", "train.max_steps=3", "algo.beta=0", "logging.audit_every=0",
                     "rollout.engine=tests.stale_engine:SkewedEngine")
    assert 0.0005 < history[0]["audit/sampler_kl"] < 0.1 and history[0]["time/audit"] > 0
    assert not any(k.startswith("audit/") for h in history[1:] for k in h)
    _, history = run(tmp_path / "c", "train.max_steps=1", "algo.beta=0", "logging.audit_every=0",
                     "logging.preflight=false")
    assert not any(k.startswith("audit/") for k in history[0])


def test_the_preflight_check_stops_a_reference_of_other_weights(single_rank_env, tmp_path):
    from grpo.foundation.tiny import write_tiny
    from grpo.training.audit import PreflightError

    other = write_tiny(tmp_path / "other", seed=11)
    with pytest.raises(PreflightError, match=r"audit/reference_kl=\S+ nats between the reference and the policy's "
                                             r"starting weights \(logging.preflight_kl=0.02 nats; .*Likely cause: the "
                                             r"reference is another model \(ref.model='.*other'"):
        run(tmp_path, "train.max_steps=1", "algo.beta=0.04", f"ref.model={other}", "logging.audit_top_k=64",
            "logging.audit_every=0", "logging.preflight_kl=0.02")


def test_the_preflight_audits_the_first_step_of_a_run_and_checks_the_reference_only_when_fresh():
    """A resumed run's first step is its checkpoint's, and its policy has moved from the reference by design;
    streamed rollouts are judged on the current weights' tokens."""
    from grpo.training.audit import Audit, PreflightError
    from grpo.training.configure import load_config

    cfg = load_config(None, "grpo", ["logging.audit_every=0"])
    fresh, resumed = Audit(cfg), Audit(cfg, first_step=40, fresh=False)
    assert fresh.top_k(0) == cfg.logging.audit_top_k and fresh.top_k(1) == 0
    assert resumed.top_k(40) == cfg.logging.audit_top_k and resumed.top_k(0) == resumed.top_k(41) == 0
    assert Audit(load_config(None, "grpo", ["logging.preflight=false"])).top_k(0) == 0
    far = {"audit/reference_kl": 0.5, "audit/sampler_kl": 0.01}
    resumed._preflight(40, far)  # no error: a resumed policy has moved from the reference
    with pytest.raises(PreflightError, match="audit/reference_kl=0.5 nats"):
        fresh._preflight(0, far)
    fresh._preflight(0, {"audit/sampler_kl": 0.5, "audit/sampler_kl_behind_0": 0.01})  # stale tokens: by design
    with pytest.raises(PreflightError, match="audit/sampler_kl_behind_0=0.5 nats"):
        fresh._preflight(0, {"audit/sampler_kl": 0.01, "audit/sampler_kl_behind_0": 0.5})


def test_rows_an_algorithm_rewrote_are_not_held_against_the_sampler(single_rank_env, tmp_path):
    """EDGE-GRPO's guided correction rewrites wrong completions with tokens the engine never drew: the audit's sampler
    KL and sampler_gap cover the drawn rows only (before, the rewritten rows' stale top-k gave the pre-flight 6.7
    nats on two ranks and stopped the run), while the reference audit still covers every row."""
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    tr = Trainer(load_config("configs/edge-grpo.yaml", "edge-grpo", [
        f"train.output_dir={tmp_path}", "rollout.prompts_per_step=4", "rollout.num_generations=4",
        "reward_pool.num_workers=0", "logging.progress_bar=false", "logging.plot=false", "train.max_steps=2",
        "rollout.engine=static", "model.dtype=fp32", "logging.audit_every=1", "logging.audit_rows=16",
        "train.save_every=0", 'rewards=[{fn: "tests.reward_fixtures:length_bonus"}]',
        "algo.correct_threshold=8"]))  # the rows cut short by an EOS are "wrong": rewritten, the others kept
    try:
        history = tr.train()
    finally:
        tr.close()
    assert 0 < history[0]["edge/corrected_frac"] < 1  # step 0 (measured: 3 of 16 rows) rewritten, the rest drawn
    assert all(h["audit/sampler_kl_max"] < 1e-4 and h["sampler_gap/max"] < 1e-3 for h in history)
