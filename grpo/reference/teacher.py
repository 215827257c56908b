"""The teacher of on-policy distillation (``teacher:``, docs/distillation.md): a second reference.

The teacher answers the question the reference answers (the per-token log-probs of given completions), from another
model: in this process (``teacher.model``) or from a ``ref_client.py`` server started on the teacher model
(``teacher.url``). So it is built by the reference's own clients (grpo/reference/http.py's and in_process.py's, told
the teacher's server or model), and it shares the reference's wire format, retries, queue and auth (the ``ref``
section's client settings). Its tokenizer must be
the policy's: a server is checked by its client (tokenizer fingerprint and vocabulary size), an in-process teacher
here, both naming the two models when they differ.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Optional

import torch

from grpo.foundation.config import Config, ConfigError
from grpo.foundation.config_rules import distilling
from grpo.foundation.logprobs import Packed, Scores
from grpo.foundation.modeling import check_model_path
from grpo.reference.handle import ReferenceHandle
from grpo.reference.in_process import AdapterTeacher, InProcessReference, Loader
from grpo.reference.protocol import ReferenceServerError


class TeacherHandle(ReferenceHandle):
    """The reference handle, whose server errors say they are the teacher's (the client's own words speak of the
    reference and of ``ref.url``)."""

    def __init__(self, impl, url: Optional[str], top_k: int = 0):
        super().__init__(impl)
        self.url, self.top_k = url, top_k  # top_k: also its k most likely tokens at each position (teacher.top_k)

    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]":
        return self._relabelled(super().submit(packed, temperature))

    def submit_topk(self, packed: Packed, temperature: float, top_k: int) -> "Future[Scores]":
        return self._relabelled(super().submit_topk(packed, temperature, top_k))

    def pop_metrics(self) -> dict[str, float]:
        """A teacher server's client metrics (``ref/latency`` and the rest) as ``teacher/...``."""
        return {"teacher/" + k.split("/", 1)[1]: v for k, v in super().pop_metrics().items()}

    def _relabelled(self, inner: Future) -> Future:
        if not self.remote:
            return inner
        out: Future = Future()

        def relay(done: Future) -> None:
            e = done.exception()
            if e is None:
                out.set_result(done.result())
            else:
                out.set_exception(teacher_error(self.url, e) if isinstance(e, ReferenceServerError) else e)

        inner.add_done_callback(relay)
        return out


def ask_teacher(teacher: Optional[TeacherHandle], batch, pad_id: int,
                temperature: float) -> tuple[Optional[Future], float]:
    """The teacher's request for ``batch`` (None without a teacher; its top-k too with ``teacher.top_k``) and the
    seconds asking took: a server's answer comes later (its request is in flight meanwhile), an in-process teacher
    computes here. :func:`take_answer` puts the answer into the batch."""
    t0 = time.perf_counter()
    future = None
    if teacher is not None and teacher.top_k:
        future = teacher.submit_topk(batch.packed(None, pad_id), temperature, teacher.top_k)
    elif teacher is not None:
        future = teacher.submit(batch.packed(None, pad_id), temperature)
    return future, time.perf_counter() - t0


def take_answer(batch, answer: "torch.Tensor | Scores") -> None:
    """The teacher's answer into ``batch``: its log-probs of the sampled tokens (``teacher_logp``) and, when asked,
    its top-k log-probs and token ids (``extra["teacher_topk_logp"]``, ``extra["teacher_topk_ids"]``, [rows, T,
    k], zeros beyond each row)."""
    lp = answer.logprobs if isinstance(answer, Scores) else answer
    batch.teacher_logp = lp.float() * batch.mask
    if isinstance(answer, Scores):
        batch.extra = {**batch.extra, "teacher_topk_logp": answer.topk_logprobs.float(),
                       "teacher_topk_ids": answer.topk_ids.long()}


def teacher_error(url: Optional[str], e: Exception) -> ReferenceServerError:
    return ReferenceServerError(f"the teacher's server (teacher.url={url!r}; the settings named ref.* apply to it): {e}")


def check_same_tokenizer(cfg: Config, tokenizer) -> None:
    """An in-process teacher's tokenizer and chat template (where prompts use it) are the policy's."""
    from grpo.foundation.modeling import load_tokenizer, tokenizer_fingerprint

    theirs = load_tokenizer(cfg.teacher.model, cfg.model.trust_remote_code)
    if tokenizer_fingerprint(theirs) != tokenizer_fingerprint(tokenizer):
        refuse(cfg, f"its tokenizer ({len(theirs)} tokens) is not the policy's ({len(tokenizer)} tokens)")
    if cfg.data.chat_template and getattr(theirs, "chat_template", None) != getattr(tokenizer, "chat_template", None):
        refuse(cfg, "its chat template is not the policy's")


def refuse(cfg: Config, problem: str) -> None:
    raise ConfigError(f"teacher.model={cfg.teacher.model!r} cannot teach model.name_or_path={cfg.model.name_or_path!r}: "
                      f"{problem}. On-policy distillation compares log-probs token by token: use a teacher of the "
                      f"same family (the same tokenizer)")


def _same_model(a: str, b: str) -> bool:
    """Two model names or folders that name the same model (a folder by its resolved path)."""
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _origin(cfg: Config) -> str:
    return f"teacher.url={cfg.teacher.url!r}" if cfg.teacher.url else f"teacher.model={cfg.teacher.model!r}"


