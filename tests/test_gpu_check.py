"""scripts/benchmarks/gpu_check.py runs every stage on CPU with --tiny: each stage's JSON appended as it finishes, and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.patience import LAUNCH_S

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_tiny_on_cpu(tmp_path):
    out = tmp_path / "gc"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmarks" / "gpu_check.py"), "--out", str(out), "--device", "cpu",
                           "--tiny", "--set", "train.logprob_chunk_size=64"], cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == ["machine", "generation", "generation", "step_256", "step_1024", "ref_http",
                                          "step_rm"]
    gen, gen_static, short, long, ref, rm = rows[1:]
    assert gen["tokens_per_s"] > 0 and gen["rows"] == 4
    # the static engine (eager on CPU) at the same prompts: its greedy tokens are the hf engine's (fp32)
    assert (gen_static["engine"], gen_static["mode"], gen_static["rows"]) == ("static", "eager", 4)
    assert gen_static["tokens_per_s"] > 0 and gen_static["greedy_same_tokens"] == gen_static["greedy_tokens"] == 8
    assert 0 <= gen_static["logprob_gap_mean"] <= gen_static["logprob_gap_max"] < 1e-4 and "logprob_gap_mean" not in gen
    # the audit's figure (issue 45): the sampler's top-8 against the training forward, ~0 in fp32 on both engines
    for g in (gen, gen_static):
        assert 0 <= g["audit_kl_mean"] <= g["audit_kl_max"] < 1e-5 and g["audit_top_k"] == 8
    assert short["new_tokens"] < long["new_tokens"]
    # the reward model (a random one-logit classifier of the policy's shape) scored every step, a part of its time
    assert 0 < rm["median"]["reward/rm/latency"] < rm["median"]["time/step"]
    assert 0 < rm["median"]["reward/model_time_frac"] < 1 and "reward/rm/latency" not in short["median"]
    for step in (short, long, rm):
        med = step["median"]
        assert med["time/step"] >= med["time/generation"] > 0 and med["time/train"] > 0
        parts = step["memory_parts"]
        # the arithmetic parts of the tiny model (fp32 on CPU: no master copy; Adam's two fp32 moments)
        assert parts["weights"] == 4 * step["params"] and parts["master"] == 0 and parts["optimizer"] == 8 * step["params"]
        assert step["peak_bytes"] > sum(v for k, v in parts.items() if k != "activations_and_rest")
        assert step["max_over_median"] >= 1.0 and isinstance(step["outliers"], list)
        # --set reaches the step stages' config; memory/* phase peaks exist on CUDA only
        assert step["overrides"] == ["train.logprob_chunk_size=64"]
        assert not any(k.startswith("memory/") for k in med)
    assert "logprob_chunk_size: 64" in (out / "run" / "config.yaml").read_text()
    assert ref["round_trip_ms"] > ref["server_forward_ms"] > 0
    table = (out / "gpu_table.md").read_text()
    assert table.count("\n| tiny |") == 6 and "tokens/s" in table and "HTTP path" in table and "reward model" in table


def test_gpu_check_real_length_stages_on_cpu(tmp_path):
    """Issue 41, item 4 on CPU: eos_generation (both engines, EOS ignored and at recorded lengths) and step_256_eos;
    issue 56's stream stage (a step at a time against streaming, beside EOS ignored)."""
    out = tmp_path / "gc"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmarks" / "gpu_check.py"), "--out", str(out),
                           "--device", "cpu", "--tiny", "--stages", "eos_generation,step_256_eos,stream"], cwd=ROOT,
                          capture_output=True, text=True, timeout=LAUNCH_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == ["machine", "eos_generation", "eos_generation", "step_256_eos", "stream"]
    stream = rows[4]
    for side in ("today", "K=1,slots=64,check=4", "K=2,slots=64,check=4"):
        r = stream[side]
        assert r["decoded_tokens"] > 0 and 0 < r["occupancy"] <= 1 and r["per_token_over_ignored"] > 0
    assert stream["K=1,slots=64,check=4"]["staleness_max"] <= 1 and stream["ignored_ms_per_token"] > 0
    for gen in rows[1:3]:
        lengths = gen["eos_distribution"]["lengths"]
        assert len(lengths) == gen["rows"] == 4 and all(1 <= n <= gen["new_tokens"] for n in lengths)
        assert gen["ignored"]["tokens"] == 4 * gen["new_tokens"]  # EOS ignored: every row to the cap
        assert gen["forced"]["tokens"] <= sum(lengths)  # EOS at the recorded lengths (or the model's own, earlier)
        assert gen["per_token_forced_over_ignored"] > 0 and gen["floor_per_token_forced_over_ignored"] > 0
    assert (rows[1]["engine"], rows[2]["engine"]) == ("hf", "static")
    step = rows[3]
    assert step["eos_distribution"]["cap"] == step["new_tokens"] and step["median"]["time/step"] > 0
    assert "forced_eos_lengths" in (out / "run" / "config.yaml").read_text()
    assert "EOS at recorded lengths" in (out / "gpu_table.md").read_text()


