"""The ``code_tests`` judge: a test's code runs here, in the trusted process; the model's program runs in the
sandbox and only answers calls (docs/sandbox.md, "the reward itself").

The program is loaded by :data:`SERVE` in a :class:`grpo.workers.sandbox.Session`. Its top-level names come back as
plain values, standard-library modules, or *handles* (a function, a class, an object); the test is executed
here with those names, and each call of a handle is a request to the sandbox whose answer is plain data
(numbers, strings, bytes, None, and lists, tuples, sets and dicts of them; a Counter, OrderedDict, defaultdict,
deque, namedtuple or range rebuilt here by name; a container's subclass as the container; read by :func:`literal`,
which calls nothing else), an iterator whose items come on demand (a generator, map, zip), or another handle. So nothing the program does reaches the judgement: an ``__eq__`` that is always true, a patched
``unittest`` or builtin, an ``os._exit(0)``, a printed "passed", the frames of the harness: none of them is in
this process. A handle compares equal only to itself. A test passes when its asserts hold here (``assert``
tests, HumanEval's ``check(candidate)``) or the answer equals the expected value, type included (``call``
tests).
"""

from __future__ import annotations

import ast
import base64
import builtins
import collections
import importlib
import io
import json
import math
import pickle
import re
import time
from decimal import Decimal
from fractions import Fraction
from typing import Any, Optional

from grpo.workers import sandbox

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
FACTORIES = (int, float, str, bytes, list, tuple, dict, set, frozenset)  # a defaultdict's factories that cross
CHUNK = 256  # an iterator's items per answer
objects, pending = {}, {}

class Made:  # a value the judge rebuilds by name (its repr is the constructor call the judge parses)
    def __init__(self, text):
        self.text = text
    def __repr__(self):
        return self.text

def conv(v, d=0):
    """v as plain data: containers of plain data (their subclasses as the container: a user's dict subclass as a
    dict), with Counter, OrderedDict, defaultdict, deque, namedtuple and range rebuilt by name on the judge's side;
    TypeError for anything else (it stays here, as a handle)."""
    t = type(v)
    if t in PLAIN or (t.__module__, t.__name__) in NUMBERS:
        return v
    if d > 50:
        raise TypeError("too deep")
    d += 1
    n = (t.__module__, t.__name__)
    if n == ("collections", "Counter"):
        return Made("Counter(%r)" % ({conv(k, d): conv(x, d) for k, x in v.items()},))
    if n == ("collections", "OrderedDict"):
        return Made("OrderedDict(%r)" % ([(conv(k, d), conv(x, d)) for k, x in v.items()],))
    if n == ("collections", "defaultdict"):
        f = v.default_factory
        return Made("defaultdict(%r, %r)" % (f.__name__ if f in FACTORIES else None,
                                             {conv(k, d): conv(x, d) for k, x in v.items()}))
    if n == ("collections", "deque"):
        return Made("deque(%r, %r)" % ([conv(x, d) for x in v], v.maxlen))
    if t is range:
        return Made(repr(v))
    if isinstance(v, tuple) and isinstance(getattr(t, "_fields", None), tuple):
        return Made("namedtuple(%r, %r, %r)" % (t.__name__, tuple(str(f) for f in t._fields),
                                                tuple(conv(x, d) for x in v)))
    if isinstance(v, dict):
        return {conv(k, d): conv(x, d) for k, x in dict.items(v)}
    for base in (list, tuple, set, frozenset):
        if isinstance(v, base):
            return base(conv(x, d) for x in base.__iter__(v))
    for base in (bool, int, float, complex, str, bytes):
        if isinstance(v, base):
            return base(v)
    raise TypeError(t.__name__)

def encode(v):
    try:
        return ("value", repr(conv(v)))
    except Exception:
        pass
    objects[len(objects) + 1] = v
    kind = "iter" if hasattr(type(v), "__next__") else "ref"  # a generator, map, zip, ...: its items on demand
    return (kind, len(objects), type(v).__name__)

def take(ref):
    """The next items of an iterator (up to CHUNK), whether it is done; an error after some items comes next time."""
    if ref in pending:
        raise pending.pop(ref)
    it, items = objects[ref], []
    while len(items) < CHUNK:
        try:
            items.append(next(it))
        except StopIteration:
            return [encode(x) for x in items], True
        except BaseException as e:
            if not items:
                raise
            pending[ref] = e
            break
    return [encode(x) for x in items], False

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
        elif op == "next":
            items, done = take(target)
            say(seq, "items", items, done)
            continue
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


class TooLarge(Gone):
    """An answer past the judge's limits on reading it (:class:`AnswerTooLarge`): output past its limit."""


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


