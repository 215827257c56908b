"""Issue 60 item 2: every code block of README.md and docs/*.md that a user would run is run by a test as written, or
says here why CI cannot run it (a GPU, the hub, a placeholder a user fills in, minutes of training). A new block, or
a changed first line, fails ``test_every_block_is_run_or_excused`` until it is classified here."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"```(python|bash|sh|console|shell)\n(.*?)```", re.S)

RUN = "run"  # run as written by the test named in the note
GPU, HUB = "not run: it needs a GPU", "not run: it downloads from the hub (no network in CI)"
TEMPLATE = "not run: a template whose placeholders the user fills in"
SUITE = "run: it is CI itself, or a part of the suite CI runs"
# (file, the block's first line) -> RUN + where, or why not
BLOCKS: dict[tuple[str, str], str] = {
    ("README.md", "make demo                     # install, then train the demo"):
        "not run: 1-4 minutes of training on 2 cores; its parts run in tests: the demo config on 2 CPU ranks "
        "(test_distributed.py), ref_client.py on loopback (test_ref_server.py)",
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate"): "run: CI's own install (make install)",
    ("README.md", "python train.py --config configs/gsm8k-qwen2.5-0.5b.yaml --print-config     # every error before any"):
        "not run: the config names Qwen2.5-0.5B, which comes from the hub",
    ("README.md", "make test                                               # what CI runs (.ci/run): the suite, then vL"):
        SUITE,
    ("docs/agents.md", "from envs.base import Environment, StepResult"): f"{RUN}: test_the_agents_example_environment",
    ("docs/agents.md", ".venv/bin/python -m pytest tests/test_multiturn.py tests/test_algos_multiturn.py -q      # rollouts,"):
        SUITE,
    ("docs/architecture.md", "python train.py --list-algos                        # it is registered"):
        TEMPLATE + " (NAME: the algorithm added)",
    ("docs/architecture.md", ".venv/bin/python -m pytest tests/test_rollout_seam.py tests/test_rollout.py tests/test_layers.py -q"):
        SUITE,
    ("docs/checkpoints.md", "python train.py --config configs/X.yaml train.output_dir=runs/x --resume"): TEMPLATE,
    ("docs/checkpoints.md", "python scripts/eval.py --model runs/x/checkpoints/latest --config configs/X.yaml"): TEMPLATE,
    ("docs/checkpoints.md", "from transformers import AutoModelForCausalLM, AutoTokenizer"):
        f"{RUN}: test_a_checkpoint_loads_as_the_docs_say (its runs/x made first)",
    ("docs/data.md", "# myrewards.py"): f"{RUN}: test_the_data_docs_reward",
    ("docs/distillation.md", "CUDA_VISIBLE_DEVICES=7 python ref_client.py --config configs/gsm8k-qwen2.5-0.5b.yaml \\"): GPU,
    ("docs/install.md", "make demo      # install, then train the demo (2 CPU ranks, about 1-4 minutes on 2 cores)"):
        "not run: 1-4 minutes of training, as README.md's",
    ("docs/install.md", "python3 -m venv .venv && . .venv/bin/activate"): "run: CI's own install (make install)",
    ("docs/install.md", "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir models/qwen2.5-0.5b-instruct"): HUB,
    ("docs/python-api.md", "from grpo import train"):
        f"{RUN}: tests/test_api.py::test_the_docs_example_runs_as_written_as_a_script_and_learns",
    ("docs/quickstart-gsm8k.md", "pip install torch --index-url https://download.pytorch.org/whl/cu130   # match your driver"):
        GPU,
    ("docs/quickstart-gsm8k.md", "python train.py --config configs/gsm8k-qwen2.5-0.5b.yaml"): GPU,
    ("docs/quickstart-gsm8k.md", "deepspeed --num_gpus 8 train.py --config configs/gsm8k-qwen2.5-0.5b-8gpu.yaml"): GPU,
    ("docs/quickstart-gsm8k.md", "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir models/qwen2.5-0.5b-instruct"):
        HUB,
    ("docs/quickstart-gsm8k.md", "CUDA_VISIBLE_DEVICES=1 python ref_client.py --config configs/gsm8k-qwen2.5-0.5b.yaml &   # listens o"):
        GPU,
    ("docs/quickstart-gsm8k.md", "CUDA_VISIBLE_DEVICES=7 python ref_client.py --config configs/gsm8k-qwen2.5-0.5b-8gpu.yaml &"): GPU,
    ("docs/quickstart-gsm8k.md", "tensorboard --logdir runs/gsm8k-qwen2.5-0.5b/tensorboard"): GPU + " run's logs first",
    ("docs/quickstart-gsm8k.md", "python train.py --config configs/gsm8k-qwen2.5-0.5b.yaml --resume"): GPU,
    ("docs/quickstart-gsm8k.md", "python scripts/eval.py --model runs/gsm8k-qwen2.5-0.5b/checkpoints/step-500 --config configs/gsm8k-q"):
        GPU + " run's checkpoint first",
    ("docs/rewards.md", "def f(prompts, completions, completion_ids, trainer_state, **kwargs) -> list[float | None]: ..."):
        "not run: a signature, not a program",
    ("docs/rewards.md", "python ref_client.py --config my.yaml --reward-model path/to/rm [--reward-label good] [--reward-batc"):
        TEMPLATE,
    ("docs/rewards.md", "PYTHONPATH=. python scripts/benchmarks/learn_reward_model.py --out runs/rm_learning      # ~1.5-3 mi"):
        "not run: 1.5-3 minutes; tests/test_reward_learning.py runs the same script at CI size",
    ("docs/vllm.md", "pip install -e \".[vllm]\"            # the GPU package vllm (>= 0.32)"):
        "run: make test builds .venv-vllm with the CPU build of this extra and runs the vllm tests in it",
}


def blocks() -> dict[tuple[str, str], str]:
    """(file, first line) -> the block's text, for every runnable block of README.md and docs/*.md."""
    out = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in FENCE.finditer(path.read_text()):
            first = m.group(2).strip().splitlines()[0][:100]
            out[(str(path.relative_to(ROOT)), first)] = m.group(2)
    return out


