"""The package's layering: the folder is the floor, imports run one way and nowhere in a circle.

    ground   grpo/      the engine: foundation -> workers -> data -> rollout -> scoring -> reference -> training
                        -> api (the Python API), knowing its plug-ins only by their protocols and registries
                        (grpo/foundation/plugins.py)
    plug-ins rewards/   reward functions
             envs/      environments and tools (the python tool and the code environment reuse rewards' code)
             algos/     algorithms (some reuse reward functions: DAPO's overlong penalty, DIVER's diversity)
    top      train.py, ref_client.py, scripts/: compose a run from the floors below

Two checks against the table below: every import statement in the code (function-level ones
included, so a lazy import cannot dodge a cycle), and every module imported alone in a fresh
interpreter (what it really pulls in, transitively).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from tests.patience import LAUNCH_S

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("grpo", "algos", "rewards", "envs")

# layer -> module prefix (longest prefix wins): a folder of the ground floor is a layer of its own
LAYER_OF_PREFIX = {
    "grpo": "foundation",  # the package itself: the Python API's names, loaded from grpo/api.py on first use
    "grpo.api": "api",
    "grpo.foundation": "foundation",
    "grpo.workers": "workers",
    "grpo.data": "data",
    "grpo.rollout": "rollout",
    "grpo.scoring": "scoring",
    "grpo.reference": "reference",
    "grpo.training": "training",
    "rewards": "rewards",
    "envs": "envs",
    "algos": "algos",
}

GROUND = {"foundation", "workers", "data", "rollout", "scoring", "reference", "training", "api"}  # grpo/

# layer -> the layers its modules may import (its own included): the ground floor never imports a plug-in
ALLOWED = {
    "foundation": {"foundation"},
    "workers": {"foundation", "workers"},  # worker processes and the sandbox: reward functions and tools run there
    "data": {"foundation", "data"},
    "rollout": {"foundation", "workers", "rollout"},  # an environment's tools run in workers
    "scoring": {"foundation", "workers", "scoring"},  # reward sources called and combined
    "reference": {"foundation", "reference"},
    "training": GROUND - {"api"},
    "api": GROUND,  # a run from Python: compose, check, train (train.py's steps)
    "rewards": GROUND | {"rewards"},
    "envs": GROUND | {"rewards", "envs"},
    "algos": GROUND | {"rewards", "algos"},
}


def layer(module: str) -> str:
    best = max((p for p in LAYER_OF_PREFIX if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF_PREFIX[best]


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """Project modules that ``path`` imports anywhere in its code."""
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def test_the_table_covers_every_module():
    for name in project_modules():
        assert layer(name) in ALLOWED, name


def test_every_import_statement_follows_the_layers():
    mods = project_modules()
    bad = []
    for name, path in mods.items():
        for dep in imports_of(path, name, set(mods)):
            if layer(dep) not in ALLOWED[layer(name)]:
                bad.append(f"{name} ({layer(name)}) imports {dep} ({layer(dep)})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycles():
    mods = project_modules()
    graph = {name: imports_of(path, name, set(mods)) for name, path in mods.items()}
    # A package's __init__ runs when any of its submodules is imported: an edge from each module to its parents.
    for name in mods:
        parent = name.rpartition(".")[0]
        while parent:
            if parent in mods:
                graph[name].add(parent)
            parent = parent.rpartition(".")[0]
    cycles, state = [], {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = "open"
        for d in sorted(graph[n]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d):] + [n, d]) if d in stack else f"{n} -> {d}")
            elif d not in state:
                visit(d, stack + [n])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    # a package importing its own submodules (algos/__init__ discovering algorithms) is not a cycle of concern
    real = [c for c in cycles if not _package_self_edge(c)]
    assert not real, "import cycles:\n" + "\n".join(real)


def _package_self_edge(cycle: str) -> bool:
    names = cycle.split(" -> ")
    return all(a.startswith(names[0]) or names[0].startswith(a) for a in names)


# Imports every module alone, each in a fresh child of an interpreter that has loaded only third-party
# libraries, and prints which project modules each one pulled in. The third-party modules are the ones the
# whole project loads: the parent imports every module, then forgets the project's (sys.modules), so each
# child, forked on the libraries alone, runs only project code.
_PROBE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
PROJECT = ("grpo", "algos", "rewards", "envs")
mods = json.loads(sys.argv[2])


def in_child(fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            msg = json.dumps({"ok": True, "value": fn()})
        except BaseException as e:
            msg = json.dumps({"ok": False, "error": repr(e)})
        os.write(w, msg.encode())
        os.close(w)
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


for m in mods:
    try:
        __import__(m)
    except BaseException:
        pass  # reported by its own child below
for name in [k for k in sys.modules if k.split(".")[0] in PROJECT]:
    del sys.modules[name]  # the children import the project afresh, on the libraries it loaded
result = {}
for m in mods:
    r = in_child(lambda: (__import__(m), sorted(k for k in sys.modules if k.split(".")[0] in PROJECT))[1])
    result[m] = {"ok": r["ok"], "loaded": r.get("value"), "error": r.get("error")}
print(json.dumps(result))
"""


def test_each_module_imported_alone_loads_only_allowed_layers():
    mods = sorted(project_modules())
    out = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT), json.dumps(mods)], capture_output=True,
                         text=True, timeout=LAUNCH_S, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    bad = []
    for m in mods:
        r = result[m]
        if not r["ok"]:
            bad.append(f"{m}: import failed alone: {r['error']}")
            continue
        for dep in r["loaded"]:
            if layer(dep) not in ALLOWED[layer(m)]:
                bad.append(f"{m} ({layer(m)}) loads {dep} ({layer(dep)})")
    assert not bad, "\n".join(bad)
