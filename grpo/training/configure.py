"""Resolve a run's configuration: the typed schema (grpo/foundation/config.py) and the chosen algorithm's
options and defaults (the ALGORITHMS registry) put together.

    load_config(path, algo, overrides): defaults < algorithm defaults < YAML < --algo < key=value
    check_run(cfg, resume, parts):      what the run would refuse later, checked before any model loads
                                        (train.py: for --print-config and the run alike)
    probe_services(cfg):                the run's servers answer at start (ref.url), before any model loads
    needs_reference(path, overrides):   whether that run queries a reference model
    needs_reference_server(path, overrides): whether it needs a reference server started for it (not with
                                        LoRA's free reference: the policy with its adapters off)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from grpo.foundation.config import FILE_SOURCES, Config, ConfigError, auto_dtype
from grpo.foundation.config_rules import check_optimizer_states, config_warnings, distilling
from grpo.foundation.config_assembly import build_config, read_user_tree
from grpo.foundation.plugins import ALGORITHMS, REWARDS
from grpo.reference.handle import adapters_off_reference
from grpo.training.compose import Parts, compose


def load_config(
    path: Optional[str | Path] = None,
    algo: Optional[str] = None,
    overrides: Optional[list[str]] = None,
    tree: Optional[dict] = None,
) -> Config:
    """Resolve and validate; a wrong key or value raises ConfigError naming the valid choices. ``tree``: settings
    as Python data, the YAML file's shape (over the file, under ``overrides``)."""
    tree, name = read_user_tree(path, algo, overrides, tree)
    cfg = build_config(tree, ALGORITHMS.get(name))
    if cfg.model.dtype == "auto":  # resolved once, before anything reads it: every consumer sees a real dtype
        cfg.model.dtype = auto_dtype()
        check_optimizer_states(cfg)
    resolve_checkpoint_paths(cfg)
    return cfg


def resolve_checkpoint_paths(cfg: Config) -> None:
    """A model given as a run's checkpoint (``OUT/checkpoints/latest``, ``OUT/checkpoints``, ``OUT``) becomes its
    newest step folder, once: every consumer (the loaders, vLLM, a reference server, config.yaml) sees that folder."""
    from grpo.foundation.modeling import resolve_model_path

    cfg.model.name_or_path = resolve_model_path(cfg.model.name_or_path)
    if cfg.ref.model:
        cfg.ref.model = resolve_model_path(cfg.ref.model)


def check_output_dir(output_dir: str) -> None:
    """train.output_dir is a folder this process can write, or can be made under the nearest folder above it that
    exists (probed with a folder made and removed there): an unwritable one failed after the models had loaded,
    with a traceback."""
    path = Path(output_dir).expanduser().absolute()
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"train.output_dir={output_dir!r}: {str(probe)!r} is a file, not a folder; name another "
                          f"folder for the run")
    try:  # a folder made and removed at once: what the run will do there (os.access says yes to root everywhere)
        os.rmdir(tempfile.mkdtemp(prefix=".grpo-probe-", dir=probe))
    except OSError:
        raise ConfigError(f"train.output_dir={output_dir!r}: {str(probe)!r} is not writable here, so the "
                          f"run's folder {'cannot be made there' if probe != path else 'cannot hold its files'}; name "
                          f"a folder you can write, e.g. train.output_dir=runs/my-run") from None


