"""The math-answer rule (``reward.rule=math``): 1.0 when the response's final answer equals
the record's, else 0.0, compared by ``math-verify`` (plain Python).

Owns: where the final answer is taken from, first match wins —

1. the last complete ``\\boxed{...}`` (nested braces kept: ``\\boxed{\\frac{1}{2}}``);
2. the last ``<answer>...</answer>``;
3. the last ``#### x`` (GSM8K's form; the rest of that line);
4. the last number in the text: ``-3``, ``2.5``, ``.75``, ``3/4``, a ratio ``1:2`` (no space
   around the colon: ``Step 1: 5`` is not one), a percentage ``75%`` (``75\\%``, ``75 percent``),
   thousands grouped by commas or spaces (``1,234``, ``1 234``, a thin or no-break space,
   ``1\\,234``: one separator throughout, each group exactly three digits, so ``1 2`` is two
   numbers and a list of three-digit numbers separated by single spaces reads as one);
   ``$5`` reads as ``5``;

none of them: 0.0. The gold answer is ``record["answer"]`` (a GSM8K solution "…#### 42"
gives what follows its last ``####``). Both are cleaned the same way (``$`` signs and
thousands separators dropped, a percentage written ``\\%``, a trailing period dropped) and
read by math-verify as the LaTeX ``$answer$``; math-verify decides equality (``0.5`` =
``\\frac{1}{2}`` = ``1:2``, ``3.50`` = ``3.5``). Percentages: ``75%`` equals its value
(0.75, 3/4), as math-verify reads it; and when only one side is a percentage, the other
may also give its number (``75%`` = ``75``, ``12.5%`` = ``12.5``), because a "what percent"
question's gold answer is usually the bare number (GSM8K's are) — math-verify allows this
for whole numbers only, which would score ``12.5%`` wrong against ``12.5`` but right
``75%`` against ``75``.

Bounds: every answer and gold answer is checked before it is parsed and before it is
compared (``colocate.assets.math_bounds``: its length, its nesting, the size of its numbers
and polynomials), on every thread, so a hostile completion (``\\boxed{9999999!}``) costs
milliseconds; one refused scores 0.0, and :func:`judge` names why. math-verify runs only
on LaTeX (not its Python-expression reader, which evaluates what it reads); in the main
thread each parse and comparison is also cut at :data:`TIMEOUT_S` seconds (math-verify's
``signal.alarm`` timeout, which works there only).

Leaves out: the other rules (``colocate.assets.tasks``), choosing rules by name and the
error policy (``colocate.rollout.named_rewards``, ``colocate.rollout.reward_fns``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

from colocate.errors import ConfigError

ANSWER_KEY = "answer"
TIMEOUT_S = 5
EQUAL, NOT_EQUAL, NO_ANSWER = "equal", "not equal", "no final answer"
_BOXED_OR_BRACE = re.compile(r"\\boxed\s*\{|[{}]")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_SEP = r"(?:,|[ \u00a0\u2009\u202f]|\\,)"  # a thousands separator: a comma, a (thin, no-break) space, \,
# a whole number whose thousands are grouped: one separator throughout, groups of exactly three digits
_GROUPED = rf"\d{{1,3}}(?P<sep>{_SEP})\d{{3}}(?:(?P=sep)\d{{3}})*(?!\d)"
_NUMBER = re.compile(rf"""
    (?<![\w.])-?                                       # not glued to a word or a decimal point before it
    (?:(?:{_GROUPED}|\d+)(?:\.\d+)? | \.\d+)           # 1,234  1 234  42  2.5  .75
    (?:/\d+ | (?::\d+(?:\.\d+)?)+)?                    # 3/4, a ratio 1:2
    (?:[ \t]?(?:\\?%|percent\b))?                      # 75%  75\%  75 percent