def test_every_block_is_run_or_excused():
    found = blocks()
    new = sorted(set(found) - set(BLOCKS))
    assert not new, f"code blocks no test runs and none is excused here (add each to BLOCKS): {new}"
    gone = sorted(set(BLOCKS) - set(found))
    assert not gone, f"BLOCKS names blocks the docs no longer have: {gone}"
    for key, note in BLOCKS.items():
        assert note.startswith(("run", "not run: ")), (key, note)
        if note.startswith(f"{RUN}: tests/"):  # a test in another file
            file, name = note.split()[1].split("::")
            assert f"def {name}(" in (ROOT / file).read_text(), (key, note)
        elif note.startswith(f"{RUN}: test_"):  # a test in this file
            assert note.split()[1] in globals(), (key, note)


def run_block(key: tuple[str, str]) -> dict:
    """Executes the block as written; returns its namespace."""
    namespace: dict = {"__name__": "doc_block"}
    exec(compile(blocks()[key], f"{key[0]} block", "exec"), namespace)
    return namespace


def test_the_agents_example_environment():
    """docs/agents.md's environment, as written: its tasks, its reset, a right answer, a wrong one, a tool call."""
    from envs.base import StepResult

    ns = run_block(("docs/agents.md", "from envs.base import Environment, StepResult"))

    class Calculator:  # the run's ToolBox, as the environment calls it
        def call(self, name, text):
            return type("R", (), {"ok": True, "output": str(eval(text, {}))})()  # noqa: S307 - the test's own input

    tasks = ns["Guess"].tasks(3, 0)
    assert tasks == [{"prompt": f"{i}*3", "answer": str(3 * i)} for i in range(3)]
    env = ns["Guess"](tools=Calculator())
    assert env.reset(tasks[2]) == "2*3"
    tool = env.step("=2*3")
    assert isinstance(tool, StepResult) and tool.reward == 0.0 and not tool.done
    assert env.step("6").reward == 1.0 and env.step("seven").reward == 0.0


def test_the_data_docs_reward():
    """docs/data.md's myrewards.py, as written: 1 up to max_words words, falling linearly to 0 at twice that."""
    brevity = run_block(("docs/data.md", "# myrewards.py"))["brevity"]
    assert brevity([""] * 3, ["a " * 10, "a " * 90, "a " * 130]) == [1.0, pytest.approx(0.5), 0.0]


def test_a_checkpoint_loads_as_the_docs_say(tmp_path, monkeypatch):
    """docs/checkpoints.md's transformers snippet, as written, on a runs/x made by a 2-step run first."""
    from grpo import train

    monkeypatch.chdir(tmp_path)
    train(str(ROOT / "configs" / "demo.yaml"), train={"max_steps": 2, "output_dir": "runs/x", "micro_batch_size": 64},
          rollout={"num_generations": 2, "prompts_per_step": 2}, reward_pool={"num_workers": 0},
          logging={"progress_bar": False, "plot": False}, algo={"beta": 0.0})
    ns = run_block(("docs/checkpoints.md", "from transformers import AutoModelForCausalLM, AutoTokenizer"))
    ids = ns["tokenizer"]("47=", return_tensors="pt").input_ids
    assert ns["model"](input_ids=ids).logits.shape[:2] == ids.shape
