"""The ``code_tests`` judge: a test's code runs here, in the trusted process; the model's program runs in the
sandbox and only answers calls (docs/sandbox.md, "the reward itself").

The program is loaded by :data:`SERVE` in a :class:`rewards.sandbox.Session`. Its top-level names come back as
plain values, standard-library modules, or *handles* (a function, a class, an object); the test is executed
here with those names, and each call of a handle is a request to the sandbox whose answer is plain data
(numbers, strings, bytes, None, and lists, tuples, sets and dicts of them, read by :func:`ast.literal_eval`) or
another handle. So nothing the program does reaches the judgement: an ``__eq__`` that is always true, a patched
``unittest`` or builtin, an ``os._exit(0)``, a printed "passed", the frames of the harness: none of them is in
this process. A handle compares equal only to itself. A test passes when its asserts hold here (``assert``
tests, HumanEval's ``check(candidate)``) or the answer equals the expected value, type included (``call``
tests).
"""

from __future__ import annotations

import ast
import base64
import builtins
import importlib
import io
import pickle
from decimal import Decimal
from fractions import Fraction
from typing import Any, Optional

from rewards import sandbox

# Runs in the sandbox (standard library only). Requests on stdin, answers on stdout, one repr()'d tuple a
# line; the program's own stdin is empty and its prints go to stderr.
SERVE = r'''
import _pickle, binascii, io, os, sys, types  # not pickle / base64: they import re (9 ms a test)
requests = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace")
answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.dup2(2, 1)
PLAIN = (int, float, complex, str, bytes, bool, type(None))
NUMBERS = {("fractions", "Fraction"), ("decimal", "Decimal")}
objects = {}

def plain(v, depth=0):
    t = type(v)
    if t in PLAIN or (t.__module__, t.__name__) in NUMBERS:
        return True
    if depth > 50:
        return False
    if t in (list, tuple, set, frozenset):
        return all(plain(x, depth + 1) for x in v)
    if t is dict:
        return all(plain(k, depth + 1) and plain(x, depth + 1) for k, x in v.items())
    return False

def encode(v):
    if plain(v):
        try:
            return ("value", repr(v))
        except Exception:
            pass
    objects[len(objects) + 1] = v
    return ("ref", len(objects), type(v).__name__)

class Requests(_pickle.Unpickler):
    def persistent_load(self, ref):  # a handle the test passes back: the object itself
        return objects[ref]

def say(*parts):
    answers.write(repr(parts) + "\n")
    answers.flush()

try:
    code = compile(open("solution.py").read(), "solution.py", "exec")
except (SyntaxError, ValueError, MemoryError, RecursionError):
    say("compile_error")
    os._exit(0)
g = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(code, g)
except MemoryError:
    say("memory")
    os._exit(0)
except BaseException as e:
    say("load_error", type(e).__name__, str(e)[:500])
    os._exit(0)
names = []
for k, v in list(g.items()):
    if k.startswith("__"):
        continue
    if isinstance(v, types.ModuleType):
        names.append((k, "module", v.__name__))
    else:
        names.append((k,) + encode(v))
say("ready", names)
for line in requests:
    try:
        seq, op, target, *rest = Requests(io.BytesIO(binascii.a2b_base64(line))).load()
        if op == "call":
            args, kwargs = rest
            out = objects[target](*args, **kwargs)
        elif op == "getattr":
            out = getattr(objects[target], rest[0])
        else:
            raise ValueError(op)
        reply = encode(out)
    except MemoryError:
        reply = ("raise", "MemoryError", "")
    except BaseException as e:
        try:
            reply = ("raise", type(e).__name__, str(e)[:500])
        except BaseException:
            reply = ("raise", "Exception", "")
    say(seq, *reply)
'''

MAX_ANSWER_BYTES = 8 << 20  # one answer of the program (a returned value), as text


class Gone(BaseException):
    """The sandboxed program ended, was stopped, or broke the protocol while a test waited for it (not an
    Exception: a test's own ``except Exception`` does not swallow it)."""


class RemoteError(Exception):
    """The program raised while answering a call (its exception's type name and text). Raised as a subclass of
    the builtin exception of that name too, so a test expecting ``ValueError`` catches it."""

    kind = "Exception"


_REMOTE_TYPES: dict[str, type] = {}


