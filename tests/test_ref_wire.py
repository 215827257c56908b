"""The reference server's wire format and request validation (no server, no model)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save as st_save

from grpo.foundation.logprobs import pack
from grpo.reference.wire import (
    TooLarge,
    WireError,
    decode_response,
    decode_scores,
    encode,
    encode_flat_response,
    encode_request,
    flatten_packed,
    flatten_rows,
    parse_request,
    unflatten,
)
from grpo.reference.protocol import row_slices
from tests.ref_support import ragged_batch

VOCAB = 93


def _request(**header_changes):
    """A valid request's tensors and header, with header fields replaced (None deletes)."""
    p = ragged_batch(0, rows=5, vocab=VOCAB)
    ids, plen, clen = flatten_packed(p)
    tensors = {"input_ids": ids, "prompt_lens": plen, "completion_lens": clen}
    header = {"temperature": 1.0, "with_entropy": False, "pad_id": 0}
    for k, v in header_changes.items():
        if v is None:
            header.pop(k, None)
        else:
            header[k] = v
    return tensors, header


def test_flatten_then_unflatten_rebuilds_pack_exactly():
    p = ragged_batch(1, rows=9, vocab=VOCAB)
    assert int(p.length.min()) == 0, "the sample should include an empty completion"
    ids, plen, clen = flatten_packed(p)
    assert ids.numel() == int(p.attention_mask.sum())
    q = unflatten(ids, plen, clen, pad_id=0)
    assert torch.equal(q.input_ids, p.input_ids)
    assert torch.equal(q.attention_mask, p.attention_mask)
    assert torch.equal(q.start, p.start) and torch.equal(q.length, p.length)


def test_request_round_trip():
    p = ragged_batch(2, rows=6, vocab=VOCAB, width=16)
    req = parse_request(encode_request(p, 0.7, with_entropy=True, pad_id=0, rows_per_pass=4), VOCAB, 16384)
    assert req.temperature == 0.7 and req.with_entropy and req.rows_per_pass == 4
    assert torch.equal(req.packed().input_ids, p.input_ids) and torch.equal(req.packed().length, p.length)
    assert req.rows == 6 and req.tokens == int(p.attention_mask.sum())


def test_response_round_trip_fills_zeros_beyond_lengths():
    lengths = torch.tensor([3, 0, 2])
    lp = torch.randn(3, 5)
    body = encode_flat_response(flatten_rows(lp, lengths), None, {"version": 2})  # what the server sends
    got, ent, header = decode_response(body, lengths, width=5)
    assert ent is None and header == {"version": 2}
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    assert torch.equal(got[mask], lp[mask]) and bool((got[~mask] == 0).all())


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda t, h: t.update(input_ids=t["input_ids"].float()), "input_ids", "dtype float32"),
        (lambda t, h: t.update(input_ids=t["input_ids"].reshape(1, -1)), "input_ids", "1-D"),
        (lambda t, h: t.update(input_ids=t["input_ids"][:-1]), "input_ids", "sum to"),
        (lambda t, h: t.update(completion_lens=t["completion_lens"][:-1]), "completion_lens", "rows"),
        (lambda t, h: t["prompt_lens"].__setitem__(0, 0), "prompt_lens", "prompt_lens[0]=0"),
        (lambda t, h: t["completion_lens"].__setitem__(1, -1), "completion_lens", "negative"),
        (lambda t, h: t["input_ids"].__setitem__(3, VOCAB), "input_ids", f"input_ids[3]={VOCAB}"),
        (lambda t, h: t["input_ids"].__setitem__(0, -5), "input_ids", "input_ids[0]=-5"),
        (lambda t, h: t.pop("prompt_lens"), "prompt_lens", "missing"),
        (lambda t, h: t.update(extra=torch.zeros(2)), "extra", "unknown tensor"),
        (lambda t, h: h.update(temperature=0), "temperature", "> 0"),
        (lambda t, h: h.update(temperature="hot"), "temperature", "'hot'"),
        (lambda t, h: h.pop("temperature"), "temperature", "None"),
        (lambda t, h: h.update(with_entropy="yes"), "with_entropy", "true or false"),
        (lambda t, h: h.update(pad_id=VOCAB + 1), "pad_id", "outside the vocabulary"),
        (lambda t, h: h.update(rows_per_pass=0), "rows_per_pass", ">= 1"),
        (lambda t, h: h.update(top_k=65), "top_k", "64 tokens per position at most"),
        (lambda t, h: h.update(top_k=-1), "top_k", ">= 0"),
        (lambda t, h: h.update(top_k=2.5), "top_k", "integer"),
        (lambda t, h: h.update(top_k=None), "top_k", "got null; leave the field out for its default (0)"),
        (lambda t, h: h.update(pad_id=None), "pad_id", "got null; leave the field out for its default (0)"),
        (lambda t, h: h.update(model="critic"), "model", "'critic' is not one of ['reference', 'teacher']"),
        (lambda t, h: h.update(colour="blue"), "colour", "unknown header field"),
    ],
)
def test_every_invalid_field_is_named(mutate, field, words):
    tensors, header = _request()
    mutate(tensors, header)
    with pytest.raises(WireError) as e:
        parse_request(encode(tensors, header), VOCAB, 16384)
    assert e.value.field == field
    assert words in e.value.message