MAX_ITEMS = 200_000  # values in one answer read value by value (the judge's time to read it: about 1 s)
MAX_NUMBERS = 1_000_000  # numbers in an answer that is a list of numbers alone (JSON's reader: about 0.2 s)
MAX_DIGITS = 4300  # an integer's digits, a number's exponent (Python's own int-from-text limit)


class AnswerTooLarge(ValueError):
    """An answer past MAX_ITEMS values or MAX_DIGITS digits: the program's output past its limit."""


_TOKEN = re.compile(r"""\s*(?:
    (?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?j?)
  | (?P<str>b?(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"))
  | (?P<name>[A-Za-z_]\w*)
  | (?P<op>[][(){},:+-])
  )""", re.X)
_NAMES = {"True": True, "False": False, "None": None, "nan": math.nan, "inf": math.inf, "infj": complex(0, math.inf),
          "nanj": complex(0, math.nan)}


def literal(text: str) -> Any:
    """Plain data from its repr(): numbers (nan and inf too), strings, bytes, None, lists, tuples, sets and dicts of
    them, and the values :data:`_MAKERS` rebuilds by name (Fraction, Decimal, Counter, namedtuple, ...; nothing
    else is ever called). Read by a scanner in one pass, at most MAX_ITEMS values and MAX_DIGITS digits a number
    (AnswerTooLarge past them); ValueError for anything else."""
    if (text[:1] == "[" and "'" not in text and '"' not in text and "\\" not in text
            and text.count(",") < MAX_NUMBERS):  # lists of numbers alone (the long answers): JSON's reader, in C
        try:
            return json.loads(text, parse_int=_int)
        except AnswerTooLarge:
            raise
        except (ValueError, RecursionError):
            pass
    try:
        reader = _Reader(text)
        value = reader.value(0)
        if reader.peek() is not None:
            raise ValueError("text after the value")
        return value
    except AnswerTooLarge:
        raise
    except (ValueError, MemoryError, RecursionError, TypeError, ArithmeticError, KeyError, SyntaxError) as e:
        raise ValueError(f"not plain data: {text[:80]!r} ({type(e).__name__}: {str(e)[:80]})") from None


class _Reader:
    """A recursive-descent reader of repr() text (see :func:`literal`)."""

    def __init__(self, text: str):
        self.text, self.pos, self.items = text, 0, 0
        self.ahead = self._scan()

    def _scan(self) -> Optional[tuple[str, str]]:
        """The next token (its kind, its text), None at the end; every character is a token's or blank."""
        m = _TOKEN.match(self.text, self.pos)
        if m is None or m.lastgroup is None:
            if self.text[self.pos:].strip():
                raise ValueError(f"unreadable text at {self.pos}")
            return None
        self.pos = m.end()
        return m.lastgroup, m.group(m.lastgroup)

    def peek(self) -> Optional[str]:
        return None if self.ahead is None else self.ahead[1]

    def take(self) -> tuple[str, str]:
        if self.ahead is None:
            raise ValueError("the text ends inside a value")
        token, self.ahead = self.ahead, self._scan()
        return token

    def expect(self, op: str) -> None:
        kind, tok = self.take()
        if tok != op or kind != "op":
            raise ValueError(f"expected {op!r}, got {tok!r}")

    def value(self, depth: int) -> Any:
        if depth > 100:
            raise ValueError("plain data nested too deeply")
        self.items += 1
        if self.items > MAX_ITEMS:
            raise AnswerTooLarge(f"an answer of more than {MAX_ITEMS} values")
        kind, tok = self.take()
        if kind == "num":
            return _number(tok)
        if kind == "str":
            return ast.literal_eval(tok)  # one string or bytes literal (the scanner matched exactly one)
        if kind == "name":
            if self.peek() == "(" and tok in _MAKERS:
                return self.call(tok, depth + 1)
            if tok in _NAMES:
                return _NAMES[tok]
            raise ValueError(f"the name {tok!r}")
        if tok in "+-":
            v = self.value(depth + 1)
            if type(v) not in (int, float, complex):
                raise ValueError(f"{tok}{type(v).__name__}")
            return -v if tok == "-" else +v
        if tok == "[":
            return self.sequence("]", depth + 1)
        if tok == "(":
            return self.parenthesised(depth + 1)
        if tok == "{":
            return self.braced(depth + 1)
        raise ValueError(f"unexpected {tok!r}")

    def sequence(self, close: str, depth: int) -> list:
        out = []
        while self.peek() != close:
            out.append(self.value(depth))
            if self.peek() != close:
                self.expect(",")
        self.take()
        return out

    def parenthesised(self, depth: int) -> Any:
        if self.peek() == ")":
            self.take()
            return ()
        first = self.value(depth)
        if self.peek() in ("+", "-") and type(first) in (int, float):  # a complex number: (1+2j), (-0-1j)
            sign = self.take()[1]
            imag = self.value(depth)
            self.expect(")")
            if type(imag) is not complex or imag.real != 0:
                raise ValueError("not a complex number")
            return complex(first, imag.imag if sign == "+" else -imag.imag)
        if self.peek() == ")":  # (x) is x: repr writes a tuple of one as (x,)
            self.take()
            return first
        self.expect(",")
        return tuple([first] + self.sequence(")", depth))

    def braced(self, depth: int) -> Any:
        if self.peek() == "}":
            self.take()
            return {}
        first = self.value(depth)
        if self.peek() == ":":
            self.take()
            out = {first: self.value(depth)}
            while self.peek() != "}":
                self.expect(",")
                if self.peek() == "}":
                    break
                key = self.value(depth)
                self.expect(":")
                out[key] = self.value(depth)
            self.take()
            return out
        items = [first]
        while self.peek() != "}":
            self.expect(",")
            if self.peek() == "}":
                break
            items.append(self.value(depth))
        self.take()
        return set(items)

    def call(self, name: str, depth: int) -> Any:
        self.expect("(")
        args = self.sequence(")", depth)
        kinds, make = _MAKERS[name]
        if len(args) in kinds and all(type(a) in allowed for a, allowed in zip(args, kinds[len(args)])):
            if name in ("Fraction", "Decimal") and type(args[0]) is str:
                _check_number_text(args[0])
            return make(*args)
        raise ValueError(f"{name} of {[type(a).__name__ for a in args]}")


