"""Partial rollouts with a bound (grpo/rollout/stream.py, issue 56): the static and hf engines' stop and per-row
room, and the stream that hands out whole groups while the other rows carry on."""

import itertools
import warnings

import pytest
import torch

from grpo.rollout import static
from grpo.rollout.engine import SamplingParams
from grpo.rollout.hf import HFEngine
from grpo.rollout.stream import Stream
from tests.test_static_engine import PROMPTS, build, eos_mid_run, setup_for


def feed_of(prompts):
    """An endless feed cycling over ``prompts``: (ids, item) with the item the issue number."""
    counter = itertools.count()

    def feed(n):
        return [(prompts[i % len(prompts)], i) for i in (next(counter) for _ in range(n))]

    return feed


def engine_of(kind, model, overrides=(), eos=(2,)):
    """The static engine (host reads every step) or the hf engine (which reads every step on a CPU), with the
    sampler's log-probs (a streamed run has a correction, so the hf engine keeps them)."""
    setup = setup_for(model, ["rollout.static.check_every=1", "algo.tis_cap=2.0", *overrides], eos=eos)
    return static.StaticEngine(setup) if kind == "static" else HFEngine(setup)


@pytest.mark.parametrize("kind", ["static", "hf"])
def test_stop_returns_the_unfinished_rows_as_they_stand_and_room_caps_each_prompt(kind):
    """``stop`` ends the call at a host read, the rows still decoding returned with their tokens so far (a prefix of
    the rows they draw uncut under greedy decoding), ``stopped`` set, not truncated; ``room`` ends a prompt's rows
    at its own count."""
    model = build("qwen2")
    eos = eos_mid_run(model, PROMPTS)
    greedy = SamplingParams(max_tokens=12).greedy()
    engine = engine_of(kind, model, eos=(eos,))
    full = engine.generate(PROMPTS, greedy, 2)
    assert full.stopped is None
    seen = []
    cut = engine.generate(PROMPTS, greedy, 2, stop=lambda done: seen.append(list(done)) or len(done) >= 1)
    assert cut.stopped is not None and cut.stopped.any() and not cut.truncated[cut.stopped].any()
    for a, b, stopped in zip(cut.tokens, full.tokens, cut.stopped.tolist()):
        assert a == b if not stopped else (b[: len(a)] == a and len(a) < len(b))
    assert seen and len(seen[-1]) >= 1
    capped = engine.generate(PROMPTS, greedy, 2, room=[3, 12, 5])
    assert [len(t) <= c for t, c in zip(capped.tokens, [3, 3, 12, 12, 5, 5])]
    assert [t for t in capped.tokens] == [b[: c] for b, c in zip(full.tokens, [3, 3, 12, 12, 5, 5])]
    with pytest.raises(ValueError, match="room: one count per prompt in 1..12"):
        engine.generate(PROMPTS, greedy, 2, room=[3, 13, 5])


@pytest.mark.parametrize("kind,slots", [("static", 0), ("static", 4), ("hf", 0), ("hf", 4)])
def test_greedy_rows_carried_across_calls_are_the_rows_one_call_draws(kind, slots):
    """K = 2, one group a step: the other groups' rows stop part-way and carry on at the next call, fed again as
    prompt + tokens so far. Under greedy decoding (the weights unchanged) each group handed out holds exactly the
    rows one uncut call draws; every issued group is handed out once, oldest whole group first."""
    model = build("qwen2")
    eos = eos_mid_run(model, PROMPTS)
    greedy = SamplingParams(max_tokens=12).greedy()
    engine = engine_of(kind, model, [f"rollout.slots={slots}"] if slots else [], eos=(eos,))
    want = {tuple(p): engine.generate([p], greedy, 3).tokens for p in PROMPTS}
    stream = Stream(engine, greedy, group_size=3, groups_per_step=1, max_staleness=2, feed=feed_of(PROMPTS))
    served, carried = [], 0
    for version in range(8):
        (g,) = stream.next(version)
        carried += stream.pop_metrics([g], version)["rollout/carried_rows"]
        assert [r.tokens for r in g.rows] == want[tuple(g.prompt)]
        assert all(r.done and len(r.versions) == len(r.tokens) == len(r.logprobs) for r in g.rows)
        served.append(g.serial)
    assert carried > 0 and stream.counts["regenerated"] == 0  # nothing stale: each group waits at most 2 steps
    assert len(set(served)) == 8 and set(served) <= set(range(stream.serial))


