"""What the user sees: reporting targets that are missing fail with a clear message; the plot."""

from __future__ import annotations

import sys
import json

import pytest

from grpo.foundation.config import ConfigError
from grpo.training.configure import load_config
from grpo.training.metrics import MetricsLogger, plot_metrics


@pytest.mark.parametrize("target", ["tensorboard", "wandb"])
def test_missing_report_target_is_a_clear_error(tmp_path, monkeypatch, target):
    # a None entry in sys.modules makes the import fail, installed or not
    monkeypatch.setitem(sys.modules, "wandb" if target == "wandb" else "torch.utils.tensorboard", None)
    cfg = load_config(overrides=[f"logging.report_to=[{target}]", f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=f"'{target}' but it is not installed: pip install"):
        MetricsLogger(cfg)


def test_metrics_lines_and_plot(tmp_path):
    cfg = load_config(overrides=[f"train.output_dir={tmp_path}", "logging.progress_bar=false"])
    log = MetricsLogger(cfg)
    for step in range(1, 4):
        log.log(step, {"reward/mean": step / 10, "completion/length_mean": 3.0, "time/step": 0.1},
                [{"prompt": "1=", "completion": "1", "reward": 1.0}])
    png = log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["reward/mean"] == pytest.approx(0.3)
    assert png is not None and png.stat().st_size > 1000
    # a resumed logger drops lines after its start step (no duplicated steps)
    MetricsLogger(load_config(overrides=[f"train.output_dir={tmp_path}", "logging.progress_bar=false"]), start_step=2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert plot_metrics(tmp_path / "missing.jsonl", tmp_path / "x.png") is None
