"""Reward of the built-in digits task (grpo/data/sources.py: DigitsTask)."""

from __future__ import annotations


def digits_match(prompts: list[str], completions: list[str], answer: list[str], strip: bool = True,
                 **_: object) -> list[float]:
    """Fraction of positions where the completion equals the answer, over the longer of the two.

    Exact answers score 1; every wrong, missing or extra character costs its share. ``strip``: surrounding
    whitespace is dropped first; with ``strip=False`` it counts too, so only a completion that stops right
    after the answer (EOS, which the rewards do not see) scores 1: the demo's reward.
    """
    scores = []
    for text, gold in zip(completions, answer):
        text, gold = (text.strip() if strip else text), str(gold)
        n = max(len(text), len(gold))
        scores.append(sum(a == b for a, b in zip(text, gold)) / n if n else 1.0)
    return scores


def digits_step_match(prompt: str, steps: list[str], example: dict) -> list[float]:
    """Step reward of the digits task for process supervision (grpo-ps).

    The steps, laid end to end, are compared with the answer position by position: a step scores
    the fraction of its characters that equal the answer's at the same place; the last step also
    pays for missing answer characters (an empty step in between scores 0). With one step this
    is ``digits_match``.
    """
    gold = str(example["answer"])
    scores, pos = [], 0
    for j, step in enumerate(steps):
        last = j == len(steps) - 1
        text = step.strip()
        end = pos + len(text)
        span = (max(end, len(gold)) if last else end) - pos
        right = sum(1 for k, ch in enumerate(text) if pos + k < len(gold) and gold[pos + k] == ch)
        scores.append(right / span if span else float(last))  # an empty step in between is no progress
        pos = end
    return scores