@pytest.mark.parametrize("slots", [0, 4])
def test_kept_caches_carry_rows_on_without_feeding_them_again(slots):
    """rollout.carried_kv: keep (hf engine): a cut row's cache is kept and the next call feeds only its last token.
    With the weights unchanged (greedy, float64) the groups are exactly the rows one uncut call draws, as with the
    prefill; every carried token is served from a kept cache (rollout/kept_tokens), none prefilled again."""
    model = build("qwen2")
    eos = eos_mid_run(model, PROMPTS)
    greedy = SamplingParams(max_tokens=12).greedy()
    engine = engine_of("hf", model, ["rollout.engine=hf", "rollout.max_staleness=2", "rollout.carried_kv=keep",
                                     *([f"rollout.slots={slots}"] if slots else [])], eos=(eos,))
    want = {tuple(p): engine.generate([p], greedy, 3).tokens for p in PROMPTS}
    engine.pop_metrics()
    stream = Stream(engine, greedy, group_size=3, groups_per_step=1, max_staleness=2, feed=feed_of(PROMPTS))
    held = []
    generate = engine.generate

    def counted(prompts, *args, **kw):  # the carried tokens each call is given
        held.append(sum(len(r.tokens) for g in stream.pending for r in g.rows if not r.done))
        return generate(prompts, *args, **kw)

    engine.generate = counted
    for version in range(8):
        (g,) = stream.next(version)
        assert [r.tokens for r in g.rows] == want[tuple(g.prompt)]
        engine.sync_weights()  # the carried caches stay
        engine.offload()
    kept = engine.pop_metrics()["rollout/kept_tokens"]
    assert sum(held) > 0 and kept >= sum(held)


@pytest.mark.parametrize("kind,slots", [("static", 2), ("hf", 0), ("hf", 2)])
def test_a_step_waits_for_a_group_k_versions_behind_rather_than_let_it_go_stale(kind, slots):
    """K = 1, two slots, one group a step; one recorded length is the cap: the step that would leave that group's
    rows two versions behind waits for them instead (no group drawn again, none dropped), so no token handed out is
    more than one version behind, and every row ends with its EOS."""
    model = build("qwen2")
    params = SamplingParams(max_tokens=40, temperature=1.0, forced_eos_lengths=(2, 3, 40, 2, 3, 2))
    engine = engine_of(kind, model, [f"rollout.slots={slots}"])
    stream = Stream(engine, params, group_size=3, groups_per_step=1, max_staleness=1, feed=feed_of(PROMPTS))
    carried = 0
    for version in range(10):
        (g,) = stream.next(version)
        m = stream.pop_metrics([g], version)
        carried += m["rollout/carried_rows"]
        assert m["rollout/staleness_max"] <= 1 and m["rollout/regenerated"] == 0
        assert all(version - v <= 1 for r in g.rows for v in r.versions)
        # each row ends at its recorded length, or before it at the model's own EOS
        assert all(len(r.tokens) <= params.forced_eos_lengths[(g.serial * 3 + j) % 6] and r.tokens[-1] == 2
                   for j, r in enumerate(g.rows))
    assert carried > 0


@pytest.mark.parametrize("kind", ["static", "hf"])
def test_a_whole_group_left_more_than_k_versions_behind_is_drawn_again(kind):
    """Whole groups beyond a step's share wait; one that is then more than K versions behind starts again from
    its prompt (counted) and is handed out only with fresh tokens."""
    model = build("qwen2")
    params = SamplingParams(max_tokens=4, temperature=1.0)
    engine = engine_of(kind, model)
    stream = Stream(engine, params, group_size=2, groups_per_step=1, max_staleness=1, feed=feed_of(PROMPTS))
    first = stream.next(0)[0]
    assert stream.pending and all(g.whole for g in stream.pending)  # no stop: the second group finished too
    late = stream.pending[0]
    old = [list(r.tokens) for r in late.rows]
    got = stream.next(2)[0]  # two updates later: the waiting group is 2 versions behind
    m = stream.pop_metrics([got], 2)
    assert m["rollout/regenerated"] == 1 and got is late and got.serial != first.serial
    assert all(v == 2 for r in got.rows for v in r.versions) and len(old) == 2


