"""Loading a model keeps what the model is: Gemma 2's attention soft-cap under transformers versions whose default
SDPA attention drops it (grpo.foundation.modeling.keep_attention_softcap); image-text-to-text checkpoints load as
their own class, score text exactly, keep their vision side frozen and their processor files on export; a checkpoint
that cannot generate is refused by name."""

from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma2 import modeling_gemma2

from grpo.foundation.config import ConfigError, ModelConfig
from grpo.foundation.modeling import load_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sdpa_drops_the_cap(monkeypatch):
    """transformers 5.17 (the GPU machine's, 2026-11-27): Gemma 2 declares SDPA support, SDPA is its default, and
    sdpa_attention_forward takes the ``softcap`` keyword among its **kwargs and ignores it. Later versions refuse
    both; this puts 5.17's behaviour back for the test."""
    monkeypatch.setattr(modeling_gemma2.Gemma2PreTrainedModel, "_supports_sdpa", True)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def dropping(*args, softcap=None, **kwargs):
        return sdpa(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", dropping)


@pytest.fixture
def gemma2_folder(tmp_path):
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       attn_logit_softcapping=1.5, final_logit_softcapping=None, attn_implementation="eager")
    model = Gemma2ForCausalLM(cfg)
    for name, p in model.named_parameters():
        if "q_proj" in name or "k_proj" in name:  # scores large enough for the cap to bite
            p.data.mul_(30)
    model.save_pretrained(tmp_path)
    return tmp_path, model.eval()


IDS = torch.tensor([[3, 9, 14, 27, 5, 41, 8, 60]])


def test_a_default_sdpa_that_drops_gemma2s_softcap_is_switched_to_eager(sdpa_drops_the_cap, gemma2_folder):
    folder, eager = gemma2_folder
    want = eager(input_ids=IDS).logits
    raw = Gemma2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert raw.config._attn_implementation == "sdpa"  # 5.17's default, as emulated
    assert (raw(input_ids=IDS).logits - want).abs().max() > 0.1  # the cap dropped: not the model
    model = load_model(ModelConfig(dtype="fp32"), str(folder)).eval()
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(model(input_ids=IDS).logits, want, rtol=0, atol=1e-5)


def test_asking_for_sdpa_on_a_softcapped_model_names_the_value_and_the_choices(sdpa_drops_the_cap, gemma2_folder):
    with pytest.raises(ConfigError, match=r"attn_implementation='sdpa'.*attn_logit_softcapping=1.5.*eager"):
        load_model(ModelConfig(dtype="fp32", attn_implementation="sdpa"), str(gemma2_folder[0]))


def test_models_without_a_softcap_keep_their_attention(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    assert load_model(ModelConfig(dtype="fp32"), str(tmp_path)).config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch, cls", [("gemma3_mm", "Gemma3ForConditionalGeneration"),
                                       ("mistral3_mm", "Mistral3ForConditionalGeneration"),
                                       ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
                                       ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
                                       ("llava", "LlavaForConditionalGeneration")])
def test_image_text_to_text_checkpoints_load_as_their_own_class_and_score_text_exactly(tmp_path, arch, cls):
    """Checkpoints that AutoModelForCausalLM refuses (Mistral Small 3.1 / 3.2, Qwen2.5-VL, Qwen3-VL, LLaVA) load as their
    own class, as TRL loads them; text-only, the log-probs of every path (each group's prompt once, or one forward
    per row) are the model's own forward's in float64; freeze_bottom_layers finds the language model's layers."""
    from grpo.foundation.logprobs import completion_scores, pack
    from grpo.foundation.tiny import write_tiny

    folder = write_tiny(tmp_path / arch, arch=arch)
    model = load_model(ModelConfig(dtype="fp32", freeze_bottom_layers=1), str(folder)).double().eval()
    assert type(model).__name__ == cls
    layers = model.model.language_model.layers
    assert not any(p.requires_grad for p in layers[0].parameters())
    assert all(p.requires_grad for p in layers[1].parameters())
    language = {id(p) for p in model.model.language_model.parameters()} | {id(model.lm_head.weight)}
    outside = [n for n, p in model.named_parameters() if id(p) not in language]
    assert outside and not any(p.requires_grad for n, p in model.named_parameters() if n in outside)  # vision side
    for p in model.parameters():  # nothing frozen that a text forward reaches: every gradient lands inside
        p.requires_grad_(True)
    model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.sum().backward()
    assert not [n for n, p in model.named_parameters() if p.grad is not None and n in outside]
    model.zero_grad(set_to_none=True)
    model.requires_grad_(False)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    rows = [prompts[i // 2] for i in range(4)]
    comps = [[12, 13, 14], [15, 16], [17, 18, 19, 20], [21]]
    with torch.no_grad():
        expected = []
        for p, c in zip(rows, comps):
            lp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0], -1)
            expected.append(torch.stack([lp[len(p) - 1 + j, t] for j, t in enumerate(c)]))
        for share in (True, False):
            got = completion_scores(model, pack(rows, comps, 0), 1.0, share_prefix=share).logprobs
            for i, e in enumerate(expected):
                torch.testing.assert_close(got[i, : len(e)], e, rtol=0, atol=1e-12)


