"""The GSM8K recipes (configs/gsm8k-*.yaml) load as written and run a training step.

Each recipe is trained for one step with a tiny, randomly initialised stand-in of its model's architecture
(Qwen2 for Qwen2.5, Llama for SmolLM2) written as a local HF folder, and a tiny GSM8K laid out as the hub
repository ``openai/gsm8k`` is (README.md with its ``main`` config, train / test Parquet files) and read from
that folder: the offline path of the recipes (model.name_or_path and data.path = local folders). Only the
sizes are overridden; dtype, gradient checkpointing, ZeRO stage, algorithm, reward (math-verify) and the
evaluation on the test split are the recipe's own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpo.training.configure import load_config

ROOT = Path(__file__).resolve().parent.parent
GSM8K_ROWS = ROOT / "tests" / "data" / "gsm8k" / "train_head40.jsonl"
# recipe -> the architecture of its hub model
RECIPES = {
    "gsm8k-qwen2.5-0.5b.yaml": "qwen2",
    "gsm8k-qwen2.5-0.5b-8gpu.yaml": "qwen2",
    "gsm8k-smollm2-1.7b.yaml": "llama",
    "gsm8k-smollm2-1.7b-8gpu.yaml": "llama",
}
HUB_MODELS = {"qwen2": "Qwen/Qwen2.5-0.5B-Instruct", "llama": "HuggingFaceTB/SmolLM2-1.7B-Instruct"}
HUB_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory) -> Path:
    """30 train and 10 test problems in the layout of the hub repository (what `huggingface-cli download
    openai/gsm8k --repo-type dataset --local-dir DIR` writes)."""
    import datasets

    rows = [json.loads(line) for line in GSM8K_ROWS.read_text().splitlines()]
    out = tmp_path_factory.mktemp("gsm8k")
    (out / "main").mkdir()
    datasets.Dataset.from_list(rows[:30]).to_parquet(str(out / "main" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(rows[30:]).to_parquet(str(out / "main" / "test-00000-of-00001.parquet"))
    (out / "README.md").write_text(HUB_README)
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    from grpo.foundation.tiny import write_tiny

    base = tmp_path_factory.mktemp("models")
    # as the real ones: Qwen2.5-0.5B has grouped-query attention (14 heads, 2 for keys and values), SmolLM2-1.7B not
    return {"qwen2": write_tiny(base / "qwen2", arch="qwen2", num_kv_heads=2), "llama": write_tiny(base / "llama")}


def checkpointing_on(model) -> bool:
    on = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5 (the old name warns)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


def tiny_overrides(model: Path, data: Path, out: Path) -> list[str]:
    """The recipe's sizes made CPU-sized, its model and data pointed at local folders."""
    return [f"model.name_or_path={model}", f"data.path={data}", f"train.output_dir={out}",
            "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_completion_length=8",
            "rollout.max_prompt_length=480", "train.micro_batch_size=4", "train.max_steps=1",
            "eval.limit=2", "eval.batch_size=2", "eval.every=1",
            "reward_pool.num_workers=0", "logging.report_to=[]", "logging.progress_bar=false", "logging.plot=false"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_loads_as_written(recipe):
    """No override: the hub model and dataset, bf16, the test split scored with math-verify, periodic
    checkpoints and a logger, the reference in-process; the 8-GPU variant splits its prompts over 8 ranks."""
    cfg = load_config(ROOT / "configs" / recipe)
    assert cfg.model.name_or_path == HUB_MODELS[RECIPES[recipe]]
    assert cfg.model.dtype == "bf16"
    d = cfg.data
    assert (d.source, d.path, d.hub_config, d.split, d.eval_split) == ("hub", "openai/gsm8k", "main", "train", "test")
    assert [r.fn for r in cfg.rewards] == ["math_correct"] and cfg.eval.every > 0 and cfg.eval.correctness is None
    assert cfg.train.save_every > 0 and cfg.train.max_steps % cfg.train.save_every == 0
    assert cfg.logging.report_to and cfg.ref.url is None and cfg.algo.beta > 0
    if recipe.endswith("-8gpu.yaml"):
        assert cfg.rollout.prompts_per_step % 8 == 0 and cfg.train.zero_stage == 2
        one_gpu = load_config(ROOT / "configs" / recipe.replace("-8gpu", ""))
        assert cfg.rollout.prompts_per_step == 4 * one_gpu.rollout.prompts_per_step
        assert cfg.train.output_dir != one_gpu.train.output_dir


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_trains_a_step_with_a_tiny_stand_in(recipe, model_dirs, gsm8k_dir, single_rank_env, tmp_path):
    from grpo.training.trainer import Trainer

    arch = RECIPES[recipe]
    cfg = load_config(ROOT / "configs" / recipe, None, tiny_overrides(model_dirs[arch], gsm8k_dir, tmp_path))
    tr = Trainer(cfg)
    try:
        assert type(tr.model).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
        assert tr.model.config.num_key_value_heads == {"qwen2": 2, "llama": 4}[arch]
        assert all(p.dtype == torch.bfloat16 for p in tr.model.parameters())
        assert checkpointing_on(tr.model) == cfg.model.gradient_checkpointing
        assert tr.reference.kind == "in-process"
        history = tr.train()
    finally:
        tr.close()
    (m,) = history
    assert m["step"] == 1 and math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    assert m["eval/num_problems"] == 2 and 0 <= m["eval/accuracy"] <= 1  # the test split, math-verify
    assert (tmp_path / "metrics.jsonl").is_file()
    assert list((tmp_path / "checkpoints").glob("step-1*")), sorted(p.name for p in (tmp_path / "checkpoints").iterdir())


@pytest.mark.slow
def test_8gpu_recipe_under_the_deepspeed_launcher(model_dirs, gsm8k_dir, tmp_path, monkeypatch):
    """``deepspeed --num_gpus N train.py --config configs/gsm8k-smollm2-1.7b-8gpu.yaml``: here 2 CPU ranks
    (ZeRO-2, gradient checkpointing, the test split evaluated over both ranks), offline: the model and the
    dataset from local folders with the hub unreachable."""
    from tests.conftest import run_deepspeed

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    run_deepspeed(["--config", "configs/gsm8k-smollm2-1.7b-8gpu.yaml",
                   *tiny_overrides(model_dirs["llama"], gsm8k_dir, tmp_path), "eval.limit=4"], num_ranks=2)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # the evaluation before training, then the step
    assert math.isfinite(rows[1]["loss"]) and math.isfinite(rows[1]["grad_norm"])
    for r in rows:  # the first 4 test problems, over both ranks (prompts over the tiny limit are dropped and counted)
        assert r["eval/num_problems"] >= 1 and r["eval/num_problems"] + r["eval/dropped_prompts"] == 4


# --------------------------------------------------------------------------- what a GPU user gets without setting it


def test_model_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu(capsys):
    """``model.dtype: auto`` (the default) is resolved when the config loads: every consumer (DeepSpeed's
    mode, the reference, vLLM) sees a real precision, and --print-config shows it."""
    from grpo.foundation.config import ModelConfig, auto_dtype
    from grpo.foundation.modeling import load_model

    assert ModelConfig().dtype == "auto"
    assert (auto_dtype("cuda"), auto_dtype("cpu")) == ("bf16", "fp32")
    expected = "bf16" if torch.cuda.is_available() else "fp32"
    assert load_config().model.dtype == expected
    assert load_config(None, None, ["model.dtype=bf16"]).model.dtype == "bf16"  # an explicit choice stays
    # a ModelConfig built in code (not through load_config) resolves "auto" where the model loads
    assert {p.dtype for p in load_model(ModelConfig()).parameters()} == {getattr(torch, {"bf16": "bfloat16",
                                                                                          "fp32": "float32"}[expected])}
    import train  # its entry, in this process: --print-config returns before anything starts

    assert train.main(["--print-config"]) == 0
    assert f"  dtype: {expected}\n" in capsys.readouterr().out


def _grads_and_layer_calls(checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of the summed token log-probs of a fixed batch, and how often the first decoder layer ran
    (its input norm: the first thing it computes)."""
    from grpo.foundation.config import ModelConfig
    from grpo.foundation.modeling import load_model

    model = load_model(ModelConfig(name_or_path="builtin:tiny-char", dtype="fp32",
                                   gradient_checkpointing=checkpointing)).train()
    assert checkpointing_on(model) == checkpointing
    assert model.config.use_cache is not checkpointing  # the KV cache is off while activations are recomputed
    calls = []
    # the layer's first module (transformers checkpoints forward, not __call__; a recompute may stop early)
    model.model.layers[0].input_layernorm.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(4, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    logp.gather(-1, ids[:, 1:, None]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)


def test_gradient_checkpointing_recomputes_layers_and_keeps_the_gradients():
    """model.gradient_checkpointing=true reaches transformers' checkpointing: each decoder layer runs again in
    the backward pass (2 calls instead of 1), and the gradients are those of the plain model."""
    plain, plain_calls = _grads_and_layer_calls(False)
    ckpt, ckpt_calls = _grads_and_layer_calls(True)
    assert (plain_calls, ckpt_calls) == (1, 2)
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_periodic_checkpoints_keep_the_newest(single_rank_env, tmp_path):
    """train.save_every writes a checkpoint every N steps; train.keep_checkpoints deletes all but the newest N,
    and the run resumes from the newest."""
    from grpo.training.trainer import Trainer

    def run(steps: int, resume: bool = False) -> Trainer:
        cfg = load_config(ROOT / "configs" / "demo.yaml", None, [
            f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false", "algo.beta=0",
            "reward_pool.num_workers=0", "rollout.prompts_per_step=2", "rollout.num_generations=2",
            f"train.max_steps={steps}", "train.save_every=1", "train.keep_checkpoints=2"])
        tr = Trainer(cfg, resume=resume)
        tr.train()
        return tr

    run(4)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-3", "step-4"]
    assert run(5, resume=True).step == 5
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-4", "step-5"]


# --------------------------------------------------------------------------- the demo


def test_demo_reward_requires_the_stop():
    """configs/demo.yaml's reward: with whitespace counting, only the answer and nothing after it (EOS, which
    the rewards do not see) scores 1, so a completion cut at the 3-token cap cannot; the default strips."""
    from rewards.digits import digits_match

    (spec,) = load_config(ROOT / "configs" / "demo.yaml").rewards
    assert (spec.fn, spec.kwargs) == ("digits_match", {"strip": False})
    completions = ["47", "47 ", "47\n", "477", "4", " 47"]
    strict = digits_match([""] * 6, completions, ["47"] * 6, **spec.kwargs)
    assert strict == pytest.approx([1, 2 / 3, 2 / 3, 2 / 3, 1 / 2, 0])
    assert digits_match([""] * 6, completions, ["47"] * 6) == pytest.approx([1, 1, 1, 2 / 3, 1 / 2, 1])


def test_demo_takes_one_rank_per_gpu_else_two_cpu_ranks(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import demo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert demo.default_ranks() == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert demo.default_ranks() == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert demo.default_ranks() == 8


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "configs").glob("gsm8k-*.yaml")))
def test_the_gsm8k_recipes_print_their_config_in_makes_venv(recipe, capsys):
    """Issue 42, item 23: the recipes report to TensorBoard, which make's venv did not install: their
    --print-config failed. make installs the ``tensorboard`` extra now."""
    import train

    assert train.main(["--config", str(ROOT / "configs" / recipe), "--print-config"]) == 0, capsys.readouterr().err
    assert "report_to:\n  - tensorboard\n" in capsys.readouterr().out
