"""LoRA (model.lora, through PEFT), the reference for free (the policy with its adapters off), and
periodic reference sync for every algorithm (ref.sync_every, ref.mixup_alpha).

All fast tests use the tiny model on one in-process rank; the one slow test runs the DeepSpeed
launcher with 2 CPU ranks (gradient invariance with LoRA under ZeRO-2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from grpo.foundation.config import ConfigError, LoraConfig
from grpo.training.configure import load_config
from tests.ref_support import RecordingServer
from tests.script_support import load_script

ROOT = Path(__file__).resolve().parent.parent
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the one-rank trainer's device
LORA = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, up_proj]}"
# the tiny model ties lm_head to the input embeddings: the head trains as a copy, the embeddings stay frozen
LORA_HEAD = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, up_proj], modules_to_save: [lm_head]}"


# --------------------------------------------------------------------------- config


def test_lora_config_off_by_default_and_on_with_defaults():
    assert load_config(None, "grpo", []).model.lora is None
    lora = load_config(None, "grpo", ["model.lora={}"]).model.lora
    assert isinstance(lora, LoraConfig) and lora.r > 0 and lora.alpha > 0 and lora.target_modules
    cfg = load_config(None, "grpo", ["model.lora.r=8", "model.lora.dropout=0.05"])  # one key turns it on
    assert (cfg.model.lora.r, cfg.model.lora.dropout) == (8, 0.05)
    assert load_config(None, "grpo", [LORA, "model.lora=null"]).model.lora is None
    ref = load_config(None, "grpo", []).ref
    assert (ref.sync_every, ref.mixup_alpha) == (0, 1.0)


@pytest.mark.parametrize("override, message", [
    ("model.lora.r=0", r"model.lora.r=0 is invalid: it must be > 0"),
    ("model.lora.alpha=0", r"model.lora.alpha=0.0 is invalid: it must be > 0"),
    ("model.lora.dropout=1", r"model.lora.dropout=1.0 is invalid: it must be in \[0, 1\)"),
    ("model.lora.dropout=-0.1", r"model.lora.dropout=-0.1 is invalid"),
    ("model.lora.target_modules=[]", r"model.lora.target_modules is empty: name the linear layers"),
    ("model.lora.target_modules=[q_proj, '']", r"model.lora.target_modules\[1\]='' is invalid"),
    ("model.lora.modules_to_save=['']", r"model.lora.modules_to_save\[0\]='' is invalid"),
    ("model.lora.target_module=[q_proj]", r"unknown config key 'model.lora.target_module'. Did you mean 'target_modules'\?"),
    ("model.lora=3", r"model.lora must be a mapping of keys \(r, alpha, dropout"),
    ("ref.sync_every=-1", r"ref.sync_every=-1 is invalid: it must be >= 0 \(0 = off\)"),
    ("ref.mixup_alpha=0", r"ref.mixup_alpha=0.0 is invalid: it must be in \(0, 1\]"),
    ("ref.mixup_alpha=1.5", r"ref.mixup_alpha=1.5 is invalid: it must be in \(0, 1\]"),
])
def test_lora_and_sync_config_errors_name_the_value_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, "grpo", [override])


def test_lora_config_refuses_what_it_does_not_support():
    with pytest.raises(ConfigError, match=r"model.lora with train.zero_stage=3 is not supported.*zero_stage 0, 1 or 2"):
        load_config(None, "grpo", [LORA, "train.zero_stage=3"])
    with pytest.raises(ConfigError, match=r"model.lora with model.dtype='fp16' is not supported.*bf16"):
        load_config(None, "grpo", [LORA, "model.dtype=fp16"])
    with pytest.raises(ConfigError, match=r"ref.mixup_alpha=0.5 has no effect without ref.sync_every"):
        load_config(None, "grpo", ["ref.mixup_alpha=0.5"])
    with pytest.raises(ConfigError, match=r"ref.sync_every=4 needs a reference.*algo.beta=0"):
        load_config(None, "dapo", ["ref.sync_every=4"])
    load_config(None, "grpo", [LORA, "train.zero_stage=2", "model.dtype=bf16", "ref.sync_every=4", "ref.mixup_alpha=0.5"])


# --------------------------------------------------------------------------- helpers


def make_trainer(tmp_path, *overrides: str, algo: str = "grpo", resume: bool = False):
    from grpo.training.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "demo.yaml", algo, [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false", "reward_pool.num_workers=0",
        "rollout.prompts_per_step=2", "rollout.num_generations=4", *overrides])
    return Trainer(cfg, resume=resume)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def is_adapter_key(key: str) -> bool:
    """A trained weight: an adapter's, or a modules_to_save copy's."""
    return ".lora_" in key or ".modules_to_save." in key


def perturb_adapters(model, seed: int = 0, scale: float = 0.05) -> None:
    """Non-zero B (LoRA starts at B = 0, where the adapted model is the base) and a moved head copy: the checks
    below see a real adapter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or ".modules_to_save." in n:
                p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * scale)


