"""reward.rule=math: the final answer taken from the response in the documented order and
compared with record["answer"] by math-verify."""

from __future__ import annotations

import threading
import time

import pytest
from math_verify import parse, verify

from colocate.assets.math_rule import final_answer, gold_answer, math_reward
from colocate.errors import ConfigError

# (response text, record["answer"], the final answer the rule takes, the score)
CASES = [
    # integers, negatives, decimals
    ("The answer is 42", "42", "42", 1.0),
    ("So x = -7", "-7", "-7", 1.0),
    ("So x = 7", "-7", "7", 0.0),
    ("It is 3.5 meters", "3.5", "3.5", 1.0),
    ("It is 3.50", "3.5", "3.50", 1.0),
    ("half: 0.5", "\\frac{1}{2}", "0.5", 1.0),
    ("It is 12.0", "12", "12.0", 1.0),
    # fractions
    ("three quarters: 3/4", "0.75", "3/4", 1.0),
    ("\\boxed{\\frac{3}{4}}", "3/4", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\dfrac12}", "0.5", "\\dfrac12", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", "-\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", "\\frac{1}{3}", 0.0),
    # \boxed{}: the last one, nested braces kept
    ("First \\boxed{1}, then \\boxed{2}", "2", "2", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("So \\boxed{2\\sqrt{2}} and 7 more words", "\\sqrt{8}", "2\\sqrt{2}", 1.0),
    ("\\boxed{5} is it (5 + 1 = 6)", "5", "5", 1.0),  # boxed before the last number
    ("\\boxed{4}, and \\boxed{\\frac{1}{2", "4", "4", 1.0),  # an unclosed last box: the one before
    ("\\boxed {10}", "10", "10", 1.0),
    # <answer> tags: the last one
    ("<answer>17</answer>", "17", "17", 1.0),
    ("<answer>1</answer> no wait <answer>\n 2 \n</answer>", "2", "2", 1.0),
    ("<answer>$\\frac{2}{4}$</answer>", "1/2", "\\frac{2}{4}", 1.0),
    ("<answer>16</answer> because 4*4 = 16 or 17", "17", "16", 0.0),
    # GSM8K's ####
    ("48/2 = 24 clips in May. 48 + 24 = 72.\n#### 72", "72", "72", 1.0),
    ("#### 9\nso maybe 10", "Natalia sold 48/2 = 24 clips.\n#### 9", "9", 1.0),  # gold after its ####
    ("The total is 5 + 3.\n####   8.", "#### 8", "8", 1.0),
    ("#### 1,000", "1000", "1000", 1.0),
    # units, currency, thousands commas
    ("It costs $5.", "5", "5", 1.0),
    ("It costs \\$18 in all", "18", "18", 1.0),
    ("She has 1,234 apples", "1234", "1234", 1.0),
    ("1,234,567 people", "1234567", "1234567", 1.0),
    ("The price is 1,234 dollars", "#### 1,234", "1234", 1.0),
    ("He walked 12 km", "12", "12", 1.0),
    # several numbers: the last counts
    ("5 apples and 3 pears make 8 fruits", "8", "8", 1.0),
    ("5 apples and 3 pears make 8 fruits", "5", "8", 0.0),
    ("from 2 to 10, a range of 9 minus 1", "8", "1", 0.0),
    ("5-3 is the difference", "2", "3", 0.0),  # the dash is not a sign here
    # wrong answers, no answer at all
    ("\\boxed{41}", "42", "41", 0.0),
    ("<answer>seven</answer>", "7", "seven", 0.0),
    ("I do not know.", "42", None, 0.0),
    ("", "42", None, 0.0),
    ("\\boxed{} and <answer> </answer>", "3", None, 0.0),
]


def test_the_table_is_big_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("text,gold,extracted,score", CASES)
def test_score_is_math_verify_on_the_extracted_answer(text, gold, extracted, score):
    record = {"answer": gold}
    assert final_answer(text) == extracted
    assert math_reward(record, text) == score
    if extracted is not None:  # what math-verify itself says of the two answers
        by_math_verify = verify(parse(f"${gold_answer(record)}$"), parse(f"${extracted}$"))
        assert float(by_math_verify) == score


@pytest.mark.parametrize("answer,gold", [
    (42, "42"), ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"), ("$1,234.", "1234"), (" 7 ", "7"),
])
def test_gold_answer(answer, gold):
    assert gold_answer({"answer": answer}) == gold


def test_an_integer_gold_answer_scores():
    assert math_reward({"answer": 42, "question": "q"}, "\\boxed{42}") == 1.0


def test_a_record_without_an_answer_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as info:
        math_reward({"prompt": "What is 2+2?", "solution": "4"}, "4")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("reward.rule=math: the prompt record has no 'answer' key (its keys: prompt, solution)")
    assert "data.answer_key" in message


def test_outside_the_main_thread_it_scores_the_same():
    results = []
    worker = threading.Thread(target=lambda: results.extend(math_reward({"answer": g}, t) for t, g, _, _ in CASES))
    worker.start()
    worker.join(timeout=120)
    assert results == [score for _, _, _, score in CASES]


@pytest.mark.parametrize("text", ["\\boxed{9^{9^{9}}}", "\\boxed{9^9^9}", "\\boxed{2^{1000000}}",
                                  "<answer>" + "1+" * 300 + "1</answer>"])
def test_answers_too_big_to_evaluate_score_zero_at_once(text):
    start = time.monotonic()
    assert math_reward({"answer": "3"}, text) == 0.0
    assert time.monotonic() - start < 2


def test_small_powers_are_still_compared():
    assert math_reward({"answer": "1024"}, "\\boxed{2^{10}}") == 1.0
    assert math_reward({"answer": "e^{-x^2}"}, "\\boxed{e^{-x^{2}}}") == 1.0
