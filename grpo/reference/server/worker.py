"""The reference server's device side: the frozen model, a bounded job queue, one worker thread.

HTTP threads only parse and validate; every forward pass runs on the single worker thread, so
the device holds one batch at a time. Each request is computed in forward passes of at most
``max_batch_tokens`` padded tokens (and the client's ``rows_per_pass``) with the function the
in-process reference uses, so a request's answer never depends on what other ranks sent at
the same time: results are deterministic and, in float32 on CPU, bit-identical to in-process.
A request's rows stay flat until their pass: only one pass's rows are padded at a time.
A full queue refuses new work (:class:`QueueFull` -> 503) instead of growing without bound.
A reload travels through the same queue: requests queued before it use the old weights. One
reload at a time, each done once per Idempotency-Key, so no retry loads a second model.

Work nobody waits for is not done: each HTTP thread waiting on a job leaves it when its client
disconnects, and a job whose clients have all left is dropped (before its turn, or between two
forward passes). A request sent with a key (the client's Idempotency-Key and the body's hash)
joins the queued or running job of the same key instead of queueing a copy, so a client's
retries after a read timeout cost one computation, and a keyed answer is kept RESULT_TTL_S for
a retry, even once an HTTP thread has sent it: the client may have timed out while it was sent. A keyed job is kept RETRY_GRACE_S after its clients left,
since a retry usually follows.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Optional

import torch

from grpo.foundation.config import ConfigError, ModelConfig
from grpo.foundation.logprobs import Scores, check_head
from grpo.foundation.modeling import load_model, load_tokenizer, tokenizer_fingerprint
from grpo.reference.wire import LogprobRequest, flatten_rows
from grpo.reference.protocol import row_slices, sliced_scores


class QueueFull(Exception):
    """The job queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"queue full, retry after {retry_after} s")
        self.retry_after = retry_after


