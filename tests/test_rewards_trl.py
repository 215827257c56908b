"""Reward functions in TRL's shape: keyword arguments, columns, completion_ids, trainer_state, None, async.

The expected values are written by hand the way TRL's GRPOTrainer._calculate_rewards computes them: each
function's None becomes nan, and a row's reward is the nansum over functions of weight * value (0 when every
function skipped the row). A reward that fails on most rows stops a real training run within a few steps.
"""

import math
import time
from pathlib import Path

import pytest

from grpo.foundation.config import ConfigError, RewardPoolConfig, RewardSpec
from grpo.training.configure import load_config
from grpo.training.health import LearningHealth, RewardFailureGuard, RewardsFailing
from grpo.scoring.combined import CombinedReward

ROOT = Path(__file__).resolve().parent.parent
F = "tests.reward_fixtures:"
RAW = ["12=", "12=", "skip 3=", "skip 3="]
COMPLETIONS = ["12", "1", "", "3"]
IDS = [[5, 6, 0], [5], [0], [7, 0]]
COLUMNS = {"answer": ["12", "12", "3", "3"]}


def combined(specs, workers=1, timeout=10.0, chunk=0):
    return CombinedReward([RewardSpec(**s) for s in specs], RewardPoolConfig(workers, timeout, chunk))


def nan_equal(a, b):
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


@pytest.mark.parametrize("isolation,workers", [("process", 2), ("inline", 2), ("process", 0)])
def test_trl_shaped_functions_give_trls_weighted_nansum(isolation, workers):
    r = combined([{"fn": F + "trl_id_count", "isolation": isolation},
                  {"fn": F + "trl_exact", "weight": 2.0, "isolation": isolation},
                  {"fn": F + "trl_async_half", "weight": 4.0, "isolation": isolation},
                  {"fn": F + "plain_positional", "weight": 0.5, "isolation": isolation}], workers=workers)
    try:
        styles = {t.name: t.style for t in r.terms}
        assert styles == {"trl_id_count": "trl", "trl_exact": "trl", "trl_async_half": "trl",
                          "plain_positional": "plain"}
        total, per_fn = r(["<templated>"] * 4, COMPLETIONS, COLUMNS, raw_prompts=RAW, completion_ids=IDS)
        nan = math.nan
        assert nan_equal(per_fn["trl_id_count"], [3.0, 1.0, nan, nan])
        assert per_fn["trl_exact"] == [1.0, 0.0, 0.0, 1.0]
        assert nan_equal(per_fn["trl_async_half"], [0.5, 0.5, nan, 0.5])
        assert per_fn["plain_positional"] == [2.0, 2.0, 0.0, 0.0]
        # row 0: 3 + 2*1 + 4*0.5 + 0.5*2 = 8; row 1: 1 + 0 + 2 + 1 = 4; row 2: 0 + 0 (both others None) = 0;
        # row 3: (None) + 2*1 + 4*0.5 + 0 = 4
        assert total == [8.0, 4.0, 0.0, 4.0]
        m = r.pop_metrics()
        assert m["reward/trl_id_count/skipped"] == 2.0 and m["reward/trl_async_half/skipped"] == 1.0
        assert m["reward/trl_exact/skipped"] == 0.0 and m["reward/trl_exact/errors"] == 0.0
        assert all(m[f"reward/{n}/latency"] > 0 for n in styles)
    finally:
        r.close()


def test_trls_factory_rewards_taking_completion_ids_get_trls_call():
    """Issue 42, item 21: ``__call__(self, completion_ids, **kwargs)`` (TRL's get_soft_overlong_punishment) got
    the positional call under ``style: auto`` and was refused."""
    r = combined([{"fn": F + "trl_factory_object"}, {"fn": F + "trl_factory_function"}], workers=0)
    assert [t.style for t in r.terms] == ["trl", "trl"]
    r.check_columns(["answer"])
    total, per_fn = r(["t"] * 4, COMPLETIONS, COLUMNS, raw_prompts=RAW, completion_ids=IDS)
    want = [-max(0.0, len(ids) - 1) for ids in IDS]
    assert per_fn["trl_factory_object"] == want and per_fn["trl_factory_function"] == want
    plain = combined([{"fn": F + "trl_factory_object", "style": "plain"}], workers=0)
    with pytest.raises(ConfigError, match="style: trl"):  # forced to the other call: the error names the fix
        plain.check_columns(["answer"])