def test_streaming_draws_more_tokens_a_decode_step_at_reasoning_lengths():
    """Issue 56's CPU measure at a smaller size (scripts/benchmarks/bench_stream.py; docs/results.md has the figures):
    8 groups x 8 rows a step, EOS at reasoning-like recorded lengths (10% at the 64-token cap). A step at a time
    (today's trainer) decodes about 14 tokens a decode step; streaming with K = 1 over 64 slots about 1.8x that and
    K = 2 about 2.8x, every token at most K versions behind. (K = 1 cannot reach 2.5x at these lengths: a row at the
    cap needs 64 decode steps within K + 1 = 2 steps, so a step runs at least 32 of them for its ~1,100 tokens.)"""
    from scripts.benchmarks.bench_stream import measure

    model = build("qwen2", dtype=torch.float32)
    prompts = [[3 + i % 31, 3 + (7 * i) % 31, 3 + (3 * i) % 31] for i in range(48)]
    res = measure(model, 2, prompts, groups=8, G=8, cap=64, steps=4, runs=[(1, 64, 1), (2, 64, 1)])
    today, k1, k2 = res["today"], res["K=1,slots=64,check=1"], res["K=2,slots=64,check=1"]
    assert k1["staleness_max"] <= 1 and k2["staleness_max"] <= 2
    assert k1["handed_out"] == k2["handed_out"] == 4 * 8
    assert k1["tokens_per_decode_step"] >= 1.5 * today["tokens_per_decode_step"], (k1, today)
    assert k2["tokens_per_decode_step"] >= 2.3 * today["tokens_per_decode_step"], (k2, today)
    assert k2["occupancy"] > today["occupancy"] and k1["occupancy"] > today["occupancy"]


def test_max_staleness_needs_a_stopping_engine_a_correction_and_single_turn():
    from grpo.foundation.config import ConfigError
    from grpo.training.configure import load_config

    ok = ["rollout.engine=static", "rollout.max_staleness=1", "algo.rollout_correction={mode: truncate}"]
    assert load_config(None, "grpo", ok).rollout.max_staleness == 1
    assert load_config(None, "grpo", [*ok[:2], "algo.tis_cap=2.0"]).rollout.max_staleness == 1
    for engine in ("hf", "auto", "vllm"):
        assert load_config(None, "grpo", [f"rollout.engine={engine}", *ok[1:]]).rollout.engine == engine

    class Plain:  # a custom engine without room / stop
        def generate(self, prompts, params, n):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match=r"Plain cannot stop a generation call part-way \(generate\(..., room=, "
                                         r"stop=\)\), which rollout.max_staleness needs: use a built-in engine"):
        Stream(Plain(), SamplingParams(max_tokens=4), group_size=2, groups_per_step=1, max_staleness=1,
               feed=feed_of(PROMPTS))
    with pytest.raises(ConfigError, match="rollout.vllm.tensor_parallel_size=2: the ranks of a tensor-parallel group "
                                          "share one engine"):
        load_config(None, "grpo", ["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2", *ok[1:]])
    with pytest.raises(ConfigError, match=r"without a correction such runs collapse. Set algo.rollout_correction="
                                          r"\{mode: truncate\}"):
        load_config(None, "grpo", ok[:2])
    with pytest.raises(ConfigError, match="env.name='maze': multi-turn trajectories are not streamed"):
        load_config(None, "grpo", [*ok, "env.name=maze"])
    keep = "rollout.carried_kv=keep"
    assert load_config(None, "grpo", ["rollout.engine=hf", *ok[1:], keep]).rollout.carried_kv == "keep"
    with pytest.raises(ConfigError, match="rollout.carried_kv='keep' keeps carried rows' caches in the hf engine, and "
                                          "rollout.engine='static' prefills them again: set rollout.engine=hf"):
        load_config(None, "grpo", [*ok, keep])
    with pytest.raises(ConfigError, match="rollout.carried_kv='keep' with rollout.max_staleness=0: no row is carried"):
        load_config(None, "grpo", ["rollout.engine=hf", keep])
    with pytest.raises(ConfigError, match="carried_kv"):
        load_config(None, "grpo", ["rollout.engine=hf", *ok[1:], "rollout.carried_kv=reuse"])


STATIC_SLOTS = ["rollout.engine=static", "rollout.slots=4", "rollout.static.check_every=1"]


# the hf engine decodes every row at once (no slots): recorded lengths make some groups end before others
HF_LENGTHS = ["rollout.engine=hf", "rollout.forced_eos_lengths=[3, 3, 2, 3, 12, 12, 12, 12]"]


