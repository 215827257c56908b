"""The ``code_tests`` reward on correct, partly correct, non-compiling and timing-out programs, in each test
format, against values written here; and its counts in CombinedReward's metrics."""

import pytest

from grpo.foundation.config import RewardPoolConfig, RewardSpec, SandboxConfig
from grpo.scoring.combined import CombinedReward
from rewards.code_tests import code_tests, extract_program, run_tests

# a generous wall clock (a loaded 2-core CI machine starts two interpreters per test), one CPU second: a busy
# loop ends at 1 s of CPU; the hanging programs get a 0.3 s row limit of their own (score_hang: a program that
# never finishes scores its timeouts however slow the machine, so the limit can be short)
FAST = {"timeout": 10.0, "cpu_seconds": 1}


def fence(code):
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


ADD_OK = fence("def add(a, b):\n    return a + b")
ADD_HALF = fence("def add(a, b):\n    return a + b if a else 0")  # wrong when a == 0
ADD_BAD = fence("def add(a, b)\n    return a + b")
ADD_HANG = fence("def add(a, b):\n    while True:\n        pass")

ASSERTS = ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(2, 2) == 4", "assert add(0, 0) == 0"]
CALLS = [{"args": [1, 2], "result": 3}, {"args": [0, 5], "result": 5}, {"args": [2, 2], "result": 4},
         {"args": [0, 0], "result": 0}]
APPS_CALL = {"fn_name": "add", "inputs": [[1, 2], [0, 5], [2, 2], [0, 0]], "outputs": [3, 5, 4, 0]}

ECHO_OK = fence("a, b = map(int, input().split())\nprint(a + b)")
ECHO_HALF = fence("a, b = map(int, input().split())\nprint(a + b if a else 0)")
ECHO_BAD = fence("a, b = map(int, input().split()\nprint(a + b)")
ECHO_HANG = fence("import time\ntime.sleep(30)")
STDIO = {"inputs": ["1 2\n", "0 5\n", "2 2\n", "0 0\n"], "outputs": ["3\n", "5\n", "4\n", "0"]}
STDIO_LIST = [{"input": i, "output": o} for i, o in zip(STDIO["inputs"], STDIO["outputs"])]


def score(completions, tests, **kw):
    return code_tests([""] * len(completions), completions, [tests] * len(completions), sandbox=FAST, **kw)


def score_hang(completion, tests, **kw):
    """A hanging program under a 0.3 s row limit: its first test times out there, the others are not started."""
    s = code_tests([""], [completion], [tests], sandbox=FAST, row_timeout=0.3, **kw)
    assert list(s) == [0.0] and s.metrics["timeout"] == 4 and s.metrics["passed"] == 0
    return s


@pytest.mark.parametrize("tests,kw", [(ASSERTS, {}), ("\n".join(ASSERTS), {}), (CALLS, {"fn_name": "add"}),
                                      (APPS_CALL, {})], ids=["assert-list", "assert-text", "call", "apps-call"])
def test_function_formats(tests, kw):
    s = score([ADD_OK, ADD_HALF, ADD_BAD], tests, **kw)
    # add(0, 5) and add(0, 0): the half-right program returns 0 -> 5 wrong, 0 right: 3 of 4
    assert list(s) == [1.0, 0.75, 0.0]
    assert s.metrics == {"passed": 7.0, "wrong": 1.0, "runtime_error": 0.0, "compile_error": 4.0, "timeout": 0.0,
                         "memory": 0.0, "killed": 0.0}
    score_hang(ADD_HANG, tests, **kw)


@pytest.mark.parametrize("tests", [STDIO, STDIO_LIST], ids=["apps", "list"])
def test_stdio_formats(tests):
    s = score([ECHO_OK, ECHO_HALF, ECHO_BAD], tests)
    assert list(s) == [1.0, 0.75, 0.0]
    assert s.metrics["passed"] == 7 and s.metrics["wrong"] == 1 and s.metrics["compile_error"] == 4
    assert s.metrics["timeout"] == 0
    score_hang(ECHO_HANG, tests)


