"""Chunked completion log-probs and entropy equal a naive full-softmax computation in float64."""

from __future__ import annotations

import pytest
import torch

from grpo.foundation.logprobs import completion_scores, pack
from grpo.foundation.tiny import build_tiny


@pytest.fixture(scope="module")
def model_and_rows():
    model, _ = build_tiny(seed=3)
    model = model.double()
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    lens = [(3, 5), (7, 1), (1, 6), (4, 4), (2, 0)]  # (prompt, completion): ragged, one empty
    prompts = [torch.randint(4, V, (p,), generator=g).tolist() for p, _ in lens]
    completions = [torch.randint(4, V, (c,), generator=g).tolist() for _, c in lens]
    return model, prompts, completions


def naive(model, prompts, completions, width, temperature):
    """One unpadded forward per row; full-vocabulary log-softmax in float64."""
    lp = torch.zeros(len(prompts), width, dtype=torch.float64)
    ent = torch.zeros(len(prompts), width, dtype=torch.float64)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not c:
            continue
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0].double() / temperature
        logsm = torch.log_softmax(logits, -1)
        for t, tok in enumerate(c):
            row = logsm[len(p) + t - 1]
            lp[i, t] = row[tok]
            ent[i, t] = -(row.exp() * row).sum()
    return lp, ent


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive(model_and_rows, chunk_size, temperature):
    model, prompts, completions = model_and_rows
    packed = pack(prompts, completions, pad_id=0, width=8)
    with torch.no_grad():
        scores = completion_scores(model, packed, temperature, chunk_size, with_entropy=True)
        lp, ent = scores.logprobs, scores.entropy
        ref_lp, ref_ent = naive(model, prompts, completions, 8, temperature)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-10, rtol=1e-10)


def test_gradient_matches_naive(model_and_rows):
    """The checkpointed chunked path gives the same parameter gradient as the naive one."""
    model, prompts, completions = model_and_rows
    packed = pack(prompts, completions, pad_id=0, width=8)
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64)
    model.zero_grad()
    lp = completion_scores(model, packed, 1.0, chunk_size=2).logprobs
    (lp * weights).sum().backward()
    fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_lp, _ = naive(model, prompts, completions, 8, 1.0)
    (ref_lp * weights).sum().backward()
    for a, (name, p) in zip(fast, model.named_parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-8, rtol=1e-6, msg=name)


