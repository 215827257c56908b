"""The policy on a DeepSpeed engine: its config, optimizer and schedule, and every DeepSpeed workaround.

The trainer calls only what is here to touch DeepSpeed:
    build_engine(cfg, model)       -> (engine, scheduler)
    begin_micro_batch(engine)      before each micro-batch's forward (ZeRO's gradient accumulation)
    stage0_grad_norm / grad_norm   the step's global gradient norm (DeepSpeed reports none without ZeRO)
    discard_gradients(engine)      drop a step's gradients without an update (no ZeRO; the watchdog)
    reset_optimizer_state(engine)  Adam moments and step counts start afresh
    partitions_weights(engine)     ZeRO-3: no rank holds the whole model
    (with frozen weights, e.g. LoRA's base, checkpoints leave every one of them out: see build_engine)
"""

from __future__ import annotations

import math
import os
import sys
import types
from typing import Optional

import torch

from grpo.foundation import dist
from grpo.foundation.config import Config


def lr_lambda(cfg: Config):
    warm, total, kind = cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.lr_schedule

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def make_adamw(params, **kwargs) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where it exists (CPU and GPU): one pass over each tensor, no
    per-parameter temporaries (0.1 s instead of 0.6 s a step for 135M parameters on one CPU core);
    the same update as the default implementation."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, **kwargs)


