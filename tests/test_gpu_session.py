"""scripts/benchmarks/gpu_session.sh, checked where no GPU is: the GPU suite's tests it selects exist.

A GPU session has about 15 device minutes; a stage that selects nothing spends them and measures nothing. The
H100 stage's ``-k "[graphs-qwen3_5] or ..."`` selected none of the graphed steps it named (their ids are
``[qwen3_5-graphs]``), which only a GPU run would have shown.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "benchmarks" / "gpu_session.sh"

# collects the gpu-marked tests as a CUDA machine would (tests/conftest.py deselects them where torch sees none)
COLLECT = """
import sys, torch
torch.cuda.is_available = lambda: True
import pytest
class Ids:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("ITEM", item.nodeid)
sys.exit(pytest.main(["-p", "no:cacheprovider", "--collect-only", "-qq", "-m", "gpu", sys.argv[1]], plugins=[Ids()]))
"""


def gpu_tests_expression() -> tuple[str, str]:
    """(the test file, the -k expression) of the script's pytest stage."""
    text = SCRIPT.read_text()
    expr = re.search(r'^GPU_TESTS="([^"]+)"', text, re.M).group(1)
    stage = re.search(r"-m pytest .* -m gpu (\S+) -k \"\$GPU_TESTS\"", text).group(1)
    return stage, expr


def test_every_term_of_the_gpu_pytest_stage_selects_a_gpu_test():
    path, expr = gpu_tests_expression()
    out = subprocess.run([sys.executable, "-c", COLLECT, path], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    ids = [line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("ITEM ")]
    assert ids, out.stdout[-2000:] + out.stderr[-2000:]
    terms = [t.strip() for t in expr.split(" or ")]
    assert all(re.fullmatch(r"[\w\-\[\]+]+", t) for t in terms), terms  # plain names: no and / not / parentheses
    # pytest -k: a term matches a test whose name contains it (case-insensitively)
    empty = [t for t in terms if not any(t.lower() in i.split("::")[-1].lower() for i in ids)]
    assert not empty, f"gpu_session.sh's -k terms {empty} select no gpu test of {path}"
    # and the families the stage is there for are among them
    names = [i.split("::")[-1] for i in ids if any(t.lower() in i.split("::")[-1].lower() for t in terms)]
    for kind in ("gemma2", "qwen3_5", "gemma4", "gemma3n", "llama4", "mistral4"):
        assert f"test_compiled_and_graphed_steps_give_the_eager_tokens[{kind}-graphs]" in names, kind
    assert "test_bf16_logprob_gap_against_the_trainer[gemma2-cuda]" in names