def _int(tok: str) -> int:
    if len(tok) > MAX_DIGITS:  # whatever sys.set_int_max_str_digits says
        raise AnswerTooLarge(f"a number of {len(tok)} characters")
    return int(tok)


def _number(tok: str) -> Any:
    if len(tok) > MAX_DIGITS:  # int() of more digits is refused (and quadratic); a float's text is short
        raise AnswerTooLarge(f"a number of {len(tok)} characters")
    if tok.endswith("j"):
        return complex(0, float(tok[:-1]))
    if "." in tok or "e" in tok or "E" in tok:
        return float(tok)
    return int(tok)


_NUMBER_TEXT = re.compile(r"\s*[+-]?(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?\s*")


def _check_number_text(text: str) -> None:
    """A number's text for int / Fraction / Decimal: at most MAX_DIGITS digits and an exponent of at most
    MAX_DIGITS (Fraction('1e20000000') would build 10**20000000: 20 s)."""
    m = _NUMBER_TEXT.fullmatch(text.replace("_", "")) if len(text) < 2 * MAX_DIGITS else None
    if m is None:
        if len(text) >= 2 * MAX_DIGITS:
            raise AnswerTooLarge(f"a number of {len(text)} characters")
        return  # not plain digits (a ratio "1/3", "nan", "Infinity"): the constructor decides
    digits = len(m.group(1) or "") + len(m.group(2) or "")
    if digits > MAX_DIGITS or (m.group(3) and abs(int(m.group(3))) > MAX_DIGITS):
        raise AnswerTooLarge(f"the number {text[:40]!r}... has more than {MAX_DIGITS} digits or exponent")


_NAMED: dict[tuple, type] = {}


def _namedtuple(name: str, fields: tuple, values: tuple) -> tuple:
    """A namedtuple of the program's type name and fields (identifiers only: namedtuple checks them)."""
    if len(fields) != len(values) or not all(type(f) is str for f in fields):
        raise ValueError("a namedtuple's fields and values do not match")
    key = (name, fields)
    if key not in _NAMED:
        if len(_NAMED) > 1000:
            _NAMED.clear()
        _NAMED[key] = collections.namedtuple(name, fields)
    return _NAMED[key](*values)


_FACTORIES = {f.__name__: f for f in (int, float, str, bytes, list, tuple, dict, set, frozenset)}
_INT, _SEQ = (int,), (list, tuple)
# name: ({number of arguments: the allowed types of each}, the constructor); nothing else is ever called
_MAKERS: dict[str, tuple[dict[int, tuple], Any]] = {
    "Fraction": ({1: ((int, str),), 2: (_INT, _INT)}, Fraction),
    "Decimal": ({1: ((int, str),)}, Decimal),
    "set": ({0: (), 1: (_SEQ + (set,),)}, set),
    "frozenset": ({0: (), 1: (_SEQ + (set,),)}, frozenset),
    "range": ({1: (_INT,), 2: (_INT, _INT), 3: (_INT, _INT, _INT)}, range),
    "Counter": ({1: ((dict,),)}, collections.Counter),
    "OrderedDict": ({1: ((list,),)}, collections.OrderedDict),
    "defaultdict": ({2: ((str, type(None)), (dict,))},
                    lambda f, d: collections.defaultdict(_FACTORIES[f] if f is not None else None, d)),
    "deque": ({2: ((list,), (int, type(None)))}, collections.deque),
    "namedtuple": ({3: ((str,), (tuple,), (tuple,))}, _namedtuple),
}


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


