"""Completion masks and truncation flags: hand-made sequences and real generation."""

from __future__ import annotations

import pytest
import torch

from grpo.rollout.engine import SamplingParams, completion_mask, cut_at_eos
from grpo.rollout.hf import generate, sample_next
from grpo.foundation.tiny import build_tiny

EOS = 2


def test_cut_at_eos_keeps_the_eos_token():
    assert cut_at_eos([5, 6, EOS, 7, EOS], {EOS}, 10) == ([5, 6, EOS], False)
    assert cut_at_eos([EOS, 5], {EOS}, 10) == ([EOS], False)


def test_cut_at_eos_truncates_without_eos():
    assert cut_at_eos([5, 6, 7, 8], {EOS}, 3) == ([5, 6, 7], True)
    assert cut_at_eos([5, 6, EOS], {EOS}, 3) == ([5, 6, EOS], False)  # EOS exactly at L_max
    assert cut_at_eos([5, 6, 7, EOS], {EOS}, 3) == ([5, 6, 7], True)  # EOS one past L_max


def test_cut_at_eos_with_several_eos_ids():
    assert cut_at_eos([5, 9, 6], {EOS, 9}, 5) == ([5, 9], False)


def test_completion_mask_by_hand():
    mask = completion_mask([3, 1, 0, 4], 4)
    expected = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    assert torch.equal(mask, expected)


def test_generate_masks_and_flags_are_consistent():
    model, tok = build_tiny(seed=1)
    torch.manual_seed(0)
    prompts = [tok("12=").input_ids, tok("3456=").input_ids]
    cfg = SamplingParams(max_tokens=5)
    comp = generate(model, prompts, cfg, [tok.eos_token_id], tok.pad_token_id, n=6)
    assert len(comp.tokens) == 12
    for tokens, truncated in zip(comp.tokens, comp.truncated.tolist()):
        assert 1 <= len(tokens) <= 5
        assert tok.eos_token_id not in tokens[:-1]  # nothing after the first EOS
        assert truncated == (tokens[-1] != tok.eos_token_id)
        if truncated:
            assert len(tokens) == 5
    mask = comp.mask(5)
    assert mask.sum(-1).tolist() == [len(t) for t in comp.tokens]


def test_generate_stops_finished_rows_and_matches_forced_eos():
    """Make EOS certain after one token: every completion is [x, EOS], none truncated."""
    model, tok = build_tiny(seed=1)
    calls = {"n": 0}
    orig = model.forward

    def forward(*args, **kwargs):
        out = orig(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] > 1:  # after the prefill: force EOS
            out.logits[..., :] = -1e9
            out.logits[..., tok.eos_token_id] = 0
        return out

    model.forward = forward
    comp = generate(model, [tok("1=").input_ids], SamplingParams(max_tokens=6), [tok.eos_token_id],
                    tok.pad_token_id, n=4)
    assert all(len(t) == 2 and t[-1] == tok.eos_token_id for t in comp.tokens)
    assert not comp.truncated.any()
    assert calls["n"] == 2  # one prefill for the group, one decode step, then every row left


def test_generation_reuses_one_prefill_per_prompt():
    model, tok = build_tiny(seed=1)
    seen = []
    orig = model.forward

    def forward(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape)
        return orig(*args, **kwargs)

    model.forward = forward
    generate(model, [tok("12=").input_ids, tok("7=").input_ids], SamplingParams(max_tokens=3), [tok.eos_token_id],
             tok.pad_token_id, n=8)
    assert seen[0] == (2, 3)  # the prefill: 2 prompts, not 16 rows
    assert all(s[1] == 1 for s in seen[1:])  # then one token per active row


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    torch.manual_seed(0)
    assert set(sample_next(logits, 1.0, 1.0, top_k=2).tolist()) == {2, 3}
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 3.0]), -1)  # [0.032, 0.087, 0.237, 0.644]
    assert p[3] < 0.7 < p[3] + p[2]
    assert set(sample_next(logits, 1.0, 0.7, top_k=0).tolist()) == {2, 3}
    assert set(sample_next(logits, 1.0, 0.5, top_k=0).tolist()) == {3}