def remote_error(kind: str, text: str) -> RemoteError:
    if kind not in _REMOTE_TYPES:
        base = getattr(builtins, kind, None)
        cls: type = RemoteError
        if isinstance(base, type) and issubclass(base, Exception) and base is not Exception:
            try:
                cls = type(f"Remote{kind}", (RemoteError, base), {})
            except TypeError:  # a builtin whose layout cannot be combined (OSError's family)
                cls = RemoteError
        _REMOTE_TYPES[kind] = cls
    err = _REMOTE_TYPES[kind](f"{kind}: {text}")
    err.kind = kind
    return err


def literal(text: str) -> Any:
    """Plain data from its repr(): numbers (nan and inf too, Fraction and Decimal), strings, bytes, None, and
    lists, tuples, sets, frozensets and dicts of them. Nothing is called but those two constructors and
    set() / frozenset(). ValueError for anything else."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        return _plain(tree, 0)
    except (SyntaxError, MemoryError, RecursionError, TypeError, ArithmeticError) as e:
        raise ValueError(f"not plain data: {text[:80]!r} ({type(e).__name__})") from None


_MAKERS = {"Fraction": Fraction, "Decimal": Decimal, "set": set, "frozenset": frozenset}


def _plain(node: ast.AST, depth: int) -> Any:
    if depth > 100:
        raise ValueError("plain data nested too deeply")
    d = depth + 1
    if isinstance(node, ast.Constant) and not isinstance(node.value, type(...)):
        return node.value
    if isinstance(node, ast.Name) and node.id in ("nan", "inf"):
        return float(node.id)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_plain(e, d) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_plain(k, d): _plain(v, d) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _plain(node.operand, d)
        if type(v) in (int, float, complex, Fraction, Decimal):
            return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):  # complex: 1+2j
        left, right = _plain(node.left, d), _plain(node.right, d)
        if type(left) in (int, float) and type(right) is complex:
            return left + right if isinstance(node.op, ast.Add) else left - right
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _MAKERS
            and not node.keywords and len(node.args) <= 2):
        args = [_plain(a, d) for a in node.args]
        if all(type(a) in (int, str, set, list, tuple) for a in args):
            return _MAKERS[node.func.id](*args)
    raise ValueError(f"not plain data ({type(node).__name__})")


class Handle:
    """A value that stayed in the sandbox (a function, a class, an object): calling it or reading an attribute
    asks the program; it equals only itself."""

    def __init__(self, conn: "Connection", ref: int, kind: str):
        self._conn, self._ref, self._kind = conn, ref, kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._conn.ask("call", self._ref, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._conn.ask("getattr", self._ref, name)

    def __repr__(self) -> str:
        return f"<{self._kind} in the sandbox>"


class _Requests(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Optional[int]:
        return obj._ref if isinstance(obj, Handle) else None


class Connection:
    """Requests and answers over a sandbox Session."""

    def __init__(self, session: sandbox.Session):
        self.session, self.seq = session, 0

    def read(self) -> tuple:
        line = self.session.receive()
        if line is None:
            raise Gone()
        try:
            parts = literal(line)
        except ValueError as e:
            raise Gone(f"the program broke the protocol ({e})") from None
        if not isinstance(parts, tuple) or not parts:
            raise Gone("the program broke the protocol")
        return parts

    def value(self, parts: tuple) -> Any:
        kind = parts[0]
        if kind == "value" and len(parts) == 2 and isinstance(parts[1], str):
            try:
                return literal(parts[1])
            except ValueError as e:
                raise Gone(str(e)) from None
        if kind == "ref" and len(parts) == 3 and isinstance(parts[1], int):
            return Handle(self, parts[1], str(parts[2]))
        if kind == "raise" and len(parts) == 3:
            raise remote_error(str(parts[1]), str(parts[2]))
        raise Gone("the program broke the protocol")

    def ask(self, op: str, target: int, *rest: Any) -> Any:
        """A request (pickled: from the trusted side to the sandbox only; handles go back as references) and
        its answer (never unpickled: plain data or a handle)."""
        self.seq += 1
        buf = io.BytesIO()
        try:
            _Requests(buf).dump((self.seq, op, target, *rest))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"a test passes the program an argument that cannot be sent to it ({e})") from None
        if not self.session.send(base64.b64encode(buf.getvalue()).decode()):
            raise Gone()
        parts = self.read()
        if parts[0] != self.seq:
            raise Gone("the program broke the protocol (an answer to another call)")
        return self.value(parts[1:])

    def namespace(self, names: Any, entry_point: Optional[str] = None) -> dict[str, Any]:
        """The program's top-level names for the test: values, handles and standard-library modules. A name
        that shadows a builtin is left out (the test's ``abs`` or ``set`` is always the real one), unless it
        is the row's entry point; a module is imported here only when it is one of :data:`TEST_MODULES`
        (nothing is imported on the program's word: ``venv.__main__`` would run on import)."""
        ns: dict[str, Any] = {}
        for item in names if isinstance(names, list) else []:
            if not (isinstance(item, tuple) and item and isinstance(item[0], str)):
                continue
            if item[0] in _BUILTIN_NAMES and item[0] != entry_point:
                continue
            if len(item) == 3 and item[1] == "module":
                if item[2] in TEST_MODULES:
                    ns[item[0]] = importlib.import_module(item[2])
                continue
            if item[0] in TEST_MODULES:  # not a module, under a module's name: the test must not use it as one
                continue
            try:
                ns[item[0]] = self.value(item[1:])
            except (Gone, RemoteError):
                continue
        return ns


_BUILTIN_NAMES = frozenset(vars(builtins))

# The modules a program's imports make visible to a test (MBPP's tests call ``math.isclose`` on the program's
# ``import math``): standard-library modules whose import does nothing but define names. Others are left out.
TEST_MODULES = frozenset({
    "abc", "array", "bisect", "calendar", "cmath", "collections", "collections.abc", "copy", "dataclasses",
    "datetime", "decimal", "enum", "fractions", "functools", "hashlib", "heapq", "io", "itertools", "json",
    "math", "numbers", "operator", "os", "os.path", "queue", "random", "re", "statistics", "string", "struct",
    "sys", "textwrap", "time", "types", "typing", "unicodedata"})


def judge(program: str, job: dict, limits: Any) -> str:
    """The outcome of one ``assert`` or ``call`` test (code_tests.METRICS)."""
    session = sandbox.Session(["python", "serve.py"], limits, files={"serve.py": SERVE, "solution.py": program},
                              max_line_bytes=MAX_ANSWER_BYTES)
    try:
        outcome = _judge(Connection(session), job)
    finally:
        result = session.close()
    if result.reason == "error":
        raise sandbox.SandboxError(f"code_tests: the sandbox could not run the program: {result.error}")
    if outcome is not None:
        return outcome
    if result.reason in ("timeout", "cpu"):
        return "timeout"
    if result.reason == "memory":
        return "memory"
    if result.reason in ("signal", "output_limit"):
        return "killed"
    return "runtime_error"  # it ended itself (sys.exit, os._exit) while a test waited for it


def _judge(conn: Connection, job: dict) -> Optional[str]:
    """The test's outcome, or None when the program's end decides it (see :func:`judge`)."""
    try:
        hello = conn.read()
        if hello[0] == "compile_error":
            return "compile_error"
        if hello[0] == "memory":
            return "memory"
        if hello[0] == "load_error":
            return "memory" if len(hello) > 1 and hello[1] == "MemoryError" else "runtime_error"
        if hello[0] != "ready" or len(hello) != 2:
            return "runtime_error"
        ns = conn.namespace(hello[1], job.get("fn_name") or job.get("entry_point"))
        if job["kind"] == "call":
            fn = ns.get(job["fn_name"])
            if not isinstance(fn, Handle):
                return "runtime_error"
            got = fn(*job["args"])
            if isinstance(got, tuple):
                got = list(got)
            want = job["result"]
            same = type(got) is type(want) and got == want or (
                type(got) in (int, float) and type(want) in (int, float)
                and abs(got - want) <= 1e-9 * max(1.0, abs(want)))
            return "passed" if same else "wrong"
        ns["__name__"] = "__test__"
        exec(compile(job["test"], "test.py", "exec"), ns)
        if job.get("entry_point") and "def check(" in job["test"] and callable(ns.get("check")):
            ns["check"](ns.get(job["entry_point"]))
        return "passed"
    except AssertionError:
        return "wrong"
    except RemoteError as e:  # the program's exception reached the test (the old harness's outcomes)
        return {"MemoryError": "memory", "AssertionError": "wrong"}.get(e.kind, "runtime_error")
    except Gone:
        return None
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - the test's own error with this program (a NameError: a missing
        return "runtime_error"  # function), a SystemExit included: nothing a test raises ends the reward process
