"""Write docs/config-reference.md from the config dataclasses' own field documentation.

Every key of ``grpo/foundation/config.py`` (and every algorithm's ``algo.<key>`` option from its
``Options`` dataclass in ``algos/``) gets a row: key, type, default, meaning. A field's meaning is
read from its source, in this order (the first that exists wins, the comments are joined):

1. ``field(..., metadata={"help": "..."})``;
2. the ``#`` comment block directly above the field (no blank line between), plus
3. the ``#`` comment at the end of the field's line(s).

Divider comments (``# --- functions``) are skipped. A comment block right below a field that has a
trailing comment, above a field that has its own, continues the first field's comment when it starts
in lower case (the rest of a sentence too long for one line).

A field with none of these is *undocumented*: it still gets a row (marked so), the script with
``--check`` exits 1 naming it, and ``tests/test_docs.py`` fails with the list. Document it with a
comment in the style of its neighbours, then run::

    PYTHONPATH=. python scripts/gen_config_docs.py          # rewrites docs/config-reference.md
    PYTHONPATH=. python scripts/gen_config_docs.py --check  # exit 1 if stale or a key is undocumented
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parent.parent
DIVIDER = re.compile(r"^[-=#*~ ]{3,}\w*[\w ]*[-=#*~ ]*$")  # "--- functions": a section divider, not a field's doc
OUT = ROOT / "docs" / "config-reference.md"


# --------------------------------------------------------------------------- reading the source


def _class_field_docs(cls: type) -> dict[str, str]:
    """Field name -> its documentation, from ``cls``'s own source (not its bases')."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = src.splitlines()
    comments: dict[int, str] = {}  # line number (1-based) -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    tree = ast.parse(src)
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    fields = [n for n in klass.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]

    def trailing(node: ast.AnnAssign) -> list[str]:
        return [comments[i] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                if i in comments and not lines[i - 1].strip().startswith("#")]

    docs: dict[str, list[str]] = {}
    previous: Optional[ast.AnnAssign] = None
    for node in fields:
        name = node.target.id
        above = []
        ln = node.lineno - 1
        while ln >= 1 and lines[ln - 1].strip().startswith("#"):
            text = comments.get(ln, lines[ln - 1].strip().lstrip("#").strip())
            if not DIVIDER.match(text):
                above.insert(0, text)
            ln -= 1
        own = trailing(node)
        # A block right below a field with a trailing comment, above a field with its own trailing comment,
        # continues the first field's comment when it starts in lower case (the rest of a long sentence).
        if (above and own and above[0][:1].islower() and previous is not None and previous.end_lineno == ln
                and trailing(previous)):
            docs.setdefault(previous.target.id, []).extend(above)
            above = []
        help_text = _metadata_help(node.value)
        docs[name] = [help_text] if help_text else [t for t in above + own if t]
        previous = node
    return {k: " ".join(v) for k, v in docs.items() if v}


