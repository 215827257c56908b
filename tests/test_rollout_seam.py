"""The rollout seam: an engine named in the config generates for the trainer, which syncs it after
every optimizer step; the service's collective helpers; bad engine names fail before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo.foundation.config import ConfigError
from grpo.foundation.tiny import build_tiny
from grpo.rollout.engine import EngineSetup, SamplingParams
from grpo.rollout.service import RolloutService, engine_class
from grpo.training.configure import load_config
from tests import scripted_engine

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def test_a_scripted_engine_trains_through_the_config(single_rank_env, tmp_path):
    from grpo.training.trainer import Trainer

    scripted_engine.CALLS["generate"].clear()
    scripted_engine.CALLS["sync_weights"].clear()
    cfg = load_config(DEMO, "grpo", [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false", "train.max_steps=3",
        "rollout.prompts_per_step=4", "rollout.num_generations=4", "reward_pool.num_workers=0", "algo.beta=0",
        "rollout.engine=tests.scripted_engine:ScriptedEngine", "algo.tis_cap=2.0"])
    tr = Trainer(cfg)
    assert type(tr.rollout.engine).__name__ == "ScriptedEngine"
    history = tr.train()
    calls = scripted_engine.CALLS
    assert len(history) == 3 and len(calls["generate"]) == 3 and len(calls["sync_weights"]) == 3
    assert all(n == 4 and G == 4 and p.max_tokens == 3 for n, G, p in calls["generate"])
    # the demo task copies the prompt's digits: the scripted even rows are right, the odd ones wrong
    assert all(h["reward/mean"] == pytest.approx(0.5) for h in history)
    b = tr._last_batch
    assert b.rewards.tolist() == [1.0, 0.0] * 8
    assert b.sampler_logp is not None and torch.equal(b.sampler_logp, -0.5 * b.mask)
    assert all(torch.isfinite(torch.tensor(h["loss"])) and h["grad_norm"] > 0 for h in history)
    assert "time/weight_sync" in history[0]
    assert all(h["time/gc"] >= 0 and h["time/outlier"] in (0.0, 1.0) for h in history)  # the step-time watch
    # the engine's made-up log-probs (-0.5) against the trainer's: a gap is logged, TIS weights the loss
    for h in history:
        assert 0 < h["sampler_gap/mean"] <= h["sampler_gap/max"] and 0 < h["tis/weight_mean"] <= 2.0


def test_unknown_or_incomplete_engines_fail_with_the_choices(single_rank_env, tmp_path):
    from grpo.training.trainer import Trainer

    with pytest.raises(ConfigError,
                       match=r"rollout.engine='vlm' is unknown: choose from \['auto', 'hf', 'static', 'vllm'\]"):
        engine_class("vlm")
    with pytest.raises(ConfigError, match="cannot be imported"):
        engine_class("tests.no_such_module:Engine")
    with pytest.raises(ConfigError, match=r"lacks \['generate', 'sync_weights'\]"):
        engine_class("tests.scripted_engine:CALLS")
    with pytest.raises(ConfigError, match="rollout.engine is empty"):
        load_config(overrides=["rollout.engine= "])
    cfg = load_config(DEMO, "grpo", [f"train.output_dir={tmp_path}", "rollout.engine=nope", "algo.beta=0"])
    with pytest.raises(ConfigError, match="rollout.engine='nope'"):
        Trainer(cfg)


def test_continue_sequences_extends_each_row_within_its_room():
    model, tok = build_tiny(seed=2)
    cfg = load_config(overrides=["rollout.max_completion_length=6"])
    eos = tok.eos_token_id
    service = RolloutService(EngineSetup(cfg, model, tok, [eos], tok.pad_token_id))
    prompts = [tok("12=").input_ids, tok("345=").input_ids, tok("6=").input_ids]
    prefixes = [tok("1", add_special_tokens=False).input_ids, [], tok("99", add_special_tokens=False).input_ids]
    torch.manual_seed(0)
    out = service.continue_sequences(prompts, prefixes, [2, 5, 1])
    assert [len(t) <= r for (t, _), r in zip(out, [2, 5, 1])] == [True] * 3
    for toks, truncated in out:
        assert truncated == (eos not in toks) and eos not in toks[:-1]
    assert service.continue_sequences([], [], []) == []  # nothing to do: no forward pass (one rank)
    assert service.collective_rounds(3) == 3  # not under ZeRO-3: no collective
    assert SamplingParams.from_rollout(cfg.rollout).greedy().top_k == 1


def test_the_vllm_engine_without_vllm_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed (an import of it raises ImportError)
    with pytest.raises(ConfigError, match=r'rollout.engine=vllm needs the vllm extra.*pip install -e "\.\[vllm\]"'):
        engine_class("vllm")
