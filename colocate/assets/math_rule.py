"""The math-answer rule (``reward.rule=math``): 1.0 when the response's final answer equals
the record's, else 0.0, compared by ``math-verify`` (plain Python).

Owns: where the final answer is taken from, first match wins —

1. the last complete ``\\boxed{...}`` (nested braces kept: ``\\boxed{\\frac{1}{2}}``);
2. the last ``<answer>...</answer>``;
3. the last ``#### x`` (GSM8K's form; the rest of that line);
4. the last number in the text (``-3``, ``2.5``, ``1,234``, ``3/4``; ``$5`` reads as ``5``);

none of them: 0.0. The gold answer is ``record["answer"]`` (a GSM8K solution "…#### 42"
gives what follows its last ``####``). Both are cleaned the same way (``$`` signs dropped,
thousands commas ``1,234`` → ``1234``, a trailing period dropped) and read by math-verify
as the LaTeX ``$answer$``; math-verify decides equality (``0.5`` = ``\\frac{1}{2}``,
``3.50`` = ``3.5``). Bounds: an answer longer than :data:`MAX_ANSWER_CHARS`, or with a
tower of numeric powers (``9^{9^{9}}``) or an exponent of six digits or more, scores 0.0
without being evaluated; in the main thread each parse and comparison is also cut at
:data:`TIMEOUT_S` seconds (math-verify's ``signal.alarm`` timeout, which works there
only; in another thread math-verify runs without one).

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
MAX_ANSWER_CHARS = 500
TIMEOUT_S = 5
_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
# a number not glued to a word or a decimal point before it: -3, 2.5, 1,234, 3/4
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# an exponent that is itself a power of a number (9^{9^9}, 9^9^9), or a number of six digits or more
_TOWER = re.compile(r"\^\s*(?:\{[^}]*\d\s*\^|\d+\s*\^|\{?\s*\(?\s*\d{6})")


def math_reward(record: Mapping[str, Any], text: str) -> float:
    """1.0 when the final answer in ``text`` equals ``record["answer"]`` by math-verify, else 0.0."""
    gold = gold_answer(record)
    answer = final_answer(text)
    if answer is None or not _bounded(answer) or not _bounded(gold):
        return 0.0
    return 1.0 if same(gold, answer) else 0.0


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
    """``answer`` without ``$`` signs, thousands commas, surrounding space and a trailing period."""
    answer = _THOUSANDS.sub("", answer.replace("\\$", "").replace("$", ""))
    return answer.strip().rstrip(".").strip()


def same(gold: str, answer: str) -> bool:
    """Whether math-verify finds ``answer`` equal to ``gold`` (both read as ``$…$``)."""
    from math_verify import parse, verify  # here: it brings sympy, needed only by this rule

    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    return verify(parse(f"${gold}$", parsing_timeout=timeout), parse(f"${answer}$", parsing_timeout=timeout),
                  timeout_seconds=timeout)


def _bounded(answer: str) -> bool:
    return len(answer) <= MAX_ANSWER_CHARS and not _TOWER.search(answer)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` whose braces close."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for i in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[match.end():i]
    return None


def _last_answer_tag(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else None


def _last_hashes(text: str) -> str | None:
    found = _HASHES.findall(text)
    return found[-1] if found else None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None
