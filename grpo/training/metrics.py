"""What the user sees: a step's metrics reduced over ranks (``step_metrics``), the progress bar,
metrics.jsonl, samples.jsonl, TensorBoard / W&B, and the final plot.

The JSONL files are appended to a line per record. A resumed run (``start_step > 0``) drops
the lines after its checkpoint's step (rewritten atomically: a temporary file, then a rename);
a fresh run (``start_step == 0``) into a folder that already holds them moves them aside to
``NAME.bak-<time>`` with a warning, as a rerun should never silently wipe an earlier run's
record. A partial last line (a write cut short by a kill or a full disk) is skipped with a
warning wherever the files are read.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch

from grpo.foundation.console import say
from grpo.foundation import rl_math, dist
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config, ConfigError


def logger_module(target: str) -> Any:
    """What ``logging.report_to``'s ``target`` writes with (TensorBoard's SummaryWriter, the wandb module), or
    a ConfigError naming the package to install (checked at start: grpo/training/configure.py check_run)."""
    try:
        if target == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter
        import wandb

        return wandb
    except ImportError as e:
        raise ConfigError(f"logging.report_to includes {target!r} but it is not installed: pip install {target} "
                          f"(in a checkout: pip install -e '.[{target}]', or '.[logging]' for both), or remove it "
                          f"from logging.report_to ({e})") from e


WANDB_RUN_ID = "wandb_run_id"  # OUT/wandb_run_id: the W&B run that --resume continues


def wandb_init_args(cfg: Config, out: Path, start_step: int) -> dict[str, Any]:
    """wandb.init's arguments: project, name, entity, tags; on --resume the run this output folder logged to."""
    lc = cfg.logging
    args: dict[str, Any] = {"project": lc.wandb_project, "dir": str(out)}
    args.update({k: v for k, v in (("name", lc.wandb_name), ("entity", lc.wandb_entity)) if v is not None})
    if lc.wandb_tags:
        args["tags"] = list(lc.wandb_tags)
    saved = out / WANDB_RUN_ID
    if start_step > 0 and saved.is_file():
        args.update(id=saved.read_text().strip(), resume="allow")
    return args


# what a step's console line and progress bar show, where the step logs it: (metric, label, format)
CONSOLE = (("reward/mean", "reward", ".3f"), ("kl", "kl", ".4g"),
           ("distill/reverse_kl", "distill_kl", ".4g"),  # on-policy distillation's (docs/distillation.md)
           ("completion/length_mean", "len", ".1f"), ("time/step", "s/step", ".2f"))


def console_fields(metrics: dict[str, Any]) -> dict[str, str]:
    """{label: formatted value} of the CONSOLE metrics this step logged."""
    return {label: f"{metrics[key]:{fmt}}" for key, label, fmt in CONSOLE
            if isinstance(metrics.get(key), (int, float))}


def console_line(step: int, max_steps: int, metrics: dict[str, Any]) -> str:
    """One plain line per step for logs without a progress bar: step, reward, KL, distillation's KL, length, time."""
    return " | ".join([f"step {step}/{max_steps}"] + [f"{k} {v}" for k, v in console_fields(metrics).items()])