def _metadata_help(value: Optional[ast.expr]) -> Optional[str]:
    """The ``help`` string of ``field(metadata={"help": ...})``, if the field is written that way."""
    if not (isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field"):
        return None
    for kw in value.keywords:
        if kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
            for k, v in zip(kw.value.keys, kw.value.values):
                if isinstance(k, ast.Constant) and k.value == "help" and isinstance(v, ast.Constant):
                    return str(v.value)
    return None


def field_docs(cls: type) -> dict[str, str]:
    """Documentation of every field of ``cls``, inherited fields read from the class that defines them."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_class_field_docs(klass))
    return docs


def class_summary(cls: type) -> str:
    """The first paragraph of a class's own docstring (none: empty)."""
    doc = cls.__dict__.get("__doc__") or ""
    if not doc or doc.startswith(cls.__name__ + "("):  # dataclasses' generated signature
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


# --------------------------------------------------------------------------- types and defaults


def _nested_dataclass(tp: Any) -> Optional[tuple[type, str]]:
    """A dataclass inside an annotation: (class, how it nests: '' | '[]' | '?')."""
    if dataclasses.is_dataclass(tp):
        return tp, ""
    origin = get_origin(tp)
    args = [a for a in get_args(tp) if a is not type(None)]
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], "[]"
    if origin is Union or str(origin) == "types.UnionType":
        for a in args:
            inner = _nested_dataclass(a)
            if inner:
                return inner[0], "[]" if inner[1] == "[]" else "?"
    return None


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(tp))
    if origin is Union or str(origin) == "types.UnionType":
        return " or ".join(type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        (item,) = get_args(tp) or (Any,)
        return f"list of {type_name(item)}"
    if origin is dict:
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return "`" + repr([dataclasses.asdict(v) for v in value]).replace("|", "\\|") + "`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return "`" + repr(value).replace("|", "\\|") + "`"


# --------------------------------------------------------------------------- collecting keys


@dataclasses.dataclass
class Key:
    path: str
    type: str
    default: str
    doc: str


def collect(cls: type, prefix: str, out: list[Key], skip: frozenset = frozenset()) -> None:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        nested = _nested_dataclass(tp)
        doc = " ".join(docs.get(f.name, "").split())
        if nested is None:
            # its range, declared on the field (grpo.foundation.config.positive / at_least_zero), beside its type
            kind = type_name(tp) + (f" ({f.metadata['range']})" if "range" in f.metadata else "")
            out.append(Key(path, kind, default_text(f), doc))
            continue
        inner, how = nested
        if how == "?" or how == "[]":  # a section that may be null, or a list of entries: its own row too
            out.append(Key(path, type_name(tp), default_text(f), doc or class_summary(inner)))
        collect(inner, f"{path}{'[]' if how == '[]' else ''}.", out)


def config_sections() -> list[tuple[str, str, list[Key]]]:
    from grpo.foundation.config import Config

    sections = []
    hints = typing.get_type_hints(Config)
    docs = field_docs(Config)
    top: list[Key] = []  # keys at the top level that are not sections
    for f in dataclasses.fields(Config):
        keys: list[Key] = []
        nested = _nested_dataclass(hints[f.name])
        if nested is None:
            top.append(Key(f.name, type_name(hints[f.name]), default_text(f), " ".join(docs.get(f.name, "").split())))
            continue
        inner, how = nested
        if how == "[]":
            keys.append(Key(f.name, type_name(hints[f.name]), default_text(f), class_summary(inner)))
            collect(inner, f"{f.name}[].", keys)
        else:
            collect(inner, f"{f.name}.", keys, skip=frozenset({"options"}))
        sections.append((f.name, class_summary(inner), keys))
    if top:
        sections.insert(0, ("top-level", "Keys outside any section.", top))
    return sections


def algorithm_sections() -> list[tuple[str, Any, list[Key]]]:
    from algos import ALGORITHMS

    out = []
    for name in sorted(ALGORITHMS):
        algo = ALGORITHMS[name]
        keys: list[Key] = []
        if dataclasses.is_dataclass(algo.Options) and dataclasses.fields(algo.Options):
            collect(algo.Options, "algo.", keys)
        out.append((name, algo, keys))
    return out


def undocumented() -> list[str]:
    """Every config key and algorithm option without documentation (see the module docstring)."""
    missing = [k.path for _, _, keys in config_sections() for k in keys if not k.doc]
    for name, _, keys in algorithm_sections():
        missing += [f"{k.path} ({name})" for k in keys if not k.doc]
    return missing


# --------------------------------------------------------------------------- writing


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from the dataclasses in grpo/foundation/config.py and the",
        "     algorithms' Options in algos/. Do not edit by hand: edit the field's comment and re-run the script. -->",
        "",
        "Every key the trainer accepts, with its type, its default and what it does. Set keys in the YAML file",
        "(`--config`) or on the command line (`train.lr=1e-5`); precedence and validation are described in",
        "[configuration.md](configuration.md). `python train.py --config C.yaml --print-config` prints the",
        "resolved values of a run. A key written `a[].b` is the key `b` of each entry of the list `a`.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{name})" for name, _, _ in config_sections())
        + ", [algorithm options](#algorithm-options).",
        "",
    ]
    for name, summary, keys in config_sections():
        lines += [f"## {name}", ""]
        if summary:
            lines += [summary, ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for k in keys:
            doc = _cell(k.doc) if k.doc else "**undocumented**"
            lines.append(f"| `{k.path}` | {k.type} | {k.default} | {doc} |")
        lines.append("")
    lines += [
        "## Algorithm options",
        "",
        "Each algorithm's own keys, flat under `algo` (`algo.alpha2=0.2`); a key of another algorithm is a",
        "config error. \"Overrides\" are the shared `algo.*` defaults the algorithm changes (applied before the",
        "YAML file). Formulas: [algorithms.md](algorithms.md).",
        "",
    ]
    for name, algo, keys in algorithm_sections():
        lines += [f"### {name}", ""]
        head = f"{algo.paper}." if algo.paper else ""
        overrides = ", ".join(f"`{k}` = `{v!r}`" for k, v in algo.defaults.items())
        lines += [(head + (f" Overrides: {overrides}." if overrides else " No overrides.")).strip(), ""]
        if keys:
            lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
            for k in keys:
                doc = _cell(k.doc) if k.doc else "**undocumented**"
                lines.append(f"| `{k.path}` | {k.type} | {k.default} | {doc} |")
        else:
            lines.append("No options of its own.")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the file is stale or a key is undocumented")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    text = render()
    missing = undocumented()
    if args.check:
        stale = not args.out.exists() or args.out.read_text() != text
        if stale:
            print(f"{args.out} is stale: run PYTHONPATH=. python scripts/gen_config_docs.py", file=sys.stderr)
        if missing:
            print("undocumented config keys: " + ", ".join(missing), file=sys.stderr)
        return 1 if stale or missing else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({text.count(chr(10))} lines)")
    if missing:
        print("undocumented config keys (document them in the source): " + ", ".join(missing), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