""", re.X)
_THOUSANDS = re.compile(rf"(?<![\d.]){_GROUPED}")
_PERCENT = re.compile(r"(?<=\d)[ \t]*(?:\\?%|percent\b)")


def math_reward(record: Mapping[str, Any], text: str) -> float:
    """1.0 when the final answer in ``text`` equals ``record["answer"]`` by math-verify, else 0.0."""
    return judge(record, text)[0]


def judge(record: Mapping[str, Any], text: str) -> tuple[float, str]:
    """The score of ``text`` and why: ``equal``, ``not equal``, ``no final answer``, or
    ``answer refused: <reason>`` / ``gold refused: <reason>`` (``colocate.assets.math_bounds``)."""
    gold = gold_answer(record)
    answer = final_answer(text)
    if answer is None:
        return 0.0, NO_ANSWER
    parsed = {}
    for side, value in (("answer", answer), ("gold", gold)):
        parsed[side], why = _read(value)
        if why is not None:
            return 0.0, f"{side} refused: {why}"
    if _verify(parsed["gold"], parsed["answer"]) or _same_number_of_percent(gold, answer):
        return 1.0, EQUAL
    return 0.0, NOT_EQUAL


def final_answer(text: str) -> str | None:
    """The final answer of ``text``, cleaned (module docstring: the order), or None."""
    for find in (_last_boxed, _last_answer_tag, _last_hashes, _last_number):
        found = find(text)
        if found is not None and clean(found):
            return clean(found)
    return None


def gold_answer(record: Mapping[str, Any]) -> str:
    """``record["answer"]``, cleaned; a GSM8K solution's final answer after its last ``####``."""
    if ANSWER_KEY not in record:
        keys = ", ".join(map(str, list(record)[:8])) or "none"
        raise ConfigError(f"reward.rule=math: the prompt record has no {ANSWER_KEY!r} key (its keys: {keys}); "
                          "give each record one, or name the field that holds it with data.answer_key")
    gold = str(record[ANSWER_KEY])
    return clean(gold.rsplit("####", 1)[1] if "####" in gold else gold)


def clean(answer: str) -> str:
    """``answer`` without ``$`` signs, thousands separators, surrounding space and a trailing
    period; a percentage written ``\\%``."""
    answer = answer.replace("\\$", "").replace("$", "")
    answer = _THOUSANDS.sub(lambda m: m.group(0).replace(m.group("sep"), ""), answer)
    answer = _PERCENT.sub(r"\\%", answer)
    return answer.strip().rstrip(".").strip()


def _read(answer: str) -> tuple[list[Any], str | None]:
    """math-verify's parse of ``answer`` (LaTeX only), or why it was refused (unparsed)."""
    from math_verify import LatexExtractionConfig, parse  # here: it brings sympy, needed only by this rule

    from colocate.assets import math_bounds

    why = math_bounds.refused_text(answer)
    if why is not None:
        return [], why
    parsed = parse(f"${answer}$", [LatexExtractionConfig()], parsing_timeout=_timeout())
    return parsed, math_bounds.refused_expr(parsed)


def _verify(gold: list[Any], answer: list[Any]) -> bool:
    from math_verify import verify

    return verify(gold, answer, timeout_seconds=_timeout())


def _same_number_of_percent(gold: str, answer: str) -> bool:
    """When only one side is a percentage: whether its number equals the other (module docstring)."""
    if _is_percent(gold) == _is_percent(answer):
        return False
    (gold_number, _), (answer_number, _) = _read(gold.removesuffix("\\%")), _read(answer.removesuffix("\\%"))
    return _verify(gold_number, answer_number)


def _is_percent(answer: str) -> bool:
    return answer.endswith("\\%")


def _timeout() -> int | None:
    """math-verify's signal timeout: in the main thread only (signals work there only)."""
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` whose braces close (one pass over the braces)."""
    opened: list[int | None] = []  # for each open brace: where its box's content starts, or None
    last: tuple[int, int] | None = None
    for match in _BOXED_OR_BRACE.finditer(text):
        if match.group() == "}":
            start = opened.pop() if opened else None
            if start is not None and (last is None or start > last[0]):
                last = (start, match.start())
        else:
            opened.append(match.end() if match.group() != "{" else None)
    return text[last[0]:last[1]] if last else None


def _last_answer_tag(text: str) -> str | None:
    """The content of the last ``<answer>…</answer>`` (found from the end: linear time)."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>"):end].split("</answer>", 1)[0] if start >= 0 else None


def _last_hashes(text: str) -> str | None:
    found = _HASHES.findall(text)
    return found[-1] if found else None


def _last_number(text: str) -> str | None:
    found = [match.group() for match in _NUMBER.finditer(text)]
    return found[-1] if found else None