def check_run(cfg: Config, resume: bool = False, parts: Optional[Parts] = None) -> Parts:
    """Everything the run would otherwise refuse later, checked before any model loads and without starting
    anything: names that must resolve (reward functions, the generation engine, the environment and its
    tools), loggers that must be installed, local model folders and data files that must exist, prompts
    that must split over the ranks, a checkpoint to resume. Raises ConfigError naming the fix; returns the
    run's plug-ins (``parts``, or those the config names)."""
    from grpo.foundation.modeling import check_model_path
    from grpo.training.metrics import logger_module

    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_ranks(cfg, world)
    check_output_dir(cfg.train.output_dir)
    parts = parts or compose(cfg)
    if cfg.rollout.engine == "vllm":
        from grpo.rollout.vllm_engine import check_tensor_parallel

        check_tensor_parallel(cfg.rollout.vllm.tensor_parallel_size, world)
    for target in cfg.logging.report_to:
        logger_module(target)
    if parts.env is not None:
        try:
            parts.env.check(cfg.env, cfg.sandbox, cfg.data.source)
        except ValueError as e:  # a bad option value of the environment's own
            raise ConfigError(str(e)) from e
    else:  # with an environment the rewards are its own
        for i, spec in enumerate(cfg.rewards):
            if spec.kind == "fn":
                check_python_reward(spec.fn, f"rewards[{i}].fn", cfg.train.output_dir)
                REWARDS.get(spec.fn, key=f"rewards[{i}].fn")
                parts.rewards.check_settings(f"rewards[{i}]", spec)
    for key in ("correctness", "format"):
        spec = getattr(cfg.eval, key)
        if spec is not None and spec.kind == "fn":
            REWARDS.get(spec.fn, key=f"eval.{key}.fn")
            parts.rewards.check_settings(f"eval.{key}", spec)
    if "required" in (cfg.sandbox.network, cfg.sandbox.isolation, cfg.sandbox.memory):  # asked for what the machine may not give
        parts.rewards.check_sandbox(cfg.sandbox)
    check_model_path("model.name_or_path", cfg.model.name_or_path)
    if cfg.model.attn_implementation == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError as e:
            raise ConfigError("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not "
                              "installed: pip install flash-attn --no-build-isolation (CUDA only), or use sdpa") from e
    if cfg.ref.model and not cfg.ref.url:
        check_model_path("ref.model", cfg.ref.model)
    check_teacher_paths(cfg)
    for i, spec in enumerate(cfg.rewards):
        if spec.kind == "model" and spec.where == "trainer":
            check_model_path(f"rewards[{i}].model", spec.model)
    d = cfg.data
    if d.source in FILE_SOURCES:
        for key in ("path", "eval_path"):
            path = getattr(d, key)
            if path and not any(c in path for c in "*?[") and "://" not in path and not Path(path).exists():
                raise ConfigError(f"data.{key}={path!r}: no such file ({str(Path(path).absolute())!r}); paths are "
                                  f"relative to the directory train.py runs in")
    if not cfg.env.name and d.source != "hub" and any(s.kind == "fn" for s in cfg.rewards):
        # a reward parameter no column fills (or a column clashing with one): what the Trainer refuses
        from grpo.data.sources import load_source

        item = load_source(d, cfg.train.seed)[0]
        parts.rewards.check(cfg.rewards, cfg.reward_pool, cfg.sandbox, [k for k in item if k != "prompt"])
    if resume:
        from grpo.training.checkpoint import checkpoint_to_resume

        checkpoint_to_resume(cfg.train.output_dir)
    return parts


def check_python_reward(name: str, key: str, output_dir: str) -> None:
    """A reward named ``fn#N`` is a Python function a ``grpo.train`` call registered in its own process (the run's
    config.yaml keeps its name, not its code): where it is not registered (train.py resuming such a run), say so
    and how to resume it, instead of the closest built-in name."""
    if "#" not in name or name in REWARDS:
        return
    raise ConfigError(f"{key}={name!r} is a Python function that grpo.train was given in another process: the run's "
                      f"config.yaml names it but cannot hold its code. Resume such a run from Python with the same "
                      f"function: train(<the same config>, rewards=[{name.split('#')[0]}, ...], resume=True, "
                      f"train={{'output_dir': {output_dir!r}}}) (docs/python-api.md)")


