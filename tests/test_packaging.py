"""What `pip install .` ships: every package the code imports, and the console commands."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_top_level_package_is_packaged():
    found = PROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    on_disk = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests")
    assert on_disk == sorted(n for n in found if "*" not in n)
    for name in on_disk:  # their subpackages too
        if any((p / "__init__.py").is_file() for p in (ROOT / name).iterdir() if p.is_dir()):
            assert f"{name}.*" in found, f"{name}'s subpackages are not packaged"


@pytest.mark.parametrize("command", ["grpo-train", "grpo-ref-server"])
def test_console_commands_resolve_and_answer_help(command, capsys):
    module, _, attr = PROJECT["project"]["scripts"][command].partition(":")
    assert module in PROJECT["tool"]["setuptools"]["py-modules"]
    main = getattr(importlib.import_module(module), attr)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out