@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_fp32_chunked_path_equals_the_plain_one_with_its_gradient(chunk_size):
    """Issue 41 (CPU part): in float32, the chunked and fused path (shared prompts, LM head on completion positions
    only) equals the plain one (one forward per row, full-vocabulary log-softmax, in float32 too) within 1e-5, the
    values and every parameter's gradient."""
    model, _ = build_tiny(seed=4)
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    prompts = [torch.randint(4, V, (n,), generator=g).tolist() for n in (5, 5, 2, 6)]
    prompts[1] = prompts[0]  # a group sharing its prompt
    completions = [torch.randint(4, V, (n,), generator=g).tolist() for n in (6, 3, 8, 1)]
    weights = torch.linspace(-1, 1, 8)
    packed = pack(prompts, completions, pad_id=0, width=8)
    model.zero_grad()
    lp = completion_scores(model, packed, 0.8, chunk_size=chunk_size).logprobs
    (lp * weights).sum().backward()
    fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = torch.zeros(len(prompts), 8)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        logsm = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0].float() / 0.8, -1)
        plain[i, : len(c)] = logsm[len(p) - 1: len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None])[:, 0]
    (plain * weights).sum().backward()
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.detach(), plain.detach(), atol=1e-5, rtol=0)
    for a, (name, p) in zip(fast, model.named_parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_padding_does_not_change_rows(model_and_rows):
    """A row's log-probs do not depend on what other rows are batched (padded) with it."""
    model, prompts, completions = model_and_rows
    with torch.no_grad():
        full = completion_scores(model, pack(prompts, completions, 0, 8)).logprobs
        alone = completion_scores(model, pack(prompts[:1], completions[:1], 0, 8)).logprobs
    torch.testing.assert_close(full[0], alone[0], atol=1e-10, rtol=0)


# --------------------------------------------------------------------------- the fused LM-head path


def naive_head(head, hidden, targets, temperature, softcap):
    """The full [n, vocab] log-softmax through autograd: the definition the fused path must equal."""
    logits = head(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logsm = torch.log_softmax(logits / temperature, -1)
    lp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    return lp, ent


def random_head(seed: int, bias: bool = True, requires_grad: bool = True):
    """A float64 linear head (6 -> 11), 13 hidden states and their targets, and the generator for more."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(6, 11, bias=bias).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(11, 6, generator=g, dtype=torch.float64) * 2)
    hidden = torch.randn(13, 6, generator=g, dtype=torch.float64, requires_grad=requires_grad)
    return head, hidden, torch.randint(0, 11, (13,), generator=g), g


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.3, 2.5)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_head_equals_naive(chunk_size, temperature, softcap, bias):
    """Values, entropy and the gradients of hidden states, weight and bias, in float64."""
    from grpo.foundation.logprobs import _LinearHeadLogprob, head_logprobs

    head, hidden, targets, g = random_head(7, bias)
    upstream = torch.randn(13, generator=g, dtype=torch.float64)

    lp, ent = head_logprobs(head, hidden, targets, temperature, chunk_size, with_entropy=True, softcap=softcap)
    assert lp.grad_fn is not None and type(lp.grad_fn).__name__.startswith(_LinearHeadLogprob.__name__)
    fast = torch.autograd.grad((lp * upstream).sum(), [hidden] + list(head.parameters()))
    ref_lp, ref_ent = naive_head(head, hidden, targets, temperature, softcap)
    slow = torch.autograd.grad((ref_lp * upstream).sum(), [hidden] + list(head.parameters()))
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-12, rtol=1e-12)
    assert not ent.requires_grad
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.3, 2.5)])
def test_entropy_gradient_equals_naive(fused, chunk_size, temperature, softcap):
    """entropy_grad (an entropy bonus in the loss): the entropy's gradient, alone and together with the
    log-probs', equals autograd through the full softmax in float64, on the fused and the checkpointed path."""
    from grpo.foundation.logprobs import head_logprobs

    head, hidden, targets, g = random_head(3)
    up_lp, up_ent = (torch.randn(13, generator=g, dtype=torch.float64) for _ in range(2))
    params = [hidden] + list(head.parameters())
    lp, ent = head_logprobs(head, hidden, targets, temperature, chunk_size, softcap=softcap, fused=fused,
                            entropy_grad=True)
    ref_lp, ref_ent = naive_head(head, hidden, targets, temperature, softcap)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=1e-12)
    assert ent.requires_grad
    for fast_out, slow_out in [((ent * up_ent).sum(), (ref_ent * up_ent).sum()),  # the entropy alone
                               ((lp * up_lp + ent * up_ent).sum(), (ref_lp * up_lp + ref_ent * up_ent).sum())]:
        fast = torch.autograd.grad(fast_out, params, retain_graph=True)
        slow = torch.autograd.grad(slow_out, params, retain_graph=True)
        for a, b in zip(fast, slow):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.3, 2.5)])
def test_sum_pi_squared_equals_naive(fused, temperature, softcap):
    """sum_pi_squared (verl's optimal token baseline): sum_v pi_v^2 of each token's distribution, detached, next to
    unchanged log-probs and entropy, in float64; and on the model through completion_scores."""
    from grpo.foundation.logprobs import head_logprobs

    head, hidden, targets, _ = random_head(11, requires_grad=False)
    with torch.no_grad():
        lp, ent, sq = head_logprobs(head, hidden, targets, temperature, 5, with_entropy=True, softcap=softcap,
                                    fused=fused, sum_pi_squared=True)
        ref_lp, ref_ent = naive_head(head, hidden, targets, temperature, softcap)
        logits = head(hidden)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        probs = torch.softmax(logits / temperature, -1)
    want = [sum(float(probs[i, v]) ** 2 for v in range(11)) for i in range(13)]
    torch.testing.assert_close(sq, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=1e-12)
    lp2, ent2, sq2 = head_logprobs(head, hidden, targets, temperature, 5, softcap=softcap, fused=fused,
                                   sum_pi_squared=True)
    assert ent2 is None and not sq2.requires_grad
    torch.testing.assert_close(sq2, sq)


