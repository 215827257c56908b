"""Loading a model keeps what the model is: Gemma 2's attention soft-cap under transformers versions whose default
SDPA attention drops it (grpo.foundation.modeling.keep_attention_softcap)."""

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma2 import modeling_gemma2

from grpo.foundation.config import ConfigError, ModelConfig
from grpo.foundation.modeling import load_model


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