def test_sample_categorical_matches_the_distribution_and_skips_zero_mass():
    from grpo.rollout.hf import sample_categorical

    logits = torch.tensor([[0.0, float("-inf"), 1.0, 2.0, float("-inf"), 3.0]]).repeat(100_000, 1)
    torch.manual_seed(1)
    counts = torch.bincount(sample_categorical(logits), minlength=6).double()
    p = torch.softmax(logits[0].double(), -1)
    assert counts[1] == 0 and counts[4] == 0  # probability 0 is never drawn
    # every frequency within 5 standard errors of its probability
    se = (p * (1 - p) / 100_000).sqrt()
    assert ((counts / 100_000 - p).abs() <= 5 * se + 1e-12).all()


def test_ignore_eos_gives_full_length_completions():
    """rollout.ignore_eos (benchmarks only): EOS does not end a row, every completion is L_max long."""
    model, tok = build_tiny(seed=1)
    orig = model.forward

    def forward(*args, **kwargs):
        out = orig(*args, **kwargs)
        out.logits[..., :] = -1e9
        out.logits[..., tok.eos_token_id] = 0  # EOS certain at every step
        return out

    model.forward = forward
    cfg = SamplingParams(max_tokens=5, ignore_eos=True)
    comp = generate(model, [tok("1=").input_ids, tok("234=").input_ids], cfg, [tok.eos_token_id], tok.pad_token_id, n=3)
    assert [len(t) for t in comp.tokens] == [5] * 6
    assert all(t == [tok.eos_token_id] * 5 for t in comp.tokens)


def test_ignore_eos_is_a_typed_config_key():
    from grpo.foundation.config import ConfigError
    from grpo.training.configure import load_config

    assert load_config().rollout.ignore_eos is False
    assert load_config(overrides=["rollout.ignore_eos=true"]).rollout.ignore_eos is True
    with pytest.raises(ConfigError, match="rollout.ignore_eos"):
        load_config(overrides=["rollout.ignore_eos=sometimes"])