def fixed_packed(tr, groups: int = 3, G: int = 4):
    """Rows of dataset prompts with fixed completions (ragged, digits and EOS): no sampling, no RNG used."""
    from grpo.foundation.logprobs import pack

    tok = tr.tokenizer
    prompts = [tr.dataset.ids[i] for i in range(groups) for _ in range(G)]
    texts = ["12", "3", "45", "6", "78", "9", "01", "2", "34", "5", "67", "8"]
    completions = [tok.convert_tokens_to_ids(list(texts[i % len(texts)])) + [tok.eos_token_id][: i % 2]
                   for i in range(len(prompts))]
    return pack(prompts, completions, tok.pad_token_id)


def plain_logprobs(model, packed, cfg) -> torch.Tensor:
    """Log-probs as the in-process reference computes them (eval mode, the same row slices, the trainer's
    device: bit-equality holds only between the same kernels), on the CPU."""
    from grpo.reference.protocol import sliced_logprobs

    return sliced_logprobs(model.to(DEVICE).eval(), packed, cfg.rollout.temperature, cfg.train.logprob_chunk_size,
                           max_rows=cfg.train.micro_batch_size)[0].cpu()


def policy_logprobs(tr, packed) -> torch.Tensor:
    was = tr.model.training
    out = plain_logprobs(tr.model, packed, tr.cfg)
    tr.model.train(was)
    return out


# --------------------------------------------------------------------------- training: only adapters


@pytest.mark.parametrize("lora_cfg", [LORA, LORA_HEAD], ids=["adapters", "adapters+head"])
def test_only_adapters_train_the_base_stays_bit_identical_and_the_reference_is_the_base(single_rank_env, tmp_path,
                                                                                       lora_cfg):
    from grpo.foundation.modeling import load_model

    tr = make_trainer(tmp_path, lora_cfg, "algo.beta=0.04", "train.lr=1e-2")
    trainable = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n) for n in trainable)
    adapted = {n.split(".lora_")[0].split(".modules_to_save")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == ({"q_proj", "v_proj", "up_proj"} | ({"lm_head"} if lora_cfg == LORA_HEAD else set()))
    opt = getattr(tr.engine.optimizer, "optimizer", tr.engine.optimizer)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in tr.model.parameters() if p.requires_grad}  # only the adapters reach it
    # the reference is the policy itself (adapters off): no second model anywhere
    assert tr.reference.kind == "adapters-off" and tr.reference.impl.model is tr.model is tr.engine.module
    assert tr.rollout.setup.model is tr.model  # the hf engine generates with the adapted model

    perturb_adapters(tr.model)  # B != 0: the policy differs from the reference, the KL term has a gradient
    before = snapshot(tr.model)
    for _ in range(2):
        m = tr.train_step()
    assert m["kl"] > 0
    after = snapshot(tr.model)
    base = [k for k in before if not is_adapter_key(k)]
    assert base and all(torch.equal(before[k], after[k]) for k in base)  # bit-identical
    for part in ("lora_A", "lora_B") + ((".modules_to_save.",) if lora_cfg == LORA_HEAD else ()):
        assert any(not torch.equal(before[k], after[k]) for k in before if part in k), part
    assert len(opt.state) == len(in_opt)

    # with LoRA the reference log-probs are the base model's, exactly
    tr.model.train()
    packed = fixed_packed(tr)
    ref = tr.reference.logprobs(packed, tr.cfg.rollout.temperature).cpu()
    assert tr.model.training  # its mode is restored
    fresh_base = load_model(tr.cfg.model)
    assert torch.equal(ref, plain_logprobs(fresh_base, packed, tr.cfg))
    policy = policy_logprobs(tr, packed)
    assert (policy - ref).abs().max() > 1e-3  # and the adapters are back on afterwards
    tr.close()