def test_a_row_every_function_skips_scores_zero_and_conversations_arrive_as_messages():
    r = combined([{"fn": F + "trl_id_count"}, {"fn": F + "trl_async_half", "weight": 3.0}], workers=0)
    total, per_fn = r(["t"] * 4, COMPLETIONS, COLUMNS, raw_prompts=RAW, completion_ids=IDS)
    assert total == [3.0 + 1.5, 1.0 + 1.5, 0.0, 1.5]  # row 2: both None -> 0, like TRL's nansum
    chat = [[{"role": "user", "content": "12="}]] * 2
    r2 = combined([{"fn": F + "trl_exact"}, {"fn": F + "trl_no_kwargs", "weight": 10.0}], workers=1)
    try:
        total, _ = r2(["t", "t"], ["12", "x"], {"answer": ["12", "12"]}, raw_prompts=chat, completion_ids=[[1], [2]])
        # trl_exact reads c[0]["content"]; trl_no_kwargs gets len(message list) = 1 per row
        assert total == [1.0 + 10.0, 0.0 + 10.0]
    finally:
        r2.close()


def test_trainer_state_is_the_step_and_spec_kwargs_are_passed():
    r = combined([{"fn": F + "trl_step"}, {"fn": F + "trl_async_half", "kwargs": {"delay": 0.01}}], workers=0)
    r.set_state(7, 10)
    total, per_fn = r(["t"], ["a"], {}, raw_prompts=["p"], completion_ids=[[1]])
    assert per_fn["trl_step"] == [7.0] and total == [7.5]


def test_async_functions_inline_run_concurrently():
    """Each call scores only once all three are in flight together: one after another, none would."""
    specs = [{"fn": F + "trl_async_meet", "isolation": "inline", "kwargs": {"group": "inline-3"}}] * 3
    r = combined(specs, workers=0)
    total, _ = r(["t"] * 2, ["a", "b"], {}, raw_prompts=["p", "p"], completion_ids=[[1], [2]])
    assert total == [1.5, 1.5] and [t.name for t in r.terms] == ["trl_async_meet", "trl_async_meet_2",
                                                                 "trl_async_meet_3"]


def test_an_inline_async_call_past_its_timeout_is_a_timeout():
    r = combined([{"fn": F + "trl_async_half", "isolation": "inline", "timeout": 0.2, "kwargs": {"delay": 600}}],
                 workers=0)
    t0 = time.perf_counter()
    total, _ = r(["t"], ["a"], {}, raw_prompts=["p"], completion_ids=[[1]])
    assert time.perf_counter() - t0 < 120 and total == [0.0], "the 600 s call outlived its 0.2 s timeout"
    assert r.pop_metrics()["reward/trl_async_half/timeouts"] == 1.0


