"""The documentation stays true to the code: the generated configuration reference is current and
every key is documented, every relative link in README.md and docs/ resolves, and the README stays
short (the details live in docs/)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gen_config_docs  # noqa: E402

README_MAX_LINES = 150
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lower case, punctuation dropped, spaces -> '-')."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if in_fence or not m:
            continue
        text = re.sub(r"[`*]", "", m.group(2))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    in_fence = False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        for m in LINK.finditer(line):
            found.append((i, m.group(1) or m.group(2)))
    return found


def test_config_reference_is_current_and_complete():
    missing = gen_config_docs.undocumented()
    assert not missing, (
        "config keys without documentation (add a comment above or beside the field, then run "
        "PYTHONPATH=. python scripts/gen_config_docs.py): " + ", ".join(missing))
    text = gen_config_docs.render()
    written = gen_config_docs.OUT.read_text() if gen_config_docs.OUT.exists() else ""
    assert written == text, ("docs/config-reference.md is stale: run PYTHONPATH=. python scripts/gen_config_docs.py")


def test_reference_lists_every_key():
    """Every leaf key of the config and every algorithm option appears in the reference (and nothing is doubled)."""
    import dataclasses
    import typing

    from algos import ALGORITHMS
    from grpo.foundation.config import Config

    text = gen_config_docs.OUT.read_text()

    def leaves(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "options":
                continue
            nested = gen_config_docs._nested_dataclass(hints[f.name])
            if nested:
                yield from leaves(nested[0], f"{prefix}{f.name}{'[]' if nested[1] == '[]' else ''}.")
            else:
                yield f"{prefix}{f.name}"

    keys = list(leaves(Config, ""))
    assert "train.lr" in keys and "rewards[].fn" in keys and "model.lora.r" in keys
    for key in keys:
        assert text.count(f"| `{key}` |") == 1, key
    for name, algo in ALGORITHMS.items():
        assert f"### {name}\n" in text, name
        for f in dataclasses.fields(algo.Options) if dataclasses.is_dataclass(algo.Options) else ():
            assert f"| `algo.{f.name}` |" in text, (name, f.name)


def test_undocumented_field_is_reported(tmp_path):
    """The generator reads comments above and beside a field and metadata help; a bare field is reported."""
    src = tmp_path / "cfgmod.py"
    src.write_text(
        "from dataclasses import dataclass, field\n\n\n"
        "@dataclass\nclass C:\n"
        "    # the first\n    # over two lines\n    a: int = 1\n"
        "    b: int = 2  # the second\n"
        "    c: list = field(default_factory=list, metadata={'help': 'the third'})\n"
        "    d: int = 4\n"
        "    e: int = 5  # the fifth, whose comment\n"
        "    # goes on below it\n"
        "    f: int = 6  # the sixth\n"
        "    # --- a divider\n"
        "    g: int = 7  # the seventh\n"
        "    # The eighth, a sentence of its own\n"
        "    h: int = 8  # (its trailing part)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import cfgmod

        docs = gen_config_docs.field_docs(cfgmod.C)
        keys: list = []
        gen_config_docs.collect(cfgmod.C, "x.", keys)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cfgmod", None)
    assert docs == {"a": "the first over two lines", "b": "the second", "c": "the third",
                    "e": "the fifth, whose comment goes on below it", "f": "the sixth", "g": "the seventh",
                    "h": "The eighth, a sentence of its own (its trailing part)"}
    assert [k.path for k in keys if not k.doc] == ["x.d"]


def test_relative_links_resolve():
    broken = []
    for path in doc_files():
        for line, target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}:{line}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}:{line}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_checker_catches_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `code` Title: here\n\n## Second\n[ok](#a-code-title-here) [bad](#nope) "
                    "`[not a link](x.md)`\n```\n[in a fence](y.md)\n```\n")
    assert anchors(page) == {"a-code-title-here", "second"}
    assert [t for _, t in links(page)] == ["#a-code-title-here", "#nope"]


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it at most {README_MAX_LINES} (details go to docs/)"


def test_readme_lists_every_algorithm():
    """The README's one algorithm table names every registered algorithm, and says how many there are."""
    from algos import ALGORITHMS

    section = (ROOT / "README.md").read_text().split("## Algorithms", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"\| `([a-z0-9][a-z0-9-]*)` \|", section))
    missing = sorted(set(ALGORITHMS) - listed)
    assert not missing, f"README's algorithm table lacks {missing} (add a row: name, paper, what it changes)"
    assert not listed - set(ALGORITHMS), f"README lists unregistered algorithms {sorted(listed - set(ALGORITHMS))}"
    assert f"All {len(ALGORITHMS)}," in section, f"README's algorithm section should say 'All {len(ALGORITHMS)},'"