def test_bf16_base_with_fp32_adapters(single_rank_env, tmp_path):
    from grpo.training.deepspeed_engine import deepspeed_config

    tr = make_trainer(tmp_path, LORA, "model.dtype=bf16", "algo.beta=0.04", "train.lr=1e-2")
    dtypes = {n: p.dtype for n, p in tr.model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if is_adapter_key(n))
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if not is_adapter_key(n))
    assert "bf16" not in deepspeed_config(tr.cfg)  # the adapters train in DeepSpeed's fp32 mode
    perturb_adapters(tr.model)
    before = snapshot(tr.model)
    for _ in range(2):
        tr.train_step()
    after = snapshot(tr.model)
    assert all(torch.equal(before[k], after[k]) for k in before if not is_adapter_key(k))
    assert any(not torch.equal(before[k], after[k]) for k in before if "lora_A" in k)
    tr.close()


def test_reference_kind_with_lora(single_rank_env, monkeypatch):
    import grpo.reference.http as http
    from grpo.reference.handle import make_reference
    from grpo.foundation.modeling import load_policy

    class FakeServer:
        def __init__(self, cfg, tokenizer=None, vocab_size=None):
            self.url = cfg.ref.url

    monkeypatch.setattr(http, "HTTPReference", FakeServer)
    cfg = load_config(None, "grpo", [LORA])
    policy = load_policy(cfg.model)
    assert make_reference(cfg, True, torch.device("cpu"), policy=policy).kind == "adapters-off"
    assert make_reference(cfg, False, torch.device("cpu"), policy=policy) is None  # beta = 0: nothing
    served = load_config(None, "grpo", [LORA, "ref.url=http://127.0.0.1:1"])
    assert make_reference(served, True, torch.device("cpu"), policy=policy).kind == "server"  # ref.url still works
    other = load_config(None, "grpo", [LORA, "ref.model=builtin:tiny-char"])
    assert make_reference(other, True, torch.device("cpu"), policy=policy).kind == "in-process"
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['nope'\] match no linear layer"):
        load_policy(load_config(None, "grpo", ["model.lora.target_modules=[nope]"]).model)
    with pytest.raises(ConfigError, match=r"names \['lm_head'\], whose weight this model ties.*modules_to_save"):
        load_policy(load_config(None, "grpo", ["model.lora.target_modules=[q_proj, lm_head]"]).model)
    with pytest.raises(ConfigError, match=r"names the input embeddings \['model.embed_tokens'\].*lm_head"):
        load_policy(load_config(None, "grpo", ["model.lora.modules_to_save=[embed_tokens]"]).model)
    with pytest.raises(ConfigError, match=r"modules_to_save=\['lm_head'\] with a torch.bfloat16 base"):
        load_policy(load_config(None, "grpo", [LORA_HEAD, "model.dtype=bf16"]).model)


# --------------------------------------------------------------------------- checkpoints, resume, merge, eval

MERGE_BOUND = 1e-5  # |log p(merged) - log p(adapted)|: float32 rounding of W + scale * B A (measured: ~5e-7)


