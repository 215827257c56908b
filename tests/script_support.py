"""A script of scripts/ loaded as a module, so a test calls its functions in-process."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """``name``: the script's path under scripts/ without ``.py`` ("eval", "benchmarks/bench_ref_http")."""
    path = SCRIPTS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