def weights_hash(model: torch.nn.Module) -> str:
    """A hash of every parameter and buffer (names, dtypes, shapes, bytes): the weights' identity."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class LoadedModel:
    """A reference model with what clients check against their policy."""

    model: torch.nn.Module
    source: str
    tokenizer_fingerprint: str
    tokenizer_size: int
    vocab_size: int
    weights_hash: str
    step: Optional[int]  # the training step when ``source`` is a trainer checkpoint (step-N)


def load_reference(model_cfg: ModelConfig, source: str, safetensors_only: bool = False) -> LoadedModel:
    """Load model (on CPU, eval, frozen) and tokenizer of ``source``; hashes the weights."""
    tokenizer = load_tokenizer(source, model_cfg.trust_remote_code)
    model = load_model(model_cfg, source, safetensors_only=safetensors_only).eval()
    model.requires_grad_(False)
    match = re.search(r"step-(\d+)$", str(source).rstrip("/"))
    return LoadedModel(
        model=model,
        source=str(source),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        tokenizer_size=len(tokenizer),
        vocab_size=int(model.config.get_text_config().vocab_size),
        weights_hash=weights_hash(model),
        step=int(match.group(1)) if match else None,
    )


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")  # formats torch.load / pickle read


def reload_folder(checkpoint: str, root: Optional[Path], _bases: tuple = ()) -> Path:
    """The resolved folder of a reload, refused (ConfigError) unless it holds safetensors weights only.

    A folder with pickle-format files beside its weights is refused outright (from_pretrained may
    prefer them); with ``root`` set, the folder (symlinks resolved) must lie inside it.
    """
    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigError(f"checkpoint {checkpoint!r} is not a folder on the server's machine")
    real = path.resolve()
    if root is not None and not real.is_relative_to(root):
        raise ConfigError(f"checkpoint {checkpoint!r} ({real}) is outside the server's reload root {root} "
                          f"(GRPO_REF_RELOAD_ROOT); put the checkpoint under it")
    if root is not None:  # every file it reads, not only the folder: a symlinked file or shard leaves the root
        reads = [f for f in real.iterdir() if not f.is_dir()]
        index = real / "model.safetensors.index.json"
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
            except (ValueError, AttributeError) as e:
                raise ConfigError(f"checkpoint {checkpoint!r}: model.safetensors.index.json is not a weight "
                                  f"index ({e})") from None
            reads += [real / str(s) for s in shards]
        for f in reads:
            if not f.resolve().is_relative_to(root):
                raise ConfigError(f"checkpoint {checkpoint!r}: {f.name} resolves to {f.resolve()}, outside the "
                                  f"server's reload root {root} (GRPO_REF_RELOAD_ROOT); copy it into the checkpoint")
    if (real / "adapter_config.json").is_file():  # a LoRA adapter loads its base too: the base is read as well
        try:
            base = json.loads((real / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (ValueError, AttributeError) as e:
            raise ConfigError(f"checkpoint {checkpoint!r}: adapter_config.json is not valid ({e})") from None
        if root is not None and not (isinstance(base, str) and Path(base).is_dir()):
            raise ConfigError(f"checkpoint {checkpoint!r} is a LoRA adapter whose base {base!r} is not a folder "
                              f"inside the server's reload root {root} (GRPO_REF_RELOAD_ROOT): reload a merged "
                              f"folder, or put the base under the root")
        if isinstance(base, str) and Path(base).is_dir():
            if Path(base).resolve() in (real, *_bases):
                raise ConfigError(f"checkpoint {checkpoint!r} is a LoRA adapter whose base {base!r} is itself or "
                                  f"one of the adapters above it: set base_model_name_or_path in its "
                                  f"adapter_config.json to the base model's folder")
            reload_folder(base, root, (*_bases, real))  # the same rules for the base's files
    pickles = sorted(f.name for f in real.iterdir() if f.is_file() and f.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise ConfigError(f"checkpoint {checkpoint!r} holds pickle-format files {pickles}; reload reads only "
                          f"safetensors weights and refuses folders with pickles beside them: remove them, or "
                          f"re-save the model with save_pretrained(safe_serialization=True)")
    if (real / "adapter_config.json").is_file() and (real / "adapter_model.safetensors").is_file():
        return real
    if not (real / "model.safetensors").is_file() and not (real / "model.safetensors.index.json").is_file():
        raise ConfigError(f"checkpoint {checkpoint!r} holds no model.safetensors (or model.safetensors.index.json); "
                          f"reload reads only safetensors weights written by save_pretrained")
    return real


RELOAD_KEY_TTL_S = 600.0  # a reload's retries (same Idempotency-Key) get its answer for this long
RETRY_GRACE_S = 5.0  # a keyed job whose clients all left still runs if one of them returns within this
RESULT_TTL_S = 60.0  # an answer nobody collected waits this long for a retry


class ReloadBusy(Exception):
    """Another reload is loading or waiting for its turn (409)."""


class Abandoned(Exception):
    """Every client waiting for the job has gone; nothing is computed for it."""


@dataclass
class Job:
    """A queued unit of device work and the HTTP threads waiting for it."""

    run: Callable[["Job"], Any]
    key: Optional[Hashable] = None  # requests with the same key share the job
    future: Future = field(default_factory=Future)
    waiters: int = 1
    left_at: float = 0.0  # time.monotonic() when the last waiter left
    finished_at: Optional[float] = None
    dropped: bool = False

    def abandoned(self, now: float) -> bool:
        """Nobody waits for it, and (keyed) nobody came back within RETRY_GRACE_S."""
        grace = RETRY_GRACE_S if self.key is not None else 0.0
        return self.waiters == 0 and now - self.left_at >= grace

    def joinable(self) -> bool:
        """Still running, queued, or finished with an answer a retry can take."""
        f = self.future
        return not self.dropped and not f.cancelled() and not (f.done() and f.exception() is not None)


_STOP = object()


class DeviceWorker:
    """Owns the model on ``device``; runs queued jobs one at a time on its own thread."""

    def __init__(self, model_cfg: ModelConfig, source: str, device: str | torch.device,
                 max_batch_tokens: int, max_queue: int, chunk_size: int, reload_root: Optional[str] = None,
                 reward: Optional[dict] = None, teacher: Optional[str] = None):
        self.model_cfg = model_cfg
        self.reload_root = Path(reload_root).resolve() if reload_root else None
        if self.reload_root is not None and not self.reload_root.is_dir():
            raise ConfigError(f"reload root {reload_root!r} (GRPO_REF_RELOAD_ROOT) is not a folder")
        self.device = torch.device(device)
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.chunk_size = chunk_size
        self.current = load_reference(model_cfg, source)
        self.current.model.to(self.device)
        check_head(self.current.model)  # the log-probs it serves are the model's own (once, at start)
        self.version = 0
        # on-policy distillation's teacher beside the reference (--teacher-model): same device and queue, asked for
        # with the request's "model": "teacher"; the same tokenizer as the reference's
        self.teacher = None if not teacher else load_reference(model_cfg, teacher)
        if self.teacher is not None:
            if self.teacher.tokenizer_fingerprint != self.current.tokenizer_fingerprint:
                raise ConfigError(f"--teacher-model {teacher!r}: its tokenizer ({self.teacher.tokenizer_size} tokens) is "
                                  f"not the reference {source!r}'s ({self.current.tokenizer_size} tokens); a server "
                                  f"holds a teacher of the reference's family, or run it on a server of its own")
            self.teacher.model.to(self.device)
            check_head(self.teacher.model)
        # a reward model beside the reference (grpo/scoring/models.py): same device, same queue, own version
        self.reward_args = dict(reward or {})
        self.reward = self._load_reward(self.reward_args["model"]) if reward else None
        self.reward_version = 0
        self.loaded_at = time.time()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._running = 0
        self._job_seconds = 0.0  # moving average of one job's time, for Retry-After
        self._keyed: dict[Hashable, Job] = {}  # keyed jobs a retry may join
        self._reloading: Optional[tuple[str, float]] = None  # (checkpoint, since) of the reload under way
        self._reload_keys: dict[str, tuple[Future, float]] = {}  # Idempotency-Key -> (its reload, when)
        self.stats = {"computed": 0, "joined": 0, "dropped": 0}  # requests computed; retries joined; jobs dropped
        self._thread = threading.Thread(target=self._loop, name="ref-device", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ jobs
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                job = self._queue.get()
                if job is _STOP:
                    return
                if self._drop_if_abandoned(job) or not job.future.set_running_or_notify_cancel():
                    continue
                with self._lock:
                    self._running = 1
                t0 = time.perf_counter()
                try:
                    job.future.set_result(job.run(job))
                except BaseException as e:  # a failing job answers 500; the worker keeps serving
                    job.future.set_exception(e)
                finally:
                    dt = time.perf_counter() - t0
                    with self._lock:
                        self._running = 0
                        self._job_seconds = dt if not self._job_seconds else 0.8 * self._job_seconds + 0.2 * dt
                        job.finished_at = time.monotonic()
                        if not job.joinable():
                            self._forget(job)

    def _drop_if_abandoned(self, job: Job) -> bool:
        """Mark ``job`` dropped when nobody waits for it any more (under the lock: no one joins meanwhile)."""
        with self._lock:
            if not job.abandoned(time.monotonic()):
                return False
            job.dropped = True
            self.stats["dropped"] += 1
            self._forget(job)
        job.future.cancel()  # still pending when called from _loop; a running job raises Abandoned instead
        return True

    def _forget(self, job: Job) -> None:
        """Under the lock: a later request with ``job``'s key starts afresh."""
        if job.key is not None and self._keyed.get(job.key) is job:
            del self._keyed[job.key]

    def _forget_stale(self, now: float) -> None:
        """Under the lock: answers nobody collected within RESULT_TTL_S, oldest first beyond 2 x max_queue."""
        done = sorted(((j.finished_at, k) for k, j in self._keyed.items() if j.finished_at is not None), key=lambda x: x[0])
        for i, (finished_at, key) in enumerate(done):
            if now - finished_at > RESULT_TTL_S or len(done) - i > 2 * self.max_queue:
                del self._keyed[key]

    def _enqueue(self, run: Callable[[Job], Any], key: Optional[Hashable] = None) -> Job:
        job = Job(run, key)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            wait = self._job_seconds * (self._queue.qsize() + 1)
            raise QueueFull(max(1, min(60, math.ceil(wait)))) from None
        return job

    def leave(self, job: Job) -> None:
        """An HTTP thread stops waiting for ``job``: it has the answer, or its client has gone.

        A keyed answer stays joinable (until :meth:`_forget_stale`) even after it was sent: a
        client whose read timed out while the answer was being written retries with the same key,
        and must get that answer instead of a second computation. Keys are one per logical request.
        """
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0:
                job.left_at = time.monotonic()

    def _logprobs(self, model: torch.nn.Module, req: LogprobRequest, job: Job) -> Scores:
        """Flat [T] log-probs (and entropy; and [T, k] top-k log-probs and ids) of ``req``, padding one forward
        pass's rows at a time.

        The passes are ``sliced_scores``' own (same row slices, same padded width), so the answer
        is the one the in-process reference computes from the whole padded batch. Between passes,
        a job whose clients have all gone stops (:class:`Abandoned`).
        """
        parts = []
        for rows in row_slices(req.rows, req.row_tokens, req.rows_per_pass, self.max_batch_tokens):
            if self._drop_if_abandoned(job):
                raise Abandoned(f"every client of this request has gone; stopped before rows {rows.start}+")
            part = req.packed(rows)
            s = sliced_scores(model, part, req.temperature, self.chunk_size, with_entropy=req.with_entropy,
                              top_k=req.top_k)
            parts.append({k: flatten_rows(v, part.length) for k, v in vars(s).items() if v is not None})
        flat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        return Scores(**flat)

    def _load_reward(self, source: str):
        """The reward model at ``source``, built by the loader the server was handed (``reward["load"]``:
        ref_client.py passes grpo.scoring.models.RewardModel)."""
        a = self.reward_args
        return a["load"](source, str(self.device), a.get("dtype"), a.get("label"),
                         a.get("batch_tokens") or self.max_batch_tokens, a.get("chat_template"),
                         self.model_cfg.trust_remote_code)

    def submit_reward(self, prompts: list, completions: list[str], key: Optional[Hashable] = None) -> Job:
        """A job whose future gives (scores, compute seconds, reward model version); joined like :meth:`submit`."""

        def run(job: Job):
            model, version = self.reward, self.reward_version  # as of the job's turn: a reload may precede it
            t0 = time.perf_counter()
            scores = model.score_texts(model.texts(prompts, completions))
            with self._lock:
                self.stats["computed"] += 1
            return scores, time.perf_counter() - t0, version

        return self._submit_keyed(run, key)

    def submit(self, req: LogprobRequest, key: Optional[Hashable] = None) -> Job:
        """A job whose future gives (flat :class:`Scores`: [T] log-probs, entropy or None, [T, k] top-k or None;
        compute seconds, weights version).

        With ``key``, a job of the same key that is queued, running or finished uncollected is joined
        instead. The caller must :meth:`leave` the job once it stops waiting.
        """

        def run(job: Job):
            current, version = self.current, self.version  # as of the job's turn: a reload may precede it
            if req.model == "teacher":
                current, version = self.teacher, 0
            t0 = time.perf_counter()
            scores = self._logprobs(current.model, req, job)
            with self._lock:
                self.stats["computed"] += 1
            return scores, time.perf_counter() - t0, version

        return self._submit_keyed(run, key)

    def _submit_keyed(self, run: Callable[[Job], Any], key: Optional[Hashable]) -> Job:
        with self._lock:
            self._forget_stale(time.monotonic())
            job = self._keyed.get(key) if key is not None else None
            if job is not None and job.joinable():
                job.waiters += 1
                self.stats["joined"] += 1
                return job
            job = self._enqueue(run, key)
            if key is not None:
                self._keyed[key] = job
            return job

    def reload(self, checkpoint: str, key: Optional[str] = None, target: str = "reference") -> Future:
        """Future of /v1/info's answer after loading ``checkpoint`` and swapping it in, in queue order.

        One reload at a time: another while one is loading or queued raises :class:`ReloadBusy`,
        so the server never loads two models at once. A reload with ``key`` is done once: a retry
        with the same key (the client's, after a read timeout) gets the first attempt's future,
        finished or not, for RELOAD_KEY_TTL_S. The load runs on the first caller's thread.
        """
        with self._lock:
            now = time.monotonic()
            self._reload_keys = {k: v for k, v in self._reload_keys.items() if now - v[1] < RELOAD_KEY_TTL_S}
            if key is not None and key in self._reload_keys:
                return self._reload_keys[key][0]
            if self._reloading is not None:
                path, since = self._reloading
                raise ReloadBusy(f"a reload of {path!r} is in progress (for {now - since:.0f} s); retry when it has "
                                 f"finished (GET /v1/info shows the version)")
            self._reloading = (checkpoint, now)
            done: Future = Future()
            if key is not None:
                self._reload_keys[key] = (done, now)
        done.add_done_callback(self._reload_finished)
        try:
            if target == "reward":
                self._load_and_queue_reward_swap(checkpoint, done)
            else:
                self._load_and_queue_swap(checkpoint, done)
        except BaseException as e:  # answered through the future, to this caller and to retries alike
            done.set_exception(e)
        return done

    def _reload_finished(self, _: Future) -> None:
        with self._lock:
            self._reloading = None

    def _load_and_queue_swap(self, checkpoint: str, done: Future) -> None:
        """Load ``checkpoint`` (the caller's thread) and queue the swap, whose job answers ``done``.

        The new weights must keep the tokenizer and vocabulary: clients checked those at start.
        Only safetensors weights are read (:func:`reload_folder`).
        """
        path = reload_folder(checkpoint, self.reload_root)
        new = load_reference(self.model_cfg, str(path), safetensors_only=True)
        old = self.current
        if (new.tokenizer_fingerprint, new.vocab_size) != (old.tokenizer_fingerprint, old.vocab_size):
            raise ConfigError(
                f"checkpoint {checkpoint!r} has tokenizer {new.tokenizer_fingerprint} / vocabulary {new.vocab_size}, "
                f"but the served model has {old.tokenizer_fingerprint} / {old.vocab_size}; clients checked those at "
                f"start, so a reload must keep them (start a new server for a different model family)"
            )

        def swap(job: Job) -> dict:
            new.model.to(self.device)
            self.current = new
            self.version += 1
            self.loaded_at = time.time()
            if self.device.type == "cuda":
                old.model.to("cpu")
                torch.cuda.empty_cache()
            return self.info()

        self._queue.put(Job(swap, future=done))  # waits for room: the loaded model is not thrown away

    def _load_and_queue_reward_swap(self, checkpoint: str, done: Future) -> None:
        """Load a new reward model (this thread, safetensors only) and queue its swap: requests queued before
        it are scored by the old model, later ones by the new; each answer names its version."""
        if self.reward is None:
            raise ConfigError("this server hosts no reward model (start it with --reward-model)")
        new = self._load_reward(str(reload_folder(checkpoint, self.reload_root)))

        def swap(job: Job) -> dict:
            self.reward = new  # the old model is freed with its last reference
            self.reward_version += 1
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return self.info()

        self._queue.put(Job(swap, future=done))

    # ------------------------------------------------------------------ state
    def load(self) -> tuple[int, int]:
        """(queued jobs, running jobs)."""
        with self._lock:
            return self._queue.qsize(), self._running

    def info(self) -> dict:
        c = self.current
        queued, running = self.load()
        dtype = next(c.model.parameters()).dtype
        return {
            "model": c.source,
            "version": self.version,
            "weights_hash": c.weights_hash,
            "checkpoint_step": c.step,
            "loaded_at": self.loaded_at,
            "vocab_size": c.vocab_size,
            "tokenizer_size": c.tokenizer_size,
            "tokenizer_fingerprint": c.tokenizer_fingerprint,
            "dtype": str(dtype).replace("torch.", ""),
            "device": str(self.device),
            "logprob_chunk_size": self.chunk_size,
            "limits": {"max_batch_tokens": self.max_batch_tokens, "max_queue": self.max_queue},
            "queue": {"queued": queued, "running": running},
            "jobs": dict(self.stats),
            "teacher": None if self.teacher is None else {
                "model": self.teacher.source, "version": 0, "weights_hash": self.teacher.weights_hash,
                "vocab_size": self.teacher.vocab_size, "tokenizer_size": self.teacher.tokenizer_size,
                "tokenizer_fingerprint": self.teacher.tokenizer_fingerprint},
            "reward": None if self.reward is None else {
                "model": self.reward.source, "version": self.reward_version, "label": self.reward_args.get("label"),
                "dtype": str(next(self.reward.model.parameters()).dtype).replace("torch.", ""),
                "batch_tokens": self.reward.batch_tokens},
        }

    def stop(self, timeout: Optional[float] = None) -> None:
        """Finish every queued job, then stop the worker thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
