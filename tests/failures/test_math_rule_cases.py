"""Item 8 of issue 50: the math rule (``reward.rule=math``) on hand-written completions.

Ratios (``1:2``), leading-dot decimals (``.75``), percentages (``75%`` against 3/4, 0.75 and
the bare 75 of a "what percent" question) and space-grouped thousands (``1 000``, thin and
narrow no-break spaces, ``\\,``; a group is exactly three digits, so ``1 2`` stays two
numbers) are read as a reader reads them, and checked against math-verify itself where it
is the reference. Hostile completions (a factorial tower, huge powers, binomials, products,
deep nesting, large polynomials, thousands of unclosed ``\\boxed{``) score 0.0 with a named
reason in bounded time in a worker thread, where math-verify has no timeout."""

from __future__ import annotations

import threading
import time

import pytest
from math_verify import parse, verify

from colocate.assets import math_rule
from colocate.assets.math_rule import final_answer, gold_answer, math_reward

# (completion, record["answer"], the final answer the rule takes, correct?, math-verify on
# (gold, that answer) is the reference?)
CASES = [
    # ratios: the whole ratio, not its last number
    ("The ratio of boys to girls is 1:2", "1:2", "1:2", True, True),
    ("So the ratio is 3:4.", "3:4", "3:4", True, True),
    ("Simplified, 2:4", "1:2", "2:4", True, True),  # the same ratio
    ("The ratio is 1:3", "1:2", "1:3", False, True),
    ("They meet at 3:45", "3:45", "3:45", True, True),
    ("Step 1: add 5 and 7 to get 12", "12", "12", True, True),  # a colon and a space: no ratio
    # leading-dot decimals
    ("The probability is .75", "3/4", ".75", True, True),
    ("So x = -.5", "-1/2", "-.5", True, True),
    ("p = .75.", "0.75", ".75", True, True),
    ("It is 0.5", ".5", "0.5", True, True),
    ("It is .25", "0.75", ".25", False, True),
    # percentages: the value (75% = 0.75 = 3/4), or the number of a bare gold (75% = 75)
    ("So 75% of them passed", "3/4", "75\\%", True, True),
    ("That is 75%.", "0.75", "75\\%", True, True),
    ("The discount is 75%", "75", "75\\%", True, True),
    ("The rate is 12.5%", "0.125", "12.5\\%", True, True),
    ("The rate is 12.5%", "12.5", "12.5\\%", True, False),  # math-verify: 12.5% only as 0.125
    ("It grew by 75 percent", "3/4", "75\\%", True, True),
    ("\\boxed{75\\%}", "3/4", "75\\%", True, True),
    ("It is 75", "75%", "75", True, True),
    ("That is 75%.", "0.5", "75\\%", False, True),
    ("That is 7.5%", "0.75", "7.5\\%", False, True),
    ("\\boxed{0.75\\%}", "75%", "0.75\\%", False, True),
    # thousands grouped by spaces (a group is exactly three digits)
    ("The population is 1 000", "1000", "1000", True, False),  # math-verify reads 1 000 as 1*0
    ("1\u202f000 people", "1000", "1000", True, False),
    ("1\u2009000 people", "1000", "1000", True, False),
    ("1\u00a0000 people", "1000", "1000", True, False),
    ("12 345 678 grains", "12345678", "12345678", True, False),
    ("\\boxed{1\\,000}", "1000", "1000", True, False),
    ("\\boxed{1 000}", "1 000", "1000", True, False),
    ("#### 2 500", "2500", "2500", True, False),
    ("the numbers are 1 2", "12", "2", False, True),  # not silently 12
    ("the numbers are 1 2", "2", "2", True, True),
    ("1 0000 seeds", "10000", "0000", False, True),
]


def test_the_table_covers_each_form():
    assert len(CASES) >= 30


def _reference(gold: str, answer: str) -> bool:
    return bool(verify(parse(f"${gold}$"), parse(f"${answer}$")))


@pytest.mark.parametrize("text,gold,answer,correct,reference", CASES)
def test_the_final_answer_is_read_as_written(text, gold, answer, correct, reference):
    record = {"answer": gold}
    assert final_answer(text) == answer
    assert math_reward(record, text) == float(correct)
    if reference:  # math-verify itself agrees on the two answers
        assert _reference(gold_answer(record), answer) == correct


