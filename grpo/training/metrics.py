"""What the user sees: progress bar, metrics.jsonl, samples.jsonl, TensorBoard / W&B, final plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from grpo.foundation import dist
from grpo.foundation.config import Config, ConfigError


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
        _truncate_after(self.metrics_path, start_step)
        _truncate_after(self.samples_path, start_step)
        for target in cfg.logging.report_to:
            if target == "tensorboard":
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError as e:
                    raise ConfigError(
                        "logging.report_to includes 'tensorboard' but it is not installed: pip install tensorboard"
                    ) from e
                self.tb = SummaryWriter(str(self.out / "tensorboard"))
            elif target == "wandb":
                try:
                    import wandb
                except ImportError as e:
                    raise ConfigError("logging.report_to includes 'wandb' but it is not installed: pip install wandb") from e
                from grpo.foundation.config import to_dict

                self.wandb = wandb.init(project=cfg.logging.wandb_project, config=to_dict(cfg), dir=str(self.out))
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
        if self.bar is not None:
            post = {"reward": f"{metrics.get('reward/mean', float('nan')):.3f}",
                    "len": f"{metrics.get('completion/length_mean', float('nan')):.1f}",
                    "s/step": f"{metrics.get('time/step', float('nan')):.2f}"}
            if "kl" in metrics:
                post["kl"] = f"{metrics['kl']:.4f}"
            self.bar.set_postfix(post, refresh=False)
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


def _truncate_after(path: Path, step: int) -> None:
    """On resume, drop lines of steps after the checkpoint so no step appears twice."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
    path.write_text("".join(ln + "\n" for ln in keep))


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


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
