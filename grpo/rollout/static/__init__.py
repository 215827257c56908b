"""The ``static`` engine: decoding over static KV buffers with a functional step over the policy's own weights.

Built for a GPU (``rollout.engine: auto`` picks it on CUDA for the model families below; see docs/gpu.md) and
exact on a CPU too, where it runs eager. Read top to bottom:

* ``ModelSpec`` / ``unsupported_reason``: which models it runs (the Llama, Mistral (Ministral 1 and 3, Mixtral, 4),
  Qwen2, Qwen3 (their MoE models too), Gemma 1-4 and 3n, Llama 4 and SmolLM3 lines: grouped-query attention, q/k/v/o and MLP
  biases, q/k RMSNorms, RoPE with a position-independent scaling (one per layer type for Gemma 3; none on SmolLM3's
  NoPE layers; Ministral 3's position-dependent query scale), SiLU or GELU-tanh gated MLP, tied or untied head,
  sliding windows; Gemma's (1 + w) RMSNorm, scaled embedding, norms around attention and MLP, attention-logit and
  final-logit soft-capping; Gemma 3's, Mistral 3's, LLaVA's and Qwen's VL checkpoints through their text model;
  mixture-of-experts MLPs with a softmax top-k router and Qwen2-MoE's gated shared expert, every expert applied
  to every token in one batched GEMM, so a decode step keeps static shapes and reads each expert's weights once;
  Qwen3.5's, Qwen3.5-MoE's and Qwen3-Next's hybrid decoders: Gated DeltaNet layers (delta_net.py; their two
  buffers per layer are a convolution window and a recurrent state instead of keys and values) between attention
  layers whose q_proj also gives an output gate, with a partial RoPE; Gemma 4: per-layer head sizes, keys =
  values, value norms, KV sharing (a layer's buffers are an earlier layer's), per-layer inputs and output
  scalars, its MoE models' experts beside the MLP; Llama 4's text models: interleaved RoPE, q/k L2 norms,
  chunked attention, the NoPE layers' query scale, its MoE layers; Mistral 4: latent attention, grouped
  routing; Gemma 3n's text models through gemma3n.py; OLMo 2 and 3 (post-norms, q/k norms over the projection)
  and OLMoE; Phi-3 / Phi-4's fused projections; Granite 3's multipliers; Seed-OSS); anything else gets a reason and the
  ``hf`` engine.
* ``Weights``: the tensors the step reads, taken from the module at every call (so a moved weight is always seen);
  a LoRA policy is read through an engine-owned merged copy, refreshed at ``sync_weights``; ZeRO-3 (below).
* ``forward``: one functional pass (prefill or decode) independent of transformers' cache, mask and generate
  code. KV buffers are [layers, rows, kv_heads, max_len, head_dim]; every row of a call writes the same column,
  and carries its own position; ``kpos`` [rows, max_len] holds the position of every written column (-1: left
  padding or not written yet), and the attention mask is built from positions alone (key position <= query
  position, within the sliding window), so ragged left-padded prompts need no other bookkeeping.
* ``StaticEngine.generate``: prefill each prompt once, copy its KV to its G rows, then decode. The rows are padded
  to a rows bucket, keys are read up to a length bucket (``rollout.static.length_bucket`` columns), the uniforms
  of every step are drawn up front from the engine's seeded ``torch.Generator`` (row r uses column r whatever the
  bucket, so tokens do not depend on buckets or compaction), and the host reads which rows finished once every ``check_every`` steps
  through a non-blocking copy (into pinned memory on CUDA) that it waits for only after the next step is queued.
  When the live rows fit a smaller bucket they are moved there (compaction).
* ``rollout.static.mode``: ``eager``, ``compile`` (torch.compile of the decode step's forward), ``graphs`` (a CUDA graph per
  (rows bucket, length bucket)), ``compile+graphs``; ``auto`` = graphs on CUDA, eager elsewhere (measured on an H200
  with torch 2.11: graphs 12.8-12.9k tokens/s at the 1.7B shape, 1.4-3.4 s of captures; compile+graphs 20.1k, but
  it compiles once per length bucket: 67 s of warm-up at 256 new tokens; docs/results.md). Graphs hold
  pointers: every call compares each weight's ``data_ptr`` with the captured ones and recaptures on a change.

``Completions.logprobs`` are the sampler's log-probs of the drawn tokens under the distribution it drew from
(temperature, top-k, top-p applied and renormalised: vLLM's ``processed_logprobs``); without top-k / top-p they are
the trainer's temperature-scaled log-probs of the same weights. Multi-turn: every call prefills its prompts whole
(turns after the first are re-prefilled; nothing is kept between calls). ZeRO-3: each call gathers the partitioned
weights once (a collective: every rank calls ``generate`` alike) into a copy the engine owns, so decoding needs no
collectives; the copy is a whole model per rank, freed with the KV buffers by ``offload``.

The package, each module importing only those listed before it: ``norms`` (RMSNorm in each family's flavour),
``delta_net`` and ``gemma3n`` (the hybrid and Gemma 3n layers), ``attention`` (the projections: separate, fused;
queries, keys and values per head or latent; the scores), ``mlp`` (the MLPs: gated, fused, mixtures of experts),
``blocks`` (the layer's shape: pre-norm, sandwich), ``spec`` (which models, what their configs say: ``ModelSpec``;
the table of families, ``FAMILIES``: each family's flags, layer shape, attention inputs, MLP, layer weights and
renames), ``weights`` (the tensors a step reads), ``layers`` (the step: ``forward``, ``sample``) and ``engine`` (buffers, buckets, graphs, ``StaticEngine``).
"""

from grpo.rollout.static.engine import StaticEngine, capture_graph, new_buffers, resolve_mode, rows_bucket
from grpo.rollout.static.layers import forward, sample
from grpo.rollout.static.norms import rms_norm
from grpo.rollout.static.spec import (FAMILIES, MODEL_TYPES, Family, ModelSpec, kv_sharing, model_spec, text_config,
                                      unsupported_reason)
from grpo.rollout.static.weights import Weights, read_weights

__all__ = ["FAMILIES", "Family", "MODEL_TYPES", "ModelSpec", "StaticEngine", "Weights", "capture_graph", "forward", "kv_sharing",
           "model_spec", "new_buffers", "read_weights", "resolve_mode", "rms_norm", "rows_bucket", "sample",
           "text_config", "unsupported_reason"]