def test_row_longer_than_the_token_budget_is_refused_with_the_fix():
    p = pack([[5] * 30], [[6] * 10], 0)
    with pytest.raises(WireError) as e:
        parse_request(encode_request(p, 1.0), VOCAB, max_row_tokens=32)
    assert "40 tokens" in e.value.message and "--max-batch-tokens" in e.value.message


def _short_rows_and_one_long(short_rows: int, long_row: int) -> bytes:
    """``short_rows`` one-token rows and one row of ``long_row`` tokens: few bytes, a huge padded batch."""
    prompts = [[5]] * short_rows + [[5] * (long_row // 2)]
    completions = [[]] * short_rows + [[6] * (long_row - long_row // 2)]
    return encode_request(pack(prompts, completions, 0), 1.0)


def test_padded_total_is_capped_before_anything_is_padded():
    """10,000 one-token rows and one 4,096-token row: a 133 KiB body that padded to 10,001 x 4,096
    tokens (625 MiB of int64 ids and mask) in the HTTP thread, before the bounded queue."""
    body = _short_rows_and_one_long(10_000, 4096)
    assert len(body) < 140 * 1024
    with pytest.raises(TooLarge) as e:
        parse_request(body, VOCAB, max_row_tokens=4096, max_padded_tokens=2**24)
    assert e.value.status == 413 and e.value.field == "completion_lens"
    assert "10001 x 4096" in e.value.message and "max_padded_tokens=16777216" in e.value.message


def test_rows_stay_flat_until_each_forward_pass_pads_its_own():
    body = _short_rows_and_one_long(3_000, 4096)  # 12.3M padded tokens: under the cap, so it is accepted
    req = parse_request(body, VOCAB, max_row_tokens=4096, max_padded_tokens=2**24)
    held = sum(t.numel() for t in (req.input_ids, req.prompt_lens, req.completion_lens, req.offsets))
    assert req.rows * req.row_tokens == 3_001 * 4096 and held < 3 * (req.tokens + req.rows), "nothing padded at parse time"
    for rows in row_slices(req.rows, req.row_tokens, None, max_tokens=8192)[-2:]:
        assert req.packed(rows).input_ids.numel() <= 8192, "one pass pads at most max_batch_tokens"

    p = ragged_batch(4, rows=10, vocab=VOCAB, width=16)
    req = parse_request(encode_request(p, 1.0), VOCAB, 16384, max_padded_tokens=10**6)
    for rows in row_slices(10, req.row_tokens, 3, None):  # each pass sees exactly its rows of the padded batch
        part = req.packed(rows)
        assert torch.equal(part.input_ids, p.input_ids[rows]) and torch.equal(part.attention_mask, p.attention_mask[rows])
        assert torch.equal(part.start, p.start[rows]) and torch.equal(part.length, p.length[rows])
        assert part.width == int(p.length.max())


@pytest.mark.parametrize(
    "body, field",
    [
        (b"", "body"),
        (b"not safetensors at all", "body"),
        ((10**6).to_bytes(8, "little") + b"{}", "body"),
        ((2).to_bytes(8, "little") + b"[]", "body"),
        (st_save({"input_ids": torch.zeros(2, dtype=torch.int64)}), "header"),
        (st_save({"input_ids": torch.zeros(2, dtype=torch.int64)}, metadata={"header": "{not json"}), "header"),
        (st_save({"input_ids": torch.zeros(2, dtype=torch.int64)}, metadata={"header": json.dumps([1])}), "header"),
    ],
)
def test_malformed_bodies(body, field):
    with pytest.raises(WireError) as e:
        parse_request(body, VOCAB, 16384)
    assert e.value.field == field


def test_truncated_payload_is_refused():
    body = encode_request(ragged_batch(3, rows=4, vocab=VOCAB), 1.0)
    with pytest.raises(WireError) as e:
        parse_request(body[:-7], VOCAB, 16384)
    assert e.value.field == "body"


@pytest.mark.parametrize(
    "rows, row_tokens, max_rows, max_tokens, sizes",
    [
        (10, 7, None, None, [10]),
        (10, 7, 4, None, [4, 4, 2]),
        (10, 7, None, 21, [3, 3, 3, 1]),
        (10, 7, 2, 21, [2, 2, 2, 2, 2]),
        (3, 100, None, 50, [1, 1, 1]),  # a row over the budget still goes alone
    ],
)
def test_row_slices(rows, row_tokens, max_rows, max_tokens, sizes):
    slices = row_slices(rows, row_tokens, max_rows, max_tokens)
    assert [len(range(rows)[s]) for s in slices] == sizes


# --------------------------------------------------------------------------- hostile values (400, never 500)


def _lengths_request(prompt_lens: list[int], completion_lens: list[int], tokens: int):
    return {"input_ids": torch.full((tokens,), 5, dtype=torch.int64),
            "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int64),
            "completion_lens": torch.tensor(completion_lens, dtype=torch.int64)}


@pytest.mark.parametrize(
    "prompt_lens, completion_lens, tokens, field",
    [
        # 2**62 + 2**62 wraps to -2**63 in int64: two such rows sum to 0, so the sum and max checks saw 2 tokens
        ([2**62, 2**62, 1, 1], [2**62, 2**62, 0, 0], 2, "prompt_lens"),
        ([1, 1], [2**63 - 1, 2**63 - 1], 0, "completion_lens"),
        ([2**63 - 1, 2], [0, 2**63 - 1], 1, "prompt_lens"),
    ],
)
def test_row_lengths_that_would_wrap_int64_are_refused(prompt_lens, completion_lens, tokens, field):
    body = encode(_lengths_request(prompt_lens, completion_lens, tokens), {"temperature": 1.0})
    with pytest.raises(WireError) as e:
        parse_request(body, VOCAB, 16384)
    assert e.value.field == field and "max_batch_tokens=16384" in e.value.message


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["header", "safetensors header"])
def test_deeply_nested_json_is_a_400_not_a_recursion_error(where):
    tensors, header = _request()
    if where == "header":
        body = st_save(tensors, metadata={"header": json.dumps({**header, "pad_id": None}).replace("null", _nested(100_000))})
        field = "header"
    else:  # the outer safetensors JSON, parsed before safetensors sees it
        raw = json.dumps({"x": None}).replace("null", _nested(100_000)).encode()
        body = len(raw).to_bytes(8, "little") + raw
        field = "body"
    with pytest.raises(WireError) as e:
        parse_request(body, VOCAB, 16384)
    assert e.value.field == field and "nested" in e.value.message


def test_a_temperature_too_large_for_a_float_is_refused():
    tensors, header = _request(temperature=10**400)
    with pytest.raises(WireError) as e:
        parse_request(encode(tensors, header), VOCAB, 16384)
    assert e.value.field == "temperature" and "finite number" in e.value.message


def test_top_k_round_trip_and_answers_checked_against_the_question():
    """top_k travels in the header; the answer's [T, k] top-k log-probs and ids come back as [B, width, k] with zeros
    beyond each row; an answer with top-k tensors nobody asked for, or of the wrong shape or dtype, is refused."""
    p = ragged_batch(2, rows=6, vocab=VOCAB, width=16)
    assert parse_request(encode_request(p, 0.7, top_k=5), VOCAB, 16384).top_k == 5
    assert parse_request(encode_request(p, 0.7), VOCAB, 16384).top_k == 0
    assert parse_request(encode_request(p, 0.7, model="teacher"), VOCAB, 16384).model == "teacher"
    assert parse_request(encode_request(p, 0.7), VOCAB, 16384).model == "reference"
    small = ragged_batch(2, rows=3, vocab=20)
    with pytest.raises(WireError, match="20 tokens per position at most"):  # a vocabulary smaller than k
        parse_request(encode_request(small, 0.7, top_k=40), 20, 16384)
    lengths = torch.tensor([3, 0, 2])
    lp, tlp, tid = torch.randn(3, 5), torch.randn(3, 5, 4), torch.randint(0, VOCAB, (3, 5, 4))
    body = encode_flat_response(flatten_rows(lp, lengths), None, {}, (flatten_rows(tlp, lengths), flatten_rows(tid, lengths)))
    got, _ = decode_scores(body, lengths, 5, top_k=4)
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    assert torch.equal(got.topk_logprobs[mask], tlp[mask]) and torch.equal(got.topk_ids[mask], tid[mask])
    assert not got.topk_logprobs[~mask].any() and got.topk_ids.dtype == torch.long
    with pytest.raises(WireError, match="not asked for"):
        decode_scores(body, lengths, 5)
    with pytest.raises(WireError, match=r"\[5, 4\]"):
        decode_scores(body, lengths, 5, top_k=3)
    with pytest.raises(WireError, match="topk_logprobs"):
        decode_scores(encode_flat_response(flatten_rows(lp, lengths), None, {}), lengths, 5, top_k=4)


def test_a_null_rows_per_pass_is_its_default():
    """rows_per_pass's default is null (no cap): null is that default, not an error."""
    tensors, header = _request()
    header["rows_per_pass"] = None
    assert parse_request(encode(tensors, header), VOCAB, 16384).rows_per_pass is None
