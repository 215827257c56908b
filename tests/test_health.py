"""Runs that cannot learn are refused; runs that look stuck warn; NaN/inf steps are skipped and stop the
run after train.max_nonfinite_steps in a row; every exit of train.py tears the process group down."""

from __future__ import annotations

import gc
import weakref
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


def test_stop_when_needs_a_target_and_a_window():
    with pytest.raises(ConfigError, match=r"train.stop_when.at_least is missing.*at_least: 0.9"):
        load_config(overrides=["train.stop_when={metric: reward/mean}"])
    with pytest.raises(ConfigError, match=r"train.stop_when.window"):
        load_config(overrides=["train.stop_when={at_least: 0.5, window: 0}"])
    with pytest.raises(ConfigError, match=r"threshold"):  # a wrong key names the valid ones
        load_config(overrides=["train.stop_when={threshold: 0.5}"])
    sw = load_config(overrides=["train.stop_when={at_least: 0.5}"]).train.stop_when
    assert (sw.metric, sw.at_least, sw.window, sw.min_steps) == ("reward/mean", 0.5, 5, 0)


def stop_when_run(tmp_path, stop_when: str, steps: int = 6, more: tuple = ()):
    from grpo.training.trainer import Trainer

    cfg = load_config(DEMO, "grpo", [f"train.output_dir={tmp_path}", "logging.progress_bar=false", "algo.beta=0",
                                     "logging.plot=false", "rollout.prompts_per_step=2", "rollout.num_generations=4",
                                     "reward_pool.num_workers=0", f"train.max_steps={steps}", f"train.stop_when={stop_when}",
                                     "train.export_final=false", *more])
    return Trainer(cfg)


def test_stop_when_on_an_evaluation_metric_is_decided_at_the_evaluations(single_rank_env, tmp_path):
    """Issue 42, item 15: ``eval/accuracy`` with ``eval.every: 2`` stopped the run at step 1 ("not logged")."""
    evals = ["eval.every=2", "eval.limit=4", "data.eval_holdout=8"]
    history = stop_when_run(tmp_path, "{metric: eval/accuracy, at_least: -1, window: 2}", more=evals).train()
    assert [h["step"] for h in history] == [1, 2, 3, 4]  # the mean of the last 2 evaluations: after step 4
    assert "eval/accuracy" not in history[0] and "eval/accuracy" in history[1]
    with pytest.raises(ConfigError, match=r"train.stop_when.metric='eval/acuracy' is not logged"):
        stop_when_run(tmp_path / "b", "{metric: eval/acuracy, at_least: 0.5}", more=evals).train()


def test_stop_when_ends_the_run_at_the_target_with_its_final_checkpoint(single_rank_env, tmp_path, capsys):
    from grpo.training.metrics import read_metrics

    # the mean reward of 3 steps is always >= -1: the run ends after step 3 of 6, as if max_steps were 3
    history = stop_when_run(tmp_path, "{metric: reward/mean, at_least: -1, window: 3}").train()
    assert [h["step"] for h in history] == [1, 2, 3]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3
    assert (tmp_path / "checkpoints" / "step-3").is_dir() and not (tmp_path / "checkpoints" / "step-6").exists()
    assert "train.stop_when: the mean of reward/mean over the last 3 steps" in capsys.readouterr().out
    # a target never reached: every step runs
    assert len(stop_when_run(tmp_path / "b", "{at_least: 100, window: 2}").train()) == 6
    # not before min_steps
    assert len(stop_when_run(tmp_path / "c", "{at_least: -1, window: 2, min_steps: 4}").train()) == 4


def test_a_finished_trainer_is_freed_and_the_next_does_not_walk_the_libraries_again(single_rank_env, tmp_path,
                                                                                   monkeypatch):
    """The libraries are frozen out of the collector once per process; a Trainer's own objects are not frozen.
    (Alone or after other tests: the first Trainer of this process may be this one. Frozen objects that a finished
    run drops are freed and leave the frozen count, so the count may fall; it never grows.)"""
    runs = [stop_when_run(tmp_path / "a", "{at_least: 100, window: 1}", steps=1)]
    frozen = gc.get_freeze_count()
    assert frozen > 100_000  # torch, transformers, DeepSpeed...
    freezes = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1) or real_freeze())
    model = weakref.ref(runs[0].model)
    runs.pop().train()
    gc.collect()
    assert model() is None, "the finished Trainer's model is still alive"
    runs.append(stop_when_run(tmp_path / "b", "{at_least: 100, window: 1}", steps=1))
    assert freezes == [] and gc.get_freeze_count() <= frozen  # nothing of the first run was frozen by the second
    assert len(runs.pop().train()) == 1


def test_stop_when_on_a_metric_the_steps_do_not_log_names_the_ones_they_do(single_rank_env, tmp_path):
    with pytest.raises(ConfigError, match=r"train.stop_when.metric='reward/meen' is not logged .*'reward/mean'"):
        stop_when_run(tmp_path, "{metric: reward/meen, at_least: 0.5}").train()


