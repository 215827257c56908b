"""docs/python-api.md's table from TRL's GRPOConfig, checked against TRL's own GRPOConfig (issue 60 item 6): every
field the table names is one of TRL's, every default it states is TRL's, and every other value it names is one TRL
documents for that field.

Runs in .venv-vllm, where ``make test`` installs the TRL the table was written against (trl==1.16.0); skipped where
TRL is not installed (the main venv)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is not installed here: make test runs this file in .venv-vllm")

from trl import GRPOConfig  # noqa: E402

pytestmark = pytest.mark.trl

DOC = Path(__file__).resolve().parent.parent / "docs" / "python-api.md"
# ``name=value`` in the table's TRL column is TRL's default, except these: values to set (TRL's default differs)
SETTINGS = {("loss_type", "grpo"), ("loss_type", "dr_grpo"), ("importance_sampling_level", "sequence"),
            ("use_vllm", True)}
TOKEN = re.compile(r"`([^`]+)`")
LITERALS = {"True": True, "False": False, "None": None}


def trl_cells() -> list[str]:
    """The TRL column of the section's table."""
    section = DOC.read_text().split("## From TRL's `GRPOConfig`", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| TRL (")]
    return [row.split(" | ")[0][2:] for row in rows]


def parse(value: str):
    """A Python literal as the table writes it: "x", True, None, 0.2, 512."""
    if value.startswith('"'):
        return value.strip('"')
    if value in LITERALS:
        return LITERALS[value]
    return int(value) if value.lstrip("-").isdigit() else float(value)


def named(cell: str) -> list[tuple[str, object, str]]:
    """(field, value, kind) for every backticked token of a cell, kind "field" (named only), "default" (TRL's
    default, stated) or "value" (a value to set: SETTINGS, or a bare quoted token such as "bnpo", another value of
    the field named before it). ``a_min/max/delta`` names a_min, a_max and a_delta; a token starting with ``_`` (a
    suffix of the field before it, named in passing) is skipped."""
    out: list[tuple[str, object, str]] = []
    for tok in TOKEN.findall(cell):
        if tok.startswith("_"):
            continue
        if tok.startswith('"'):
            out.append((out[-1][0], parse(tok), "value"))
            continue
        name, eq, value = tok.partition("=")
        if "/" in name:
            first, *rest = name.split("/")
            base = first.rsplit("_", 1)[0]
            out += [(n, None, "field") for n in [first] + [f"{base}_{r}" for r in rest]]
        elif not eq:
            out.append((name, None, "field"))
        else:
            v = parse(value)
            out.append((name, v, "value" if (name, v) in SETTINGS else "default"))
    return out


def test_the_table_reads_every_row():
    """The parser sees the rows it must (a changed table layout fails here, not silently)."""
    names = {n for cell in trl_cells() for n, _, _ in named(cell)}
    assert {"loss_type", "beta", "use_bias_correction_kl", "per_device_train_batch_size", "entropy_coef_max",
            "vllm_importance_sampling_clip_max", "bf16", "output_dir"} <= names and len(names) > 30


def test_every_field_and_default_in_the_grpoconfig_table_is_trls():
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    wrong = []
    for cell in trl_cells():
        for name, value, kind in named(cell):
            f = fields.get(name)
            if f is None:
                wrong.append(f"{name}: not a field of TRL's GRPOConfig")
            elif kind == "default":
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                if default != value:
                    wrong.append(f"{name}={value!r}: TRL's default is {default!r}")
            elif kind == "value" and not isinstance(value, bool) and not re.search(
                    rf"[`'\"]{re.escape(str(value))}[`'\"]", f.metadata.get("help", "")):
                wrong.append(f"{name}={value!r}: not a value TRL's help for {name} names")
    assert not wrong, "docs/python-api.md's GRPOConfig table disagrees with TRL's GRPOConfig:\n" + "\n".join(wrong)


def test_the_table_names_no_prompt_length_field_trl_lacks():
    """TRL 1.16's GRPOConfig has no max_prompt_length (the table says so rather than map it)."""
    assert "max_prompt_length" not in {f.name for f in dataclasses.fields(GRPOConfig)}
    assert all("max_prompt_length" not in {n for n, _, _ in named(cell)} for cell in trl_cells())