class RemoteIterator(Handle):
    """An iterator that stayed in the sandbox (a generator, map, zip, ...): its items come on demand, a chunk at a
    time, each plain data or a handle."""

    def __init__(self, conn: "Connection", ref: int, kind: str):
        super().__init__(conn, ref, kind)
        self._buffer: list = []
        self._done = False

    def __iter__(self) -> "RemoteIterator":
        return self

    def __next__(self) -> Any:
        if not self._buffer and not self._done:
            self._buffer, self._done = self._conn.items(self._ref)
        if not self._buffer:
            raise StopIteration
        return self._buffer.pop(0)


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
        except AnswerTooLarge as e:
            raise TooLarge(str(e)) from None
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
            except AnswerTooLarge as e:
                raise TooLarge(str(e)) from None
            except ValueError as e:
                raise Gone(str(e)) from None
        if kind in ("ref", "iter") and len(parts) == 3 and isinstance(parts[1], int):
            return (Handle if kind == "ref" else RemoteIterator)(self, parts[1], str(parts[2]))
        if kind == "raise" and len(parts) == 3:
            raise remote_error(str(parts[1]), str(parts[2]))
        raise Gone("the program broke the protocol")

    def items(self, ref: int) -> tuple[list, bool]:
        """An iterator's next items and whether it is done."""
        parts = self.send("next", ref)
        if parts[0] == "items" and len(parts) == 3 and isinstance(parts[1], list) and isinstance(parts[2], bool):
            return [self.value(p) if isinstance(p, tuple) and p else self._broken() for p in parts[1]], parts[2]
        return [self.value(parts)], False  # a raise (or a broken answer: value() says so)

    @staticmethod
    def _broken() -> Any:
        raise Gone("the program broke the protocol")

    def ask(self, op: str, target: int, *rest: Any) -> Any:
        """A request (pickled: from the trusted side to the sandbox only; handles go back as references) and
        its answer (never unpickled: plain data or a handle)."""
        return self.value(self.send(op, target, *rest))

    def send(self, op: str, target: int, *rest: Any) -> tuple:
        """A request and its answer's parts after the sequence number."""
        self.seq += 1
        buf = io.BytesIO()
        try:
            _Requests(buf).dump((self.seq, op, target, *rest))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"a test passes the program an argument that cannot be sent to it ({e})") from None
        if not self.session.send(base64.b64encode(buf.getvalue()).decode()):
            raise Gone()
        parts = self.read()
        if parts[0] != self.seq or len(parts) < 2:
            raise Gone("the program broke the protocol (an answer to another call)")
        return parts[1:]

    def namespace(self, names: Any, entry_point: Optional[str] = None,
                  modules_used: frozenset = frozenset()) -> dict[str, Any]:
        """The program's top-level names for the test: values, handles and standard-library modules. A name
        that shadows a builtin is left out (the test's ``abs`` or ``set`` is always the real one), unless it
        is the row's entry point; a module is imported here only when it is one of :data:`TEST_MODULES`
        (nothing is imported on the program's word: ``venv.__main__`` would run on import); a name the test
        uses as one of those modules (``math.isclose(...)``, ``modules_used``) is the real module, whatever the
        program bound to it (``class math: isclose = ...``)."""
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
            if item[0] in modules_used:  # not a module, under a module's name the test uses as that module
                ns[item[0]] = importlib.import_module(item[0])
                continue
            try:
                ns[item[0]] = self.value(item[1:])
            except (Gone, RemoteError):
                continue
        return ns


_BUILTIN_NAMES = frozenset(vars(builtins))


def modules_used(test: str) -> frozenset:
    """The names of :data:`TEST_MODULES` that ``test`` reads an attribute of (``math`` in ``math.isclose(x, y)``)."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return frozenset()
    return frozenset(node.value.id for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                     and node.value.id in TEST_MODULES)

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
    if outcome is not None:  # the judge's own time (reading answers, running the test) counts against the limit
        return "timeout" if time.monotonic() > session.deadline and outcome != "compile_error" else outcome
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
        ns = conn.namespace(hello[1], job.get("fn_name") or job.get("entry_point"),
                            modules_used(job["test"]) if job["kind"] == "assert" else frozenset())
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
    except TooLarge:
        return "killed"
    except Gone:
        return None
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - the test's own error with this program (a NameError: a missing
        return "runtime_error"  # function), a SystemExit included: nothing a test raises ends the reward process