def test_a_checkpoint_that_cannot_generate_text_is_refused_by_name(tmp_path):
    from transformers import ViTConfig, ViTModel

    ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                       patch_size=14)).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"ViTConfig\) is neither a causal language model nor an image-text-to-text"):
        load_model(ModelConfig(dtype="fp32"), str(tmp_path))


def test_an_exported_image_text_to_text_model_keeps_its_processor_files(tmp_path, monkeypatch):
    """The export / checkpoint folder of a multimodal policy carries its source folder's processor files (vLLM builds
    the processor from them even for text) and loads as the same class; a model from no folder copies nothing, not
    even from the working directory."""
    from transformers import AutoTokenizer

    from grpo.foundation.tiny import build_tiny, write_tiny
    from grpo.training.checkpoint import write_weights

    src = write_tiny(tmp_path / "src", arch="qwen2_5_vl")
    (src / "preprocessor_config.json").write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    model = load_model(ModelConfig(dtype="fp32"), str(src))
    write_weights(model, model.state_dict(), AutoTokenizer.from_pretrained(src), tmp_path / "out")
    for name in ("preprocessor_config.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_text() == (src / name).read_text()
    again = load_model(ModelConfig(dtype="fp32"), str(tmp_path / "out"))
    assert type(again) is type(model)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    monkeypatch.chdir(src)  # a folder with processor files as the working directory
    tiny, tok = build_tiny()
    write_weights(tiny, tiny.state_dict(), tok, tmp_path / "plain")
    assert not (tmp_path / "plain" / "preprocessor_config.json").exists()


def test_a_multimodal_checkpoints_vision_side_stays_as_it_was_under_zero_2(single_rank_env, tmp_path):
    """Text prompts never reach a VL checkpoint's vision tower: it is frozen, so ZeRO-2's flat Adam partitions (which
    gave it zero gradients) no longer decay it with weight decay; the language model trains."""
    from grpo.foundation.tiny import write_tiny
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    folder = write_tiny(tmp_path / "m", arch="qwen2_5_vl")
    cfg = load_config(ROOT / "configs" / "demo.yaml", "grpo", [
        f"train.output_dir={tmp_path}/run", "logging.progress_bar=false", "logging.plot=false", "train.max_steps=1",
        "rollout.prompts_per_step=4", "rollout.num_generations=4", "reward_pool.num_workers=0", "algo.beta=0",
        "model.dtype=fp32", f"model.name_or_path={folder}", "train.zero_stage=2", "train.weight_decay=0.1",
        "train.lr=0.01", "train.save_every=0", "train.export_final=false"])
    tr = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    after = dict(tr.model.named_parameters())
    vision = [n for n in before if ".visual." in n]
    assert vision and all(torch.equal(before[n], after[n]) for n in vision)
    assert any(not torch.equal(before[n], after[n]) for n in before if "language_model" in n)
    tr.close()


def gemma3n_folder(path: Path, per_layer_vocab: int) -> Path:
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    Gemma3nForCausalLM(Gemma3nTextConfig(
        vocab_size=64, vocab_size_per_layer_input=per_layer_vocab, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size_per_layer_input=4,
        layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0, laurel_rank=4,
        altup_num_inputs=2, activation_sparsity_pattern=[0.0, 0.0], sliding_window=8)).save_pretrained(path)
    return path


def test_gemma3n_stops_at_start_under_a_transformers_whose_forward_fails_on_its_media_tokens(tmp_path, monkeypatch):
    """transformers 5.17-5.20 look every token id up in Gemma 3n's per-layer embedding, which holds only the first
    vocab_size_per_layer_input ids (262,144 of 262,400: the rest are audio and image tokens): a sampled id past them
    fails in the trainer's forward (checked with transformers 5.17: IndexError on CPU). 5.21 maps them to row 0, as
    the static engine does. Under an older version such a model stops at load, naming the fix."""
    import transformers
    from packaging.version import Version

    installed = Version(transformers.__version__)
    short = gemma3n_folder(tmp_path / "short", per_layer_vocab=48)
    monkeypatch.setattr(transformers, "__version__", "5.20.0")
    with pytest.raises(ConfigError, match=r"gemma3n_text with transformers 5\.20\.0: .*vocab_size_per_layer_input.*"
                                          r"install transformers>=5\.21"):
        load_model(ModelConfig(dtype="fp32"), str(short))
    # a per-layer table over the whole vocabulary cannot be read past: nothing to stop
    assert load_model(ModelConfig(dtype="fp32"), str(gemma3n_folder(tmp_path / "whole", per_layer_vocab=64)))
    monkeypatch.setattr(transformers, "__version__", "5.21.0")
    model = load_model(ModelConfig(dtype="fp32"), str(short)).eval()
    past = torch.tensor([[1, 50, 63]])  # ids past the per-layer table
    if installed >= Version("5.21"):
        assert torch.isfinite(model(input_ids=past).logits).all()
    else:  # the defect itself, where the installed transformers has it
        with pytest.raises(IndexError):
            model(input_ids=past)