def check_not_the_student(cfg: Config, source: str, weights_hash: Optional[str],
                          reference: Optional[ReferenceHandle]) -> None:
    """A teacher that is the policy's starting model or the run's reference teaches nothing: the student starts at
    the teacher (or the reference's KL term pulls it back there) and the term is 0 from the first step.
    ConfigError naming the two. ``source``: the teacher's model (a server's as it reports it); ``weights_hash``:
    a server's hash of the teacher's weights, compared with a reference server's."""
    problem = None
    if _same_model(source, cfg.model.name_or_path):
        problem = f"it is the policy's starting model (model.name_or_path={cfg.model.name_or_path!r})"
    elif reference is not None:
        theirs = reference.weights_hash()  # collective with a server; None in-process
        if weights_hash is not None and theirs == weights_hash:
            problem = (f"its weights are the reference's (ref.url={cfg.ref.url!r} serves the same weights, hash "
                       f"{theirs})")
        elif _same_model(source, reference.source):
            problem = f"it is the run's reference ({reference.source!r})"
    if problem:
        raise ConfigError(f"{_origin(cfg)} serves the teacher {source!r}, and {problem}: its log-probs would be the "
                          f"student's own or the reference's, so the distillation term would be 0 on every token. Name "
                          f"a stronger model of the same family as the teacher")


def check_served_teacher(cfg: Config, impl, reference: Optional[ReferenceHandle]) -> None:
    """A ``ref_client.py`` server at teacher.url answers as the teacher with its teacher, or with its model when it
    holds none: right for a server started on the teacher alone, silently the reference when teacher.url is the
    run's reference server started without ``--teacher-model``. Refused then, and when the model that answers is
    the policy's start or the reference (:func:`check_not_the_student`)."""
    info = getattr(impl, "server_info", None)
    if not isinstance(info, dict):
        return  # not a ref_client.py server (teacher.api: openai)
    teacher = info.get("teacher")
    if not teacher and cfg.ref.url and cfg.ref.url.rstrip("/") == cfg.teacher.url.rstrip("/"):
        raise ConfigError(f"teacher.url={cfg.teacher.url!r} is the reference server (ref.url), and it holds no "
                          f"teacher: it was started without --teacher-model, so it would answer the teacher's requests "
                          f"with the reference ({info.get('model')!r}) and the distillation term would be 0. Restart it "
                          f"with `python ref_client.py --config <this run's config> --teacher-model TEACHER`, or point "
                          f"teacher.url at a server started on the teacher (ref.model=TEACHER)")
    served = teacher or info
    check_not_the_student(cfg, str(served.get("model", "")), served.get("weights_hash"), reference)


def make_teacher(cfg: Config, device: torch.device, tokenizer=None, vocab_size: Optional[int] = None,
                 load: Optional[Loader] = None, synced: bool = False,
                 policy: Optional[torch.nn.Module] = None,
                 reference: Optional[ReferenceHandle] = None) -> Optional[ReferenceHandle]:
    """The teacher's handle (None when no teacher is named or its term is off). ``policy``: the trainer's model,
    which holds ``teacher.adapter`` beside its own adapter (LoRA). ``reference``: the run's reference handle (or
    None), which the teacher must not be (collective with a server: called on every rank)."""
    if not distilling(cfg):
        return None
    if cfg.teacher.adapter:
        if policy is None:
            raise ValueError("make_teacher: with teacher.adapter the teacher lives in the policy; pass it as policy=")
        return TeacherHandle(AdapterTeacher(cfg, policy), None, cfg.teacher.top_k)
    if cfg.teacher.api == "openai":
        from grpo.reference.openai import OpenAITeacher  # vLLM's /v1/completions with prompt_logprobs

        try:
            return TeacherHandle(OpenAITeacher(cfg, tokenizer, vocab_size), cfg.teacher.url, cfg.teacher.top_k)
        except ReferenceServerError as e:  # not there at start
            raise teacher_error(cfg.teacher.url, e) from None
    if cfg.teacher.model:  # before the teacher's weights are loaded
        check_model_path("teacher.model", cfg.teacher.model)
        check_not_the_student(cfg, cfg.teacher.model, None, reference)
        if tokenizer is not None:
            check_same_tokenizer(cfg, tokenizer)
    try:
        if cfg.teacher.url:  # a ref_client.py server: its teacher when it holds one beside its reference
            from grpo.reference.http import HTTPReference

            handle = ReferenceHandle(HTTPReference(cfg, tokenizer, vocab_size, role="teacher"))
        else:
            handle = ReferenceHandle(InProcessReference(cfg, device, load, synced, source=cfg.teacher.model))
    except ConfigError as e:  # the server's client speaks of "the reference": say which one
        if not cfg.teacher.url:
            raise
        raise ConfigError(f"teacher.url={cfg.teacher.url!r} (the teacher's server) cannot teach model.name_or_path="
                          f"{cfg.model.name_or_path!r}: {e}") from e
    except ReferenceServerError as e:  # not there at start
        raise teacher_error(cfg.teacher.url, e) from None
    if cfg.teacher.url:
        check_served_teacher(cfg, handle.impl, reference)
    model = getattr(handle.impl, "model", None)
    if model is not None and vocab_size is not None and model.config.get_text_config().vocab_size != vocab_size:
        refuse(cfg, f"its vocabulary size {model.config.get_text_config().vocab_size} is not the policy's {vocab_size}")
    return TeacherHandle(handle.impl, cfg.teacher.url, cfg.teacher.top_k)
