"""What a Trainer is built from, piece by piece: the data, the policy (partitioned under ZeRO-3), multi-turn
rollouts, and the lines printed at start."""

from __future__ import annotations

from typing import Any, Callable, Optional

from grpo.foundation.console import say
from grpo.data.sources import (PromptDataset, PromptSampler, check_template_kwargs, describe_unusable, is_chat,
                               load_source)
from grpo.data.tasks import system_prompt
from grpo.foundation import dist
from grpo.foundation.config import Config, ConfigError
from grpo.foundation.config_rules import custom_chat_template
from grpo.foundation.logprobs import check_head
from grpo.foundation.modeling import load_policy, load_tokenizer
from grpo.rollout.environment import EnvSetup
from grpo.rollout.multiturn import MultiTurnRollout
from grpo.rollout.stream import Stream
from grpo.training import deepspeed_engine as ds
from grpo.training.partitioned import load_partitioned


def make_env_setup(cfg: Config, setup: type = EnvSetup) -> Optional[EnvSetup]:
    """The run's environment and tool box (``setup``: the class that builds them, the composed run's), or None for
    single-turn rollouts."""
    if not cfg.env.name:
        return None
    try:
        return setup(cfg.env, cfg.sandbox)
    except ValueError as e:  # a bad option value of the environment's own
        raise ConfigError(str(e)) from e


def data(cfg: Config, env: Any) -> tuple[Any, PromptDataset, PromptSampler]:
    """(tokenizer, the prompts, their seeded sampler): a dataset, or the environment's own tasks."""
    tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    if (template := custom_chat_template(cfg.data)) is not None:  # data.chat_template: a template or a file
        tokenizer.chat_template = template
    source = env.tasks(cfg.env.num_examples, cfg.data.seed) if cfg.data.source == "env" else load_source(
        cfg.data, cfg.train.seed)
    dataset = PromptDataset.build(source, tokenizer, cfg.data, cfg.rollout.max_prompt_length)
    check_template_kwargs(tokenizer, cfg.data, bool(cfg.env.name) or any(is_chat(item, cfg.data)
                                                                        for item in dataset.items))
    return tokenizer, dataset, PromptSampler(len(dataset), cfg.train.seed, cfg.data.shuffle)


def policy(cfg: Config, world: int, load: Callable[[Any], Any] = load_policy) -> tuple[Any, Optional[dict]]:
    """(the policy model, ZeRO-3's DeepSpeed config when it is built partitioned, else None). ZeRO-3 over several
    ranks builds it partitioned, so no rank ever holds the whole model; otherwise ``load`` loads it (LoRA, which
    ZeRO-3 refuses, too)."""
    zero3 = ds.deepspeed_config(cfg) if cfg.train.zero_stage == 3 and cfg.train.zero3_init and world > 1 else None
    if zero3 is not None:
        return load_partitioned(cfg, cfg.model.name_or_path, zero3), zero3
    model = load(cfg.model)
    check_head(model)  # the log-probs here are the model's own (a head that scales its logits is known)
    return model, None


def multiturn(cfg: Config, rollout: Any, env: Any) -> Optional[MultiTurnRollout]:
    """Multi-turn rollouts with the environment (None without one)."""
    if env is None:
        return None
    return MultiTurnRollout(
        rollout, env.factory, cfg.rollout.max_turns, cfg.rollout.max_trajectory_tokens, stop=cfg.env.stop,
        system_prompt=system_prompt(cfg.data.system_prompt), prefill=cfg.data.prefill or "",
        template_kwargs=cfg.data.chat_template_kwargs,
        tool_counts=env.toolbox.pop_counts, watchdog_s=cfg.env.watchdog_s,
        max_prompt_length=cfg.rollout.max_prompt_length, env_threads=cfg.env.tool_workers)


def stream(cfg: Config, rollout: Any, dataset: PromptDataset, sampler: PromptSampler, rank: int,
           world: int) -> Optional[Stream]:
    """``rollout.max_staleness`` >= 1: the step's groups come from a Stream over this rank's share of the data (every
    rank draws the same global batches, so every rank's feed asks for as many as the others'); None: K = 0."""
    K = cfg.rollout.max_staleness
    if not K:
        return None
    if rollout.setup.synced:
        raise ConfigError(f"rollout.max_staleness={K} with train.zero_stage=3 over {world} ranks: ZeRO-3 makes every "
                          f"decode step a collective, and streamed steps end at different decode steps on each rank; "
                          f"use train.zero_stage 0-2, or rollout.max_staleness=0")

    def feed(n: int) -> list[tuple[list[int], int]]:
        return [(dataset.ids[i], i) for i in sampler.rank_batch(n * world, rank, world)]

    return Stream(rollout.engine, rollout.params, cfg.rollout.num_generations, cfg.rollout.prompts_per_step // world,
                  K, feed, topk=cfg.logging.audit_top_k if cfg.logging.audit_every else 0)


def announce(cfg: Config, model: Any, device: Any, dataset: PromptDataset, multi_turn: bool) -> None:
    """The start-up lines of the main rank: a context the run would overrun, the policy, the prompts dropped."""
    if not dist.is_main():
        return
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    length_key = "max_trajectory_tokens" if multi_turn else "max_completion_length"
    longest = cfg.rollout.max_prompt_length + getattr(cfg.rollout, length_key)
    if context and longest > context:
        say(f"config warning: rollout.max_prompt_length + rollout.{length_key} = {longest} tokens, beyond the "
            f"model's context of {context} (max_position_embeddings): the longest sequences would run past the "
            f"positions it was trained on", err=True)
    say(f"policy {cfg.model.name_or_path}: {cfg.model.dtype} on {device}"
        f"{', gradient checkpointing' if cfg.model.gradient_checkpointing else ''}")
    if dataset.dropped:
        say(f"dropped {dataset.dropped} prompts longer than rollout.max_prompt_length")
    if dataset.unusable:
        say(f"data: {describe_unusable(dataset.unusable)}: null, empty or not text")