# hostile final answers: each scores 0.0 with a reason, in bounded time, in a worker thread
BIG = "a number too big to evaluate"
UNEVALUATED = "an unevaluated sum, product, integral, limit or derivative"
POLYNOMIAL = "a polynomial of over 64 terms"
DEEP = "brackets nested over 6 deep"
WHILE_PARSING = "a determinant, matrix function, substitution or computed root (evaluated while parsing)"
# name -> (the completion, the reason it is refused)
HOSTILE = {
    "factorial tower": ("\\boxed{9999999!}", BIG),
    "factorial of a power": ("\\boxed{(10^{6})!}", BIG),
    "repeated factorials": ("\\boxed{10!!!!!!!!}", BIG),
    "factorial of a factorial": ("\\boxed{(9!)!}", BIG),
    "binomial": ("\\boxed{\\binom{10^{7}}{5000000}}", BIG),
    "nested binomials": ("\\boxed{\\binom{\\binom{999}{499}}{999}}", BIG),
    "gamma": ("\\boxed{\\Gamma(10^{7})}", BIG),
    "gcd of powers": ("\\boxed{\\gcd(10^{99999}, 10^{99998})}", BIG),
    "power of a power": ("\\boxed{(99999^{99999})^{99999}}", BIG),
    "power tower": ("\\boxed{9^{9^{9}}}", BIG),
    "exponential tower": ("\\boxed{e^{e^{e^{e^{10}}}}}", BIG),
    "product": ("\\boxed{\\prod_{i=1}^{10^{7}} i}", UNEVALUATED),
    "sum of factorials": ("\\boxed{\\sum_{i=1}^{10^{8}} i!}", UNEVALUATED),
    "integral": ("\\boxed{\\int_0^1 e^{x^{2}}\\sin(x) dx}", UNEVALUATED),
    "large polynomial": ("\\boxed{(x+1)^{999}-(x+2)^{999}}", POLYNOMIAL),
    "product of trinomials": ("\\boxed{" + "".join(f"(x+y+{k})" for k in range(1, 40)) + "}", POLYNOMIAL),
    "deep parentheses": ("\\boxed{" + "(" * 40 + "1" + ")" * 40 + "}", DEEP),
    "deep braces": ("\\boxed{" + "{" * 60 + "1" + "}" * 60 + "}", DEEP),
    "root of a tower": ("\\boxed{\\sqrt[9^{9^{9}}]{2}}", WHILE_PARSING),
    "substitution": ("\\boxed{\\left.x^{x}\\right|_{x=99999}}", WHILE_PARSING),
    "determinant": ("\\boxed{\\begin{vmatrix}a&b&c\\\\d&e&f\\\\g&h&i\\end{vmatrix}}", WHILE_PARSING),
    "identity matrix": ("\\boxed{\\operatorname{eye}(100000)}", WHILE_PARSING),
    "too long": ("\\boxed{" + "1+" * 300 + "1}", "longer than 500 characters"),
}
BOUND_S = 5.0


def _in_a_thread(fn, *args):
    """``fn(*args)`` in a daemon thread: (its value or None, seconds, whether it finished)."""
    out: list = []
    start = time.monotonic()
    worker = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    worker.start()
    worker.join(timeout=BOUND_S)
    return (out[0] if out else None), time.monotonic() - start, not worker.is_alive()


def test_the_factorial_tower_off_the_main_thread_is_wrong_at_once():
    score, seconds, finished = _in_a_thread(math_reward, {"answer": "3"}, "So \\boxed{9999999!}")
    assert finished, f"still running after {BOUND_S} s in a worker thread"
    assert score == 0.0 and seconds < BOUND_S


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_answer_is_wrong_with_a_reason_in_bounded_time(name):
    text, reason = HOSTILE[name]
    verdict, seconds, finished = _in_a_thread(math_rule.judge, {"answer": "3"}, text)
    assert finished, f"{name}: still running after {BOUND_S} s in a worker thread"
    assert verdict == (0.0, f"answer refused: {reason}")
    assert seconds < BOUND_S


@pytest.mark.parametrize("text", ["\\boxed{" * 30000 + "1", "<answer>" * 20000 + "1", "\\boxed{1}" + "{" * 100000],
                         ids=["unclosed boxes", "unclosed answer tags", "open braces"])
def test_a_long_hostile_completion_is_read_in_bounded_time(text):
    score, seconds, finished = _in_a_thread(math_reward, {"answer": "1"}, text)
    assert finished, f"still running after {BOUND_S} s in a worker thread"
    assert score == 1.0 and seconds < 2.0  # the closed box, or the last number


def test_a_hostile_gold_answer_is_refused_too():
    score, reason = math_rule.judge({"answer": "9999999!"}, "\\boxed{3}")
    assert (score, reason) == (0.0, "gold refused: a number too big to evaluate")


@pytest.mark.parametrize("text,gold,reason", [
    ("\\boxed{42}", "42", "equal"),
    ("\\boxed{41}", "42", "not equal"),
    ("I do not know.", "42", "no final answer"),
])
def test_every_score_has_a_reason(text, gold, reason):
    assert math_rule.judge({"answer": gold}, text) == ((1.0 if reason == "equal" else 0.0), reason)


@pytest.mark.parametrize("text,gold", [
    ("\\boxed{\\binom{10}{3}}", "120"), ("\\boxed{10!}", "3628800"),
    ("\\boxed{2^{100}}", "1267650600228229401496703205376"),
    ("\\boxed{(x+1)^{3}}", "x^3+3x^2+3x+1"), ("\\boxed{\\left(\\frac{1}{2}\\right)^{2}}", "0.25"),
    ("\\boxed{e^{-x^{2}}}", "e^{-x^2}"), ("\\boxed{\\gcd(12, 18)}", "6"), ("\\boxed{\\frac{100!}{98!}}", "9900"),
    ("\\boxed{\\sqrt[3]{8}}", "2"), ("\\boxed{(x+1)(x+2)(x+3)}", "x^3+6x^2+11x+6"), ("\\boxed{2^{3000}}", "2^{3000}"),
])
def test_ordinary_answers_near_the_bounds_still_score(text, gold):
    assert math_reward({"answer": gold}, text) == 1.0