def check_teacher_paths(cfg: Config) -> None:
    """teacher.model and teacher.adapter name what exists, before any model loads (the teacher loads after the
    policy)."""
    from grpo.foundation.modeling import check_model_path, load_tokenizer, looks_local
    from grpo.foundation.tiny import is_builtin

    if cfg.teacher.model:
        check_model_path("teacher.model", cfg.teacher.model)
        local = [n for n in (cfg.teacher.model, cfg.model.name_or_path) if is_builtin(n) or looks_local(n)]
        if len(local) == 2:  # both on this machine: the tokenizers compared now (the hub's are, after loading)
            from grpo.foundation.config_rules import custom_chat_template
            from grpo.reference.teacher import check_same_tokenizer

            tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
            if (template := custom_chat_template(cfg.data)) is not None:  # as the trainer's tokenizer has it
                tokenizer.chat_template = template
            check_same_tokenizer(cfg, tokenizer)
    if cfg.teacher.adapter:
        from grpo.foundation.lora import ADAPTER_CONFIG, is_adapter_folder

        if not is_adapter_folder(cfg.teacher.adapter):
            where = Path(cfg.teacher.adapter).absolute()
            raise ConfigError(f"teacher.adapter={cfg.teacher.adapter!r}: {str(where)!r} is not a LoRA adapter folder "
                              f"({'no ' + ADAPTER_CONFIG + ' in it' if where.is_dir() else 'it does not exist'}); give "
                              f"a LoRA run's checkpoint folder (adapter_config.json + adapter_model.safetensors)")


def check_ranks(cfg: Config, world: int) -> None:
    """The step's prompts split evenly over the ranks."""
    if cfg.rollout.prompts_per_step % world:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                          f"number of ranks ({world})")


def probe_services(cfg: Config, parts: Optional[Parts] = None) -> None:
    """The servers this run queries answer at start (ReferenceServerError within ``ref.startup_wait`` seconds
    otherwise): the reference server, when the run uses a reference (``parts``' algorithm, or the config's) or a
    reward model hosted there; the distillation teacher's server."""
    from grpo.reference.http import check_reload, probe

    hosted = [s.name or str(s.model) for s in cfg.rewards if s.kind == "model" and s.where == "server"]
    a = cfg.algo
    why = [f"algorithm {a.name!r} takes the reference's log-probs (algo.beta={a.beta}, algo.kl_in_reward="
           f"{a.kl_in_reward})"] if (parts or compose(cfg)).algorithm.needs_reference else []
    why += [f"the reward model {name!r} is hosted there" for name in hosted]
    if cfg.ref.url and why:
        probe(cfg, why="; ".join(why))
        check_reload(cfg)
    if cfg.teacher.url and distilling(cfg):
        probe(cfg, teacher=True)


def run_warnings(cfg: Config, parts: Parts) -> list[str]:
    """What train.py and grpo.train print once before any model loads: the config's own warnings
    (``config_warnings``) and the servers the run's algorithm never asks."""
    out = config_warnings(cfg)
    if cfg.ref.url and not parts.algorithm.needs_reference:
        out.append(f"ref.url={cfg.ref.url!r} is never asked: algorithm {cfg.algo.name!r} uses no reference with "
                   f"algo.beta={cfg.algo.beta} and algo.kl_in_reward={cfg.algo.kl_in_reward}, so the server gets no "
                   f"request and no KL to it is logged; set algo.beta > 0 (e.g. algo.beta=0.04) to train against it, "
                   f"or leave ref.url out")
    return out


def needs_reference(config: Optional[str | Path], overrides: list[str]) -> bool:
    """Whether training ``config`` with ``overrides`` uses a reference model (its algorithm with its beta)."""
    cfg = load_config(config, None, overrides)
    return ALGORITHMS.get(cfg.algo.name)(cfg).needs_reference


def needs_reference_server(config: Optional[str | Path], overrides: list[str]) -> bool:
    """Whether a script should start a reference server for this run: it uses a reference, and that reference
    is not LoRA's free one (model.lora without ref.url / ref.model: the policy with its adapters off)."""
    cfg = load_config(config, None, overrides)
    return ALGORITHMS.get(cfg.algo.name)(cfg).needs_reference and not adapters_off_reference(cfg)
