"""Format rewards for tagged layouts, by default R1's ``<think>...</think><answer>...</answer>``.

``blocks`` names the tags in order (``[think, answer]``; ``[answer]`` for answer-only).
- ``format_strict``: the completion is exactly those blocks, in order, each once, each
  non-empty, with nothing but whitespace around and between them.
- ``format_soft``: the blocks appear in order somewhere (other text allowed), each
  opened and closed; a stray extra tag still counts (soft partial compliance).

When the prompt ends with the first block's opening tag (an assistant prefill such as
``<think>``), the completion is scored as if it began with that tag.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

DEFAULT_BLOCKS = ("think", "answer")


def _with_prefill(prompt: str, completion: str, first_tag: str) -> str:
    opening = f"<{first_tag}>"
    if prompt.rstrip().endswith(opening) and not completion.lstrip().startswith(opening):
        return opening + completion
    return completion


def _check_blocks(blocks: Sequence[str]) -> list[str]:
    if isinstance(blocks, str):  # one name is a list of its letters: blocks: answer would ask for <a><n><s>...
        raise ValueError(f"blocks={blocks!r} is invalid: give a list of tag names, e.g. [{blocks}] or "
                         f"['think', 'answer']")
    names = list(blocks)
    if not names or not all(isinstance(b, str) and re.fullmatch(r"[A-Za-z_][\w\-]*", b) for b in names):
        raise ValueError(f"blocks={blocks!r} is invalid: give tag names such as ['think', 'answer']")
    return names


def is_strict(text: str, blocks: Sequence[str] = DEFAULT_BLOCKS) -> bool:
    names = _check_blocks(blocks)
    # each tag exactly once first: cheap, and it leaves the pattern a single way to match
    if not all(text.count(f"<{b}>") == 1 and text.count(f"</{b}>") == 1 for b in names):
        return False
    body = r"\s*".join(rf"<{b}>(.*?)</{b}>" for b in names)
    m = re.fullmatch(rf"\s*{body}\s*", text, flags=re.DOTALL)
    return m is not None and all(g.strip() for g in m.groups())


def is_soft(text: str, blocks: Sequence[str] = DEFAULT_BLOCKS) -> bool:
    """Each block opened and then closed, in order (earliest matches first: linear time on any input)."""
    pos = 0
    for b in _check_blocks(blocks):
        start = text.find(f"<{b}>", pos)
        if start < 0:
            return False
        end = text.find(f"</{b}>", start + len(b) + 2)
        if end < 0:
            return False
        pos = end + len(b) + 3
    return True


def format_strict(prompts: list[str], completions: list[str], blocks: Sequence[str] = DEFAULT_BLOCKS,
                  value: float = 1.0, **_: Any) -> list[float]:
    """``value`` when the completion is exactly the tagged blocks, else 0."""
    first = _check_blocks(blocks)[0]
    return [value if is_strict(_with_prefill(p, c, first), blocks) else 0.0 for p, c in zip(prompts, completions)]


def format_soft(prompts: list[str], completions: list[str], blocks: Sequence[str] = DEFAULT_BLOCKS,
                value: float = 1.0, **_: Any) -> list[float]:
    """``value`` when the tagged blocks appear in order (other text allowed), else 0."""
    first = _check_blocks(blocks)[0]
    return [value if is_soft(_with_prefill(p, c, first), blocks) else 0.0 for p, c in zip(prompts, completions)]
