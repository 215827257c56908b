"""math_correct: answer extraction, gold formats, equivalent forms, and what scores 0."""

import pytest

from rewards.math_answer import after_hashes, extract_answer, gold_answer, last_boxed, last_number, math_correct


def score(completion, answer, **kw):
    return math_correct(["p"], [completion], [answer], **kw)[0]


@pytest.mark.parametrize("completion", [
    "<answer>0.5</answer>", "<answer>1/2</answer>", "<answer>\\frac{1}{2}</answer>",
    "<answer>$\\frac12$</answer>", "so \\boxed{\\frac{1}{2}}", "<answer>0.50</answer>",
])
def test_equivalent_forms_of_one_half(completion):
    assert score(completion, "\\frac{1}{2}", gold="plain") == 1.0
    assert score(completion, "0.5", gold="plain") == 1.0


def test_commas_in_numbers_on_both_sides():
    assert score("<answer>1,234</answer>", "#### 1234", gold="gsm8k") == 1.0
    assert score("<answer>1234</answer>", "so the total is\n#### 1,234", gold="gsm8k") == 1.0
    assert score("the total is 1,000,000 people", "1000000", extract="last_number", gold="plain") == 1.0
    assert score("<answer>1,235</answer>", "#### 1234", gold="gsm8k") == 0.0


def test_units_and_currency_around_the_answer():
    assert score("<answer>$18</answer>", "#### 18") == 1.0
    assert score("<answer>18 dollars</answer>", "#### 18") == 1.0
    assert score("It costs 18 dollars.", "#### 18", extract="last_number") == 1.0
    assert score("<answer>19 dollars</answer>", "#### 18") == 0.0


def test_missing_answer_scores_missing_value():
    assert score("I think it is 18 but no tag", "#### 18", extract="answer_tag") == 0.0
    assert score("no answer at all", "#### 18", extract="answer_tag", missing=-1.0) == -1.0
    assert score("", "#### 18", extract=["answer_tag", "boxed", "last_number"]) == 0.0


def test_malformed_tags_are_not_an_answer():
    assert score("<answer>18", "#### 18", extract="answer_tag") == 0.0  # never closed
    assert score("18</answer>", "#### 18", extract="answer_tag") == 0.0  # never opened
    assert score("<answer>17</answer> oops <answer>18", "#### 18", extract="answer_tag") == 0.0  # last complete is 17
    assert score("\\boxed{18", "#### 18", extract="boxed") == 0.0  # unbalanced braces


def test_extraction_modes_and_their_order():
    text = "step: 3 + 4 = 7 #### 7 so \\boxed{8} <answer>9</answer> then 10"
    assert extract_answer(text, "answer_tag") == "9"
    assert extract_answer(text, "boxed") == "$8$"
    assert extract_answer(text, "gsm8k") == "7 so \\boxed{8} <answer>9</answer> then 10"
    assert extract_answer(text, "last_number") == "10"
    assert extract_answer("nothing here", ["answer_tag", "boxed"]) is None
    assert extract_answer("x \\boxed{2} y", ["answer_tag", "boxed"]) == "$2$"  # falls through to the next mode
    with pytest.raises(ValueError, match="extract='latex'"):
        extract_answer("x", "latex")


def test_helpers_on_tricky_text():
    assert last_boxed("\\boxed{\\frac{1}{\\sqrt{2}}} and \\boxed{x^{2}}") == "x^{2}"
    assert last_number("from -3.5 to 1,250.75 units") == "1250.75"
    assert last_number("3/4 of a cup") == "3/4"
    assert after_hashes("work\n####  72 \nmore") == "72"


def test_gold_formats():
    assert gold_answer("Natalia sold 48/2 = 24 in May.\n#### 72", "gsm8k") == "72"
    assert gold_answer("so the answer is $\\boxed{\\frac{3}{4}}$.", "boxed") == "$\\frac{3}{4}$"
    assert gold_answer(42, "plain") == "42"
    assert gold_answer("#### 5", "auto") == "5" and gold_answer("\\boxed{5}", "auto") == "$5$"
    with pytest.raises(ValueError, match="no '#### N'"):
        gold_answer("no marker", "gsm8k")
    with pytest.raises(ValueError, match="gold='weird'"):
        gold_answer("5", "weird")


def test_math_solution_with_boxed_gold_and_latex_prediction():
    solution = "We have $x^2 = 4$, so $x = \\boxed{2}$."
    assert score("<answer>2</answer>", solution, gold="boxed") == 1.0
    assert score("thus \\boxed{\\sqrt{4}}", solution, gold="boxed", extract="boxed") == 1.0
    assert score("<answer>-2</answer>", solution, gold="boxed") == 0.0


def test_custom_values():
    assert score("<answer>5</answer>", "5", correct=2.0, wrong=-1.0) == 2.0
    assert score("<answer>6</answer>", "5", correct=2.0, wrong=-1.0) == -1.0