@pytest.mark.parametrize("engine", [STATIC_SLOTS, HF_LENGTHS, [*STATIC_SLOTS, "model.lora={r: 4}"],
                                    [*HF_LENGTHS, "model.lora={r: 4}"]], ids=["static", "hf", "static-lora", "hf-lora"])
def test_a_streamed_run_trains_whole_groups_within_the_bound_and_resumes_every_group_in_flight(single_rank_env,
                                                                                              tmp_path, engine):
    """The demo through the Trainer with rollout.max_staleness=1 (static or hf engine on CPU, with and without LoRA,
    truncated IS): each step trains prompts_per_step whole groups, no token more than one step behind, rows carried
    over; the checkpoint keeps the groups in flight and --resume draws them again first, so every prompt the sampler
    issued is trained exactly once across the stop."""
    from pathlib import Path

    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
    over = [f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false",
            "rollout.prompts_per_step=4", "rollout.num_generations=4", "reward_pool.num_workers=0", "algo.beta=0",
            *engine, "rollout.max_staleness=1", "algo.rollout_correction={mode: truncate}",
            "model.dtype=fp32", "train.save_every=3", "rollout.max_completion_length=12",
            "data.shuffle=false"]
    trained: list[int] = []

    def run(steps: int, resume: bool) -> list[dict]:
        tr = Trainer(load_config(demo, "grpo", [*over, f"train.max_steps={steps}"]), resume=resume)
        inner = tr.rollout.rollout_groups

        def spy(groups, items, version):
            trained.extend(g.item for g in groups)
            return inner(groups, items, version)

        tr.rollout.rollout_groups = spy
        try:
            return tr.train()
        finally:
            issued = tr.sampler.state_dict()["consumed"]
            pending = [g.item for g in tr.stream.pending]
            tr.close()
            run.state = (issued, pending)

    first = run(3, False)
    assert all(h["rollout/staleness_max"] <= 1 for h in first)
    assert any(h["rollout/carried_rows"] > 0 for h in first) and any(h["rollout/staleness_mean"] > 0 for h in first)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in first)
    assert len(trained) == 3 * 4 and len(run.state[1]) == 4  # K x prompts_per_step groups in flight at the save
    second = run(6, True)
    assert len(second) == 3 and all(h["rollout/staleness_max"] <= 1 for h in second)
    issued, pending = run.state
    assert sorted(trained + pending) == list(range(issued))  # each issued prompt trained once, or still in flight


def test_a_refill_inside_a_streamed_step_takes_whole_groups_from_the_stream(single_rank_env, tmp_path):
    """dapo's dynamic sampling (and CPPO's allocation) ask for more groups inside a step (ctx.generate_more): with
    rollout.max_staleness >= 1 they come from the stream too (oldest whole groups first, no prompt twice), and the
    step's staleness figures cover both."""
    from pathlib import Path

    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
    tr = Trainer(load_config(demo, "dapo", [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "rollout.prompts_per_step=4",
        "rollout.num_generations=4", "reward_pool.num_workers=0", "rollout.engine=static", "rollout.max_staleness=1",
        "algo.rollout_correction={mode: truncate}", "model.dtype=fp32", "rollout.max_completion_length=8"]))
    try:
        first = tr._streamed()
        more = tr.context().generate_more(6)
        assert len(first) == 4 * 4 and len(more) == 6 * 4
        indices = first.prompt_index[::4] + more.prompt_index[::4]
        assert len(set(indices)) == 10
        m = tr.rollout.pop_metrics()
        assert m["rollout/staleness_max"] == 0 and "_tokens" not in m and tr.stream.pending
    finally:
        tr.close()


# ... and a reward on the length, so that the short groups' rows differ (an update to see at one version behind)
HF_LENGTH_REWARD = [*HF_LENGTHS, 'rewards=[{fn: "tests.reward_fixtures:length_bonus"}]']


@pytest.mark.parametrize("engine", [STATIC_SLOTS, HF_LENGTH_REWARD, [*HF_LENGTH_REWARD, "rollout.carried_kv=keep"]],
                         ids=["static", "hf", "hf-kept-kv"])
