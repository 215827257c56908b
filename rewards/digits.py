"""Reward of the built-in digits task (grpo/data.py: DigitsTask)."""

from __future__ import annotations


def digits_match(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """Fraction of positions where the completion equals the answer, over the longer of the two.

    Exact answers score 1; every wrong, missing or extra character costs its share.
    """
    scores = []
    for text, gold in zip(completions, answer):
        text, gold = text.strip(), str(gold)
        n = max(len(text), len(gold))
        scores.append(sum(a == b for a, b in zip(text, gold)) / n if n else 1.0)
    return scores
