"""GRPO against a learned reward model alone, on CPU: does the model's reward rise, and the rule reward with it?

1. A tiny sequence classifier (LlamaForSequenceClassification, grpo/foundation/tiny.py) is trained for a few
   seconds on labelled completions of the built-in digits task (copy a 2-digit number): right answers, answers
   with a wrong digit, short, long, empty and junk ones, each labelled with the rule reward ``digits_match``.
2. The demo's policy (builtin:tiny-char, random init) is trained with GRPO where the only reward is that model
   (``rewards: [{model: OUT/rm}]``); the rule reward is never trained on, only measured: on the training
   completions (a second entry with weight 0) and as held-out greedy accuracy (``eval.correctness:
   digits_match`` on 100 items held out of training).

    PYTHONPATH=. python scripts/benchmarks/learn_reward_model.py --out runs/rm_learning            # ~2-3 min on 2 CPU cores
    PYTHONPATH=. python scripts/benchmarks/learn_reward_model.py --out runs/x --steps 40 --rm-seconds 10 --json

Prints the reward model's held-out error, then the first and last 20% of the run's model reward and rule reward,
the held-out rule reward (mean digits_match of greedy answers) at each evaluation, the held-out exact accuracy,
and the share of each step the reward model took; ``--json`` prints them as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from grpo.foundation.tiny import CHARSET, write_tiny_classifier  # noqa: E402
from rewards.digits import digits_match  # noqa: E402

DIGITS = "0123456789"


def labelled_example(rng: random.Random) -> tuple[str, str, float]:
    """(prompt, completion, rule reward) for the copy task: a spread of right, near and wrong answers."""
    x = str(rng.randint(10, 99))
    kind = rng.random()
    if kind < 0.2:
        c = x
    elif kind < 0.4:  # one character wrong (a digit, or any character)
        i = rng.randrange(2)
        c = x[:i] + rng.choice(DIGITS if rng.random() < 0.5 else CHARSET) + x[i + 1:]
    elif kind < 0.5:
        c = x[rng.randrange(2)]
    elif kind < 0.6:
        c = x + rng.choice(CHARSET)
    elif kind < 0.7:
        c = "".join(rng.choice(DIGITS) for _ in range(rng.randint(0, 3)))
    else:  # what an untrained policy writes: any characters (a policy seeks out what the model has not seen)
        c = "".join(rng.choice(CHARSET) for _ in range(rng.randint(0, 3)))
    return f"{x}=", c, digits_match([f"{x}="], [c], [x])[0]


def train_reward_model(out: Path, seconds: float, seed: int = 0, max_steps: int = 0) -> dict:
    """Fit the classifier's one logit to the rule reward (MSE) for ``seconds`` (or exactly ``max_steps`` batches
    when > 0: the same model on a busy machine); returns held-out figures."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    folder = write_tiny_classifier(out / "rm_init", seed=seed, padding_side="right")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    rng = random.Random(seed)
    held = [labelled_example(rng) for _ in range(500)]

    def batch(rows):
        enc = tok([p + c for p, c, _ in rows], padding=True, return_tensors="pt")
        return enc, torch.tensor([y for _, _, y in rows])

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    t0, steps = time.perf_counter(), 0
    model.train()
    while (steps < max_steps) if max_steps > 0 else (time.perf_counter() - t0 < seconds):
        enc, y = batch([labelled_example(rng) for _ in range(64)])
        loss = torch.nn.functional.mse_loss(model(**enc).logits[:, 0], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    model.eval()
    with torch.no_grad():
        enc, y = batch(held)
        pred = model(**enc).logits[:, 0]
    model.save_pretrained(out / "rm")
    tok.save_pretrained(out / "rm")
    corr = torch.corrcoef(torch.stack([pred, y]))[0, 1].item()
    return {"rm_steps": steps, "rm_seconds": round(time.perf_counter() - t0, 1),
            "rm_heldout_mse": round(torch.mean((pred - y) ** 2).item(), 4), "rm_heldout_corr": round(corr, 3),
            "label_variance": round(y.var(unbiased=False).item(), 4)}


def grpo_run(out: Path, steps: int, seed: int) -> list[dict]:
    run = out / "grpo"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/demo.yaml"),
           f"train.output_dir={run}", f"train.max_steps={steps}", f"train.seed={seed}", "train.save_every=0",
           "algo.beta=0", "rollout.prompts_per_step=16", "rollout.num_generations=8",
           "logging.progress_bar=false", "logging.plot=false", "logging.log_every=1", "reward_pool.num_workers=0",
           # the rule reward rides along with weight 0: logged (reward/digits_match/mean), never trained on
           f"rewards=[{{model: {out / 'rm'}, name: rm}}, {{fn: digits_match, weight: 0}}]",
           "data.eval_holdout=100", f"eval.every={max(1, steps // 5)}", "eval.correctness={fn: digits_match}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"train.py exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def heldout_rule_reward(run: Path) -> list[tuple[int, float]]:
    """(step, mean digits_match of the greedy completions of the held-out items) per evaluation."""
    out = []
    for f in sorted((run / "eval").glob("step-*.jsonl"), key=lambda f: int(f.stem.split("-")[1])):
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        out.append((int(f.stem.split("-")[1]), round(sum(r["reward"] for r in recs) / len(recs), 4)))
    return out


def window(records: list[dict], key: str, first: bool, frac: float = 0.2) -> float:
    vals = [r[key] for r in records if key in r]
    k = max(1, int(len(vals) * frac))
    part = vals[:k] if first else vals[-k:]
    return round(sum(part) / len(part), 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/rm_learning")
    p.add_argument("--rm-seconds", type=float, default=20.0)
    p.add_argument("--rm-steps", type=int, default=0, help="train the reward model on exactly this many batches "
                   "of 64 instead of --rm-seconds (reproducible on a busy machine)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = train_reward_model(out, args.rm_seconds, args.seed, args.rm_steps)
    recs = grpo_run(out, args.steps, args.seed)
    evals = [r for r in recs if "eval/accuracy" in r]
    res.update({
        "steps": args.steps,
        "rm_reward_first": window(recs, "reward/rm/mean", True), "rm_reward_last": window(recs, "reward/rm/mean", False),
        "rule_reward_first": window(recs, "reward/digits_match/mean", True),
        "rule_reward_last": window(recs, "reward/digits_match/mean", False),
        "heldout_rule_reward": heldout_rule_reward(out / "grpo"),
        "eval_accuracy_first": evals[0]["eval/accuracy"] if evals else None,
        "eval_accuracy_last": evals[-1]["eval/accuracy"] if evals else None,
        "eval_accuracy_max": max((r["eval/accuracy"] for r in evals), default=None),
        "rm_time_frac": window(recs, "reward/model_time_frac", False, 1.0),
        "step_seconds": window(recs, "time/step", False, 1.0),
        "wall_seconds": round(time.perf_counter() - t0, 1),
    })
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>22}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