def test_cached_decoding_equals_full_recomputation(monkeypatch):
    """The logits of every decode step (shared prefill, in-place KV cache, left padding, rows leaving
    at EOS at different steps) equal those of recomputing the whole sequence without a cache."""
    import grpo.rollout.hf as R

    model, tok = build_tiny(seed=4)
    model = model.double().eval()
    prompts = [tok("7").input_ids, tok("12345+9=1234").input_ids, tok("ab=").input_ids]
    eos, G, T = tok.eos_token_id, 2, 7
    stop = [2, 6, 0, 9, 4, 3]  # row r writes EOS at step stop[r] (9: never, truncated at T)
    V = model.config.vocab_size
    seen, alive = [], list(range(len(prompts) * G))

    def scripted(logits, *a):  # fixed tokens, mirroring generate's bookkeeping of the active rows
        t = len(seen)
        seen.append((list(alive), logits.clone()))
        out = [eos if t == stop[r] else 4 + (7 * r + 3 * t) % (V - 4) for r in alive]
        alive[:] = [r for r, x in zip(alive, out) if x != eos]
        return torch.tensor(out)

    monkeypatch.setattr(R, "sample_next", scripted)
    comp = R.generate(model, prompts, SamplingParams(max_tokens=T), [eos], tok.pad_token_id, n=G)
    assert [len(c) for c in comp.tokens] == [3, 7, 1, 7, 5, 4]
    for t, (rows, logits) in enumerate(seen):
        assert logits.shape[0] == len(rows)
        for k, r in enumerate(rows):
            with torch.no_grad():
                full = model(input_ids=torch.tensor([prompts[r // G] + comp.tokens[r][:t]])).logits[0, -1]
            torch.testing.assert_close(logits[k], full, atol=1e-9, rtol=1e-9)


class _SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that make the host wait for the device (a value read, a data-dependent shape)."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in self.SYNCS
        return func(*args, **(kwargs or {}))


def _eos_prone(seed: int):
    """The tiny model with EOS boosted, so rows finish at different steps."""
    model, tok = build_tiny(seed=seed)
    orig = model.forward

    def forward(*args, **kwargs):
        out = orig(*args, **kwargs)
        out.logits[..., tok.eos_token_id] += 3.0
        return out

    model.forward = forward
    return model, tok


@pytest.mark.parametrize("k", [1, 4])
def test_decode_loop_reads_the_device_once_per_k_tokens(k):
    """The hf loop's host synchronisations: one read per ``check_every`` tokens, none per token. Counted
    with a TorchDispatchMode (aten._local_scalar_dense and aten.nonzero) for two completion lengths:
    the difference is the per-token cost. Equal-length prompts (no padding mask: transformers' mask
    code reads the mask when there is one)."""
    model, tok = build_tiny(seed=1)
    prompts = [tok("12=").input_ids, tok("34=").input_ids]

    def count(T: int) -> int:
        with _SyncCounter() as c:
            generate(model, prompts, SamplingParams(max_tokens=T, ignore_eos=True), [tok.eos_token_id],
                     tok.pad_token_id, n=4, check_every=k)
        return c.n

    short, long = count(8), count(24)
    assert long - short == 16 // k  # one read per k tokens, nothing else per token


def test_tokens_do_not_depend_on_how_often_finished_rows_are_checked():
    """Sampling with EOS on: rows finish at different steps; checking every 1, 3 or 8 tokens gives the
    same tokens, lengths and truncation flags (each row's uniforms do not depend on the rows still active),
    and the kept caches (multi-turn) hold the same rows (up to the rounding of other batch shapes)."""
    from grpo.rollout.hf import PrefixStore

    model, tok = _eos_prone(seed=3)
    prompts = [tok("7=").input_ids, tok("12345+9=").input_ids, tok("ab=").input_ids]
    runs = []
    for k in (1, 3, 8):
        torch.manual_seed(11)
        store = PrefixStore()
        comp = generate(model, prompts, SamplingParams(max_tokens=12, temperature=1.3, top_k=20), [tok.eos_token_id],
                        tok.pad_token_id, n=4, keep=store, check_every=k)
        runs.append((comp, store))
    lengths = [len(t) for t in runs[0][0].tokens]
    assert len(set(lengths)) > 2 and min(lengths) < 12  # rows really finished at different steps
    for comp, store in runs[1:]:
        assert comp.tokens == runs[0][0].tokens
        assert comp.truncated.tolist() == runs[0][0].truncated.tolist()
        ref = runs[0][1]
        assert sorted(store.rows) == sorted(ref.rows)
        by_row = {tuple(r): kv for r, kv in zip(ref.rows, ref.kv)}
        for r, kv in zip(store.rows, store.kv):
            for (k1, v1), (k2, v2) in zip(kv, by_row[tuple(r)]):
                torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-6)  # other batch sizes: float rounding
                torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)


def test_generation_passes_the_kv_cache_without_a_deprecation_warning():
    """Issue 42, item 25: every run printed transformers' ``past_key_values`` FutureWarning (5.24 renamed the
    argument ``cache``); the engine passes the name the installed transformers takes."""
    import warnings

    model, tok = build_tiny(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        comp = generate(model, [tok("12=").input_ids], SamplingParams(max_tokens=3), [tok.eos_token_id],
                        tok.pad_token_id, n=2)
    assert len(comp.tokens) == 2


def test_hf_sampler_logprobs_equal_the_trainers_in_float64():
    """Issue 45, item 1: the hf engine's log-prob of each drawn token is the trainer's (completion_scores at the
    same temperature) in float64, ragged prompts and rows that end early included; with top-k / top-p it is the
    log-softmax of the distribution it drew from (the filtered one), as the static and vllm engines report."""
    from grpo.foundation.logprobs import completion_scores, pack
    from grpo.rollout.hf import filter_logits

    model, tok = build_tiny(seed=2)
    model = model.double()
    prompts = [tok("12+3=").input_ids, tok("7=").input_ids]
    torch.manual_seed(0)
    comp = generate(model, prompts, SamplingParams(max_tokens=9, temperature=0.7), [tok.eos_token_id],
                    tok.pad_token_id, n=3, logprobs=True)
    assert len({len(t) for t in comp.tokens}) > 1  # rows of different lengths
    packed = pack([p for p in prompts for _ in range(3)], comp.tokens, tok.pad_token_id)
    with torch.no_grad():
        trainer = completion_scores(model, packed, temperature=0.7).logprobs
    for i, lp in enumerate(comp.logprobs):
        assert len(lp) == len(comp.tokens[i])
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), trainer[i, : len(lp)], rtol=0, atol=1e-10)

    torch.manual_seed(0)
    filtered = generate(model, prompts, SamplingParams(max_tokens=6, temperature=0.9, top_k=5, top_p=0.8),
                        [tok.eos_token_id], tok.pad_token_id, n=2, logprobs=True)
    for i, (toks, lp) in enumerate(zip(filtered.tokens, filtered.logprobs)):
        ids = torch.tensor([prompts[i // 2] + toks])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompts[i // 2]) - 1: -1]
        z = filter_logits(logits, 0.9, 0.8, 5).double()  # the kept tokens (float32, as the sampler drew)
        want = torch.log_softmax(torch.where(torch.isinf(z), z, logits / 0.9), -1).gather(-1, torch.tensor(toks)[:, None])
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), want[:, 0], rtol=0, atol=1e-10)
    assert generate(model, prompts, SamplingParams(max_tokens=3), [tok.eos_token_id], tok.pad_token_id).logprobs is None


def test_a_hybrid_linear_attention_model_generates_and_scores_as_transformers_does(monkeypatch):
    """Qwen3.5's decoder (a Gated DeltaNet layer with a conv and a recurrent state, then full attention): the hf
    engine's greedy rows = transformers' generate on each prompt alone (ragged prompts left-padded, a group's state
    repeated, finished rows leaving the batch, so row selection moves the recurrent states too); its sampler
    log-probs = the trainer's (to float32 rounding: transformers' delta rule runs in float32); the trainer's log-probs = the model's own forward per row, asked to share
    each group's prompt but running one forward per row (a right-padded prompt's state would have decayed over the
    padding). A bare DynamicCache crashed both on the first prompt."""
    from grpo.foundation import logprobs as lpmod
    from grpo.foundation.logprobs import completion_scores, pack

    model, tok = build_tiny(seed=3, arch="qwen3_5")
    model = model.double().eval()
    torch.manual_seed(0)
    for p in model.parameters():  # weights large enough that greedy rows vary (the default init repeats a token)
        torch.nn.init.normal_(p, 0.0, 0.5 if p.dim() == 1 else p.shape[-1] ** -0.5)
    prompts = [tok("12+3=").input_ids, tok("7=").input_ids, tok("(1+2)*3=").input_ids]
    with torch.no_grad():  # an EOS that the prompts' greedy rows draw at different steps: rows leave at different times
        rows = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                               pad_token_id=tok.pad_token_id)[0, len(p):].tolist() for p in prompts]
    ends = {t: {r.index(t) if t in r else 8 for r in rows} for r in rows for t in r}
    eos = [next(t for t, at in ends.items() if len(at) > 1)]
    greedy = generate(model, prompts, SamplingParams(max_tokens=8, top_k=1), eos, tok.pad_token_id, n=2)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=eos,
                                  pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
            for row in greedy.tokens[2 * i: 2 * i + 2]:
                assert row == want[: len(row)] and (len(row) == 8 or row[-1] in eos)
    assert len({len(t) for t in greedy.tokens}) > 1  # some rows left early
    torch.manual_seed(0)
    comp = generate(model, prompts, SamplingParams(max_tokens=9, temperature=0.7), eos, tok.pad_token_id, n=3,
                    logprobs=True)
    shared = []
    monkeypatch.setattr(lpmod, "_shared_prefix_hidden", lambda *a: shared.append(1))
    packed = pack([p for p in prompts for _ in range(3)], comp.tokens, tok.pad_token_id)
    with torch.no_grad():
        trainer = completion_scores(model, packed, temperature=0.7, share_prefix=True).logprobs
        for i, (p, toks) in enumerate(zip([p for p in prompts for _ in range(3)], comp.tokens)):
            logits = model(input_ids=torch.tensor([p + toks])).logits[0, len(p) - 1: -1] / 0.7
            own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
            torch.testing.assert_close(trainer[i, : len(toks)], own, rtol=0, atol=1e-12)
            # transformers runs the delta rule in float32 whatever the model's dtype, and the engine's left padding
            # shifts its chunks: float32 rounding
            torch.testing.assert_close(torch.tensor(comp.logprobs[i], dtype=torch.float64), own, rtol=1e-6, atol=1e-6)
    assert not shared