def test_the_audit_splits_the_sampler_kl_by_staleness(single_rank_env, tmp_path, engine):
    """Streamed rows keep the audit's top-k of every token (an audited step holds tokens of earlier calls), and the
    audit splits KL(pi_sampler || pi_trainer) by how many steps before the audited weights each token was drawn:
    tokens of the same weights (fp32, the engine against the training forward) show only rounding, tokens one
    update old show the update. With kept caches (rollout.carried_kv: keep) a carried row's tokens drawn under the
    new weights attend to keys and values of the old ones: they show the update too (why prefill is the default)."""
    from pathlib import Path

    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
    tr = Trainer(load_config(demo, "grpo", [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false", "train.max_steps=4",
        "rollout.prompts_per_step=4", "rollout.num_generations=4", "reward_pool.num_workers=0", "algo.beta=0",
        *engine, "rollout.max_staleness=1", "algo.tis_cap=2.0", "model.dtype=fp32",
        "rollout.max_completion_length=12", "train.lr=0.05",
        "logging.audit_every=1", "logging.audit_rows=16", "train.save_every=0"]))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = tr.train()
    finally:
        tr.close()
    assert all("audit/sampler_kl_behind_0" in h and "audit/sampler_kl_behind_1" in h for h in history)
    # the stale tokens' divergence is by design: the engine is not said to miss a weight sync (kept caches' is said
    # once, as theirs)
    said = [str(w.message) for w in caught if "audit/sampler_kl" in str(w.message)]
    fresh = max(h["audit/sampler_kl_behind_0_max"] for h in history)
    if "rollout.carried_kv=keep" in engine:
        assert fresh > 1e-3 and len(said) <= 1 and all("with rollout.carried_kv=keep a carried row" in w and
                                                       "missed a weight sync" not in w.split("cannot tell")[0]
                                                       for w in said)
    else:
        assert fresh < 1e-4 and not said
    assert max(h["audit/sampler_kl_behind_1"] for h in history) > 1e-3


def test_the_hf_engine_counts_its_decode_steps_and_occupancy():
    """rollout/occupancy of the hf engine: tokens drawn by decode steps over the row-steps of each call's first
    batch (finished rows leave its batch, but a decode step on an accelerator costs about its weights' reads). Four
    rows ending at 1..4 tokens: the first token of each comes from the prefill, the other 0 + 1 + 2 + 3 from 3 decode
    steps of 4 rows."""
    model = build("qwen2")
    engine = engine_of("hf", model)
    params = SamplingParams(max_tokens=4, temperature=1.0, forced_eos_lengths=(1, 2, 3, 4))
    out = engine.generate([PROMPTS[0]], params, 4)
    assert [len(t) for t in out.tokens] == [1, 2, 3, 4]
    assert engine.pop_metrics() == {"rollout/occupancy": 6 / 12, "rollout/decode_steps": 3.0,
                                    "rollout/decoded_tokens": 6.0}
    assert engine.pop_metrics() == {}


@pytest.mark.parametrize("kind,slots", [("static", 0), ("hf", 0), ("hf", 2)])
def test_the_decode_time_splits_into_prefill_and_the_rest_and_carried_tokens_fed_again_are_counted(kind, slots):
    """time/generation_prefill (the prefill forwards, a slotted hf call's joins among them) and
    time/generation_decode (the rest of the calls) add up to the engine's calls' wall time; rollout/refed_tokens counts the carried tokens a stream fed
    again as prompt (prefilled under the new weights): the tokens its rows held when each call began."""
    import time

    model = build("qwen2")
    params = SamplingParams(max_tokens=40, temperature=1.0, forced_eos_lengths=(2, 3, 40, 2, 3, 2))
    engine = engine_of(kind, model, [f"rollout.slots={slots}"] if slots else [])
    stream = Stream(engine, params, group_size=3, groups_per_step=1, max_staleness=1, feed=feed_of(PROMPTS))
    calls, held = [], []
    generate = engine.generate

    def timed(prompts, *args, **kw):  # the wall time of each call, and the carried tokens it was given
        held.append(sum(len(r.tokens) for g in stream.pending for r in g.rows if not r.done))
        t0 = time.perf_counter()
        out = generate(prompts, *args, **kw)
        calls.append(time.perf_counter() - t0)
        return out

    engine.generate = timed
    refed = 0
    for version in range(4):
        (g,) = stream.next(version)
        refed += stream.pop_metrics([g], version)["rollout/refed_tokens"]
    m = engine.pop_timings()
    assert refed == sum(held) > 0 and engine.pop_timings() == {}
    assert m["generation_prefill"] > 0 and m["generation_decode"] > 0
    assert m["generation_prefill"] + m["generation_decode"] == pytest.approx(sum(calls), rel=0.05)


