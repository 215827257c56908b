"""What the trainer needs to know of a model family beyond transformers' own forward, in one table keyed by model
type: what the causal-LM head multiplies its logits by (``HEADS``), and where a checkpoint keeps its decoder's config
(``text_config``). The static engine's table of families (grpo/rollout/static/spec.py: FAMILIES) reads these too;
a family whose head transforms its logits otherwise is caught at start by ``logprobs.check_head``."""

from __future__ import annotations

from typing import Any, Callable


def text_config(model_or_config: Any) -> Any:
    """The decoder's config: the model's own, or its text model's in a checkpoint that wraps one with a vision tower
    (Gemma 3 4B-27B, Mistral Small 3.1 / 3.2, Qwen2.5-VL), whose text-only forward is its text model's."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _inverse(field: str) -> Callable[[Any], float]:
    return lambda cfg: 1.0 / float(getattr(cfg, field))


def _times(field: str) -> Callable[[Any], float]:
    return lambda cfg: float(getattr(cfg, field))


# model type -> what its causal-LM forward multiplies the head's logits by (a type not here: 1)
HEADS: dict[str, Callable[[Any], float]] = {
    # Cohere: logit_scale (Command R, R7B, A)
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), _times("logit_scale")),
    # IBM Granite 3 and 4, their MoE, shared-expert, hybrid and sliding-window models: 1 / logits_scaling
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa", "granitemoe_swa"),
                    _inverse("logits_scaling")),
    "falcon_h1": _times("lm_head_multiplier"),
    "hyperclovax": _times("logits_scaling"),
    "minicpm3": _inverse("logits_scaling"),  # on the hidden states before the head: the same for a head without bias
}


def logit_scale(model_or_config: Any) -> float:
    """What the model's causal-LM forward multiplies its head's logits by (1: nothing), which every log-prob the
    trainer and the static engine compute must do too (``HEADS``)."""
    cfg = text_config(model_or_config)
    head = HEADS.get(getattr(cfg, "model_type", None))
    return 1.0 if head is None else head(cfg)