@pytest.mark.parametrize("lora_cfg", [LORA, LORA_HEAD], ids=["adapters", "adapters+head"])
def test_checkpoint_resume_merge_and_eval_round_trip(single_rank_env, tmp_path, capsys, lora_cfg):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo.foundation.modeling import load_model

    out = tmp_path / "run"
    args = (lora_cfg, "algo.beta=0.04", "train.lr=1e-2")
    tr = make_trainer(out, *args)
    perturb_adapters(tr.model)
    for _ in range(2):
        tr.train_step()
    tr.step = 2
    ckpt = tr.save()
    saved_weights = snapshot(tr.model)
    opt = getattr(tr.engine.optimizer, "optimizer", tr.engine.optimizer)
    saved_moments = [opt.state[p]["exp_avg"].clone() for g in opt.param_groups for p in g["params"]]

    # the checkpoint: the adapter in PEFT's format (no whole model), the tokenizer, engine state without the base
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "ds", "trainer"} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == "builtin:tiny-char"
    module_state = torch.load(next((ckpt / "ds").glob("mp_rank_*_model_states.pt")), weights_only=False)["module"]
    assert module_state and all(is_adapter_key(k) for k in module_state)

    with torch.random.fork_rng():  # loading models initialises LoRA weights: the run's RNG must not move
        packed = fixed_packed(tr)
        adapted = policy_logprobs(tr, packed)
        # PeftModel.from_pretrained loads it: the same model, the same log-probs, bit for bit
        peft_model = PeftModel.from_pretrained(load_model(tr.cfg.model), str(ckpt))
        assert torch.equal(plain_logprobs(peft_model.get_base_model(), packed, tr.cfg), adapted)

        # merged (scripts/merge_lora.py): a plain HF folder; log-probs equal within float32 rounding
        merged_dir = tmp_path / "merged"
        assert load_script("merge_lora").main([str(ckpt), str(merged_dir)]) == 0
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)
        assert not any("lora" in k for k in merged.state_dict())
        assert merged.config.tie_word_embeddings == (lora_cfg == LORA)  # a trained head: untied
        diff = (plain_logprobs(merged, packed, tr.cfg) - adapted).abs().max().item()
        assert diff <= MERGE_BOUND, diff
        assert (adapted - plain_logprobs(load_model(tr.cfg.model), packed, tr.cfg)).abs().max() > 1e-3  # not the base

        # the end-of-run export (train.export_final: OUT/final/): the same merged model, without the adapter files
        from grpo.training.checkpoint import export_model

        final = export_model(tr.engine, tr.tokenizer, tmp_path / "final")
        assert (final / "config.json").is_file() and not (final / "adapter_config.json").exists()
        exported = AutoModelForCausalLM.from_pretrained(final)
        diff = (plain_logprobs(exported, packed, tr.cfg) - adapted).abs().max().item()
        assert diff <= MERGE_BOUND, diff

    # the uninterrupted run's next two steps
    want = [tr.train_step() for _ in range(2)]
    tr.close()

    # --resume: adapter weights, optimizer state and the following steps are the same
    tr2 = make_trainer(out, *args, resume=True)
    assert tr2.step == 2
    got_weights = snapshot(tr2.model)
    assert all(torch.equal(saved_weights[k], got_weights[k]) for k in saved_weights)
    opt2 = getattr(tr2.engine.optimizer, "optimizer", tr2.engine.optimizer)
    moments = [opt2.state[p]["exp_avg"] for g in opt2.param_groups for p in g["params"]]
    assert len(moments) == len(saved_moments) and all(torch.equal(a, b) for a, b in zip(moments, saved_moments))
    got = [tr2.train_step() for _ in range(2)]
    for a, b in zip(want, got):
        for key in ("reward/mean", "loss", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    tr2.close()

    # scripts/eval.py takes the adapter folder and the merged folder alike
    cfg_path = ROOT / "configs" / "demo.yaml"
    results = {}
    for name, model in (("adapter", ckpt), ("merged", merged_dir)):
        rc = load_script("eval").main(["--model", str(model), "--config", str(cfg_path), "--split", "train",
                                       "--limit", "6", "--out", str(tmp_path / f"{name}.jsonl"), "--json",
                                       "reward_pool.num_workers=0"])
        assert rc == 0
        results[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert results[name]["eval/num_problems"] == 6
    completions = {n: [json.loads(x)["completion"] for x in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
                   for n in results}
    assert completions["adapter"] == completions["merged"]  # greedy: the same answers


# --------------------------------------------------------------------------- reference sync


def moved_policy(tr) -> dict[str, torch.Tensor]:
    """Move every policy weight (whatever the step's rewards did) and return them."""
    with torch.no_grad():
        for i, p in enumerate(tr.model.parameters()):
            p.add_(0.01 * (1 + i % 3))
    return snapshot(tr.model)


def formula(theta: torch.Tensor, ref: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * theta + (1 - alpha) * ref, in float64."""
    return alpha * theta.double() + (1 - alpha) * ref.double()


def within_rounding(got: torch.Tensor, theta: torch.Tensor, ref: torch.Tensor, alpha: float) -> bool:
    """|got - (alpha theta + (1 - alpha) ref)| <= 4 float32 units of the terms' size: the three roundings of
    float32 arithmetic (two products and their sum), with room to spare; the float64 formula is the yardstick."""
    got, theta, ref = got.cpu(), theta.cpu(), ref.cpu()
    size = alpha * theta.double().abs() + (1 - alpha) * ref.double().abs()
    return bool(((got.double().cpu() - formula(theta, ref, alpha)).abs() <= 2.0**-22 * size).all())


def assert_mixed(got: dict, theta: dict, ref: dict, alpha: float) -> None:
    """The reference's weights follow the formula: bit for bit against the same float32 arithmetic, and within
    float32 rounding of the float64 value."""
    for k in ref:
        want32 = theta[k].float() * alpha + ref[k].float() * (1.0 - alpha) if alpha != 1.0 else theta[k]
        assert torch.equal(got[k].cpu(), want32.to(got[k].dtype)), k
        assert within_rounding(got[k], theta[k], ref[k], alpha), k


def test_sync_every_mixes_the_in_process_reference_as_the_formula_says(single_rank_env, tmp_path):
    from grpo.foundation.modeling import load_model

    alpha = 0.3
    tr = make_trainer(tmp_path, "algo.beta=0.04", "ref.sync_every=2", f"ref.mixup_alpha={alpha}",
                      "train.max_steps=4", "train.save_every=0")
    seen = []
    sync = tr.sync_reference

    def recording(a):
        theta, ref = snapshot(tr.model), snapshot(tr.reference.impl.model)
        folder, version = sync(a)
        seen.append((tr.step, a, folder, version))
        assert_mixed(snapshot(tr.reference.impl.model), theta, ref, a)
        saved = load_model(tr.cfg.model, folder).state_dict()  # the folder holds the new reference
        assert all(torch.equal(saved[k], tr.reference.impl.model.state_dict()[k].cpu()) for k in saved)
        return folder, version

    tr.sync_reference = recording
    history = tr.train()
    assert [(s, a, v) for s, a, _, v in seen] == [(2, alpha, 1), (4, alpha, 2)]
    assert seen[-1][2] == str(tmp_path / "reference" / "step-4") and tr.reference.folder == seen[-1][2]
    assert [h.get("ref/version") for h in history] == [None, 1, None, 2]
    last_sync = seen[-1][2]
    # step-2's folder is neither the reference nor named by a checkpoint: deleted (issue 30, item 9)
    assert sorted(p.name for p in (tmp_path / "reference").iterdir()) == ["step-4"]

    # alpha = 1 (ProRL's resets): an exact copy of the policy, weights moved by hand so they surely differ
    theta = moved_policy(tr)
    tr.step = 5
    folder, version = tr.reset_reference()
    assert version == 3 and folder.endswith("step-5")
    ref = snapshot(tr.reference.impl.model)
    assert all(torch.equal(ref[k], theta[k]) for k in ref)

    # resume: the trainer restores the synced reference and its version
    tr2 = make_trainer(tmp_path, "algo.beta=0.04", "ref.sync_every=2", f"ref.mixup_alpha={alpha}", resume=True)
    assert tr2.step == 4 and tr2.reference.version == 2 and tr2.reference.folder == last_sync
    want = load_model(tr.cfg.model, last_sync).state_dict()
    got = snapshot(tr2.reference.impl.model)
    assert all(torch.equal(want[k], got[k]) for k in want)
    tr2.close()

    # the run folder moved: it still resumes, with its own synced reference (issue 30, item 24: the state held
    # an absolute path, and the error blamed model.name_or_path)
    moved = tmp_path.parent / (tmp_path.name + "-moved")
    shutil.move(str(tmp_path), str(moved))
    tr3 = make_trainer(moved, "algo.beta=0.04", "ref.sync_every=2", f"ref.mixup_alpha={alpha}", resume=True)
    assert tr3.step == 4 and tr3.reference.folder == str(moved / "reference" / "step-4")
    got = snapshot(tr3.reference.impl.model)
    assert all(torch.equal(want[k], got[k]) for k in want)
    tr3.close()


def test_sync_through_the_server_writes_the_mixed_weights_and_reloads(single_rank_env, tmp_path):
    from grpo.foundation.modeling import load_model
    from grpo.reference.handle import ReferenceHandle

    alpha = 0.3
    tr = make_trainer(tmp_path, "algo.beta=0.04")
    server = RecordingServer()
    tr.reference = ReferenceHandle(server)
    initial = load_model(tr.cfg.model).state_dict()
    theta1 = moved_policy(tr)
    tr.step = 3
    folder, version = tr.sync_reference(alpha)
    assert server.loaded == [folder] and version == 1 and tr.reference.folder == folder
    first = load_model(tr.cfg.model, folder).state_dict()
    assert_mixed(first, theta1, initial, alpha)  # the server's weights were the initial model
    theta2 = moved_policy(tr)
    tr.step = 6
    folder2, version = tr.sync_reference(alpha)
    assert server.loaded == [folder, folder2] and version == 2
    assert_mixed(load_model(tr.cfg.model, folder2).state_dict(), theta2, first, alpha)  # then the last sync's
    folder3, _ = (setattr(tr, "step", 7), tr.sync_reference(1.0))[1]  # alpha = 1: the policy's export
    saved = load_model(tr.cfg.model, folder3).state_dict()
    assert all(torch.equal(saved[k], theta2[k]) for k in saved)
    tr.close()


@pytest.mark.parametrize("alpha, lora_cfg", [(0.3, LORA), (1.0, LORA), (0.3, LORA_HEAD)],
                         ids=["0.3", "1.0", "0.3-head"])
def test_sync_with_lora_merges_into_the_base_and_keeps_the_policy(single_rank_env, tmp_path, alpha, lora_cfg):
    from grpo.foundation import lora
    from grpo.foundation.modeling import load_model

    tr = make_trainer(tmp_path, lora_cfg, "algo.beta=0.04", "train.lr=1e-2")
    perturb_adapters(tr.model)
    tr.train_step()
    tr.step = 1
    packed = fixed_packed(tr)
    policy_before = policy_logprobs(tr, packed)
    base0 = {k: v.clone() for k, v in lora.base_state_dict(tr.model).items()}
    layers = dict(lora._lora_layers(tr.model))
    delta = {f"{n}.weight": m.get_delta_weight(lora.ADAPTER).detach().clone() for n, m in layers.items()}
    b0 = {n: m.lora_B[lora.ADAPTER].weight.detach().clone() for n, m in layers.items()}
    heads = {f"{n}.{k}": v.detach().clone() for n, w in lora._saved_modules(tr.model)
             for k, v in w.modules_to_save[lora.ADAPTER].state_dict().items()}
    assert bool(heads) == (lora_cfg == LORA_HEAD)

    folder, version = tr.sync_reference(alpha)
    assert version == 1 and tr.reference.kind == "adapters-off" and tr.reference.impl.model is tr.model
    base1 = lora.base_state_dict(tr.model)
    for k, w0 in base0.items():
        if k in delta:  # the reference: alpha (W + D) + (1 - alpha) W = W + alpha D
            assert torch.equal(base1[k], w0 + alpha * delta[k]), k
            assert within_rounding(base1[k], w0 + delta[k], w0, alpha), k
        elif k in heads:  # a trained head T: alpha T + (1 - alpha) W (the embeddings it was tied to stay W)
            assert torch.equal(base1[k], heads[k] * alpha + w0 * (1.0 - alpha)), k
            assert within_rounding(base1[k], heads[k], w0, alpha), k
        else:
            assert torch.equal(base1[k], w0), k  # layers without adapters: pi_theta = pi_ref there already
    for n, m in layers.items():  # the adapter keeps (1 - alpha) D
        assert torch.equal(m.lora_B[lora.ADAPTER].weight, b0[n] * (1.0 - alpha) if alpha != 1 else torch.zeros_like(b0[n]))
    ref = tr.reference.logprobs(packed, tr.cfg.rollout.temperature).cpu()
    synced_model = load_model(tr.cfg.model, folder)  # the folder holds the new reference (the new base)
    assert torch.equal(ref, plain_logprobs(synced_model, packed, tr.cfg))
    assert (policy_logprobs(tr, packed) - policy_before).abs().max() <= MERGE_BOUND  # the policy did not change
    if alpha == 1.0:
        assert torch.equal(ref, policy_logprobs(tr, packed)) or (ref - policy_before).abs().max() <= MERGE_BOUND

    # an adapter saved now names its new base; a resumed run puts that base back under the adapter
    tr.step = 1
    ckpt = tr.save()
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == folder
    merged = load_model(tr.cfg.model, str(ckpt))
    assert (plain_logprobs(merged, packed, tr.cfg) - policy_before).abs().max() <= 2 * MERGE_BOUND
    weights = snapshot(tr.model)
    tr.close()
    tr2 = make_trainer(tmp_path, lora_cfg, "algo.beta=0.04", "train.lr=1e-2", resume=True)
    assert tr2.reference.version == 1 and tr2.reference.folder == folder
    got = snapshot(tr2.model)
    assert all(torch.equal(weights[k], got[k]) for k in weights)
    tr2.close()


def test_prorl_resets_with_lora_use_the_same_mechanism(single_rank_env, tmp_path):
    from grpo.foundation import lora

    tr = make_trainer(tmp_path, LORA, "algo.dynamic_sampling=false", "algo.reset_every=1", "algo.reset_optimizer=false",
                      algo="prorl")
    perturb_adapters(tr.model)
    packed = fixed_packed(tr)
    before = policy_logprobs(tr, packed)
    tr.step = 1
    m = {}
    tr.algo.on_step_end(tr.context(), m)
    assert m["prorl/reset"] == 1 and tr.algo.ref_version == 1 and tr.reference.version == 1
    assert all(float(m_.lora_B[lora.ADAPTER].weight.detach().abs().max()) == 0 for _, m_ in lora._lora_layers(tr.model))
    ref = tr.reference.logprobs(packed, tr.cfg.rollout.temperature)
    assert (ref - before).abs().max() <= MERGE_BOUND  # pi_ref <- pi_theta
    assert (policy_logprobs(tr, packed) - before).abs().max() <= MERGE_BOUND
    tr.close()


# --------------------------------------------------------------------------- 2 ranks (slow)


# The adapters' step gradient on 1 rank against 2 ranks under ZeRO-2: tests/test_distributed.py ("+lora" runs).


# LoRA on 2 ranks under ZeRO-2 with checkpoints and --resume: tests/test_distributed.py (its launches).


def test_merge_lora_refuses_what_it_cannot_merge_safely(tmp_path):
    """Issue 30, item 26: a corrupt adapter_config.json, missing adapter weights and a pickled
    adapter_model.bin ended in raw tracebacks; a --base of another model merged silently and wrote the
    adapter folder's tokenizer beside a model with another vocabulary."""
    import shutil

    from peft import LoraConfig, get_peft_model

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.foundation.tiny import write_tiny

    base = write_tiny(tmp_path / "base")
    adapter = tmp_path / "adapter"
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(str(adapter))
    AutoTokenizer.from_pretrained(base).save_pretrained(str(adapter))
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    merge = load_script("merge_lora")

    def fails(folder, *extra: str, needle: str) -> None:
        import io
        from contextlib import redirect_stderr

        err = io.StringIO()
        with redirect_stderr(err):
            assert merge.main([str(folder), str(tmp_path / "out"), *extra]) == 2
        assert needle in err.getvalue(), err.getvalue()

    # another model's base: a different shape than the base the adapter names
    fails(adapter, "--base", "builtin:tiny-char-h64", needle="is not the model this adapter was trained on")
    # the named base is not here: another vocabulary than the adapter's tokenizer is still caught
    unnamed = tmp_path / "unnamed"
    shutil.copytree(adapter, unnamed)
    config = json.loads((unnamed / "adapter_config.json").read_text())
    (unnamed / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/elsewhere"}))
    fails(unnamed, "--base", "builtin:tiny-arith", needle="tokens and --base builtin:tiny-arith a vocabulary of")
    # the right base merges
    assert merge.main([str(adapter), str(tmp_path / "merged")]) == 0
    # a corrupt config, missing weights, pickled weights
    (unnamed / "adapter_config.json").write_text("{not json")
    fails(unnamed, needle="adapter_config.json is not valid JSON")
    (unnamed / "adapter_config.json").write_text(json.dumps(config))
    (unnamed / "adapter_model.safetensors").unlink()
    fails(unnamed, needle="holds no adapter_model.safetensors: the adapter's weights are missing")
    (unnamed / "adapter_model.bin").write_bytes(b"pickle")
    fails(unnamed, needle="adapter_model.bin is a pickle, which could run code when loaded: refusing it")


def test_resume_with_another_setup_is_refused_naming_both_values(single_rank_env, tmp_path):
    """Issue 30, item 6: another alpha rescaled the trained update, other target_modules dropped the trained
    adapters (and put their Adam moments on new ones), full fine-tuning resumed onto another architecture of
    the same shapes, all silently."""
    lora_run, full_run = tmp_path / "lora", tmp_path / "full"
    tr = make_trainer(lora_run, LORA, "algo.beta=0", "train.max_steps=1")
    tr.save()
    tr.close()
    for overrides, words in [
        (["model.lora={r: 4, alpha: 16, target_modules: [q_proj, v_proj, up_proj]}"], "alpha: 8.0 in the checkpoint, 16.0 now"),
        (["model.lora={r: 4, alpha: 8, target_modules: [q_proj, k_proj]}"],
         "target_modules: ['q_proj', 'up_proj', 'v_proj'] in the checkpoint, ['k_proj', 'q_proj'] now"),
        ([], "the checkpoint holds a LoRA adapter and this run has no model.lora"),
    ]:
        with pytest.raises(ConfigError, match="the run is not set up as the checkpoint was") as e:
            make_trainer(lora_run, *overrides, "algo.beta=0", resume=True)
        assert words in str(e.value), str(e.value)
    tr = make_trainer(full_run, "algo.beta=0", "train.max_steps=1")
    tr.save()
    tr.close()
    with pytest.raises(ConfigError, match="num_attention_heads: 4 in the checkpoint, 1 now"):
        make_trainer(full_run, "algo.beta=0", "model.name_or_path=builtin:tiny-char-h64", resume=True)
    make_trainer(lora_run, LORA, "algo.beta=0", resume=True).close()  # the same setup resumes


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_resume_never_unpickles_code_from_deepspeeds_files(single_rank_env, tmp_path, victim):
    """Issue 30, item 2: DeepSpeed's checkpoint engine loaded ds/*.pt with weights_only=False, so a crafted
    checkpoint ran code on --resume. Every file now loads weights-only; the real files of ZeRO-2 still do."""
    from tests.test_checkpoint import _Evil

    run = tmp_path / "run"
    tr = make_trainer(run, "algo.beta=0", "train.max_steps=1", "train.zero_stage=2")
    ckpt = tr.save()
    tr.close()
    make_trainer(run, "algo.beta=0", "train.zero_stage=2", resume=True).close()  # DeepSpeed's own files load
    marker = tmp_path / "code-ran"
    torch.save({"anything": _Evil(marker)}, ckpt / "ds" / victim)
    with pytest.raises(RuntimeError, match=rf"{victim} holds objects other than tensors and plain data.*refusing"):
        make_trainer(run, "algo.beta=0", "train.zero_stage=2", resume=True)
    assert not marker.exists()
