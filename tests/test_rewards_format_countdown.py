"""Format rewards (strict / soft R1 layout) and the Countdown checker, including unsafe input."""

import pytest

from rewards.countdown import ExpressionError, check, countdown, evaluate
from rewards.format import format_soft, format_strict


def strict(text, prompt="p", **kw):
    return format_strict([prompt], [text], **kw)[0]


def soft(text, prompt="p", **kw):
    return format_soft([prompt], [text], **kw)[0]


def test_strict_accepts_exactly_the_layout():
    assert strict("<think>\n2+2 is 4\n</think>\n<answer>\n4\n</answer>") == 1.0
    assert strict("  <think>a</think><answer>4</answer>\n") == 1.0


@pytest.mark.parametrize("text", [
    "<think>a</think><answer>4</answer> trailing words",   # text outside the blocks
    "intro <think>a</think><answer>4</answer>",            # text before
    "<answer>4</answer><think>a</think>",                  # wrong order
    "<think>a</think><answer>  </answer>",                 # empty answer
    "<think>a</think>",                                    # missing block
    "<think>a<think>b</think><answer>4</answer>",          # repeated opening tag
    "<think>a</think><answer>4</answer><answer>5</answer>",  # a block twice
    "<think>a</think><answer>4",                           # unclosed
    "<Think>a</Think><answer>4</answer>",                  # tags are case-sensitive
])
def test_strict_rejects_near_misses(text):
    assert strict(text) == 0.0


def test_soft_allows_surrounding_text_but_needs_order_and_closing():
    assert soft("Sure! <think>a</think> so <answer>4</answer> done") == 1.0
    assert soft("<answer>4</answer><think>a</think>") == 0.0
    assert soft("<think>a</think><answer>4") == 0.0
    assert soft("<think>a</think> <answer>4</answer> text") == 1.0
    assert strict("<think>a</think> <answer>4</answer> text") == 0.0


def test_prefilled_think_tag_counts_as_written():
    prompt = "<|im_start|>assistant\n<think>"
    assert strict("reasoning</think><answer>4</answer>", prompt=prompt) == 1.0
    assert strict("reasoning</think><answer>4</answer>") == 0.0  # without the prefill it is malformed


def test_layout_is_configurable():
    assert strict("<answer>4</answer>", blocks=["answer"]) == 1.0
    assert strict("<reasoning>x</reasoning><final>4</final>", blocks=["reasoning", "final"], value=0.5) == 0.5
    with pytest.raises(ValueError, match="blocks="):
        strict("x", blocks=["a>b"])


# --------------------------------------------------------------------------- countdown


def cd(text, nums=(3, 5, 7), target=22, **kw):
    return countdown(["p"], [text], [list(nums)], [target], **kw)[0]


def test_countdown_correct_and_wrong():
    assert cd("<answer>(7 - 3) * 5 + 2</answer>", nums=(7, 3, 5, 2), target=22) == 1.0
    assert cd("<answer>3 * 5 + 7</answer>") == 1.0
    assert cd("<answer>7 * 5 - 3</answer>", wrong=0.1) == 0.1  # valid, other value
    assert cd("<think>try</think><answer> (5 + 7) / 3 * 1 </answer>", nums=(5, 7, 3, 1), target=4) == 1.0


def test_countdown_division_is_exact():
    assert check("(7 + 5) / 3", [7, 5, 3], 4) == "correct"
    assert check("7 / 2 * 2", [7, 2, 2], 7) == "correct"  # fractions, not integer division
    assert check("7 / (5 - 5)", [7, 5, 5], 1) == "invalid"  # division by zero


@pytest.mark.parametrize("expression, why", [
    ("3 * 5 + 7 + 7", "a number used twice"),
    ("3 * 5", "a number left out"),
    ("3 * 5 + 8", "a foreign number"),
    ("35 + 7", "digits glued together"),
    ("3 ** 5 + 7", "power"),
    ("-3 + 5 * 7", "unary minus"),
    ("3.0 * 5 + 7", "decimal"),
    ("3 * 5 + 7 = 22", "an equation"),
    ("(3 * 5 + 7", "unbalanced"),
    ("3 5 7", "no operators"),
    ("", "empty"),
])
def test_countdown_invalid_expressions(expression, why):
    assert check(expression, [3, 5, 7], 22) == "invalid", why


@pytest.mark.parametrize("unsafe", [
    "__import__('os').system('echo pwned')",
    "open('/etc/passwd').read()",
    "(lambda: 22)()",
    "[3, 5, 7]",
    "3 * 5 + 7; import os",
    "(" * 10_000 + "3" + ")" * 10_000,
    "9" * 100_000,
    "((((((((((((((((((((((((((((((((((((3))))))))))))))))))))))))))))))))))) * 5 + 7",
])
def test_countdown_unsafe_input_is_rejected_not_run(unsafe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExpressionError):
        evaluate(unsafe)
    assert cd(f"<answer>{unsafe}</answer>") == 0.0
    assert list(tmp_path.iterdir()) == []


def test_countdown_needs_the_answer_tag_unless_told_otherwise():
    assert cd("3 * 5 + 7") == 0.0
    assert cd("3 * 5 + 7", extract="text") == 1.0
    assert cd("<answer>3 * 5 + 7") == 0.0  # unclosed tag
    with pytest.raises(ValueError, match="extract="):
        cd("x", extract="boxed")


def test_format_rewards_stay_fast_on_pathological_tag_soup():
    soup = "<think>" * 20_000 + "</think>" * 20_000 + "<answer>" * 20_000
    assert strict(soup) == 0.0 and soft(soup) == 0.0
    assert soft(soup + "4</answer>") == 1.0  # in order, each opened then closed: soft accepts extra tags