class MetricsLogger:
    """Rank 0 writes; other ranks do nothing."""

    def __init__(self, cfg: Config, start_step: int = 0):
        self.cfg = cfg
        self.out = Path(cfg.train.output_dir)
        self.main = dist.is_main()
        self.bar = None
        self.tb = None
        self.wandb = None
        if not self.main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out / "metrics.jsonl"
        self.samples_path = self.out / "samples.jsonl"
        if start_step == 0:
            _set_aside([self.metrics_path, self.samples_path])
        else:
            _truncate_after(self.metrics_path, start_step)
            _truncate_after(self.samples_path, start_step)
        for target in cfg.logging.report_to:
            if target == "tensorboard":
                self.tb = logger_module(target)(str(self.out / "tensorboard"))
            elif target == "wandb":
                from grpo.foundation.config_assembly import to_dict

                self.wandb = logger_module(target).init(**wandb_init_args(cfg, self.out, start_step),
                                                        config=to_dict(cfg))
                (self.out / WANDB_RUN_ID).write_text(str(self.wandb.id))
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, dynamic_ncols=True, desc="train")

    def log(self, step: int, metrics: dict[str, float], samples: Optional[list[dict[str, Any]]] = None,
            advance: bool = True) -> None:
        """Write one step's record; ``advance=False`` for a record that is not a training step (step-0 evaluation)."""
        if not self.main:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if samples:
            with open(self.samples_path, "a") as f:
                for s in samples:
                    f.write(json.dumps({"step": step, **s}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.bar is None and self.cfg.logging.progress_bar is False and advance:
            print(console_line(step, self.cfg.train.max_steps, metrics), flush=True)
        if self.bar is not None:
            self.bar.set_postfix(console_fields(metrics), refresh=False)
            self.bar.update(1 if advance else 0)

    def close(self) -> Optional[Path]:
        """Finish outputs; returns the plot's path (rank 0, when plotting is on)."""
        if not self.main:
            return None
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.cfg.logging.plot:
            return plot_metrics(self.metrics_path, self.out / "metrics.png")
        return None


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _warn(message: str) -> None:
    say(f"warning: {message}", err=True)


def _read_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, record) pairs of a JSONL file; a partial last line is skipped with a warning,
    a bad line before it is an error naming the file and line."""
    lines = [(i, ln) for i, ln in enumerate(path.read_text(errors="replace").splitlines(), 1) if ln.strip()]
    out = []
    for k, (i, ln) in enumerate(lines):
        try:
            out.append((ln, json.loads(ln)))
        except json.JSONDecodeError as e:
            if k < len(lines) - 1:
                raise ValueError(f"{path} line {i} is not valid JSON ({e}); repair or remove that line") from e
            _warn(f"{path}: skipped its partial last line {i} (a write cut short by a kill or a full disk): "
                  f"{ln[:60]!r}")
    return out


def _write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` all at once: a crash or a full disk leaves the old file whole."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _truncate_after(path: Path, step: int) -> None:
    """On resume, drop lines of steps after the checkpoint so no step appears twice."""
    if not path.exists():
        return
    keep = [ln for ln, rec in _read_lines(path) if rec.get("step", 0) <= step]
    _write_atomic(path, "".join(ln + "\n" for ln in keep))


def _set_aside(paths: list[Path]) -> None:
    """A fresh run into a folder with an earlier run's logs: move them to ``NAME.bak-<time>``, never delete."""
    old = [p for p in paths if p.exists() and p.stat().st_size > 0]
    if not old:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for p in old:
        dest, n = p.with_name(f"{p.name}.bak-{stamp}"), 1
        while dest.exists():
            dest, n = p.with_name(f"{p.name}.bak-{stamp}-{n}"), n + 1
        os.replace(p, dest)
        moved.append(f"{p.name} -> {dest.name}")
    _warn(f"{old[0].parent} already holds an earlier run's logs; this run starts at step 0, so they were moved "
          f"aside ({', '.join(moved)}). To continue that run instead, pass --resume; to keep runs apart, "
          f"set train.output_dir to a new folder.")


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl (a partial last line is skipped with a warning)."""
    return [rec for _, rec in _read_lines(Path(path))]


def plot_metrics(metrics_path: Path, png: Path) -> Optional[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path) if metrics_path.exists() else []
    if not rows:
        return None
    panels = [("reward/mean", "reward"), ("completion/length_mean", "completion length"), ("kl", "KL")]
    if any(r.get("eval/accuracy") is not None for r in rows):
        panels.append(("eval/accuracy", "held-out accuracy (greedy)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3))
    for ax, (key, title) in zip(axes, panels):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key.startswith("eval/") else None)
        else:
            ax.text(0.5, 0.5, "not computed", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


class SamplerGap:
    """|log pi_trainer - log pi_sampler| over a step's policy tokens: how far the generation engine's own
    log-probs (other kernels, other precision) are from the trainer's for the same tokens under the same
    weights. Logged as ``sampler_gap/mean`` and ``sampler_gap/max`` when the engine reports log-probs."""

    def __init__(self) -> None:
        self.acc = torch.zeros(2, dtype=torch.float64)  # sum, count
        self.max = torch.zeros(1, dtype=torch.float64)

    def add(self, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> None:
        d = (trainer_logp.detach().double() - sampler_logp.double()).abs().cpu() * mask.double().cpu()
        self.acc += torch.stack([d.sum(), mask.double().sum().cpu()])
        if d.numel():
            self.max = torch.maximum(self.max, d.max().reshape(1))

    def metrics(self) -> dict[str, float]:
        """Collective: every rank calls it."""
        acc, mx = dist.all_reduce_sum(self.acc), dist.all_reduce_max(self.max)
        if acc[1] == 0:
            return {}
        return {"sampler_gap/mean": float(acc[0] / acc[1]), "sampler_gap/max": float(mx[0])}


def step_metrics(batch: RolloutBatch, stats: dict[str, list[torch.Tensor]], loss_sum: torch.Tensor,
                 grad_norm: float, lr: float, hook_metrics: dict[str, float], timings: dict[str, float],
                 entropy: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> dict[str, float]:
    """One step's metrics, reduced over ranks (collective: every rank calls it).

    ``batch`` is the scored batch (rewards, advantages); ``stats`` the loss's (sum, count) pairs;
    ``hook_metrics`` what the algorithm's hooks logged; timings are the slowest rank's.
    """
    m: dict[str, float] = {}

    def moments(prefix: str, x: torch.Tensor, with_range: bool = False, mask: Optional[torch.Tensor] = None) -> None:
        mean, std = rl_math.global_mean_std(x.reshape(-1), "population", mask=mask)
        m[f"{prefix}/mean"], m[f"{prefix}/std"] = float(mean), float(std)
        if with_range:
            m[f"{prefix}/max"] = float(dist.all_reduce_max(x.max().double().reshape(1)))
            m[f"{prefix}/min"] = -float(dist.all_reduce_max((-x.min()).double().reshape(1)))

    if batch.rewards is not None:  # (None: a run without reward functions, opd's)
        moments("reward", batch.rewards)
    for name, vals in batch.reward_terms.items():  # nan: rows the source skipped (None), left out
        scored = ~torch.isnan(vals.reshape(-1))
        moments(f"reward/{name}", torch.nan_to_num(vals.reshape(-1), nan=0.0), mask=scored)
    adv = batch.advantages if batch.advantages.dim() == 1 else batch.advantages[batch.mask.bool()]
    moments("advantage", adv, with_range=True)
    if batch.rewards is not None:
        zero = rl_math.uniform_groups(batch.rewards, batch.group_size).double()
        zs = dist.all_reduce_sum(torch.stack([zero.sum(), torch.tensor(float(zero.numel()), dtype=torch.float64)]))
        m["advantage/zero_group_frac"] = float(zs[0] / zs[1])
    # lengths as generated (DAPO's overlong filter zeroes the masks of truncated completions)
    lengths = torch.tensor([float(len(c)) for c in batch.completion_ids], dtype=torch.float64)
    m["completion/length_mean"] = float(rl_math.global_mean_std(lengths)[0])
    m["completion/length_max"] = float(dist.all_reduce_max(lengths.max().reshape(1)))
    m["completion/truncated_frac"] = float(rl_math.global_mean_std(batch.truncated.double())[0])
    if entropy is not None:
        m["entropy"] = float(rl_math.global_mean_std(entropy, mask=mask)[0])
    if stats:
        names = sorted(stats)
        red = dist.all_reduce_sum(torch.stack([torch.stack(stats[n]) for n in names]))
        for i, n in enumerate(names):  # sum / count; 0 where nothing was counted
            m[n] = float(red[i, 0] / red[i, 1]) if float(red[i, 1]) > 0 else 0.0
    m["loss"] = float(dist.all_reduce_sum(loss_sum.reshape(1)))
    m["grad_norm"] = grad_norm
    m["lr"] = lr
    for k, v in hook_metrics.items():
        m[k] = float(v)
    names = sorted(timings)  # the slowest rank sets the pace
    t = dist.all_reduce_max(torch.tensor([timings[n] for n in names], dtype=torch.float64))
    for i, n in enumerate(names):
        m[f"time/{n}"] = float(t[i])
    tokens = dist.all_reduce_sum(torch.tensor(float(batch.mask.sum()) + sum(len(p) for p in batch.prompt_ids),
                                              dtype=torch.float64))
    m["tokens_per_sec"] = float(tokens) / max(m["time/step"], 1e-9)
    return m


def log_samples(batch: Optional[RolloutBatch], cfg: Config, step: int) -> list[dict]:
    """A few (prompt, completion, reward) triples of the step's batch every ``logging.log_every`` steps."""
    n = cfg.logging.samples_per_log
    if batch is None or not n or step % cfg.logging.log_every:
        return []
    return [{"prompt": batch.prompt_text[i], "completion": batch.completion_text[i], "reward": None if batch.rewards is None else float(batch.rewards[i])}
            for i in range(min(n, len(batch)))]
