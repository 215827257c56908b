"""The reference server's binary wire format, and the validation of every request field.

A body (request or response) is one safetensors file: the tensors, plus a JSON header
stored as the string ``__metadata__["header"]``. Nothing is ever unpickled: safetensors
holds only raw little-endian arrays with declared dtypes and shapes, and the header is JSON.

Request (``POST /v1/logprobs``), rows concatenated without padding:
    tensors  input_ids        int32|int64 [N]  prompt + completion tokens of every row, back to back
             prompt_lens      int32|int64 [B]  prompt tokens of each row (>= 1)
             completion_lens  int32|int64 [B]  completion tokens of each row to score (>= 0)
    header   temperature (number > 0), with_entropy (bool, default false),
             pad_id (int, default 0), rows_per_pass (int >= 1, optional: the client's
             micro-batch size, so the server's forward passes match the in-process reference's),
             top_k (int in [0, 64], default 0: also the top_k most likely next tokens at each position),
             model ("reference" or "teacher", default "reference": which of the server's models answers; a
             teacher is there when the server was started with --teacher-model)
Response:
    tensors  logprobs [T] float32 (T = sum completion_lens), entropy [T] float32 when asked,
             topk_logprobs [T, top_k] float32 and topk_ids [T, top_k] int32 (most likely first) when asked
    header   version, rows, tokens, compute_ms (the forward), parse_ms (reading and checking the
             body), wait_ms (the wait for the device thread beyond compute_ms)

The rows stay flat on the server until their forward pass: a request costs rows x its longest
row padded tokens of work, which is capped per request (:class:`TooLarge`, 413), and only one
pass's rows are ever padded at a time (:meth:`LogprobRequest.packed`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from grpo.foundation.logprobs import Packed, Scores
from grpo.foundation.config import MAX_TOP_K

CONTENT_TYPE = "application/vnd.grpo-ref+safetensors"
TOKEN_ENV = "GRPO_REF_TOKEN"  # the bearer token, for server and client alike
INT_DTYPES = (torch.int32, torch.int64)
REQUEST_TENSORS = ("input_ids", "prompt_lens", "completion_lens")
HEADER_FIELDS = ("temperature", "with_entropy", "pad_id", "rows_per_pass", "top_k", "model")
MODELS = ("reference", "teacher")  # the models a server may hold


class WireError(ValueError):
    """A request field is invalid; ``field`` names it (the 400 answer's JSON carries both)."""

    status = 400

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class TooLarge(WireError):
    """The request is valid but asks for more work than this server accepts in one request (413)."""

    status = 413


# --------------------------------------------------------------------------- framing


def encode(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> bytes:
    """One safetensors payload holding ``tensors`` and the JSON ``header``."""
    contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return st_save(contiguous, metadata={"header": json.dumps(header)})


def _json(raw: bytes | str, field: str, what: str) -> Any:
    """``raw`` parsed as JSON; invalid or absurdly nested JSON raises :class:`WireError` (``field``)."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(field, f"{what} is not valid JSON ({e})") from None
    except RecursionError:  # "[[[[..." thousands deep: Python's parser gives up; that is the client's fault
        raise WireError(field, f"{what} is nested too deeply to parse; send a flat JSON object") from None


def decode(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and header of a payload; a malformed body raises :class:`WireError` ('body'/'header')."""
    if len(body) < 8:
        raise WireError("body", f"{len(body)} bytes is too short for a safetensors payload")
    n = int.from_bytes(body[:8], "little")
    if n > len(body) - 8:
        raise WireError("body", f"declares a {n}-byte safetensors header but only {len(body) - 8} bytes follow")
    st_header = _json(body[8 : 8 + n], "body", "the safetensors header")
    if not isinstance(st_header, dict):
        raise WireError("body", "the safetensors header is not a JSON object")
    try:
        tensors = st_load(body)
    except BaseException as e:  # safetensors' Rust side may raise a PanicException (a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise WireError("body", f"not a valid safetensors payload ({type(e).__name__}: {e})") from None
    meta = st_header.get("__metadata__") or {}
    raw = meta.get("header") if isinstance(meta, dict) else None
    if raw is None:
        raise WireError("header", 'missing: put the JSON header in the safetensors metadata under "header"')
    header = _json(raw, "header", "the header")
    if not isinstance(header, dict):
        raise WireError("header", f"must be a JSON object, got {type(header).__name__}")
    return tensors, header


# --------------------------------------------------------------------------- packing


def flatten_packed(packed: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [N], prompt_lens [B], completion_lens [B]): each row's first start+length tokens."""
    seq = packed.start + packed.length
    real = packed.attention_mask.sum(-1)
    if bool((seq > real).any()):
        i = int((seq > real).nonzero()[0])
        raise ValueError(f"row {i}: start + length = {int(seq[i])} exceeds its {int(real[i])} real tokens")
    cols = torch.arange(packed.input_ids.shape[1])
    flat = packed.input_ids[cols.unsqueeze(0) < seq.unsqueeze(1)]
    return flat, packed.start.clone(), packed.length.clone()


def unflatten(input_ids: torch.Tensor, prompt_lens: torch.Tensor, completion_lens: torch.Tensor, pad_id: int,
              row_tokens: Optional[int] = None, width: Optional[int] = None) -> Packed:
    """The right-padded :class:`Packed` that ``grpo.foundation.logprobs.pack`` builds from the same rows.

    ``row_tokens`` (padded length) and ``width`` default to these rows' own; a forward pass over
    some of a request's rows passes the whole request's, so it sees exactly the columns it would
    see in the whole padded batch.
    """
    seq = prompt_lens + completion_lens
    L = int(seq.max()) if row_tokens is None else row_tokens
    keep = torch.arange(L).unsqueeze(0) < seq.unsqueeze(1)  # row-major: the rows' tokens in order
    ids = torch.full((len(seq), L), pad_id, dtype=torch.long)
    ids[keep] = input_ids.long()
    w = max(int(completion_lens.max()), 1) if width is None else width
    return Packed(ids, keep.long(), prompt_lens.long(), completion_lens.long(), w)


def flatten_rows(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, width] -> [sum lengths]: each row's first ``lengths[i]`` values."""
    cols = torch.arange(values.shape[1], device=values.device)
    return values[cols.unsqueeze(0) < lengths.to(values.device).unsqueeze(1)]


def unflatten_rows(flat: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`flatten_rows` ([sum lengths, ...] -> [B, width, ...]): zeros beyond each row's length."""
    out = torch.zeros(len(lengths), width, *flat.shape[1:], dtype=flat.dtype)
    out[torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)] = flat
    return out


# --------------------------------------------------------------------------- request


@dataclass
class LogprobRequest:
    """A validated ``/v1/logprobs`` request, its rows kept flat (nothing padded yet)."""

    input_ids: torch.Tensor  # [tokens] every row's tokens, back to back
    prompt_lens: torch.Tensor  # [rows]
    completion_lens: torch.Tensor  # [rows]
    pad_id: int
    temperature: float
    with_entropy: bool
    rows_per_pass: Optional[int]
    top_k: int = 0
    model: str = "reference"

    def __post_init__(self) -> None:
        seq = self.prompt_lens + self.completion_lens
        self.offsets = torch.cat([seq.new_zeros(1), seq.cumsum(0)])  # row i's tokens: offsets[i]:offsets[i + 1]
        self.row_tokens = int(seq.max())  # every row is padded to the longest, as in the client's batch
        self.width = max(int(self.completion_lens.max()), 1)

    @property
    def rows(self) -> int:
        return int(self.prompt_lens.numel())

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    def packed(self, rows: slice = slice(None)) -> Packed:
        """Rows ``rows`` padded like the whole request (its longest row, its width): one forward pass's input."""
        first, last, _ = rows.indices(self.rows)
        ids = self.input_ids[int(self.offsets[first]) : int(self.offsets[max(first, last)])]
        return unflatten(ids, self.prompt_lens[rows], self.completion_lens[rows], self.pad_id, self.row_tokens, self.width)


def encode_request(packed: Packed, temperature: float, with_entropy: bool = False, pad_id: int = 0,
                   rows_per_pass: Optional[int] = None, top_k: int = 0, model: str = "reference") -> bytes:
    ids, prompt_lens, completion_lens = flatten_packed(packed)
    small = torch.int32 if ids.numel() == 0 or int(ids.max()) < 2**31 else torch.int64
    header: dict[str, Any] = {"temperature": float(temperature), "with_entropy": bool(with_entropy), "pad_id": int(pad_id)}
    if rows_per_pass is not None:
        header["rows_per_pass"] = int(rows_per_pass)
    if top_k:
        header["top_k"] = int(top_k)
    if model != "reference":  # (an older server knows no "model" field: sent only when it matters)
        header["model"] = model
    tensors = {"input_ids": ids.to(small), "prompt_lens": prompt_lens.to(torch.int32),
               "completion_lens": completion_lens.to(torch.int32)}
    return encode(tensors, header)


def _int_field(header: dict, name: str, default: Optional[int], minimum: int) -> Optional[int]:
    """An integer field >= ``minimum``; absent: ``default``. null is absent only where the default is null."""
    v = header.get(name, default)
    if v is None:
        if default is not None:
            raise WireError(name, f"must be an integer, got null; leave the field out for its default ({default})")
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise WireError(name, f"must be an integer, got {v!r}")
    if v < minimum:
        raise WireError(name, f"must be >= {minimum}, got {v}")
    return v


def _int_vector(tensors: dict, name: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise WireError(name, f"missing tensor; a request carries {list(REQUEST_TENSORS)}")
    if t.dtype not in INT_DTYPES:
        raise WireError(name, f"dtype {str(t.dtype).replace('torch.', '')} is not allowed; send int32 or int64")
    if t.dim() != 1:
        raise WireError(name, f"must be 1-D, got shape {list(t.shape)}")
    return t.long()


def _row_lengths(prompt_lens: torch.Tensor, completion_lens: torch.Tensor, max_row_tokens: int) -> torch.Tensor:
    """Each row's tokens (prompt + completion), every length checked before anything is added up.

    Each part is bounded by ``max_row_tokens`` first, so no sum can wrap around int64 (2**62 + 2**62
    would be negative and slip past the later checks).
    """
    if bool((prompt_lens < 1).any()):
        i = int((prompt_lens < 1).nonzero()[0])
        raise WireError("prompt_lens", f"prompt_lens[{i}]={int(prompt_lens[i])}: every row needs a prompt of >= 1 token")
    if bool((completion_lens < 0).any()):
        i = int((completion_lens < 0).nonzero()[0])
        raise WireError("completion_lens", f"completion_lens[{i}]={int(completion_lens[i])} is negative")
    for name, lens in (("prompt_lens", prompt_lens), ("completion_lens", completion_lens)):
        if bool((lens > max_row_tokens).any()):
            i = int((lens > max_row_tokens).nonzero()[0])
            raise WireError(name, f"{name}[{i}]={int(lens[i])}: row {i} is longer than this server's "
                                  f"max_batch_tokens={max_row_tokens}; restart it with a larger --max-batch-tokens")
    seq = prompt_lens + completion_lens
    if int(seq.max()) > max_row_tokens:
        i = int(seq.argmax())
        raise WireError("completion_lens", f"row {i} has {int(seq[i])} tokens, more than this server's "
                                           f"max_batch_tokens={max_row_tokens}; restart it with a larger --max-batch-tokens")
    return seq


def _temperature(header: dict) -> float:
    t = header.get("temperature")
    try:
        value = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else math.nan
    except OverflowError:  # an integer beyond float's range, e.g. 10**400
        value = math.inf
    if not math.isfinite(value) or value <= 0:
        raise WireError("temperature", f"must be a finite number > 0, got {t!r}")
    return value


def _check_padded(rows: int, row_tokens: int, max_padded_tokens: Optional[int]) -> None:
    padded = rows * row_tokens
    if max_padded_tokens is not None and padded > max_padded_tokens:
        raise TooLarge("completion_lens", f"the {rows} rows pad to {rows} x {row_tokens} (the longest row) = {padded} "
                                          f"tokens, more than this server's max_padded_tokens={max_padded_tokens} per "
                                          f"request; send fewer rows per request, or long rows apart from many short ones")


def parse_request(body: bytes, vocab_size: int, max_row_tokens: int,
                  max_padded_tokens: Optional[int] = None) -> LogprobRequest:
    """Decode and validate a request; any problem raises :class:`WireError` naming the field.

    ``max_padded_tokens`` caps rows x longest row (:class:`TooLarge`); nothing is padded here.
    """
    tensors, header = decode(body)
    for name in tensors:
        if name not in REQUEST_TENSORS:
            raise WireError(name, f"unknown tensor; a request carries exactly {list(REQUEST_TENSORS)}")
    for name in header:
        if name not in HEADER_FIELDS:
            raise WireError(name, f"unknown header field; valid fields are {list(HEADER_FIELDS)}")
    ids, prompt_lens, completion_lens = (_int_vector(tensors, n) for n in REQUEST_TENSORS)

    if prompt_lens.numel() == 0:
        raise WireError("prompt_lens", "is empty: send at least one row")
    if completion_lens.shape != prompt_lens.shape:
        raise WireError("completion_lens", f"has {completion_lens.numel()} rows but prompt_lens has {prompt_lens.numel()}")
    seq = _row_lengths(prompt_lens, completion_lens, max_row_tokens)
    if int(seq.sum()) != ids.numel():
        raise WireError("input_ids", f"has {ids.numel()} tokens but prompt_lens + completion_lens sum to {int(seq.sum())}")
    _check_padded(len(seq), int(seq.max()), max_padded_tokens)
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise WireError("input_ids", f"input_ids[{i}]={int(ids[i])} is outside the vocabulary [0, {vocab_size})")

    t = _temperature(header)
    with_entropy = header.get("with_entropy", False)
    if not isinstance(with_entropy, bool):
        raise WireError("with_entropy", f"must be true or false, got {with_entropy!r}")
    pad_id = _int_field(header, "pad_id", 0, 0)
    if pad_id >= vocab_size:
        raise WireError("pad_id", f"{pad_id} is outside the vocabulary [0, {vocab_size})")
    rows_per_pass = _int_field(header, "rows_per_pass", None, 1)
    top_k = _int_field(header, "top_k", 0, 0)
    if top_k > min(MAX_TOP_K, vocab_size):
        raise WireError("top_k", f"{top_k} is more than this server sends ({min(MAX_TOP_K, vocab_size)} tokens per "
                                 f"position at most); ask for fewer")
    model = header.get("model", "reference")
    if model not in MODELS:
        raise WireError("model", f"{model!r} is not one of {list(MODELS)}")
    return LogprobRequest(ids, prompt_lens, completion_lens, pad_id, t, with_entropy, rows_per_pass, top_k, model)


# --------------------------------------------------------------------------- response


def encode_flat_response(logprobs: torch.Tensor, entropy: Optional[torch.Tensor], header: dict,
                         topk: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> bytes:
    """A response from flat [T] values (each row's completion tokens, back to back), and the flat [T, k] top-k
    log-probs and ids when asked."""
    tensors = {"logprobs": logprobs.float()}
    if entropy is not None:
        tensors["entropy"] = entropy.float()
    if topk is not None:
        tensors["topk_logprobs"], tensors["topk_ids"] = topk[0].float(), topk[1].to(torch.int32)
    return encode(tensors, header)


ANSWER_TENSORS = {"logprobs": torch.float32, "entropy": torch.float32, "topk_logprobs": torch.float32,
                  "topk_ids": torch.int32}


def decode_scores(body: bytes, lengths: torch.Tensor, width: int, top_k: int = 0) -> tuple[Scores, dict]:
    """(:class:`Scores` as [B, width] tensors, [B, width, top_k] for the top-k, header) of a server answer for rows of
    ``lengths``; anything else than what was asked, in its dtype and shape, raises :class:`WireError`."""
    tensors, header = decode(body)
    expected = int(lengths.sum())
    for name, t in tensors.items():
        shape = (expected, top_k) if name.startswith("topk_") else (expected,)
        if name not in ANSWER_TENSORS or (name.startswith("topk_") and not top_k):
            raise WireError(name, "the server sent a tensor that was not asked for")
        if t.dtype != ANSWER_TENSORS[name] or t.shape != shape:
            raise WireError(name, f"the server sent {str(t.dtype)} {list(t.shape)}; expected "
                                  f"{str(ANSWER_TENSORS[name])} {list(shape)}")
    for name in ("logprobs",) + (("topk_logprobs", "topk_ids") if top_k else ()):
        if name not in tensors:
            raise WireError(name, "missing from the server's answer")
    ent = tensors.get("entropy")
    out = Scores(unflatten_rows(tensors["logprobs"], lengths, width),
                 None if ent is None else unflatten_rows(ent, lengths, width))
    if top_k:
        out.topk_logprobs = unflatten_rows(tensors["topk_logprobs"], lengths, width)
        bad = (tensors["topk_ids"] < 0).any()
        if bool(bad):
            raise WireError("topk_ids", "the server sent a negative token id")
        out.topk_ids = unflatten_rows(tensors["topk_ids"].long(), lengths, width)
    return out, header


def decode_response(body: bytes, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:
    """([B, width] log-probs, entropy or None, header) of a server answer for rows of ``lengths``."""
    scores, header = decode_scores(body, lengths, width)
    return scores.logprobs, scores.entropy, header