def test_an_engine_error_inside_a_streamed_step_stops_the_run_with_that_error(single_rank_env, tmp_path):
    """Fails loud (issue 56 item 6): the stream decodes in the trainer's own thread, so an engine's error at any call
    of a streamed step is the run's error, raised from train(), nothing left waiting."""
    from pathlib import Path

    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
    tr = Trainer(load_config(demo, "grpo", [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false", "train.max_steps=4",
        "rollout.prompts_per_step=4", "rollout.num_generations=4", "reward_pool.num_workers=0", "algo.beta=0",
        *HF_LENGTHS, "rollout.max_staleness=1", "algo.tis_cap=2.0", "train.save_every=0",
        "rollout.max_completion_length=12"]))
    real, calls = tr.stream.engine.generate, []

    def generate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # a later call of the run, with rows carried over
            raise RuntimeError("the engine broke")
        return real(*args, **kwargs)

    tr.stream.engine.generate = generate
    try:
        with pytest.raises(RuntimeError, match="the engine broke"):
            tr.train()
    finally:
        tr.close()
    assert len(calls) == 3


class _Texts:
    """A tokenizer's batch_decode: ids as text."""

    @staticmethod
    def batch_decode(ids, **_):
        return [" ".join(map(str, x)) for x in ids]


@pytest.mark.parametrize("kind,slots", [("static", 2), ("hf", 0), ("hf", 3)])
def test_groups_whole_mid_call_are_scored_while_the_others_decode_and_score_as_at_the_end(kind, slots):
    """Issue 56 item 4: a group that becomes whole in the middle of an engine call is scored at once on another
    thread (its G rows in one call of the reward sources) while the other rows decode; the rest are scored together
    at the end. Every row's reward is the one a single call over the step's batch gives, no call is left running
    when the step's batch is returned, and a reward error stops the step with that error."""
    import dataclasses
    import functools
    import threading
    from concurrent.futures import Future

    from grpo.rollout.service import RolloutService

    model = build("qwen2")
    params = SamplingParams(max_tokens=30, temperature=1.0, forced_eos_lengths=(2, 3, 30, 2, 3, 2, 4, 5, 2))
    engine = engine_of(kind, model, [f"rollout.slots={slots}"] if slots else [])
    in_call = threading.Event()
    generate = engine.generate

    @functools.wraps(generate)
    def marked(*args, **kw):
        in_call.set()
        try:
            return generate(*args, **kw)
        finally:
            in_call.clear()

    engine.generate = marked
    calls = []  # (rows, whether an engine call was running, thread)

    def scorer(prompts, completions, columns, raw_prompts=None, completion_ids=None, fail=None):
        calls.append((len(completions), in_call.is_set(), threading.current_thread().name))
        if fail is not None and any(fail in c for c in completions):
            raise RuntimeError("reward source down")
        lengths = [float(len(c)) for c in completion_ids]
        return [x + 0.5 * int(col) for x, col in zip(lengths, columns["col"])], {"length": lengths}

    svc = RolloutService(dataclasses.replace(engine.setup, tokenizer=_Texts()), scorer, engine=engine)
    svc.cfg = dataclasses.replace(svc.cfg, num_generations=3)
    stream = Stream(engine, params, group_size=3, groups_per_step=2, max_staleness=1, feed=feed_of(PROMPTS))
    items = lambda i: {"prompt": "p", "col": i % 2}  # noqa: E731
    ahead = 0
    for version in range(4):
        calls.clear()
        batch = svc.rollout_stream(stream, version, items)
        assert not any(g.ahead.running() for g in stream.pending if isinstance(g.ahead, Future))
        early = [c for c in calls if c[1]]
        assert all(n == 3 and name.startswith("rewards-ahead") for n, _, name in early)
        ahead += len(early)
        one, per = scorer(batch.prompt_text, batch.completion_text, batch.columns(),
                          completion_ids=[list(c) for c in batch.completion_ids])
        assert batch.rewards.tolist() == one and batch.reward_terms["length"].tolist() == per["length"]
    assert ahead > 0
    svc.scorer = lambda *a, **kw: scorer(*a, **kw, fail=" ")
    with pytest.raises(RuntimeError, match="reward source down"):
        svc.rollout_stream(stream, 4, items)
    svc.close()