def test_style_and_kind_keys_are_validated():
    with pytest.raises(ConfigError, match=r"rewards\[0\] must name exactly one of fn, model or url"):
        load_config(overrides=["rewards=[{weight: 2}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].style=.* choose from \['auto', 'trl', 'plain'\]"):
        load_config(overrides=["rewards=[{fn: digits_match, style: keywords}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].label is a key of model rewards; this entry is a fn"):
        load_config(overrides=["rewards=[{fn: digits_match, label: good}]"])


def test_a_function_failing_on_most_rows_stops_with_its_error_and_the_fix():
    r = combined([{"fn": F + "trl_needs_solution"}, {"fn": "digits_match"}], workers=0)
    guard = RewardFailureGuard(limit=2)
    for step in (1, 2):
        r(["t"] * 2, ["12", "3"], COLUMNS | {"answer": ["12", "4"]}, raw_prompts=["12=", "3="], completion_ids=[[1], [2]])
        m = r.pop_metrics()
        assert m["reward/trl_needs_solution/failed_frac"] == 1.0 and m["reward/digits_match/failed_frac"] == 0.0
        if step == 1:
            guard.check(step, m, r)
    with pytest.raises(RewardsFailing) as e:
        guard.check(2, m, r)
    text = str(e.value)
    assert "reward 'trl_needs_solution' failed on 100% of its rows, 2 steps in a row" in text
    assert "missing 1 required positional argument: 'solution'" in text  # the function's own error
    assert "fix: the function needs an argument the call does not give" in text and "['answer']" in text


def test_the_health_warning_tells_reward_errors_from_a_hard_task(capsys):
    cfg = load_config()
    health = LearningHealth(cfg, patience=2, main=True)
    broken = {"advantage/zero_group_frac": 1.0, "reward/f/failed_frac": 1.0, "grad_norm": 0.1}
    given = [w for s in (1, 2) for w in health.check(s, broken)]
    assert len(given) == 1 and "the rewards are broken, not the task" in given[0]
    hard = LearningHealth(cfg, patience=2, main=True)
    given = [w for s in (1, 2) for w in hard.check(s, {**broken, "reward/f/failed_frac": 0.0})]
    assert len(given) == 1 and "task is too hard" in given[0]


def test_a_real_run_with_a_reward_that_always_fails_exits_nonzero_within_two_steps(single_rank_env, tmp_path, capsys):
    """train.py's entry (train.main, in this process: what `python train.py` runs and exits with), reward workers
    and all."""
    import train

    args = ["--config", str(ROOT / "configs" / "demo.yaml"), "train.max_steps=50", "rollout.prompts_per_step=2",
            "rollout.num_generations=2", "algo.beta=0", "logging.progress_bar=false", "logging.plot=false",
            "reward_pool.num_workers=1"]
    run = lambda fn, out: train.main([*args, f"train.output_dir={tmp_path / out}", f"rewards=[{{fn: {F}{fn}}}]"])
    rc, (out, err) = run("trl_always_raises", "raises"), capsys.readouterr()
    assert rc == 3, err[-3000:]  # "within two steps": the message below names step 2
    assert "training stopped: step 2: reward 'trl_always_raises' failed on 100% of its rows" in err
    assert "ValueError: this judge is misconfigured" in err
    # a function the dataset's columns cannot call is refused at start, before the model loads (issue 30,
    # item 20: it used to fail on every row until the guard above stopped the run)
    rc, (out, err) = run("trl_needs_solution", "columns"), capsys.readouterr()
    assert rc == 2, err[-3000:]
    assert ("config error: rewards[0].fn='tests.reward_fixtures:trl_needs_solution' cannot be called with this "
            "dataset's columns ['answer'] (trl style): missing a required argument: 'solution'") in err
    assert "policy " not in out  # the trainer prints the policy it loaded: it loaded none


def test_reward_columns_are_checked_against_each_functions_parameters():
    r = combined([{"fn": F + "trl_needs_solution"}, {"fn": "digits_match"}, {"fn": F + "plain_positional"}], workers=0)
    r.check_columns(["answer", "solution"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].*missing a required argument: 'solution'.*data.columns"):
        r.check_columns(["answer"])
    with pytest.raises(ConfigError, match=r"rewards\[1\].fn='digits_match'.*multiple values for argument 'completions'"):
        r.check_columns(["answer", "solution", "completions"])  # a column named like a parameter
    # issue 42, item 12: a column named like a setting (gold, tag, correct) bound, then every row failed
    m = combined([{"fn": "math_correct"}], workers=0)
    for column in ("gold", "tag", "correct", "extract"):
        with pytest.raises(ConfigError, match=rf"rewards\[0\].fn='math_correct'.*the column '{column}' would be "
                                              rf"passed as its setting '{column}'"):
            m.check_columns(["answer", column])