def test_transformers_generate_beside_the_hf_engine_and_their_decode_profiles(tmp_path):
    """Issue 41, item 3's baseline: ``--engines generate`` is transformers' ``model.generate`` on the same batch (TRL's
    path without vLLM), in the generation, eos_generation and decode_profile stages; its greedy tokens are the hf
    engine's (fp32), forced EOS lengths end its rows, and each engine's profile counts kernels, host syncs and the
    costliest host ops. Item 2's train_profile: the step's log-prob and update phases profiled one by one."""
    out = tmp_path / "gc"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmarks" / "gpu_check.py"), "--out", str(out),
                           "--device", "cpu", "--tiny", "--stages", "generation,eos_generation,decode_profile,train_profile",
                           "--engines", "hf,generate"], cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [(r["stage"], r.get("engine")) for r in rows[1:]] == [
        ("generation", "hf"), ("generation", "generate"), ("eos_generation", "hf"), ("eos_generation", "generate"),
        ("decode_profile", None), ("train_profile", None)]
    gen = rows[2]
    assert gen["tokens_per_s"] > 0 and gen["rows"] == 4 and gen["mode"] is None
    assert gen["greedy_same_tokens"] == gen["greedy_tokens"] == 8 and "audit_kl_mean" not in gen
    eos = rows[4]
    assert eos["ignored"]["tokens"] == 4 * eos["new_tokens"] and eos["forced"]["tokens"] <= sum(
        eos["eos_distribution"]["lengths"])
    profile = rows[5]
    assert list(profile["engines"]) == ["hf", "generate"]
    for e in profile["engines"].values():
        assert e["wall_ms_per_token"] > 0 and e["kernels_per_token"] > 0 and e["sync_ops_per_token"] >= 0
        assert e["top"] and e["host_top"] and all(t["calls_per_token"] > 0 for t in e["host_top"])
    assert profile["new_tokens"] == 8  # TINY's profile_tokens
    train = rows[6]
    assert list(train["phases"]) == ["logprobs", "advantages", "update"] and train["rows"] == 4
    assert train["tokens"] > 4 * 1 and train["unprofiled"]["time/step"] > 0
    for name, phase in train["phases"].items():
        assert phase["wall_ms"] > 0 and phase["kernels"] > 0 and phase["top"] and phase["host_top"]
    # GRPO at mu = 1: one forward (the reference's) in the log-prob phase, forward + backward in the update
    assert train["phases"]["logprobs"]["model_tflop"] * 3 == pytest.approx(train["phases"]["update"]["model_tflop"])
    assert train["phases"]["update"]["model_tflop"] == pytest.approx(6 * train["params"] * train["tokens"] / 1e12)
    assert train["phases"]["update"]["mfu"] is None  # no dense-peak figure for a CPU
    table = (out / "gpu_table.md").read_text()
    assert "generate" in table and "update" in table and "costliest kernels" in table


def test_gpu_check_real_model_stage_on_cpu(tmp_path):
    """Issue 41, item 5 on CPU: a real model folder trained on the arithmetic preset with the reference server as its
    own process, EOS active; accuracy before and after, the curve and the step times recorded."""
    from grpo.foundation.tiny import write_tiny

    model = write_tiny(tmp_path / "model")
    out = tmp_path / "gc"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmarks" / "gpu_check.py"), "--out", str(out),
                           "--device", "cpu", "--tiny", "--stages", "real_model", "--real-model", str(model),
                           "--real-steps", "2"], cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    real = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()][-1]
    assert real["stage"] == "real_model" and real["steps"] == 2 and real["held_out"] == 8
    assert [s for s, _ in real["evals"]][0] == 0 and [s for s, _ in real["evals"]][-1] == 2
    assert 0 <= real["accuracy_before"] <= 1 and 0 <= real["accuracy_after"] <= 1 and len(real["rewards"]) == 2
    assert real["step_median_s"] > 0 and 0 < real["reference_share"] < 1  # the server answered every step
    assert "reference server stopped (exit 0)" in proc.stdout
    assert "held-out accuracy" in (out / "gpu_table.md").read_text()


def test_the_bandwidth_floor_beside_each_decode_figure():
    """Issue 41, item 6: tokens/s at the decode's bandwidth floor = rows x peak bandwidth / (the weights' bytes + each
    row's KV cache at its mean length over the decode, prompt + new / 2), for a known GPU; none for the CPU. With
    SmolLM2-1.7B's numbers (3.42 GB of bf16 weights, 24 layers x 32 KV heads x 64, 64 rows x (40 + 256)) the
    formula gives the 55.7k tokens/s on an H200 that issue 41 states."""
    from grpo.foundation.tiny import build_tiny
    from scripts.benchmarks.gpu_check import bandwidth_floor

    model, _ = build_tiny()
    c = model.config
    weights = sum(p.numel() * 4 for p in model.parameters())
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    got = bandwidth_floor(model, 64, 40, 256, "NVIDIA H200")
    assert got["floor_tokens_per_s"] == pytest.approx(64 * 4.8e12 / (weights + kv_token * 64 * (40 + 128)))
    assert bandwidth_floor(model, 64, 40, 256, "cpu") == {}
    smollm2 = 64 * 4.8e12 / (3.42e9 + 2 * 24 * 32 * 64 * 2 * 64 * (40 + 128))
    assert 55_000 < smollm2 < 56_000