def test_sum_pi_squared_through_completion_scores(model_and_rows):
    model, prompts, completions = model_and_rows
    packed = pack(prompts, completions, pad_id=0, width=8)
    with torch.no_grad():
        scores = completion_scores(model, packed, 0.8, 3, with_entropy=True, sum_pi_squared=True)
        lp, ent, sq = scores.logprobs, scores.entropy, scores.sum_pi_squared
        scores = completion_scores(model, packed, 0.8, 3, with_entropy=True)
        lp0, ent0 = scores.logprobs, scores.entropy
        for i, (p, c) in enumerate(zip(prompts, completions)):
            logits = model(torch.tensor([p + c])).logits[0].double() / 0.8
            probs = torch.softmax(logits, -1)
            for t in range(len(c)):
                want = float((probs[len(p) + t - 1] ** 2).sum())
                assert float(sq[i, t]) == pytest.approx(want, rel=1e-5)
            assert (sq[i, len(c):] == 0).all()
    torch.testing.assert_close(lp, lp0)
    torch.testing.assert_close(ent, ent0)


def test_fused_and_checkpointed_paths_agree_on_the_model(model_and_rows):
    """completion_scores on the fused path (the default) equals the checkpointed naive path, gradients too."""
    from grpo.foundation import logprobs as L

    model, prompts, completions = model_and_rows
    assert L._plain_linear(model.get_output_embeddings())
    packed = pack(prompts, completions, pad_id=0, width=8)
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        orig = L.head_logprobs
        L.head_logprobs = lambda *a, **k: orig(*a, **{**k, "fused": fused})
        try:
            model.zero_grad()
            lp = completion_scores(model, packed, 0.9, chunk_size=3).logprobs
            (lp * weights).sum().backward()
        finally:
            L.head_logprobs = orig
        grads.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-12, rtol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_fused_head_bf16_close_to_float32():
    """Half-precision weights: log-probs and gradients within bf16 rounding of the float32 ones."""
    from grpo.foundation.logprobs import head_logprobs

    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(32, 100, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(100, 32, generator=g) * 0.2)
    h32 = torch.randn(20, 32, generator=g, requires_grad=True)
    y = torch.randint(0, 100, (20,), generator=g)
    lp32, _ = head_logprobs(head, h32, y, chunk_size=7)
    (gw32,) = torch.autograd.grad(lp32.sum(), [head.weight])
    head16 = torch.nn.Linear(32, 100, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head16.weight.copy_(head.weight)
    h16 = h32.detach().to(torch.bfloat16).requires_grad_()
    lp16, _ = head_logprobs(head16, h16, y, chunk_size=7)
    assert lp16.dtype == torch.float32 and head16.weight.dtype == torch.bfloat16
    (gw16,) = torch.autograd.grad(lp16.sum(), [head16.weight])
    assert gw16.dtype == torch.bfloat16
    torch.testing.assert_close(lp16, lp32.detach(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(gw16.float(), gw32, atol=0.05, rtol=0.05)


def test_fused_head_never_holds_more_than_a_chunk():
    """No [n x vocab] tensor is saved for backward: only the hidden states, targets and one float per token."""
    from grpo.foundation.logprobs import head_logprobs

    head = torch.nn.Linear(8, 1000, bias=False)
    hidden = torch.randn(64, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        lp, _ = head_logprobs(head, hidden, targets, chunk_size=16)
    # hidden [64 x 8], the weight [1000 x 8], targets and log-normalisers [64]: nothing of size n x vocab
    assert max(saved) == head.weight.numel() and sum(saved) == 64 * 8 + 1000 * 8 + 64 + 64
    lp.sum().backward()
    assert hidden.grad.shape == hidden.shape and head.weight.grad.shape == head.weight.shape


# --------------------------------------------------------------------------- shared prompts


@pytest.fixture(scope="module")
def grouped_rows():
    """Three prompts of different lengths, each with a group of ragged completions (one empty, one of length 1)."""
    model, _ = build_tiny(seed=5)
    model = model.double()
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    prompt_lens, comp_lens = [3, 6, 1], [[4, 1, 6], [0, 3, 3], [5, 2, 6]]
    prompts, completions = [], []
    for lp, cl in zip(prompt_lens, comp_lens):
        p = torch.randint(4, V, (lp,), generator=g).tolist()
        for c in cl:
            prompts.append(p)
            completions.append(torch.randint(4, V, (c,), generator=g).tolist())
    return model, prompts, completions


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_shared_prefix_equals_naive(grouped_rows, temperature):
    """Running each distinct prompt once gives the naive log-probs, entropy and parameter gradients."""
    model, prompts, completions = grouped_rows
    packed = pack(prompts, completions, pad_id=0, width=6)
    weights = torch.randn(len(prompts), 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    model.zero_grad()
    scores = completion_scores(model, packed, temperature, chunk_size=4, with_entropy=True, share_prefix=True)
    lp, ent = scores.logprobs, scores.entropy
    (lp * weights).sum().backward()
    fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_lp, ref_ent = naive(model, prompts, completions, 6, temperature)
    (ref_lp * weights).sum().backward()
    torch.testing.assert_close(lp, ref_lp.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-10, rtol=1e-10)
    # HF's RMSNorm computes in float32 even in a float64 model, so gradients carry float32 rounding;
    # a shared prompt sums its rows' gradients in another order: ~1e-7 relative, not 1e-15
    for a, (name, p) in zip(fast, model.named_parameters()):
        torch.testing.assert_close(a, p.grad, atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_shared_prefix_equals_unshared(grouped_rows, attn):
    """Both attention kernels: shared and unshared forwards agree (values, and no NaN from padding)."""
    model, prompts, completions = grouped_rows
    old = model.config._attn_implementation
    model.config._attn_implementation = attn
    try:
        packed = pack(prompts, completions, pad_id=0, width=6)
        with torch.no_grad():
            a = completion_scores(model, packed, 1.0, share_prefix=True).logprobs
            b = completion_scores(model, packed, 1.0, share_prefix=False).logprobs
    finally:
        model.config._attn_implementation = old
    assert not a.isnan().any()
    # transformers' eager attention takes its softmax in float32 even in a float64 model, and the two
    # layouts pad to different widths, so they agree to float32 rounding there (seen: 4e-8 with
    # transformers 5.23); sdpa stays in float64
    tol = 1e-6 if attn == "eager" else 1e-10
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_shared_prefix_runs_each_prompt_once(grouped_rows, monkeypatch):
    """The prompt forward sees 3 rows (not 9), and the completion forward only completion positions."""
    model, prompts, completions = grouped_rows
    shapes = []
    orig = type(model.base_model).forward

    def spy(self, *a, **k):
        shapes.append(tuple(k["input_ids"].shape))
        return orig(self, *a, **k)

    monkeypatch.setattr(type(model.base_model), "forward", spy)
    with torch.no_grad():
        completion_scores(model, pack(prompts, completions, 0, 6))
    assert shapes == [(3, 6), (9, 5)]  # 3 prompts padded to 6; completions without their last token


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, 2.5)])
def test_several_targets_per_row_with_their_gradients(fused, chunk_size, temperature, softcap):
    """[n, m] targets (a teacher's top-k scored by the student): each log-prob and the gradients of hidden states,
    weight and bias equal autograd through the full log-softmax in float64, with the entropy alongside."""
    from grpo.foundation.logprobs import head_logprobs

    head, hidden, _, g = random_head(11)
    targets = torch.randint(0, 11, (13, 4), generator=g)
    upstream = torch.randn(13, 4, generator=g, dtype=torch.float64)
    lp, ent = head_logprobs(head, hidden, targets, temperature, chunk_size, with_entropy=True, softcap=softcap,
                            fused=fused)
    assert lp.shape == (13, 4)
    fast = torch.autograd.grad((lp * upstream).sum(), [hidden] + list(head.parameters()))
    logits = head(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logsm = torch.log_softmax(logits / temperature, -1)
    ref = torch.stack([torch.stack([logsm[i, targets[i, j]] for j in range(4)]) for i in range(13)])
    slow = torch.autograd.grad((ref * upstream).sum(), [hidden] + list(head.parameters()))
    torch.testing.assert_close(lp, ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, -(logsm.exp() * logsm).sum(-1).detach(), atol=1e-12, rtol=1e-12)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scores_top_k_and_gathered_equal_the_full_softmax(model_and_rows, chunk_size, temperature):
    """completion_scores: the top-k of each completion position's next-token distribution (values and ids, most
    likely first), and the log-probs of given ids with their gradient, against one unpadded forward per row."""
    from grpo.foundation.logprobs import completion_scores

    model, prompts, completions = model_and_rows
    V, k = model.config.vocab_size, 5
    packed = pack(prompts, completions, pad_id=0, width=8)
    g = torch.Generator().manual_seed(4)
    asked = torch.randint(0, V, (len(prompts), 8, 3), generator=g)
    s = completion_scores(model, packed, temperature, chunk_size, gather_ids=asked, top_k=k)
    lp = completion_scores(model, packed, temperature, chunk_size).logprobs
    torch.testing.assert_close(s.logprobs, lp, atol=0, rtol=0)
    assert s.topk_logprobs.shape == (len(prompts), 8, k) and not s.topk_logprobs.requires_grad
    for i, (p, c) in enumerate(zip(prompts, completions)):
        logits = model(input_ids=torch.tensor([p + c])).logits[0].double() / temperature
        logsm = torch.log_softmax(logits, -1)
        for t in range(8):
            if t >= len(c):  # beyond the row: zeros
                assert not s.topk_logprobs[i, t].any() and not s.topk_ids[i, t].any() and not s.gathered[i, t].any()
                continue
            row = logsm[len(p) + t - 1]
            top = row.topk(k)
            torch.testing.assert_close(s.topk_logprobs[i, t], top.values, atol=1e-12, rtol=1e-12)
            assert s.topk_ids[i, t].tolist() == top.indices.tolist()
            torch.testing.assert_close(s.gathered[i, t], row[asked[i, t]], atol=1e-12, rtol=1e-12)
    # the gathered log-probs carry their gradient to the weights
    s = completion_scores(model, packed, temperature, chunk_size, gather_ids=asked)
    s.gathered.sum().backward()
    assert model.get_output_embeddings().weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_a_multimodal_checkpoints_sliding_window_is_its_text_models():
    """Gemma 3 4B-27B load as Gemma3ForConditionalGeneration, whose config holds the sliding window in its text
    config: the shared-prompt pass (which transformers' window would cut wrongly) is refused past it as for the
    text-only model (with the outer config's none, it ran and missed the log-probs by 0.24 nats on a tiny one)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from grpo.foundation.logprobs import _can_share_prefix

    text = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, sliding_window=5, model_type="gemma3_text",
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                        image_token_index=37, boi_token_index=38, eoi_token_index=39))
    assert getattr(model.config, "sliding_window", None) is None  # the outer config has none
    with torch.no_grad():
        assert _can_share_prefix(model, 5) and not _can_share_prefix(model, 6)


def test_llama4_shares_prompts_only_within_its_first_chunk_and_its_unscaled_positions():
    """Llama 4's attention chunks and its NoPE layers' query scale follow cache columns in transformers, so the
    shared-prompt pass (completions at columns past the longest prompt) is refused where either changes within
    the rows (a tiny one with chunks of 4 and a floor of 2 missed its own forward by 0.15 nats); both equal Llama 4's
    8,192 (no change below 8,192 tokens) leave it on. Its decoder is ``model.model`` (its base_model is itself)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from grpo.foundation.logprobs import _can_share_prefix, _decoder_stack

    def llama4(chunk: int, floor: int):
        return Llama4ForCausalLM(Llama4TextConfig(
            vocab_size=40, hidden_size=16, intermediate_size=16, intermediate_size_mlp=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=2, no_rope_layers=[1, 0],
            attention_chunk_size=chunk, floor_scale=floor, attn_temperature_tuning=True))

    with torch.no_grad():
        model = llama4(8192, 8192)
        assert _decoder_stack(model) is model.model
        assert _can_share_prefix(model, 8191) and not _can_share_prefix(model, 8193)
        assert not _can_share_prefix(llama4(4, 8192), 6) and not _can_share_prefix(llama4(8192, 2), 6)
        assert _can_share_prefix(llama4(4, 8192), 4)


SCALED = {  # families whose causal-LM head scales its logits, each with a scale away from 1
    "cohere": dict(logit_scale=0.25), "cohere2": dict(logit_scale=0.25), "cohere2_moe": dict(logit_scale=0.25),
    "granite": dict(logits_scaling=8.0), "granitemoe": dict(logits_scaling=8.0, num_local_experts=4,
                                                            num_experts_per_tok=2),
    "granitemoeshared": dict(logits_scaling=8.0, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
    "hyperclovax": dict(logits_scaling=0.25), "falcon_h1": dict(lm_head_multiplier=0.5),
}


@pytest.mark.parametrize("kind", sorted(SCALED))
def test_log_probs_of_a_head_that_scales_its_logits_are_the_models_own(kind):
    """Cohere's, Granite's, HyperCLOVA X's and Falcon-H1's causal-LM forward scales the head's logits: the log-probs,
    and the top-k a teacher or the audit reads, are those of the model's own logits at the sampling temperature (the
    trainer computed them from the unscaled head: 0.9 nats off on a tiny Cohere 2)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo.foundation.logprobs import completion_scores, logit_scale, pack

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(kind, **{**dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                               bos_token_id=1, eos_token_id=2), **SCALED[kind]})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for p in model.parameters():  # weights large enough that the scale moves the log-probs
        torch.nn.init.normal_(p, 0.0, 0.5 if p.dim() == 1 else p.shape[-1] ** -0.5)
    assert logit_scale(model) != 1.0
    rows = [[5, 6, 7], [5, 6, 7], [9, 10]]
    comps = [[20, 21, 22], [23, 24], [25, 26, 27, 28]]
    with torch.no_grad():
        got = completion_scores(model, pack(rows, comps, 0), 0.7, top_k=3)
        for i, (p, c) in enumerate(zip(rows, comps)):
            own = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1: -1] / 0.7, -1)
            torch.testing.assert_close(got.logprobs[i, : len(c)], own.gather(-1, torch.tensor(c)[:, None])[:, 0],
                                       rtol=0, atol=1e-5)
            top = own.topk(3, dim=-1)
            torch.testing.assert_close(got.topk_logprobs[i, : len(c)], top.values, rtol=0, atol=1e-5)
            assert torch.equal(got.topk_ids[i, : len(c)], top.indices)


def test_a_head_transform_the_trainer_does_not_know_stops_the_run_at_start(tmp_path):
    """check_head, run on every policy the trainer builds: a family whose causal-LM forward changes the head's
    logits in a way the log-probs here do not reproduce (a Llama whose forward triples them stands for one) is
    refused by name before any step; the known ones pass (Cohere 2's scale, Gemma 2's final soft-cap, Qwen3.5)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    from grpo.foundation.config import ConfigError
    from grpo.foundation.logprobs import check_head

    class Tripled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    model, _ = build_tiny(seed=1)
    assert check_head(model) < 1e-5
    with pytest.raises(ConfigError, match=r"model 'llama': the trainer's log-probs differ .* nats"):
        check_head(Tripled(model.config))
    small = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    for kind, extra in [("cohere2", dict(logit_scale=0.25)), ("gemma2", dict(final_logit_softcapping=3.0, head_dim=8))]:
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **small, **extra))
        for p in m.parameters():
            torch.nn.init.normal_(p, 0.0, 0.5 if p.dim() == 1 else p.shape[-1] ** -0.5)
        assert check_head(m) < 1e-4, kind
    assert check_head(build_tiny(arch="qwen3_5")[0]) < 1e-4