def test_tests_in_one_text_keep_their_imports_helpers_and_multi_line_asserts():
    """Issue 42, item 11: only the lines starting with ``assert`` were kept, so a test needing an import or
    spanning lines failed a correct solution."""
    text = ("import math\nfrom fractions import Fraction\n\ndef close(a, b):\n    return math.isclose(a, b)\n\n"
            "assert close(add(0.1, 0.2), 0.3)\nassert add(Fraction(1, 3),\n           Fraction(2, 3)) == 1\n"
            "assert add(\n    1,\n    2,\n) == 3\nassert add(1, 1) == 3\n")
    assert run_tests(extract_program(ADD_OK), text, limits=FAST) == ["passed", "passed", "passed", "wrong"]
    assert score([ADD_OK], text) == [0.75]


def test_all_or_nothing_and_humaneval_check():
    assert list(score([ADD_OK, ADD_HALF], ASSERTS, mode="all")) == [1.0, 0.0]
    check = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 5) == 5\n"
    s = code_tests(["", ""], [ADD_OK, ADD_HALF], [check, check], entry_point=["add", "add"], sandbox=FAST)
    assert list(s) == [1.0, 0.0]


def test_exits_and_fake_passes_do_not_pass():
    cheats = [fence("import sys\nsys.exit(0)"), fence("import os\nos._exit(0)"),
              fence("import sys\nprint('passed'); sys.stderr.write('x:passed\\n')")]
    s = score(cheats, ASSERTS[:2])
    assert list(s) == [0.0, 0.0, 0.0]
    s = score([fence("def add(a, b):\n    raise ValueError"), fence("def add(a, b):\n    return bytearray(8 << 30)")],
              ASSERTS[:1])
    assert list(s) == [0.0, 0.0] and s.metrics["runtime_error"] == 1 and s.metrics["memory"] == 1


def test_row_time_limit_stops_the_rest():
    out = run_tests(extract_program(ADD_HANG), ASSERTS, test_timeout=0.4, row_timeout=0.6, limits=FAST)
    assert out == ["timeout"] * 4  # two run and time out, the other two are not started


def test_extraction():
    text = "```python\nx = 1\n```\nand\n```python\ndef f():\n    return 2\n```\n```text\nnot code\n```"
    assert extract_program(text) == "def f():\n    return 2\n"
    assert extract_program(text, "f") == "def f():\n    return 2\n"
    assert extract_program("Sure.\ndef g(x):\n    return x\n") == "def g(x):\n    return x\n"


def test_counts_reach_the_reward_metrics():
    """Through CombinedReward's worker pool, whose 1 s call timeout is shorter than a row can take: code_tests
    gets its row_timeout (+5 s) per row instead, so a hanging program scores its own timeouts, not the pool's.
    The hanging program's tests end at their 1 CPU second; the 60 s row limit only keeps a busy machine's slow
    interpreter starts from cutting the right program short."""
    spec = RewardSpec(fn="code_tests", kwargs={"row_timeout": 60.0})
    r = CombinedReward([spec], RewardPoolConfig(1, 1.0), sandbox=SandboxConfig(timeout=10.0, cpu_seconds=1))
    try:
        total, _ = r(["p"] * 3, [ADD_OK, ADD_BAD, ADD_HANG], {"tests": [ASSERTS[:2]] * 3})
        assert total == [1.0, 0.0, 0.0]
        m = r.pop_metrics()
        assert m["reward/code_tests/passed"] == 2 and m["reward/code_tests/compile_error"] == 2
        assert m["reward/code_tests/timeout"] == 2 and m["reward/code_tests/timeouts"] == 0
        assert m["reward_pool/killed_memory"] == 0
    finally:
        r.close()