def test_the_table_holds_the_stages_of_earlier_runs_into_the_folder(tmp_path):
    """gpu_session.sh calls gpu_check once per stage into one folder: gpu_table.md lists every stage of
    gpu_check.jsonl, not the last call's alone (the H100 session's table held only its last stage). A row an older
    gpu_check wrote, without the fields this one reads, is shown as its JSON; the machine rows are left out."""
    from scripts.benchmarks.gpu_check import earlier_rows, table

    assert earlier_rows(tmp_path) == []
    rows = [{"stage": "machine", "shape": "-", "time": "t0", "device": "cuda"},
            {"stage": "ref_http", "shape": "1.7b", "time": "t1", "http_path_ms": 20.0, "http_path_p90_ms": 22.0,
             "server_parse_ms": 1.0, "server_wait_ms": 2.0, "client_codec_ms": 3.0, "rest_ms": 4.0,
             "server_forward_ms": 10.0, "rows": 64, "prompt": 40, "completion": 256},
            {"stage": "machine", "shape": "-", "time": "t2", "device": "cuda"},
            {"stage": "generation", "shape": "1.7b", "time": "t3", "tokens_per_s": 123.0}]  # an older row's fields
    (tmp_path / "gpu_check.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = earlier_rows(tmp_path)
    assert [r["time"] for r in got] == ["t1", "t3"]
    lines = table(got).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| 1.7b | ref_http | HTTP path 20.0 ms (p90 22.0;") and "64 x (40 + 256)" in lines[2]
    assert lines[3] == '| 1.7b | generation | {"tokens_per_s": 123.0} |'
    # a step with the audit on (issue 45's figure): its seconds and share of the step
    step = {"stage": "step_256", "shape": "1.7b", "engine": "static", "peak_bytes": 2 ** 30, "peak_kind": "cuda",
            "memory_parts": {"weights": 2 ** 29}, "max_over_median": 1.1, "outliers": [],
            "median": {"time/step": 4.0, "time/generation": 2.0, "time/audit": 0.2}}
    assert table([step]).endswith("; audit 0.200 s a step, 5.0% of it |\n")


def test_engine_names_map_to_rollout_overrides():
    from scripts.benchmarks.gpu_check import engine_overrides

    assert engine_overrides("static:compile+graphs:64:dynamic") == [
        "rollout.engine=static", "rollout.static.mode=compile+graphs", "rollout.static.length_bucket=64",
        "rollout.static.compile_dynamic=true"]
    assert engine_overrides("hf")[1:] == ["rollout.static.mode=auto", "rollout.static.length_bucket=64",
                                          "rollout.static.compile_dynamic=false"]
    with pytest.raises(SystemExit, match="'dynamic' or nothing"):
        engine_overrides("static:compile:64:fast")
    assert engine_overrides("static:graphs@16@4")[-2:] == ["rollout.slots=16", "rollout.static.check_every=4"]
    assert engine_overrides("static@32")[-1] == "rollout.slots=32"
    with pytest.raises(SystemExit, match="@SLOTS or @SLOTS@CHECK_EVERY"):
        engine_overrides("static@x")


def test_the_eos_floor_against_its_sum_written_out():
    """eos_floor: bytes a generated token at recorded lengths over bytes a token with every row run to the longest,
    against the sum over decode steps written out for two rows of lengths 1 and 3 after a 2-token prompt."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from scripts.benchmarks.gpu_check import decode_bytes, eos_floor

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2))
    w, k = decode_bytes(model)
    assert w == 4 * sum(p.numel() for p in model.parameters()) and k == 2 * 2 * 2 * 8 * 4  # K and V, layers, heads, dim
    forced = (w + 2 * k * 2) + (w + k * 3) + (w + k * 4)  # steps 0, 1, 2: rows of lengths 1 and 3, then 3 alone
    ignored = 3 * w + 2 * k * (2 + 3 + 4)  # both rows every step
    assert eos_floor(model, [1, 3], 2)["floor_per_token_forced_over_ignored"] == pytest.approx((forced / 4) / (ignored / 6))


def test_step_prompts_of_drawn_lengths(tmp_path):
    """--prompt-words A-B: every prompt's length drawn in [A, B] words (one token each), seeded, so that the step
    stages' batches bring new widths step after step; N: every prompt N words (the default 40)."""
    import json as js

    from scripts.benchmarks.gpu_check import write_prompts

    def lengths(words):
        path = tmp_path / "p.jsonl"
        write_prompts(path, 40, 64, words)
        return [len(js.loads(line)["prompt"].split()) for line in path.read_text().splitlines()]

    drawn = lengths((20, 60))
    assert all(20 <= n <= 60 for n in drawn) and len(set(drawn)) > 10 and drawn == lengths((20, 60))
    assert set(lengths((40, 40))) == {40}