def test_readme_names_the_test_command():
    """CI (.ci/run) runs `make test`; the README's Tests section says so."""
    readme = (ROOT / "README.md").read_text()
    assert "## Tests" in readme and "make test" in readme.split("## Tests", 1)[1]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_slowest_first_order_names_test_files_that_exist():
    """tests/conftest.py starts the slowest files first (make test keeps that order: --no-loadscope-reorder);
    a renamed file would silently drop back to the end."""
    from tests.conftest import SLOWEST_FIRST

    missing = [name for name in SLOWEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FIRST names files that do not exist: {missing}"
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)
    assert "--no-loadscope-reorder" in (ROOT / "Makefile").read_text()


def architecture_tree() -> set[str]:
    """The paths docs/architecture.md's tree picture names (its first fenced block drawn with ├── / └──):
    depth from the branch's column, "a.py, b.py" siblings, "<name>.py" (every algorithm) left out."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = next(b for b in re.findall(r"```\n(.*?)```", text, re.S) if "├── " in b)
    paths: set[str] = set()
    stack: list[str] = []
    for line in block.splitlines():
        at = max(line.find("├── "), line.find("└── "))
        if at < 0:
            if line.strip() and not line.lstrip().startswith("│"):
                stack = []  # a floor's heading: its tree starts at the root
            continue
        depth = at // 4
        entry = re.split(r"\s{2,}", line[at + 4:].strip())[0]
        names = [n.strip() for n in entry.split(",")]
        stack = stack[:depth] + [names[0] if names[0].endswith("/") else ""]
        for name in names:
            if not name.startswith("<"):
                paths.add("".join(stack[:depth]) + name)
    return paths


def test_architecture_picture_matches_the_tree():
    named = architecture_tree()
    gone = sorted(p for p in named if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md names what the tree does not have: {gone}"
    modules = {str(p.relative_to(ROOT)) for top in ("grpo", "rewards", "envs", "scripts")
               for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".sh") and p.name != "__init__.py"}
    modules |= {"train.py", "ref_client.py", "algos/base.py", "algos/loss_options.py"}
    missing = sorted(modules - named)
    assert not missing, f"docs/architecture.md's tree picture does not name: {missing}"
    assert {"grpo/foundation/rl_math.py", "grpo/reference/in_process.py", "grpo/workers/worker_pool.py"} <= named


def test_the_index_lists_every_page():
    """Issue 60 item 12: docs/index.md, which the README says lists every page, omitted rewards.md and gpu.md."""
    index = (ROOT / "docs" / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= linked, sorted(pages - linked)


def test_no_section_links_to_itself():
    """Issue 60 item 12: configuration.md's refusals section sent the reader, for the symptoms and fixes, to itself."""
    for page in doc_files():
        section, in_fence = None, False
        for line in page.read_text().splitlines():
            if FENCE.match(line):
                in_fence = not in_fence
            m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
            if m and not in_fence:
                section = re.sub(r"[^\w\- ]", "", re.sub(r"[`*]", "", m.group(1)).lower()).replace(" ", "-")
                continue
            for target in re.findall(r"\]\((?:" + re.escape(page.name) + r")?#([\w-]+)\)", line):
                assert target != section, f"{page.name}: the section #{section} links to itself"
