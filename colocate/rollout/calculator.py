"""The built-in calculator environment: a tool the model calls with ``<calc>…</calc>``.

Owns: :func:`evaluate`, a safe arithmetic evaluator (the expression is parsed with
``ast`` and only number literals, unary ``+ -``, binary ``+ - * / // % **`` and
parentheses are walked; nothing is ever ``eval``-ed, no name, call, attribute or
subscript is looked up), bounded in size and time (:data:`MAX_CHARS` characters,
:data:`MAX_NODES` nodes, exponents and magnitudes capped), with errors as
:class:`CalculatorError` carrying a short message the model reads; :func:`format_number`
(how a result is written back); and :class:`CalculatorEnv`, the :class:`Environment`
that answers the model's last ``<calc>`` call with ``<result>…</result>`` (or
``<error>…</error>``; the trajectory goes on) and ends the trajectory on an
``<answer>…</answer>`` or on a turn with neither.

Leaves out: scoring the final answer (the task reward, e.g. ``reward.rule=reasoning-gym``:
the calculator's observations carry reward 0), running turns (``colocate.rollout.turns``)
and choosing the environment by name (``colocate.rollout.environments``).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import re
from typing import Any, Callable, Mapping, Sequence

from colocate.rollout.env import Message, Observation

MAX_CHARS = 200  # longest expression evaluated
MAX_NODES = 64  # most expression nodes (numbers and operators) in one expression
MAX_EXPONENT = 64  # |b| of a ** b
MAX_BASE = 10**6  # |a| of a ** b
MAX_MAGNITUDE = 1e30  # |value| of every literal, intermediate and result
EXACT_INT = 2**53  # a float result with no fraction below this is returned as an int

ALLOWED = "only numbers and + - * / // % ** ( ) are allowed"

INSTRUCTION = (
    "Before you answer you can use a calculator: write one expression like <calc>3 * (4 + 5)</calc> "
    "(numbers, + - * / // % ** and parentheses) and end your message there; the result comes back "
    "as <result>27</result>. Give the final answer between <answer> and </answer>."
)

_CALC = re.compile(r"<calc>((?:(?!<calc>).)*?)</calc>", re.DOTALL)  # innermost-opened span
_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)

Number = int | float


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is short and
    meant for the model (it is sent back as ``<error>message</error>``)."""


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_OPERATORS = (*_BINARY, ast.Pow, *_UNARY)


def evaluate(expression: str) -> Number:
    """The value of an arithmetic ``expression``: an int when exact, else a float.

    Whitespace (newlines included) is ignored between tokens. Raises
    :class:`CalculatorError` for anything but numbers, ``+ - * / // % **`` and
    parentheses, for an expression over :data:`MAX_CHARS` characters or
    :data:`MAX_NODES` nodes, for a number beyond :data:`MAX_MAGNITUDE` (or a power
    beyond :data:`MAX_BASE` ** :data:`MAX_EXPONENT`), and for division by zero.
    """
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be text")
    if len(expression) > MAX_CHARS:
        raise CalculatorError("expression too long")
    text = " ".join(expression.split())
    if not text:
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("malformed expression") from None
    nodes = 0
    for node in ast.walk(tree.body):  # iterative: a deep tree cannot exhaust the stack here
        if isinstance(node, _OPERATORS):
            continue  # counted with their BinOp / UnaryOp
        if not _allowed(node):
            raise CalculatorError(ALLOWED)
        nodes += 1
        if nodes > MAX_NODES:
            raise CalculatorError("expression too long")
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < EXACT_INT:
        return int(value)
    return value


def format_number(value: Number) -> str:
    """How a result is written back: ints as they are; floats rounded to 6 decimals with
    trailing zeros stripped (``0.1 + 0.2`` -> ``0.3``), in ``e`` notation when they are too
    large or too small for that (``3.33333e+28``, ``1e-09``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"not a number: {value!r}")
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value.is_integer() and abs(value) < EXACT_INT:
        return str(int(value))
    if abs(value) >= 1e15:
        return f"{value:.6g}"
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    if text in ("0", "-0"):  # a nonzero value below the 6th decimal
        return f"{value:.6g}"
    return text


def _allowed(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float)  # not bool, complex, str, bytes, None, ...
    if isinstance(node, ast.UnaryOp):
        return type(node.op) in _UNARY
    if isinstance(node, ast.BinOp):
        return type(node.op) in _BINARY or isinstance(node.op, ast.Pow)
    return False


def _value(node: ast.AST) -> Number:
    """Evaluate a tree :func:`evaluate` has checked (only allowed nodes, at most MAX_NODES deep)."""
    if isinstance(node, ast.Constant):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp):
        return _bounded(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("number too large") from None
        return _bounded(result)
    raise CalculatorError(ALLOWED)  # unreachable after the walk in evaluate


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT or abs(base) > MAX_BASE:
        raise CalculatorError("number too large")
    if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
        raise CalculatorError("result is not a real number")
    try:
        result = base**exponent
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("number too large") from None
    return _bounded(result)


def _bounded(value: Any) -> Number:
    if type(value) not in (int, float):
        raise CalculatorError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("number too large")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("number too large")
    return value


def _last_assistant(history: Sequence[Message]) -> str:
    for message in reversed(history):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


@dataclasses.dataclass(frozen=True)
class CalculatorEnv:
    """The calculator tool (see the module docstring). ``role`` is the chat role of its
    observations: "user" by default, which every chat template accepts and small chat
    models answer; "tool" for templates and models trained on tool turns."""

    name: str = "calculator"
    instruction: str = INSTRUCTION
    role: str = "user"

    def step(self, record: Mapping[str, Any], history: Sequence[Message]) -> Observation:
        """Answer the model's latest turn: ``<answer>`` (or neither tag) ends the
        trajectory; else the last complete ``<calc>`` call is evaluated."""
        text = _last_assistant(history)
        if _ANSWER.search(text):
            return Observation(done=True, role=self.role)
        calls = _CALC.findall(text)
        if not calls:
            return Observation(done=True, role=self.role)
        try:
            result = f"<result>{format_number(evaluate(calls[-1]))}</result>"
        except CalculatorError as exc:
            result = f"<error>{exc}</error>"
        return Observation(text=result, role=self.role)
