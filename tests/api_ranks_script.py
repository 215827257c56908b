"""The Python API under a launcher (tests/test_api.py): every rank runs this file as __main__ and calls
grpo.train with the same arguments; the reward is a __main__ function, sent to the workers by value."""

import json
import os
import sys


def length_two(prompts, completions, **kwargs):
    return [float(len(c) == 2) for c in completions]


if __name__ == "__main__":
    from grpo import train

    out = sys.argv[1]
    rows = [{"prompt": f"{n:02d}=", "answer": f"{n:02d}"} for n in range(40)]
    result = train("configs/demo.yaml", rewards=["digits_match", length_two], dataset=rows,
                   train={"max_steps": 2, "output_dir": out, "micro_batch_size": 64},
                   rollout={"num_generations": 4, "prompts_per_step": 4, "max_completion_length": 3},
                   logging={"progress_bar": False, "plot": False}, reward_pool={"num_workers": 1})
    with open(os.path.join(out, f"result-{os.environ['RANK']}.json"), "w") as f:
        json.dump({"output_dir": str(result.output_dir), "metrics": result.metrics, "steps": len(result.history)}, f)
