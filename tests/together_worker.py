"""Run under a launcher with 2 ranks (torchrun in tests/test_dist.py): an outside service that fails on rank 0 alone
inside the algorithm's process_batch hook (remax's greedy scoring, dapo's refill) stops every rank with that error
(issue 58 item 15), instead of leaving rank 1 waiting in the hook's next collective. Each rank writes
OUT/<case>-rank<r>.json with the error it stopped on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# remax: the step's second scoring is its greedy baseline's; dapo, whose rewards are made all equal here (no group
# has differing rewards), refills: its second scoring is the first refill's
CASES = {"remax": ["rollout.num_generations=2"], "dapo": ["algo.max_gen_batches=4"]}


def main() -> None:
    from grpo.foundation import dist
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer
    from grpo.foundation.plugins import RewardServiceError

    out = Path(sys.argv[1])
    for name, overrides in CASES.items():
        cfg = load_config("configs/demo.yaml", name, [
            f"train.output_dir={out / name}", "train.max_steps=2", "rollout.prompts_per_step=4",
            "reward_pool.num_workers=0", "logging.progress_bar=false", "logging.plot=false", "train.save_every=0",
            "train.export_final=false", "algo.beta=0", *overrides])
        tr = Trainer(cfg)
        real, calls = tr.rollout.score, []

        def score(batch, real=real, calls=calls):
            calls.append(1)
            if dist.rank() == 0 and len(calls) == 2:
                raise RewardServiceError("test: the reward service is gone (rank 0 only)")
            real(batch)
            batch.rewards = batch.rewards * 0  # dapo: no group with differing rewards, so it refills

        tr.rollout.score = score
        try:
            tr.train()
            stopped = "finished"
        except RewardServiceError as e:
            stopped = f"RewardServiceError: {e}"
        except Exception as e:  # noqa: BLE001 - written for the test to show
            stopped = f"{type(e).__name__}: {e}"
        (out / f"{name}-rank{dist.rank()}.json").write_text(json.dumps({"stopped": stopped, "scorings": len(calls)}))
    dist.shutdown()


if __name__ == "__main__":
    main()