def test_presets_map_mbpp_and_humaneval_rows_and_the_built_in_task(tmp_path):
    import json

    from grpo.data.sources import load_source
    from grpo.training.configure import load_config

    mbpp = {"text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
            "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}
    he = {"prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n", "canonical_solution": "    return a + b\n",
          "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}
    for name, row in (("mbpp", mbpp), ("humaneval", he)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(row) + "\n")
        cfg = load_config(overrides=["data.source=jsonl", f"data.path={path}", f"data.task={name}",
                                     "rewards=[{fn: code_tests}]"])
        item = load_source(cfg.data, 0)[0]
        solution = row["code"] if name == "mbpp" else row["prompt"] + row["canonical_solution"]
        ep = [item["entry_point"]] * 2 if "entry_point" in item else None
        assert "```python" in item["prompt"]
        got = code_tests(["", ""], [fence(solution), fence("def add(a, b):\n    return 0")], [item["tests"]] * 2,
                         entry_point=ep, sandbox=FAST)
        assert list(got) == ([1.0, 0.5] if name == "mbpp" else [1.0, 0.0])
    cfg = load_config(overrides=["data.source=code", "data.code.num_examples=4", "data.code.families=[reverse]",
                                 "rewards=[{fn: code_tests}]"])
    items = [load_source(cfg.data, 0)[i] for i in range(4)]
    right = fence("def reverse(s):\n    return s[::-1]")
    assert list(code_tests([""] * 4, [right] * 4, [i["tests"] for i in items], sandbox=FAST)) == [1.0] * 4


def test_built_in_code_task_tests_follow_the_stated_behaviour():
    """Each family's function, written here from its prompt's wording and name, passes its generated tests (run
    in this process: the tests are ours, not the model's)."""
    from grpo.data.code_task import FAMILIES, code_task

    def solution(item):
        name, fam = item["entry_point"], item["family"]
        n = name.split("_")
        return {"add_k": lambda x: x + int(n[1]), "mul_k": lambda x: x * int(n[1]),
                "clamp": lambda x: min(max(x, int(n[1])), int(n[2])), "count_c": lambda s: s.count(n[1]),
                "sum_list": sum, "max_list": max, "reverse": lambda s: s[::-1],
                "is_mult_k": lambda x: x % int(n[2]) == 0}[fam]

    items = code_task(200, seed=5, num_tests=4)
    assert {i["family"] for i in items} == set(FAMILIES)
    for item in items:
        assert f"`{item['entry_point']}(" in item["prompt"] and len(item["tests"]) == 4
        for t in item["tests"]:
            exec(t, {item["entry_point"]: solution(item)})  # raises AssertionError on a mismatch
        wrong = lambda *a: None  # noqa: E731
        assert sum(_fails(t, item["entry_point"], wrong) for t in item["tests"]) == 4


def _fails(test, name, fn):
    try:
        exec(test, {name: fn})
    except AssertionError:
        return True
    return False


# --------------------------------------------------------------------------- the reward itself (issue 42)

FORGERS = {
    "an __eq__ that is always true": "class Yes:\n    def __eq__(self, other):\n        return True\n"
                                     "    __hash__ = object.__hash__\n\ndef add(a, b):\n    return Yes()",
    "the harness's nonce read from its frames": (
        "import os, sys\nfor frame in [sys._getframe(i) for i in range(1, 4) if sys._getframe(i - 1).f_back]:\n"
        "    for v in list(frame.f_globals.values()) + list(frame.f_locals.values()):\n"
        "        if isinstance(v, str) and len(v) == 32:\n"
        "            os.write(2, ('\\n%s:passed\\n' % v).encode())\nos._exit(0)"),
    "exiting 0 at import": "import os\nos._exit(0)",
    "SystemExit(0) in the function": "def add(a, b):\n    raise SystemExit(0)",
    "patched builtins": ("import builtins\nbuiltins.AssertionError = type('Never', (BaseException,), {})\n"
                         "builtins.isinstance = lambda *a: True\ndef add(a, b):\n    return -1"),
    "printed markers": "print('passed')\nprint('OK')\ndef add(a, b):\n    print('passed')\n    return -1",
    "forged answer lines": ("import os\nfor fd in range(3, 10):\n    try:\n        os.write(fd, b\"(1, 'value', '3')\\n\")\n"
                            "    except OSError:\n        pass\ndef add(a, b):\n    return -1"),
}


@pytest.mark.parametrize("name", sorted(FORGERS))
def test_the_reward_cannot_be_forged(name):
    """SANDBOX.md, the reward itself: the test ran in the program's interpreter, so an always-true __eq__, the
    nonce read from the harness's frames or a patched builtin passed; now the test runs in the judge and the
    program only answers calls with plain data."""
    program = FORGERS[name]
    for tests in (ASSERTS, CALLS):
        outcomes = run_tests(program, tests, "add", limits=FAST)
        assert "passed" not in outcomes, (name, tests is CALLS, outcomes)
    check = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n"
    assert run_tests(program, check, "add", limits=FAST) != ["passed"], name


def test_what_crosses_to_the_judge_classes_values_modules_and_exceptions():
    """A correct program still passes whatever its tests use: a class and its methods, a constant, a module the
    program imported, Fraction and Decimal values, the exception a test expects, nan."""
    program = ("import math\nfrom fractions import Fraction\nLIMIT = 10\n\nclass Solution:\n"
               "    def __init__(self, k):\n        self.k = k\n    def scale(self, xs):\n"
               "        return [x * self.k for x in xs]\n\ndef half(x):\n    return Fraction(x, 2)\n\n"
               "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return math.sqrt(x)\n\n"
               "def pair(x):\n    return (x, {x: [x]})\n\ndef nothing():\n    return float('nan')")
    tests = ["assert Solution(3).scale([1, 2]) == [3, 6]",
             "assert LIMIT == 10",
             "assert math.isclose(root(2.0), 2 ** 0.5)",
             "assert half(3) == Fraction(3, 2) and half(4) == 2",
             "try:\n    root(-1)\n    assert False\nexcept ValueError as e:\n    assert 'negative' in str(e)",
             "assert pair(1) == (1, {1: [1]})",
             "assert nothing() != nothing()",
             "s = Solution(2)\nassert s.k == 2 and s.scale([]) == []",
             "assert Solution(1) != Solution(1)"]  # objects stay in the sandbox: each equals only itself
    assert run_tests(program, tests, limits=FAST) == ["passed"] * len(tests)
    assert run_tests(program, [{"args": [3], "result": [3, {3: [3]}]}], "pair", limits=FAST) == ["passed"]


# --------------------------------------------------------------------------- issue 58, items 1 and 2

# HumanEval/2's check and MBPP task 2's tests, each with a wrong solution that shadows the builtin its tests use
TRUNCATE_CHECK = ("def check(candidate):\n    assert candidate(3.5) == 0.5\n"
                  "    assert abs(candidate(1.33) - 0.33) < 1e-6\n    assert abs(candidate(123.456) - 0.456) < 1e-6\n")
TRUNCATE_WRONG = "def truncate_number(number):\n    return 0.5\n"
SIMILAR_TESTS = ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
                 "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
                 "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))"]
SIMILAR_OK = "def similar_elements(test_tup1, test_tup2):\n    return tuple(set(test_tup1) & set(test_tup2))\n"
SIMILAR_WRONG = "def similar_elements(test_tup1, test_tup2):\n    return ()\n"


def test_a_builtin_the_program_shadows_is_not_the_tests_builtin():
    """Issue 58 item 1: the test ran with every top-level name of the program, so `def abs(x): return 0` passed
    HumanEval's float checks and `set = lambda *a: 0` MBPP's set comparisons. A test's builtins are the real
    ones; the row's own function may still be named like a builtin."""
    shadow_abs = "def abs(x):\n    return 0\n"
    assert run_tests(TRUNCATE_WRONG, TRUNCATE_CHECK, "truncate_number", limits=FAST) == ["wrong"]
    assert run_tests(shadow_abs + TRUNCATE_WRONG, TRUNCATE_CHECK, "truncate_number", limits=FAST) == ["wrong"]
    right = "def truncate_number(number):\n    return number % 1.0\n"
    assert run_tests(shadow_abs + right, TRUNCATE_CHECK, "truncate_number", limits=FAST) == ["passed"]

    shadow_set = "set = lambda *a: 0\n"
    assert run_tests(SIMILAR_WRONG, SIMILAR_TESTS, limits=FAST) == ["wrong"] * 3
    assert run_tests(shadow_set + SIMILAR_WRONG, SIMILAR_TESTS, limits=FAST) == ["wrong"] * 3
    assert run_tests(SIMILAR_OK, SIMILAR_TESTS, limits=FAST) == ["passed"] * 3
    # a module's name bound to something else is not that module for the test
    fake_math = "class math:\n    isclose = staticmethod(lambda *a, **k: True)\ndef f(x):\n    return 0.0\n"
    assert run_tests(fake_math, ["import math\nassert math.isclose(f(2.0), 4.0)"], limits=FAST) == ["wrong"]
    assert run_tests(fake_math, ["assert math.isclose(f(2.0), 4.0)"], limits=FAST) == ["wrong"]
    # a function of the program named like a module is the program's when the test calls it
    numbers = "def numbers(n):\n    return list(range(n))\n"
    assert run_tests(numbers, ["assert numbers(3) == [0, 1, 2]"], limits=FAST) == ["passed"]
    # the row's function itself may have a builtin's name
    own_sum = "def sum(xs):\n    return 6\n"
    assert run_tests(own_sum, [{"args": [[1, 2, 3]], "result": 6}], "sum", limits=FAST) == ["passed"]
    assert run_tests(own_sum, ["assert sum([1, 2, 3]) == 6"], "sum", limits=FAST) == ["passed"]


@pytest.mark.parametrize("module", ["venv.__main__", "this", "unittest.__main__"])
def test_the_judge_imports_nothing_on_the_programs_word(module, capsys):
    """Issue 58 item 2: a program holding ``types.ModuleType("venv.__main__")`` made the judge import it, which ran
    ``python -m venv`` on the trainer's argv and raised SystemExit(0) out of the reward process. Only the plain
    modules of TEST_MODULES are imported here; the program's other modules are left out of the test."""
    before = set(__import__("sys").modules)
    program = f"import types\nm = types.ModuleType({module!r})\ndef add(a, b):\n    return a + b\n"
    assert run_tests(program, ASSERTS, "add", limits=FAST) == ["passed"] * 4
    assert run_tests(program, ["assert m is not None"], "add", limits=FAST) == ["runtime_error"]
    assert module not in set(__import__("sys").modules) - before
    assert "Zen of Python" not in capsys.readouterr().out


def test_nothing_a_test_raises_leaves_the_judge():
    """Issue 58 item 2: BaseException is contained around a test (a SystemExit in a test is its error)."""
    program = "def add(a, b):\n    return a + b\n"
    for raising in ("raise SystemExit(0)", "import sys\nsys.exit(3)", "raise GeneratorExit()"):
        assert run_tests(program, [raising], "add", limits=FAST) == ["runtime_error"], raising


def test_containers_namedtuples_and_iterators_cross_as_their_values():
    """Issue 58 item 6: correct solutions returning a Counter (MBPP task 88's own reference solution), defaultdict,
    namedtuple or a generator came back as opaque handles and scored wrong or runtime_error. They cross as their
    values (rebuilt here by name: their methods and attributes work), an iterator's items on demand."""
    freq = "import collections\ndef freq_count(list1):\n    freq_count = collections.Counter(list1)\n    return freq_count\n"
    mbpp_88 = ["assert freq_count([10,10,10,10,20,20,20,20,40,40,50,50,30])==({10: 4, 20: 4, 40: 2, 50: 2, 30: 1})",
               "assert freq_count([1,2,3,4,3,2,4,1,3,1,4])==({1:3, 2:2,3:3,4:3})",
               "assert freq_count([5,6,7,4,9,10,4,5,6,7,9,5])==({10:1,5:3,6:2,7:2,4:2,9:2})"]
    assert run_tests(freq, mbpp_88, limits=FAST) == ["passed"] * 3
    program = ("from collections import defaultdict, namedtuple, OrderedDict, deque, Counter\n"
               "Point = namedtuple('Point', 'x y')\n"
               "class Bag(dict):\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
               "def groups(xs):\n    d = defaultdict(list)\n    for x in xs:\n        d[x % 2].append(x)\n    return d\n"
               "def point(a, b):\n    return Point(a, b)\n"
               "def squares(n):\n    for i in range(n):\n        yield i * i\n"
               "def evens(n):\n    return map(lambda i: 2 * i, range(n))\n"
               "def naturals():\n    i = 0\n    while True:\n        yield i\n        i += 1\n"
               "def broken():\n    yield 1\n    raise ValueError('after one')\n"
               "def ordered():\n    return OrderedDict([('b', 1), ('a', 2)])\n"
               "def window():\n    return deque([1, 2, 3], maxlen=3)\n"
               "def bag():\n    return Bag(a=1)\n"
               "def top(s):\n    return Counter(s)\n"
               "def span(n):\n    return range(n)\n")
    tests = ["assert groups([1, 2, 3, 4]) == {1: [1, 3], 0: [2, 4]}",
             "g = groups([1])\nassert g[0] == [] and isinstance(g, dict)",
             "p = point(1, 2)\nassert p == (1, 2) and p.x == 1 and p.y == 2 and p._asdict() == {'x': 1, 'y': 2}",
             "assert list(squares(4)) == [0, 1, 4, 9] and sum(squares(1000)) == 332833500",
             "it = squares(3)\nassert next(it) == 0 and list(it) == [1, 4]",
             "assert list(evens(3)) == [0, 2, 4]",
             "import itertools\nassert list(itertools.islice(naturals(), 5)) == [0, 1, 2, 3, 4]",
             "it = broken()\nassert next(it) == 1\ntry:\n    next(it)\n    assert False\nexcept ValueError:\n    pass",
             "assert list(ordered()) == ['b', 'a'] and ordered() == {'a': 2, 'b': 1}",
             "assert window() == __import__('collections').deque([1, 2, 3]) and window().maxlen == 3",
             "assert top('aab').most_common(1) == [('a', 2)]",
             "assert span(3) == range(3)"]
    assert run_tests(program, tests, limits=FAST) == ["passed"] * len(tests)
    # a dict subclass crosses as its data: its own __eq__ stays behind
    assert run_tests(program, ["assert bag() == {'a': 2}"], limits=FAST) == ["wrong"]
    assert run_tests(program, [{"args": [], "result": {"a": 1}}], "bag", limits=FAST) == ["passed"]
    assert run_tests(program, [{"args": [3], "result": [0, 1, 4]}], "squares", limits=FAST) == ["wrong"]  # as Python


SPOOF = ("class Fraction:\n    __module__ = 'fractions'\n    def __repr__(self):\n        return {text!r}\n"
         "def f():\n    return Fraction()\n")


@pytest.mark.parametrize("text", ["Fraction('1e20000000')", "Decimal('1e20000000')", "Fraction('" + "7" * 6000 + "')",
                                  "[" + "1" * 6000 + "]"], ids=["fraction-exponent", "decimal-exponent",
                                                                "fraction-digits", "int-digits"])
def test_an_answers_numbers_are_bounded_before_the_judge_builds_them(text):
    """Issue 58 item 7: an answer's text (here through a class that claims to be fractions.Fraction, whose repr is
    the answer) made the trusted judge build Fraction('1e20000000'): 19-21 s on a 2 s test. Digits and exponents
    past 4,300 are refused before anything is built: the output past its limit (killed)."""
    assert run_tests(SPOOF.format(text=text), ["assert f() == 1"], limits=FAST) == ["killed"]


def test_an_answer_of_too_many_values_is_refused_before_it_is_read():
    """Issue 58 item 7: a 4 MiB list literal peaked at 1.9 GB in the judge's parser. Answers are read by a scanner
    that holds no syntax tree, and more than 200,000 values (1,000,000 in a list of numbers alone, which JSON's reader
    takes) is the output past its limit. Below that, a long answer is read whole."""
    program = ("def pairs(n):\n    return [('ab', i) for i in range(n)]\n"
               "def numbers(n):\n    return [i * 0.5 if i % 2 else i for i in range(n)]\n"
               "def zeros(n):\n    return [0] * n\n")
    assert run_tests(program, ["assert len(pairs(100_000)) == 100_000"], limits=FAST) == ["killed"]  # 300,000 values
    assert run_tests(program, ["assert len(zeros(1_100_000)) == 1_100_000"], limits=FAST) == ["killed"]
    assert run_tests(program, ["assert pairs(50_000)[-1] == ('ab', 49_999)",
                               "xs = numbers(400_000)\nassert len(xs) == 400_000 and xs[-1] == 399_999 * 0.5"],
                     limits=FAST) == ["passed", "passed"]


def test_the_judges_own_time_counts_against_the_tests_limit():
    """Issue 58 item 7: the time the judge spends (reading answers, running the test's own code) is the test's."""
    program = "def add(a, b):\n    return a + b\n"
    slow = "import time\ntime.sleep(1.5)\nassert add(1, 2) == 3"
    assert run_tests(program, [slow], limits={"timeout": 1.0, "cpu_seconds": 1}) == ["timeout"]
    assert run_tests(program, [slow], limits=FAST) == ["passed"]