def test_every_exit_of_train_py_shuts_the_process_group_down(monkeypatch):
    import train
    from grpo.foundation import dist
    from grpo.training import trainer as trainer_module

    calls = []
    monkeypatch.setattr(dist, "shutdown", lambda wait=True: calls.append(wait))

    class Finishes:
        def __init__(self, cfg, resume=False, parts=None):
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


def test_a_second_run_in_the_same_process_trains(single_rank_env, tmp_path):
    """A notebook runs train.main twice: the first run's exit tears its process group down, DeepSpeed's cached
    groups with it (they were kept, and the second run's engine failed on "Group ... is not registered")."""
    import train
    from grpo.foundation import dist

    args = ["--config", str(DEMO), "train.max_steps=1", "rollout.prompts_per_step=2", "rollout.num_generations=2",
            "logging.progress_bar=false", "logging.plot=false", "reward_pool.num_workers=0"]
    for run in ("first", "second"):
        assert train.main([*args, f"train.output_dir={tmp_path / run}"]) == 0, run
        assert not dist.is_initialized()
        assert (tmp_path / run / "metrics.jsonl").read_text().count("\n") == 1


def test_an_outside_failure_inside_process_batch_stops_every_rank(tmp_path):
    """Issue 58 item 15: a reward service failing on one rank inside the algorithm's process_batch hook (remax's greedy
    scoring, dapo's refill) was not agreed across ranks: the other rank went on into the hook's next collective (or
    the next phase's) and waited there. Both ranks now stop on the error together (tests/together_worker.py)."""
    import json

    from tests.conftest import run_deepspeed

    run_deepspeed([str(tmp_path)], 2, "tests/together_worker.py", launcher="torchrun")
    for name in ("remax", "dapo"):
        ranks = [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["stopped"] == "RewardServiceError: test: the reward service is gone (rank 0 only)", ranks
        assert ranks[1]["stopped"].startswith("RewardServiceError: another rank's reward service failed"), ranks
        assert ranks[0]["scorings"] == 2, ranks  # it failed inside the hook, not in the step's own scoring


def test_ctrl_c_saves_the_step_in_progress_and_says_how_to_resume(tmp_path):
    """Issue 60 item 7: Ctrl-C lost the steps since the last save and printed two KeyboardInterrupt tracebacks. The
    first Ctrl-C finishes the step in progress, saves it, and prints one line with --resume; the run resumes there."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--config", "configs/demo.yaml", f"train.output_dir={out}", "train.max_steps=500",
           "train.save_every=0", "reward_pool.num_workers=1", "logging.progress_bar=false", "logging.plot=false"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and stderr.count("KeyboardInterrupt") == 0, stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    assert f"interrupted after step {last}, saved in {out / 'checkpoints' / f'step-{last}'}" in stderr, stderr[-2000:]
    assert "--resume" in stderr and last >= 2
    resumed = subprocess.run(cmd[:-4] + [f"train.max_steps={last + 1}", "reward_pool.num_workers=0",
                                         "logging.progress_bar=false", "logging.plot=false", "--resume"],
                             cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == last + 1 and steps.count(last) == 1, steps  # continued from the saved step


@pytest.mark.parametrize("algo, overrides, named", [("grpo", [], False), ("dapo", [], False),
                                                    ("dapo", ["algo.overlong_filter=true"], True)])
def test_the_truncation_warning_names_the_overlong_filter_only_where_it_runs(algo, overrides, named):
    """Issue 60 item 10: the demo's GRPO run was told about "DAPO's overlong filter"; it is named where the run's
    algorithm filters overlong completions."""
    health = LearningHealth(load_config(algo=algo, overrides=overrides), patience=1, main=False)
    (warning,) = health.check(1, {"completion/truncated_frac": 0.95})
    assert "hit rollout.max_completion_length=256 without EOS" in warning
    assert ("algo.overlong_filter drops them from the loss" in warning) == named and "DAPO" not in warning


def test_health_skip_silences_the_checks_a_run_expects_and_says_so(capsys):
    """Issue 60 item 10: the demo warned at step 5 against its own 3-token cap (its random model hits it until it
    learns to stop). logging.health_skip names the checks a run expects to fail: said at the start, the others
    still warn; a name that is no check is refused with the valid ones; the demo skips truncation."""
    cfg = load_config(overrides=["logging.health_skip=[truncation]"])
    health = LearningHealth(cfg, patience=1, main=True)
    assert "logging.health_skip: no warning for truncation in this run" in capsys.readouterr().out
    (warning,) = health.check(1, {"completion/truncated_frac": 1.0, "grad_norm": 0.0})
    assert "gradient norm is 0" in warning
    with pytest.raises(ConfigError, match=r"logging.health_skip\[0\]='truncated' is not a check: choose from "
                                          r"\['reward_errors', 'truncation', 'zero_advantage'"):
        load_config(overrides=["logging.health_skip=[truncated]"])
    demo = LearningHealth(load_config(DEMO), patience=1, main=False)
    assert demo.check(1, {"completion/truncated_frac": 1.0}) == []
