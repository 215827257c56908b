"""scripts/eval.py on the tiny model, and evaluation inside a (tiny) training run whose checkpoint it then reads."""

import json

import pytest

from tests.script_support import load_script

TINY_CONFIG = """
model: {name_or_path: builtin:tiny-char}
data:
  source: arithmetic
  arithmetic: {num_examples: 60, max_value: 9}
  chat_template: true
  system_prompt: Answer.
  prefill: "A:"
  eval_holdout: 12
rollout: {num_generations: 2, prompts_per_step: 2, max_prompt_length: 200, max_completion_length: 4}
algo: {beta: 0.0}
train: {max_steps: 2, lr: 1.0e-3, micro_batch_size: 8, output_dir: OUT}
logging: {progress_bar: false, plot: false}
rewards:
  - fn: math_correct
    kwargs: {extract: last_number, gold: plain}
reward_pool: {num_workers: 1}
eval:
  every: 1
  limit: 6
  batch_size: 4
  format: {fn: format_soft, kwargs: {blocks: [answer]}}
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_CONFIG.replace("OUT", str(tmp_path / "run")))
    return path


def test_eval_script_on_the_tiny_model(config, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    rc = load_script("eval").main(["--model", "builtin:tiny-char", "--config", str(config), "--split", "test",
                                  "--limit", "5", "--k", "3", "--out", str(out), "--json"])
    assert rc == 0
    printed = capsys.readouterr().out
    for line in ("problems: 5", "accuracy (greedy): ", "format rate: ", "mean completion length: ", "mean@3: ",
                 "pass@3: "):
        assert line in printed
    summary = json.loads(printed.strip().splitlines()[-1])
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == 5 == summary["eval/num_problems"]
    assert {"prompt", "completion", "answer", "correct", "format", "length", "correct_of_3"} <= set(records[0])
    assert records[0]["prompt"].endswith("a:A:")  # chat template + prefill, as the model saw it
    assert summary["eval/accuracy"] == sum(r["correct"] for r in records) / 5
    assert summary["eval/length_mean"] == sum(r["length"] for r in records) / 5
    assert 0 <= summary["eval/mean@3"] <= summary["eval/pass@3"] <= 1


def test_eval_script_rejects_a_bad_split(config, capsys):
    assert load_script("eval").main(["--model", "builtin:tiny-char", "--config", str(config), "--split", "dev"]) == 2
    assert "split='dev' is invalid" in capsys.readouterr().err


def test_training_evaluates_every_n_steps_and_eval_reads_its_checkpoint(config, tmp_path, capsys, single_rank_env):
    import train  # its entry in this process (what `python train.py` runs): the subject is the run, not the process

    rc = train.main(["--config", str(config)])
    trained = capsys.readouterr()
    assert rc == 0, trained.err[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("eval/accuracy" in r and r["eval/num_problems"] == 6 for r in rows)
    assert "reward/mean" not in rows[0] and "reward/mean" in rows[1]
    assert rows[1]["reward/math_correct/timeouts"] == 0.0 and rows[1]["reward/math_correct/errors"] == 0.0

    saved = [json.loads(x) for x in (tmp_path / "run" / "eval" / "step-2.jsonl").read_text().splitlines()]
    assert len(saved) == 6 and sum(r["correct"] for r in saved) / 6 == rows[-1]["eval/accuracy"]

    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    out = tmp_path / "ckpt.jsonl"
    assert load_script("eval").main(["--model", str(ckpt), "--config", str(config), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the checkpoint is the trained model: same problems, same greedy answers as the run's last evaluation
    assert summary["eval/num_problems"] == 6
    assert summary["eval/accuracy"] == rows[-1]["eval/accuracy"]
    assert summary["eval/length_mean"] == rows[-1]["eval/length_mean"]
    assert [json.loads(x)["completion"] for x in out.read_text().splitlines()] == [r["completion"] for r in saved]
    # the run's newest checkpoint by its run: checkpoints/latest (a symlink), the checkpoints folder, the run folder
    for given in (ckpt.parent / "latest", ckpt.parent, ckpt.parent.parent):
        again = tmp_path / f"{given.name}.jsonl"
        assert load_script("eval").main(["--model", str(given), "--config", str(config), "--out", str(again)]) == 0
        assert again.read_text() == out.read_text(), given

    # train.export_final (default on): OUT/final/ is the model + tokenizer only, the trained model's logits
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = tmp_path / "run" / "final"
    assert "final model (from_pretrained):" in trained.out
    assert not (final / "ds").exists() and not (final / "trainer").exists()
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(ckpt).get_vocab()
    ids = torch.tensor([tok.encode("1+2=")])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(final)(ids).logits
        want = AutoModelForCausalLM.from_pretrained(ckpt)(ids).logits  # the step-2 checkpoint: the trained model
    assert torch.equal(got, want)
