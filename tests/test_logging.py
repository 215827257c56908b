"""What the user sees: reporting targets that are missing fail with a clear message; the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.foundation.config import ConfigError
from grpo.training.configure import load_config
from grpo.training.metrics import MetricsLogger, plot_metrics, read_metrics
from tests.patience import LAUNCH_S


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


def _cfg(out):
    return load_config(overrides=[f"train.output_dir={out}", "logging.progress_bar=false", "logging.plot=false"])


def _lines():
    return "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(1, 4))


def test_a_partial_last_line_is_skipped_on_read_and_on_resume(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_lines() + '{"step": 4, "reward/me')  # killed mid-write (or the disk filled up)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert "skipped its partial last line 4" in capsys.readouterr().err
    log = MetricsLogger(_cfg(tmp_path), start_step=3)  # --resume from step 3
    log.log(4, {"reward/mean": 0.4})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    assert path.read_text().endswith('"reward/mean": 0.4}\n')
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')  # not the last line: an error naming the file and line
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not valid JSON"):
        read_metrics(path)


def test_the_resume_rewrite_is_atomic_a_full_disk_leaves_the_file_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    before = _lines()
    path.write_text(before)
    # The rewrite runs in a child whose file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes any write past
    # 40 bytes fail with EFBIG, as a full disk would: in-place, the file would be left truncated.
    code = ("import resource, signal\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (40, resource.RLIM_INFINITY))\n"
            "from pathlib import Path\n"
            "from grpo.training.metrics import _truncate_after\n"
            f"_truncate_after(Path({str(path)!r}), 2)\n")
    proc = subprocess.run([sys.executable, "-B", "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=LAUNCH_S)
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr[-2000:]
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left behind


def test_a_fresh_run_moves_the_earlier_runs_logs_aside(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(_lines())
    (tmp_path / "samples.jsonl").write_text('{"step": 1, "completion": "7"}\n')
    log = MetricsLogger(_cfg(tmp_path))  # no --resume: starts at step 0
    log.log(1, {"reward/mean": 0.9})
    err = capsys.readouterr().err
    assert "--resume" in err and "train.output_dir" in err and "moved" in err
    (metrics_bak,) = tmp_path.glob("metrics.jsonl.bak-*")
    (samples_bak,) = tmp_path.glob("samples.jsonl.bak-*")
    assert metrics_bak.read_text() == _lines() and "completion" in samples_bak.read_text()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.9}]
    MetricsLogger(_cfg(tmp_path))  # a second rerun within the same second keeps both earlier files
    assert len(list(tmp_path.glob("metrics.jsonl.bak-*"))) == 2


def test_without_a_progress_bar_each_step_prints_one_line(tmp_path, capsys):
    cfg = load_config(overrides=[f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false",
                                 "train.max_steps=40"])
    log = MetricsLogger(cfg)
    log.log(0, {"eval/accuracy": 0.5}, advance=False)  # the step-0 evaluation is not a step
    log.log(1, {"reward/mean": 0.25, "kl": 0.00123, "completion/length_mean": 2.5, "time/step": 0.31})
    log.log(2, {"reward/mean": 0.5})
    log.log(3, {"reward/mean": 0.5, "distill/reverse_kl": 0.0421})  # issue 60 item 13: opd's metric to watch
    log.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert lines == ["step 1/40 | reward 0.250 | kl 0.00123 | len 2.5 | s/step 0.31", "step 2/40 | reward 0.500",
                     "step 3/40 | reward 0.500 | distill_kl 0.0421"]


def test_the_progress_bar_shows_the_console_lines_fields(tmp_path):
    """The bar's postfix is the console line's fields: distillation's KL too (issue 60 item 13)."""
    cfg = load_config(overrides=[f"train.output_dir={tmp_path}", "logging.plot=false", "train.max_steps=4"])
    log = MetricsLogger(cfg)
    seen = []
    log.bar = type("Bar", (), {"set_postfix": lambda self, post, refresh: seen.append(post),
                               "update": lambda self, n: None, "close": lambda self: None})()
    log.log(1, {"reward/mean": 0.25, "distill/reverse_kl": 0.5, "time/step": 1.0})
    assert seen == [{"reward": "0.250", "distill_kl": "0.5", "s/step": "1.00"}]


def test_the_console_holds_the_bar_and_the_runs_own_lines_only(tmp_path):
    """issue 60 item 11: train.py with its progress bar, a JSONL file of its own and a checkpoint on the way: no
    DeepSpeed accelerator notice, no "Writing model shards" or "Generating train split" bars, and the run's own lines
    each on a line of their own (printed above the bar, not glued onto it)."""
    import os

    from tests.conftest import LAUNCHER_VARS

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n:02d}=", "answer": f"{n:02d}"}) + "\n" for n in range(40)))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/demo.yaml", f"data.path={data}",
                           f"train.output_dir={tmp_path / 'run'}", "train.max_steps=3", "train.save_every=2",
                           "rollout.prompts_per_step=4", "rollout.num_generations=2", "reward_pool.num_workers=0",
                           "logging.plot=false"], cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, timeout=LAUNCH_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    everything = proc.stdout + proc.stderr
    for chatter in ("Setting accelerator to CPU", "Writing model shards", "Generating train split"):
        assert chatter not in everything, chatter
    assert "train: 100%" in proc.stderr  # the bar is there
    lines = proc.stdout.replace("\r", "\n").splitlines()
    assert "policy builtin:tiny-char: fp32 on cpu" in lines and any(x.startswith("final checkpoint: ") for x in lines)


class FakeRun:
    id = "abc123"

    def log(self, metrics, step):
        pass

    def finish(self):
        pass


def test_wandb_run_name_entity_tags_and_the_same_run_on_resume(tmp_path, monkeypatch):
    import types

    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(kw) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    over = [f"train.output_dir={tmp_path}", "logging.report_to=[wandb]", "logging.plot=false", "logging.progress_bar=false",
            "logging.wandb_name=exp-1", "logging.wandb_entity=team", "logging.wandb_tags=[gsm8k, grpo]"]
    MetricsLogger(load_config(overrides=over)).close()
    assert calls[0]["name"] == "exp-1" and calls[0]["entity"] == "team" and calls[0]["tags"] == ["gsm8k", "grpo"]
    assert "id" not in calls[0] and (tmp_path / "wandb_run_id").read_text() == "abc123"
    MetricsLogger(load_config(overrides=over), start_step=3).close()  # --resume
    assert calls[1]["id"] == "abc123" and calls[1]["resume"] == "allow"
    with pytest.raises(ConfigError, match="wandb_tags"):
        load_config(overrides=[*over[:-1], "logging.wandb_tags=gsm8k"])