HYBRID = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LINEAR = dict(head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"] * 2)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe", "lfm2", "granitemoehybrid"])
def test_other_hybrid_decoders_generate_and_score_as_transformers_does(kind):
    """Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet and experts), LFM2 (short convolutions), Granite 4's hybrids (Mamba
    layers): the hf engine's greedy rows = transformers' generate per prompt (ragged prompts, groups of 2), the
    trainer's log-probs = the model's own forward per row (float32: their experts refuse float64)."""
    import transformers as T

    from grpo.foundation.logprobs import completion_scores, pack

    make = {
        "qwen3_next": lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**HYBRID, **LINEAR)),
        "qwen3_5_moe": lambda: T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**HYBRID, **LINEAR)),
        "lfm2": lambda: T.Lfm2ForCausalLM(T.Lfm2Config(**HYBRID, layer_types=["conv", "full_attention"] * 2)),
        "granitemoehybrid": lambda: T.GraniteMoeHybridForCausalLM(T.GraniteMoeHybridConfig(
            **HYBRID, layer_types=["mamba", "attention"] * 2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=8, mamba_expand=2, num_local_experts=0, shared_intermediate_size=64)),
    }
    torch.manual_seed(0)
    model = make[kind]().eval()
    for p in model.parameters():  # weights large enough that greedy rows vary
        torch.nn.init.normal_(p, 0.0, 0.5 if p.dim() == 1 else p.shape[-1] ** -0.5)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
    out = generate(model, prompts, SamplingParams(max_tokens=6, top_k=1), [2], 0, n=2)
    rows = [p for p in prompts for _ in range(2)]
    comps = [[20, 21, 22], [23, 24], [25, 26, 27, 28], [29], [30, 31], [32, 33, 34]]
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                                  eos_token_id=2)[0, len(p):].tolist()
            assert out.tokens[2 * i] == out.tokens[2 * i + 1] == want[: want.index(2) + 1 if 2 in want else 6]
        got = completion_scores(model, pack(rows, comps, 0), 1.0, share_prefix=True).logprobs
        for i, (p, c) in enumerate(zip(rows, comps)):
            own = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1: -1], -1)
            torch.testing.assert_close(got[i, : len(c)], own.gather(-1, torch.tensor(c)[:, None])[:, 0],
                                       rtol=0, atol=1e-5)


MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=8, qk_rope_head_dim=4,
           v_head_dim=6, qk_nope_head_dim=8)


@pytest.mark.parametrize("kind, extra", [
    ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=16,
                         first_k_dense_replace=1, n_shared_experts=1)),
    ("minicpm3", {}),
])
def test_latent_attention_decoders_generate_and_score_as_transformers_does(kind, extra):
    """Multi-head latent attention caches two latents of different widths as its keys and values (DeepSeek-V2/V3,
    MiniCPM3, Mistral 4): the hf engine's growing cache gave the values the keys' width and crashed at the first
    decode step. Greedy rows = transformers' generate per prompt, log-probs = the model's own forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo.foundation.logprobs import completion_scores, pack

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{**HYBRID, **MLA}, **extra)).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
    out = generate(model, prompts, SamplingParams(max_tokens=6, top_k=1), [2], 0, n=2)
    rows = [p for p in prompts for _ in range(2)]
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                                  eos_token_id=2)[0, len(p):].tolist()
            assert out.tokens[2 * i] == out.tokens[2 * i + 1] == want[: want.index(2) + 1 if 2 in want else 6]
        got = completion_scores(model, pack(rows, out.tokens, 0), 1.0, share_prefix=True).logprobs
        for i, (p, c) in enumerate(zip(rows, out.tokens)):
            own = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1: -1], -1)
            torch.testing.assert_close(got[i, : len(c)], own.gather(-1, torch.tensor(c)[:, None])[:, 0],
                                       rtol=0, atol=1e-5)
