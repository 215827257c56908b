"""The ``python`` tool (envs/tools.py) and the ``code`` environment (envs/code.py): model code runs in the
sandbox; a hostile call ends that call (its answer says why), not the trajectory, the tool worker or the run."""

import os
import time

from grpo.rollout.environment import EnvSetup
from envs.code import CodeEnv
from grpo.workers.tools import ToolBox
from grpo.rollout.multiturn import MultiTurnRollout
from grpo.workers import sandbox
from grpo.training.configure import load_config
from tests.test_multiturn import TOK, service

LIMITS = {"timeout": 5.0, "cpu_seconds": 1, "memory_mb": 256, "max_output_bytes": 5000}  # 5 s: a loaded CI machine


def test_the_python_tool_answers_output_or_the_reason_and_survives_hostile_code():
    box = ToolBox({"python": ("python", {"sandbox": LIMITS})}, num_workers=1, timeout=10.0)
    try:
        assert box.call("python", "print(6 * 7)").output == "42"
        me = os.getpid()
        hostile = {"while True: pass": "[the program used up its CPU time]",
                   "x = bytearray(1 << 33)": "[the program ran out of memory]",
                   "import os; os.kill(os.getpid(), 9)": "[the program was killed (signal 9)]",
                   "while True: print('y' * 100)": "[the program wrote too much output]",
                   "import ctypes; ctypes.string_at(0)": "[the program was killed (signal 11)]",
                   "1/0": "ZeroDivisionError: division by zero\n[the program exited with code 1]"}
        for code, end in hostile.items():
            res = box.call("python", code)
            assert res.ok and res.output.endswith(end), (code, res)
        caps = sandbox.capabilities(LIMITS)
        if caps["namespaces"]:  # its own PID namespace: neither its parent nor the trainer can be signalled
            res = box.call("python", f"import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept PermissionError:\n"
                                     f"    pass\nprint('alive', os.getppid())\nos.kill({me}, 9)")
            assert res.output.startswith("alive 1\n") and res.output.endswith(
                "ProcessLookupError: [Errno 3] No such process\n[the program exited with code 1]"), res
        elif caps["drops_user"]:  # as another user it cannot signal the trainer at all
            res = box.call("python", f"import os; os.kill({me}, 9)")
            assert res.output.endswith("PermissionError: [Errno 1] Operation not permitted\n"
                                       "[the program exited with code 1]")
        assert os.getpid() == me and box.pool.restarts == 0  # neither the trainer nor the tool worker was hit
        assert box.call("python", "print(sum(range(5)))").output == "10"
        assert box.pop_counts()["tool_errors"] == 0
        assert box.pop_counts() == {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_killed": 0}
    finally:
        box.close()


def script(text: str, r: int) -> str:
    """Row 0: an endless loop through the tool, then a right function; row 1: kills itself, then a function
    right on one test of two."""
    if "t:" not in text:
        return "<python>while True: pass</python>" if r == 0 else "<python>import os; os.kill(os.getpid(), 9)</python>"
    return "def add_2(x):\n    return 3" if "signal 9" in text else "def add_2(x):\n    return x + 2"


def test_a_hostile_call_inside_a_multi_turn_rollout_costs_only_that_call():
    cfg = load_config(overrides=["env.name=code", "env.tool_workers=1", "env.tool_timeout=4",
                                 "sandbox.cpu_seconds=1", "sandbox.timeout=3"])
    es = EnvSetup(cfg.env, cfg.sandbox)
    try:
        assert es.toolbox.tools["python"][1]["sandbox"]["timeout"] == 3.0  # inside the tool call's 4 s
        mt = MultiTurnRollout(service(script, "rollout.max_completion_length=60"), es.factory, max_turns=3,
                              max_trajectory_tokens=400, tool_counts=es.toolbox.pop_counts)
        row = {"prompt": "add 2", "tests": ["assert add_2(1) == 3", "assert add_2(5) == 7"], "entry_point": "add_2"}
        t0 = time.perf_counter()
        b = mt.rollout([TOK("add 2", add_special_tokens=False).input_ids], [row], [0])
        assert time.perf_counter() - t0 < 120, "a hostile call was not contained by its 3-4 s limits"
        text0, text1 = TOK.decode(b.completion_ids[0]), TOK.decode(b.completion_ids[1])
        assert "[the program used up its CPU time]" in text0 and "[the program was killed (signal 9)]" in text1
        assert b.reward_terms["passed"].tolist() == [1.0, 0.5]
        m = mt.pop_metrics()
        assert m["env/tool_calls"] == 2 and m["env/tool_errors"] == 0
    finally:
        es.close()


def test_code_env_tasks_are_the_built_in_code_task_and_its_reference_behaviour_passes():
    rows = CodeEnv.tasks(6, seed=3)
    assert all(r["prompt"].endswith("```python block.") and len(r["tests"]) == 4 for r in rows)
    assert rows == CodeEnv.tasks(6, seed=3) and rows != CodeEnv.tasks(6, seed=4)