def deepspeed_config(cfg: Config) -> dict:
    t = cfg.train
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": 1,  # we mark the boundary ourselves (any number of micro-batches)
        "zero_optimization": {"stage": t.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if t.grad_clip > 0:
        ds["gradient_clipping"] = t.grad_clip
    if t.optimizer_states == "bf16" and t.zero_stage == 0:
        pass  # no bf16 section: no fp32 master copy, and AdamW's moments take the bf16 weights' dtype (pure bf16)
    elif cfg.model.dtype == "bf16" and cfg.model.lora is None:
        # (with LoRA the base stays bf16 and the fp32 adapters train in DeepSpeed's fp32 mode)
        # check_grad_overflow: ZeRO skips an update whose gradient norm is not finite (fp32 and fp16 always do)
        ds["bf16"] = {"enabled": True, "check_grad_overflow": True}
        if t.optimizer_states == "bf16":  # ZeRO 1-3: bf16 master weights, gradients and Adam moments
            ds["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    elif cfg.model.dtype == "fp16":
        ds["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return ds


def init_distributed() -> None:
    """The process group (a world of one without the launcher).

    Without CUDA, DeepSpeed would compile its shared-memory all-reduce op at start (about 45 s on a fresh
    install, every rank waiting on the build's lock) and give each rank a ~70 MB /dev/shm buffer that it never
    removes; only its inference all-reduce uses them (training's all-reduces go through torch.distributed), so
    it is not built."""
    import importlib

    import deepspeed

    # the module itself: deepspeed.comm re-exports the name torch, so `import deepspeed.comm.torch as m` gives torch
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    if not torch.cuda.is_available() and hasattr(ds_torch, "build_shm_op"):
        ds_torch.build_shm_op = lambda: None
    dist.default_single_process_env()
    deepspeed.init_distributed(dist_backend=None)


def share_cpu_threads() -> None:
    """Ranks on one CPU machine split its cores instead of each grabbing all of them; on CUDA one host thread
    (``dist.host_threads``; ``OMP_NUM_THREADS`` overrides both)."""
    dist.host_threads(torch.cuda.is_available(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size())))


# DeepSpeed's Muon modules and the names it imports from them in a run with another optimizer
MUON_MODULES = {"deepspeed.runtime.zero.muon.muon_optimizer": ("MuonWithAuxAdam",),
                "deepspeed.runtime.zero.muon.original_muon": ("muon_update", "adam_update")}


def skip_deepspeed_muon() -> None:
    """DeepSpeed asks whether the optimizer is its Muon (the ZeRO optimizer check, ZeRO's gradient reduction, the
    bf16 optimizer) and ZeRO-1/2 fetch its update function at every gradient partition, by importing its Muon
    modules, whose ``@torch.compile`` kernels load torch's compiler stack: 550 modules (networkx, inductor),
    0.9-1.8 s of a CPU core in every process that builds such an engine. The optimizer here is always AdamW
    (make_adamw), never Muon: the modules are stand-ins whose class nothing is an instance of (as nothing is of
    the real one here) and whose functions are never called. Left alone where the real ones are loaded."""
    if any(name in sys.modules for name in MUON_MODULES):
        return

    def unavailable(*args, **kwargs):
        raise RuntimeError("DeepSpeed's Muon is not loaded in a process that runs the trainer (it trains with AdamW: "
                           "grpo.training.deepspeed_engine.skip_deepspeed_muon)")

    for name, attrs in MUON_MODULES.items():
        stub = types.ModuleType(name, "A stand-in for DeepSpeed's Muon (grpo.training.deepspeed_engine."
                                      "skip_deepspeed_muon): the trainer's optimizer is AdamW.")
        for attr in attrs:
            setattr(stub, attr, type(attr, (), {"__init__": unavailable}) if attr[0].isupper() else unavailable)
        sys.modules[name] = stub


def build_engine(cfg: Config, model: torch.nn.Module):
    """(engine, lr scheduler) for ``model`` with AdamW and the configured schedule."""
    import deepspeed

    skip_deepspeed_muon()
    t = cfg.train
    # Only what trains reaches the optimizer (LoRA: the adapters; frozen layers have no state to keep).
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(trainable, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                           weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    ds_config = deepspeed_config(cfg)
    if t.zero_stage == 3:
        mark_moe_leaves(model)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds_config)
    if len(trainable) < sum(1 for _ in model.parameters()):
        _exclude_tied_frozen_weights(engine)
    if dist.world_size() == 1 and t.zero_stage == 0 and "bf16" not in ds_config and "fp16" not in ds_config:
        # One rank has nothing to all-reduce, but DeepSpeed would still copy every gradient into a
        # flat bucket and back at each step (one more model-sized buffer at the memory peak).
        engine.enable_backward_allreduce = False
    return engine, scheduler


def mark_moe_leaves(model: torch.nn.Module) -> list[str]:
    """ZeRO-3: a mixture-of-experts block (transformers' ``*SparseMoeBlock``: Mixtral, Qwen2-MoE, Qwen3-MoE, ...)
    becomes a leaf of DeepSpeed's parameter hooks, gathered whole on entry. Its experts run in an order that
    changes with the routing, and transformers' experts index one 3-D weight per expert, so the per-module hooks
    reduced that weight's gradient more than once (DeepSpeed's ``params_in_bucket`` assertion). The classes marked."""
    from deepspeed.utils import set_z3_leaf_modules

    classes = sorted({type(m) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")},
                     key=lambda c: c.__name__)
    if classes:
        set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]


def _exclude_tied_frozen_weights(engine) -> None:
    """``save_checkpoint(exclude_frozen_parameters=True)`` drops frozen weights by their ``named_parameters`` names,
    which list a tied weight once: its other name (``lm_head.weight`` tied to the embeddings) stayed in every
    checkpoint, a vocabulary-sized matrix (113 MB for SmolLM2-135M) beside a LoRA adapter of a few MB."""
    plain = engine.module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters: bool = False, **kwargs):
        sd = plain(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for n, p in engine.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    sd.pop(n, None)
        return sd

    engine.module_state_dict = module_state_dict


def begin_micro_batch(engine) -> None:
    """What ``DeepSpeedEngine.forward`` does first. Our forwards call ``engine.module`` (the log-prob
    path needs the hidden states, not the logits), so the ZeRO optimizer is told here that a new
    micro-batch starts; without it ZeRO-3 overwrites the gradient of the previous micro-batches
    instead of adding to it."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(engine.optimizer, ZeROOptimizer):
        engine.optimizer.clear_backward_seen_flag()


def stage0_grad_norm(engine, zero_stage: int) -> Optional[float]:
    """DeepSpeed reports no norm without ZeRO; the (already reduced) grads give it. Call it before
    ``engine.step()``, which clears them."""
    if zero_stage != 0:
        return None
    grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    # one multi-tensor kernel, accumulated in fp32 (no fp32 copy of each bf16 gradient); one host read
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))))


def grad_norm(engine, stage0_norm: Optional[float]) -> float:
    """The last step's global gradient norm (DeepSpeed's, or ``stage0_grad_norm``'s without ZeRO)."""
    gn = engine.get_global_grad_norm()
    gn = stage0_norm if gn is None else gn
    return float(gn) if gn is not None else float("nan")


def discard_gradients(engine) -> None:
    """Drop the step's accumulated gradients without an update (no ZeRO: the module's and the optimizer's)."""
    engine.zero_grad()
    engine.optimizer.zero_grad(set_to_none=True)


def reset_optimizer_state(engine) -> None:
    """Adam moments and step counts start afresh at the next step (ZeRO wraps the torch optimizer)."""
    opt = engine.optimizer
    getattr(opt, "optimizer", opt).state.clear()


def partitions_weights(engine) -> bool:
    return bool(engine.zero_optimization_partition_weights())
