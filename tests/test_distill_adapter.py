"""A LoRA teacher (issue 44, ``teacher.adapter``): the policy's frozen base with another adapter, loaded beside the
policy's own in the same model. Its log-probs equal those of the base merged with that adapter (PEFT's own
loading); the policy's log-probs, its trainable parameters and their flags are untouched by the teacher's calls; the
config's errors; two opd steps with LoRA (the reference its base with the adapters off, both audited) whose saved
adapters hold only the policy's own, and a resume."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.foundation.config import ConfigError
from grpo.training.configure import load_config

LORA = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, up_proj]}"


def config(algo: str, *overrides: str, **keys):
    """The preset-free config with ``overrides`` and ``keys`` (None: null)."""
    return load_config(algo=algo, overrides=[*overrides, *(f"{k}={'null' if v is None else v}" for k, v in keys.items())])


def teacher_adapter(folder, seed=3, base="builtin:tiny-char"):
    """A saved adapter on ``base`` (builtin:tiny-char's shapes; other targets and rank than the policy's), with
    random B."""
    from grpo.foundation import lora
    from grpo.foundation.config import LoraConfig
    from grpo.foundation.tiny import build_tiny

    model, _ = build_tiny()
    model = lora.apply_lora(model, LoraConfig(r=2, alpha=4, target_modules=["q_proj", "o_proj", "down_proj"]),
                            base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return lora.save_adapter(model, folder)


def test_the_adapter_teacher_is_the_base_merged_with_its_adapter(tmp_path):
    from grpo.foundation import lora
    from grpo.foundation.logprobs import completion_scores, pack
    from grpo.foundation.modeling import load_model, load_policy, load_tokenizer
    from grpo.reference.teacher import make_teacher

    folder = teacher_adapter(tmp_path / "teacher")
    cfg = config("opd", LORA, **{"teacher.adapter": str(folder), "teacher.model": None})
    policy = load_policy(cfg.model)
    with torch.no_grad():  # the policy moves away from its base, so that its adapter matters
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.3)
    tok = load_tokenizer(cfg.model.name_or_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (4, 7, 2)]
    completions = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (5, 1, 6)]
    packed = pack(prompts, completions, tok.pad_token_id, 6)
    policy.train()
    with torch.no_grad():
        own = completion_scores(policy, packed, 0.8).logprobs
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    teacher = make_teacher(cfg, torch.device("cpu"), tok, len(tok), policy=policy)
    assert teacher.kind == "adapter" and not teacher.remote
    got = teacher.logprobs(packed, 0.8)
    top = teacher.submit_topk(packed, 0.8, 5).result()
    merged = lora.load_adapter_folder(folder, lambda base: load_model(cfg.model, base))
    with torch.no_grad():
        want = completion_scores(merged, packed, 0.8).logprobs
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(top.logprobs, got, rtol=0, atol=0)
    assert (got - own).abs().max() > 1e-2  # the teacher is not the policy
    # the policy afterwards: the same log-probs, the same trainable parameters, still in training mode
    with torch.no_grad():
        assert torch.equal(completion_scores(policy, packed, 0.8).logprobs, own)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable and policy.training
    assert all(".teacher." not in n for n in trainable)
    assert all(".teacher." not in k for k in lora.adapter_state_dict(policy))  # what a checkpoint saves
    assert list(lora.merged_state_dict(policy)) == list(lora.base_state_dict(policy))  # what an export writes


@pytest.mark.parametrize("overrides, match", [
    ({"teacher.adapter": "x", "model.lora": None, "teacher.model": None}, r"teacher.adapter='x' is a LoRA adapter on the policy's base, and "
                                                   r"the policy has no LoRA"),
    ({"teacher.adapter": "x"}, r"teacher.model='builtin:tiny-char' and teacher.adapter='x': name one teacher"),
    ({"teacher.adapter": "x", "teacher.model": None, "ref.sync_every": 5, "algo.beta": 0.04},
     r"teacher.adapter='x' shares the policy's base, which ref.sync_every=5 moves"),
])
def test_adapter_teacher_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config("grpo", LORA, **{"teacher.model": "builtin:tiny-char", **overrides})


def test_a_folder_that_is_not_an_adapter_is_refused(tmp_path):
    from grpo.foundation.modeling import load_policy
    from grpo.foundation.tiny import write_tiny
    from grpo.reference.teacher import make_teacher

    cfg = config("opd", LORA, **{"teacher.adapter": str(write_tiny(tmp_path / "whole")), "teacher.model": None})
    with pytest.raises(ConfigError, match=r"whole is not a LoRA adapter folder"):
        make_teacher(cfg, torch.device("cpu"), policy=load_policy(cfg.model))


def test_opd_with_lora_distils_from_an_adapter_on_its_own_base(single_rank_env, tmp_path):
    from grpo.training.trainer import Trainer

    folder = teacher_adapter(tmp_path / "teacher")
    cfg = load_config("configs/opd.yaml", None, [
        LORA, f"teacher.adapter={folder}", "teacher.model=null", f"train.output_dir={tmp_path / 'run'}",
        "algo.beta=0.04", "logging.audit_every=1",  # the reference: the same base, adapters off; audited each step
        "train.max_steps=2", "train.save_every=1", "rollout.prompts_per_step=4", "rollout.num_generations=2",
        "reward_pool.num_workers=0", "logging.progress_bar=false", "logging.plot=false"])
    tr = Trainer(cfg)
    assert tr.teacher.kind == "adapter"
    history = tr.train()
    assert len(history) == 2
    for h in history:
        assert h["distill/reverse_kl"] != 0 and 0 < h["distill/teacher_prob"] < 1 and math.isfinite(h["loss"])
        assert h["audit/sampler_kl"] < 1e-5 and h["audit/reference_kl"] >= 0 and "kl" in h
    assert history[0]["audit/reference_kl"] < 1e-6  # the adapters start at B = 0: the policy is its base
    saved = list((tmp_path / "run").rglob("adapter_model.safetensors"))
    assert saved
    from safetensors.torch import load_file

    for f in saved:
        assert not [k for k in load_file(str(f)) if "teacher" in k]
    # --resume: the teacher is loaded again beside the restored policy adapter, and the run goes on
    cfg.train.max_steps = 3
    resumed = Trainer(cfg, resume=True)
    assert resumed.step == 2 and resumed.teacher.kind == "adapter"
    more = resumed.train()
    assert len(more) == 1 and math.isfinite(more[0]["loss"]) and more[0]["distill/teacher_prob"] > 0


def test_an_adapter_trained_on_another_base_is_refused_naming_both(tmp_path):
    """Issue 58 item 9: a teacher.adapter trained on another base model was loaded without a word (same shapes:
    its deltas applied to weights they were not trained on). Refused naming both bases, as --resume refuses."""
    from grpo.foundation.modeling import load_policy, load_tokenizer
    from grpo.foundation.tiny import write_tiny
    from grpo.reference.teacher import make_teacher

    other = write_tiny(tmp_path / "other-base", seed=9)
    folder = teacher_adapter(tmp_path / "teacher", base=str(other))
    cfg = config("opd", LORA, **{"teacher.adapter": str(folder), "teacher.model": None})
    policy = load_policy(cfg.model)
    tok = load_tokenizer(cfg.model.name_or_path)
    with pytest.raises(ConfigError, match=rf"the adapter was trained on '{other}', and this model's base is "
                                          r"'builtin:tiny-char' \(model.name_or_path\)"):
        make_teacher(cfg, torch.device("cpu"), tok, len(tok), policy=policy)
    assert all(".teacher." not in n for n, _ in policy.named_parameters())  # nothing was added
