"""Runs that cannot learn are refused; runs that look stuck warn; NaN/inf steps are skipped and stop the
run after train.max_nonfinite_steps in a row; every exit of train.py tears the process group down."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from algos.base import LossOutput
from grpo.foundation.config import ConfigError
from grpo.training.configure import load_config
from grpo.training.health import LearningHealth, TrainingStopped

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


@pytest.mark.parametrize("algo", ["grpo", "dapo", "gpg", "2-grpo"])
def test_one_completion_per_prompt_is_refused_before_any_model_loads(algo):
    with pytest.raises(ConfigError, match=r"rollout.num_generations=1 cannot learn .*num_generations >= 2"):
        load_config(algo=algo, overrides=["rollout.num_generations=1"])


def test_stuck_runs_warn_once_per_cause_after_the_patience(capsys):
    cfg = load_config(overrides=["rollout.max_completion_length=7"])
    health = LearningHealth(cfg, patience=3, main=True)
    stuck = {"completion/truncated_frac": 0.95, "advantage/zero_group_frac": 1.0, "grad_norm": 0.0}
    fine = {"completion/truncated_frac": 0.2, "advantage/zero_group_frac": 0.5, "grad_norm": 0.3}
    assert health.check(1, stuck) == [] and health.check(2, stuck) == []
    assert health.check(3, fine) == []  # the streak is broken
    given = [w for s in range(4, 7) for w in health.check(s, stuck)]
    assert len(given) == 3 and all("step 6, 3 steps in a row" in w for w in given)
    assert any("rollout.max_completion_length=7" in w for w in given)
    assert any("all-equal rewards" in w and "num_generations" in w for w in given)
    assert any("gradient norm is 0" in w for w in given)
    assert [w for s in range(7, 20) for w in health.check(s, stuck)] == []  # once per cause
    assert "WARNING" in capsys.readouterr().err


def test_nan_steps_are_skipped_then_the_run_stops(single_rank_env, tmp_path):
    from grpo.training.trainer import Trainer

    cfg = load_config(DEMO, "grpo", [f"train.output_dir={tmp_path}", "logging.progress_bar=false", "algo.beta=0",
                                     "logging.plot=false", "rollout.prompts_per_step=2", "rollout.num_generations=4",
                                     "reward_pool.num_workers=0", "train.max_nonfinite_steps=2", "train.max_steps=5"])
    tr = Trainer(cfg)
    tr.train_step()  # one good step: Adam has state, the weights moved
    tr.step += 1
    before = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    good_loss = tr.algo.loss

    def nan_loss(logp, mb, norms):
        out = good_loss(logp, mb, norms)
        return LossOutput(out.loss * float("nan"), out.stats)

    tr.algo.loss = nan_loss
    m = tr.train_step()
    tr.step += 1
    assert m["nonfinite_steps"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items()), "a NaN step moved weights"
    assert all(p.grad is None for p in tr.model.parameters())  # the NaN gradients were dropped
    tr.algo.loss = good_loss
    assert tr.train_step()["nonfinite_steps"] == 1.0  # a good step breaks the streak
    tr.step += 1
    tr.algo.loss = nan_loss
    tr.train_step()
    tr.step += 1
    with pytest.raises(TrainingStopped, match=r"step 5: 2 steps in a row had a non-finite loss .*train.lr"):
        tr.train_step()
    tr.close()


def test_every_exit_of_train_py_shuts_the_process_group_down(monkeypatch):
    import train
    from grpo.foundation import dist
    from grpo.training import trainer as trainer_module

    calls = []
    monkeypatch.setattr(dist, "shutdown", lambda wait=True: calls.append(wait))

    class Finishes:
        def __init__(self, cfg, resume=False):
            pass

        def train(self):
            return []

    class Fails(Finishes):
        def train(self):
            raise ConfigError("bad")

    class Stops(Finishes):
        def train(self):
            raise TrainingStopped("nan")

    for cls, code, wait in [(Finishes, 0, True), (Fails, 2, False), (Stops, 3, False)]:
        monkeypatch.setattr(trainer_module, "Trainer", cls)
        assert train.main(["--config", str(DEMO)]) == code
        assert calls.pop() is wait
