"""A tiny Llama-style model and a character-level tokenizer, built offline in seconds.

Used by the tests and the demo (``model.name_or_path: builtin:tiny-char``, or ``builtin:tiny-char-h64``
with head_dim 64 for vLLM) and written to a folder with ``python -m grpo.foundation.tiny OUT_DIR [NAME]``. Same seed -> same weights, on every rank.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                          Gemma4ForCausalLM, Gemma4TextConfig, LlamaConfig,
                          LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration, Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig,
                          PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                          Qwen2_5_VLTextConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLTextConfig, Qwen3_5ForCausalLM,
                          Qwen3_5TextConfig)

BUILTIN_NAME = "builtin:tiny-char"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARSET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n+-*/=<>:;,.?!()[]#_'\"$\\{}"
# builtin:tiny-arith: the same model over a small action vocabulary (arithmetic, the chat template's role
# letters u/a/t/s and the calculator's "error"); any other character is <unk>. 29 tokens instead of 97.
ARITH_CHARSET = string.digits + "+-*/=() :\nuatsero"
# Every builtin model: its name -> (its tokenizer's characters, make_tiny_model's arguments).
# ``tiny-char-h64`` has tiny-char's sizes with one head of width 64 (tiny-char's heads are 16 wide, which
# vLLM's CPU attention refuses): the vllm engine's.
BUILTIN_MODELS = {
    BUILTIN_NAME: (CHARSET, {}),
    "builtin:tiny-char-h64": (CHARSET, {"num_heads": 1}),
    "builtin:tiny-arith": (ARITH_CHARSET, {}),
}
# make_tiny_model's ``arch``: the architectures of the recipes' models (SmolLM2 is a Llama, Qwen2.5 a Qwen2).
# gemma3: Gemma 3's text model (its sandwich norms, q/k norms, a RoPE per layer type; layer 1 of 2 slides);
# qwen3_moe: Qwen3's mixture of experts (top-2 of 4 experts a quarter of the dense MLP's width);
# Image-text-to-text checkpoints, each with a one-layer vision tower that text prompts never reach: gemma3_mm, that
# Gemma 3 text model inside Gemma 3's multimodal checkpoint (the 4B-27B models load as
# Gemma3ForConditionalGeneration); mistral3_mm, a Mistral text model under a Pixtral tower (Mistral Small 3.1 / 3.2,
# Magistral); qwen2_5_vl and qwen3_vl, Qwen2.5-VL's and Qwen3-VL's (multimodal RoPE: three position streams, equal
# for text); llava, a Llama under a CLIP tower. qwen3_5: Qwen3.5's hybrid decoder, a Gated DeltaNet layer (linear
# attention: a convolution and a recurrent state, no keys and values) then a gated full-attention layer. gemma4:
# Gemma 4's text model (a sliding layer, then a full one with twice the head width, one KV head and keys = values;
# per-layer inputs).
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
         "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
         "gemma3_mm": (Gemma3TextConfig, Gemma3ForConditionalGeneration),
         "mistral3_mm": (MistralConfig, Mistral3ForConditionalGeneration),
         "qwen2_5_vl": (Qwen2_5_VLTextConfig, Qwen2_5_VLForConditionalGeneration),
         "qwen3_vl": (Qwen3VLTextConfig, Qwen3VLForConditionalGeneration),
         "llava": (LlamaConfig, LlavaForConditionalGeneration),
         "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM), "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM)}


def _gemma3_text(hidden: int, heads: int) -> dict:
    return {"head_dim": hidden // heads, "query_pre_attn_scalar": hidden // heads, "sliding_window": 16,
            "sliding_window_pattern": 2}


def _mrope(hidden: int, heads: int) -> dict:
    """Multimodal RoPE: the head's frequency pairs split among the temporal, height and width positions."""
    half = hidden // heads // 2
    return {"head_dim": hidden // heads, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [half - 2 * (half // 3)] + [half // 3] * 2}}


def _qwen3_5(hidden: int, heads: int) -> dict:
    head = hidden // heads
    return {"head_dim": head, "linear_num_key_heads": max(1, heads // 2), "linear_num_value_heads": heads,
            "linear_key_head_dim": head, "linear_value_head_dim": head, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2}  # layers alternate: linear attention, then full


ARCH_KWARGS = {
    "qwen3_5": _qwen3_5,
    # the per-layer inputs' vocabulary: 128, more than any builtin tokenizer's (Gemma 4's own: 262,144)
    "gemma4": lambda hidden, heads: {"head_dim": hidden // heads, "global_head_dim": 2 * hidden // heads,
                                     "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 16,
                                     "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128},
    "gemma3": _gemma3_text, "gemma3_mm": _gemma3_text, "qwen2_5_vl": _mrope,
    "qwen3_vl": lambda hidden, heads: {**_mrope(hidden, heads), "rope_parameters": {
        **_mrope(hidden, heads)["rope_parameters"], "mrope_interleaved": True}},
    "qwen3_moe": lambda hidden, heads: {"head_dim": hidden // heads, "num_experts": 4, "num_experts_per_tok": 2,
                                        "moe_intermediate_size": hidden, "norm_topk_prob": True},
}
_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
_QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2)
MULTIMODAL = {
    "gemma3_mm": lambda text, vocab: Gemma3Config(
        text_config=text, mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 2,
        eoi_token_index=vocab - 3, vision_config=dict(_VISION, image_size=28, patch_size=14)),
    "mistral3_mm": lambda text, vocab: Mistral3Config(
        text_config=text, image_token_index=vocab - 1,
        vision_config=dict(_VISION, model_type="pixtral", image_size=32, patch_size=8)),
    "llava": lambda text, vocab: LlavaConfig(
        text_config=text, image_token_index=vocab - 1,
        vision_config=dict(_VISION, model_type="clip_vision_model", image_size=28, patch_size=14)),
    "qwen2_5_vl": lambda text, vocab: Qwen2_5_VLConfig(
        text_config=text, image_token_id=vocab - 1, video_token_id=vocab - 2, vision_start_token_id=vocab - 3,
        vision_config=dict(_QWEN_VISION, out_hidden_size=text["hidden_size"])),
    "qwen3_vl": lambda text, vocab: Qwen3VLConfig(
        text_config=text, image_token_id=vocab - 1, video_token_id=vocab - 2, vision_start_token_id=vocab - 3,
        vision_config=dict(_QWEN_VISION, out_hidden_size=text["hidden_size"], deepstack_visual_indexes=[0])),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def make_char_tokenizer(charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """One token per character; </s> is EOS, <pad> is padding."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in charset:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    arch: str = "llama",
    num_kv_heads: int | None = None,
) -> torch.nn.Module:
    """A randomly initialised causal LM of ``arch`` (a key of ARCHS) with these sizes (``num_kv_heads`` <
    ``num_heads``: grouped-query attention; default: as many as ``num_heads``)."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        **ARCH_KWARGS.get(arch, lambda hidden, heads: {})(hidden_size, num_heads),
    )
    if arch in MULTIMODAL:  # the text config inside the checkpoint's own; its image tokens the vocabulary's last
        config = MULTIMODAL[arch](config.to_dict(), vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model


def is_builtin(name: str) -> bool:
    return name in BUILTIN_MODELS


def build_builtin(name: str, seed: int = 0) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """The builtin model ``name`` (a key of BUILTIN_MODELS) and its tokenizer."""
    charset, model_kwargs = BUILTIN_MODELS[name]
    return build_tiny(seed=seed, charset=charset, **model_kwargs)


def build_tiny(seed: int = 0, charset: str = CHARSET, **model_kwargs) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    tok = make_char_tokenizer(charset)
    model = make_tiny_model(
        len(tok), seed=seed, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, **model_kwargs,
    )
    return model, tok


def write_tiny(out_dir: str | Path, seed: int = 0, **model_kwargs) -> Path:
    """Write the tiny model and tokenizer as a normal HF folder."""
    out = Path(out_dir)
    model, tok = build_tiny(seed=seed, **model_kwargs)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_tiny_classifier(seed: int = 0, num_labels: int = 1, charset: str = CHARSET, **model_kwargs):
    """A tiny LlamaForSequenceClassification (a reward model: one logit, or ``num_labels``) over the char tokenizer."""
    from transformers import LlamaForSequenceClassification

    tok = make_char_tokenizer(charset)
    base = make_tiny_model(len(tok), seed=seed, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, **model_kwargs)
    config = base.config
    config.num_labels = num_labels
    config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    return model, tok


def write_tiny_classifier(out_dir: str | Path, seed: int = 0, padding_side: str = "right", num_labels: int = 1,
                          **model_kwargs) -> Path:
    """Write a tiny reward model and its tokenizer (padding on ``padding_side``) as a normal HF folder."""
    out = Path(out_dir)
    model, tok = build_tiny_classifier(seed=seed, num_labels=num_labels, **model_kwargs)
    tok.padding_side = tok.init_kwargs["padding_side"] = padding_side  # init_kwargs: what save_pretrained keeps
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: python -m grpo.foundation.tiny OUT_DIR [{' | '.join(BUILTIN_MODELS)}]")
    charset, model_kwargs = BUILTIN_MODELS[sys.argv[2] if len(sys.argv) == 3 else BUILTIN_NAME]
    print(write_tiny(sys.argv[1], charset=charset, **model_kwargs))
