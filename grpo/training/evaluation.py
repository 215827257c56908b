"""Held-out evaluation: greedy accuracy, format rate, completion length, and mean@k / pass@k.

Used by the trainer every ``eval.every`` steps (metrics ``eval/...`` logged with the
training metrics) and by scripts/eval.py (which also writes one JSONL record per
problem). Every rank evaluates its share of the problems; the sums are reduced over
ranks, so the numbers do not depend on the number of ranks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from grpo.foundation import dist
from grpo.foundation.config import Config, ConfigError, RewardSpec
from grpo.data.sources import PromptDataset, PromptSource, Subset, load_eval_source, load_source, prompt_text
from grpo.rollout.engine import SamplingParams
from grpo.rollout.service import RolloutService
from grpo.scoring.combined import CombinedReward


@dataclass
class EvalResult:
    metrics: dict[str, float]
    records: list[dict[str, Any]]  # this rank's problems, one record each


def eval_source(cfg: Config, split: str = "eval") -> PromptSource:
    """The held-out problems (``split="eval"``) or the training ones (``"train"``), first ``eval.limit`` of them."""
    if split == "train":
        source = load_source(cfg.data, cfg.train.seed)
    elif split == "eval":
        source = load_eval_source(cfg.data, cfg.train.seed)
        if source is None:
            raise ConfigError("no held-out data: set data.eval_path, data.eval_split or data.eval_holdout")
    else:
        raise ConfigError(f"split={split!r} is invalid: choose 'eval' (the held-out data) or 'train'")
    if cfg.eval.limit is not None and cfg.eval.limit < len(source):
        source = Subset(source, list(range(cfg.eval.limit)))
    return source


def write_records(records: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")
    return path


class Evaluator:
    """Scores a model on a fixed set of prompts with the configured correctness (and format) reward."""

    def __init__(self, cfg: Config, rollout: RolloutService, source: Optional[PromptSource] = None,
                 rewards: type = CombinedReward):
        """``rewards``: the class that combines reward sources (the composed run's)."""
        self.cfg, self.rollout, self.tokenizer = cfg, rollout, rollout.tokenizer
        source = eval_source(cfg) if source is None else source
        self.dataset = PromptDataset.build(source, self.tokenizer, cfg.data, cfg.rollout.max_prompt_length)
        self.correct_spec: RewardSpec = cfg.eval.correctness or cfg.rewards[0]
        specs = [self.correct_spec] + ([cfg.eval.format] if cfg.eval.format else [])
        self.scorer = rewards(specs, cfg.reward_pool, ref=cfg.ref, sandbox=cfg.sandbox)
        self.names = [t.name for t in self.scorer.terms]
        e = cfg.eval
        length = e.max_completion_length or cfg.rollout.max_completion_length
        self.sampled = SamplingParams.from_rollout(cfg.rollout, max_tokens=length, temperature=e.temperature)
        self.greedy = self.sampled.greedy()

    def _score(self, rows: list[int], tokens: list[list[int]], k: int) -> tuple[list[str], dict[str, list[float]]]:
        """Completion texts and per-function values; ``rows`` are dataset indices, each repeated k times in tokens."""
        items = [self.dataset.items[i] for i in rows for _ in range(k)]
        prompts = self.tokenizer.batch_decode([self.dataset.ids[i] for i in rows for _ in range(k)])
        texts = self.rollout.decode(tokens)
        keys = [c for c in items[0] if c != "prompt"]
        _, per_fn = self.scorer(prompts, texts, {c: [it.get(c) for it in items] for c in keys},
                                raw_prompts=[it["prompt"] for it in items], completion_ids=tokens)
        return texts, per_fn

    @torch.no_grad()
    def run(self) -> EvalResult:
        cfg, e = self.cfg, self.cfg.eval
        t0 = time.perf_counter()
        mine = list(range(dist.rank(), len(self.dataset), dist.world_size()))
        acc_name = self.names[0]
        fmt_name = self.names[1] if len(self.names) > 1 else None
        sums = torch.zeros(7, dtype=torch.float64)  # n, correct, format, length, truncated, sample-correct, pass
        records = []
        batches = [mine[s : s + e.batch_size] for s in range(0, len(mine), e.batch_size)]
        batches += [[]] * (self.rollout.collective_rounds(len(batches)) - len(batches))  # ZeRO-3: as many as any rank
        for rows in batches:
            prompts = [self.dataset.ids[i] for i in rows]
            comp = self.rollout.generate(prompts, self.greedy, n=1)
            many = self.rollout.generate(prompts, self.sampled, n=e.k) if e.k > 1 else None
            if not rows:
                continue
            texts, vals = self._score(rows, comp.tokens, 1)
            ok = [v >= e.threshold for v in vals[acc_name]]
            fmt = [v > 0 for v in vals[fmt_name]] if fmt_name else [False] * len(rows)
            sample_ok = [[] for _ in rows]
            if many is not None:
                _, svals = self._score(rows, many.tokens, e.k)
                sample_ok = [[v >= e.threshold for v in svals[acc_name][j * e.k : (j + 1) * e.k]] for j in range(len(rows))]
            for j, i in enumerate(rows):
                n_tok = len(comp.tokens[j])
                sums += torch.tensor([1, ok[j], fmt[j], n_tok, bool(comp.truncated[j]), sum(sample_ok[j]),
                                      any(sample_ok[j])], dtype=torch.float64)
                item = self.dataset.items[i]
                record = {"index": i, "prompt": prompt_text(self.tokenizer, item, cfg.data), "completion": texts[j],
                          **{c: v for c, v in item.items() if c != "prompt"},
                          "correct": ok[j], "reward": vals[acc_name][j],
                          "format": fmt[j] if fmt_name else None, "length": n_tok,
                          "truncated": bool(comp.truncated[j])}
                if e.k > 1:
                    record[f"correct_of_{e.k}"] = sum(sample_ok[j])
                records.append(record)
        n, correct, fmt_ok, length, trunc, s_ok, passed = dist.all_reduce_sum(sums).tolist()
        n = max(n, 1.0)
        metrics = {"eval/accuracy": correct / n, "eval/length_mean": length / n, "eval/truncated_frac": trunc / n,
                   "eval/num_problems": n, "eval/dropped_prompts": float(self.dataset.dropped)}
        if fmt_name:
            metrics["eval/format_rate"] = fmt_ok / n
        if e.k > 1:
            metrics[f"eval/mean@{e.k}"] = s_ok / (n * e.k)
            metrics[f"eval/pass@{e.k}"] = passed / n
        for name, count in self.scorer.pop_metrics().items():
            metrics["eval/" + name.removeprefix("reward/")] = count
        metrics["eval/time"] = time.perf_counter() - t0
        return EvalResult(metrics, records)

    def __call__(self, step: int, out_dir: Optional[Path] = None) -> dict[str, float]:
        """Evaluate the rollout service's policy (collective); rank 0 writes every problem's record to
        ``out_dir/eval/step-N.jsonl``."""
        result = self.run()
        records = [r for part in dist.all_gather_object(result.records) for r in part]
        if out_dir is not None and dist.is_main():
            write_records(sorted(records, key=lambda r: r["index"]), Path(out_dir) / "eval" / f"step-{step}.jsonl")
        return result.metrics

    def due(self, step: int) -> bool:
        """Evaluate after this step? Every ``eval.every`` steps and after the last one."""
        every = self.cfg.eval.every
        return bool(every) and (step % every == 0 or step == self.cfg.train.max_steps)

    def close(self) -> None:
        self.scorer.close()
