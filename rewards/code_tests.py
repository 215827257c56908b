"""``code_tests``: run the program in a completion against the row's unit tests in the sandbox (docs/sandbox.md).

The program is the completion's last fenced code block (```python or bare ```); the last block that defines
the row's function when one is named; without a fence, the text from the first ``def``/``import``/``class``
line on. Each test runs in its own sandboxed process (grpo/workers/sandbox.py) within ``test_timeout`` seconds
(default ``sandbox.timeout``), and a row's tests stop after ``row_timeout`` seconds (the test then running is
cut there; the rest count as timeouts). The reward is the fraction of tests passed (``mode: fraction``) or
1 only when all pass (``mode: all``). The row's ``tests`` column is one of (``format: auto`` tells them apart):

  assert  a list of statements, or one text of them (MBPP's ``test_list``: ``assert f(1) == 2``; in a text, each
          top-level assert is a test, run after the imports and helpers above it); with an
          ``entry_point`` column, a text defining ``check(candidate)`` (HumanEval's ``test``) is one test
  stdio   ``{"inputs": [...], "outputs": [...]}`` (APPS / CodeContests) or ``[{"input": .., "output": ..}]``:
          the program reads stdin; its stdout must equal the output (trailing spaces and blank lines aside)
  call    ``{"fn_name": f, "inputs": [[args], ...], "outputs": [...]}`` (APPS call-based), or
          ``[{"args": [...], "result": ..}]`` with the function named by the ``entry_point`` column / kwarg

Counted per test in the metrics (``reward/code_tests/<name>``): passed, wrong (a wrong answer or a failed
assert), runtime_error (an exception), compile_error (the program does not compile; its row's tests are not
run), timeout (wall clock or CPU seconds), memory (past ``sandbox.memory_mb``), killed (another signal,
output past its limit). ``assert`` and ``call`` tests run in this (the trusted) process, the program in the
sandbox answering calls with plain data only (rewards/judge.py): nothing the program does, an ``__eq__`` that
is always true, a patched builtin, ``os._exit(0)``, a printed "passed", its view of a harness's frames, can
make a test pass. ``stdio`` tests compare the program's stdout with the expected output; a line with a random
nonce (read from a file the harness deletes before the program runs) tells a runtime error from a finished
run.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import secrets
import time
from typing import Any, Optional

from grpo.workers import sandbox
from rewards.judge import judge

METRICS = ("passed", "wrong", "runtime_error", "compile_error", "timeout", "memory", "killed")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
_START = re.compile(r"^(def |import |from |class |[A-Za-z_]\w* *=)", re.M)

# Runs in the sandbox (stdlib only). job.json: the nonce, the program, the test (read, then deleted); stdin: the
# test's input, untouched.
HARNESS = r'''
import json, os, sys
with open("job.json") as f:
    job = json.load(f)
os.remove("job.json")
nonce = job.pop("nonce")
def mark(what):
    os.write(2, ("\n%s:%s\n" % (nonce, what)).encode())
try:
    code = compile(job["program"], "solution.py", "exec")
except (SyntaxError, ValueError, MemoryError, RecursionError):
    mark("compile_error"); os._exit(0)
g = {"__name__": "__main__" if job["kind"] == "stdio" else "solution", "__builtins__": __builtins__}
try:
    exec(code, g)
    if job["kind"] == "assert":
        exec(compile(job["test"], "test.py", "exec"), g)
        if job.get("entry_point") and "check" in g and "def check(" in job["test"]:
            g["check"](g[job["entry_point"]])
        ok = True
    elif job["kind"] == "call":
        got = g[job["fn_name"]](*job["args"])
        if isinstance(got, tuple):
            got = list(got)
        want = job["result"]
        ok = type(got) is type(want) and got == want or (type(got) in (int, float) and type(want) in (int, float)
                                                       and abs(got - want) <= 1e-9 * max(1.0, abs(want)))
    else:
        ok = True
except AssertionError:
    ok = False
except MemoryError:
    mark("memory"); os._exit(0)
except SystemExit:
    ok = job["kind"] == "stdio"
except BaseException:
    mark("runtime_error"); os._exit(0)
sys.stdout.flush()
mark("passed" if ok else "wrong")
os._exit(0)
'''


def extract_program(text: str, entry_point: Optional[str] = None) -> str:
    """The program in a completion (see the module docstring)."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in ("", "python", "py", "python3")]
    if entry_point:
        named = [b for b in blocks if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", b)]
        if named:
            return named[-1]
    if blocks:
        return blocks[-1]
    m = _START.search(text)
    return text[m.start():] if m else text


def split_asserts(text: str) -> list[str]:
    """Tests given as one text: a test per top-level ``assert`` (however many lines it spans), each run after
    every other statement above it (imports, helpers, constants); a text that does not parse is one test."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return [text]
    lines = text.splitlines(keepends=True)
    setup, tests = "", []
    for node in tree.body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        source = "".join(lines[first - 1:node.end_lineno])
        if isinstance(node, ast.Assert):
            tests.append(setup + source)
        else:
            setup += source
    return tests or [text]


FORMATS = ("auto", "assert", "stdio", "call")  # the row's tests: format auto tells the other three apart


def bad_format(fmt: Any) -> ValueError:
    return ValueError(f"code_tests: format={fmt!r} is invalid: choose from {list(FORMATS)}")


def _jobs(tests: Any, entry_point: Optional[str], fmt: str) -> list[tuple[dict, Optional[str], Optional[str]]]:
    """(job, stdin, expected stdout) per test."""
    if isinstance(tests, str) and tests.strip()[:1] in "[{":
        try:
            tests = json.loads(tests)
        except ValueError:
            pass
    if fmt == "auto":
        if isinstance(tests, dict):
            fmt = "call" if tests.get("fn_name") else "stdio"
        elif isinstance(tests, list) and tests and isinstance(tests[0], dict):
            fmt = "stdio" if "input" in tests[0] else "call"
        else:
            fmt = "assert"
    if fmt == "assert":
        if isinstance(tests, str):
            if "def check(" in tests:
                return [({"kind": "assert", "test": tests, "entry_point": entry_point}, None, None)]
            tests = split_asserts(tests)
        return [({"kind": "assert", "test": str(t), "entry_point": entry_point}, None, None) for t in tests]
    if fmt == "stdio":
        pairs = (list(zip(tests["inputs"], tests["outputs"])) if isinstance(tests, dict)
                 else [(t["input"], t["output"]) for t in tests])
        return [({"kind": "stdio"}, str(i), str(o)) for i, o in pairs]
    if fmt == "call":
        if isinstance(tests, dict):
            name, pairs = tests["fn_name"], list(zip(tests["inputs"], tests["outputs"]))
        else:
            name, pairs = entry_point, [(t["args"], t["result"]) for t in tests]
        if not name:
            raise ValueError("code_tests: call-style tests need the function's name (an entry_point column or "
                             "kwarg, or fn_name in the tests)")
        # APPS stores each output wrapped in a list of one
        return [({"kind": "call", "fn_name": name, "args": list(a) if isinstance(a, (list, tuple)) else [a],
                  "result": r}, None, None) for a, r in pairs]
    raise bad_format(fmt)


def _same_output(got: str, want: str) -> bool:
    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip("\n").splitlines()]
    return norm(got) == norm(want)


def run_tests(program: str, tests: Any, entry_point: Optional[str] = None, fmt: str = "auto",
              test_timeout: Optional[float] = None, row_timeout: float = 30.0, limits: Any = None) -> list[str]:
    """The outcome of each test (one of METRICS)."""
    lim = sandbox.Limits.of(limits)
    per_test = test_timeout or lim.timeout
    outcomes: list[str] = []
    jobs = _jobs(tests, entry_point, fmt)
    start = time.monotonic()
    for job, stdin, want in jobs:
        left = row_timeout - (time.monotonic() - start)
        if left <= 0:
            outcomes.append("timeout")
            continue
        budget = dataclasses.replace(lim, timeout=min(per_test, left))  # never past the row's own time limit
        if job["kind"] in ("assert", "call"):  # judged in this process; the program only answers calls
            what = judge(program, job, budget)
            outcomes.append(what)
            if what == "compile_error":
                outcomes += ["compile_error"] * (len(jobs) - len(outcomes))
                break
            continue
        nonce = secrets.token_hex(16)
        job = dict(job, program=program, nonce=nonce)
        r = sandbox.run(["python", "harness.py"], budget, stdin=stdin,
                        files={"harness.py": HARNESS, "job.json": json.dumps(job)})
        if r.reason == "error":  # not the program's failure: the reward's, counted and logged as its error
            raise sandbox.SandboxError(f"code_tests: the sandbox could not run the program: {r.error}")
        marks = re.findall(rf"^{nonce}:(\w+)$", r.stderr, re.M)
        if marks:
            what = marks[-1]
            if what == "passed" and want is not None and not _same_output(r.stdout, want):
                what = "wrong"
        elif r.reason in ("timeout", "cpu"):
            what = "timeout"
        elif r.reason == "memory":
            what = "memory"
        elif r.reason in ("signal", "output_limit"):
            what = "killed"
        else:  # it ended itself (sys.exit, os._exit) before the harness could judge the test
            what = "runtime_error"
        outcomes.append(what)
        if what == "compile_error":  # the same program for every test: none of them can run
            outcomes += ["compile_error"] * (len(jobs) - len(outcomes))
            break
    return outcomes


class Scores(list):
    """A reward function's values with per-reason counts (``metrics``), which CombinedReward logs."""

    metrics: dict[str, float]


def code_tests(prompts: list[str], completions: list[str], tests: list[Any], entry_point: Optional[list] = None,
               mode: str = "fraction", format: str = "auto", test_timeout: Optional[float] = None,
               row_timeout: float = 30.0, sandbox: Any = None, fn_name: Optional[str] = None,
               **_: Any) -> list[float]:
    """Fraction of the row's tests passed (``mode: fraction``) or all-or-nothing (``mode: all``)."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_tests: mode={mode!r} is invalid: choose from ['fraction', 'all']")
    if format not in FORMATS:
        raise bad_format(format)
    for key, value in (("row_timeout", row_timeout), ("test_timeout", test_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"code_tests: {key}={value!r} is invalid: it must be > 0 (seconds)")
    scores = Scores()
    scores.metrics = dict.fromkeys(METRICS, 0.0)
    for i, text in enumerate(completions):
        name = (entry_point[i] if entry_point is not None else None) or fn_name
        outcomes = run_tests(extract_program(text, name), tests[i], name, format, test_timeout, row_timeout, sandbox)
        for o in outcomes:
            scores.metrics[o] += 1
        passed = sum(o == "passed" for o in outcomes) / len(outcomes) if outcomes else 0.0
        scores.append(passed if mode == "fraction" else float(passed == 1.0))
    return scores


code_tests.uses_sandbox = True  # CombinedReward passes the run's ``sandbox:`` limits as the ``sandbox`` kwarg
code_tests.metric_keys = METRICS
# a row never takes much more than its row_timeout (its last test is cut there, then its process group killed):
# CombinedReward gives a call at least this per row, so that reward_pool.timeout need not know about it
code_tests.seconds_per_row = lambda kwargs: float(kwargs.get("row_timeout", 30.0)) + 5.0
code_tests.rows_per_call = 1  # a row runs its tests one sandboxed process after another
