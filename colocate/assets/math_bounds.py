"""What the math rule (``colocate.assets.math_rule``) refuses to evaluate, so that no answer
makes it run without bound on any thread.

math-verify parses with latex2sympy (an ANTLR parser that evaluates a few functions while it
builds) and compares with sympy; neither has a bound of its own, and math-verify's timeout is
``signal.alarm``, which works in the main thread only, while reward functions also run in
worker threads (the API's users). So the rule checks each answer before the work starts, in
time linear in the answer, and an answer refused scores 0.0 with the reason.

Owns: :func:`refused_text` (before parsing) and :func:`refused_expr` (after parsing, before
comparing); each gives the reason, a short phrase, or None:

- the text: at most :data:`MAX_CHARS` characters; brackets nested at most :data:`MAX_DEPTH`
  deep (ANTLR's prediction grows steeply with nesting: ten parentheses take ~1.3 s on a cold
  parser, forty over 30 s; a final answer seldom nests past four); what latex2sympy
  evaluates while parsing: one ``\\binom``, ``\\gcd``, ``\\lcm`` or ``\\Gamma`` at most, of plain
  numbers of at most three digits; no determinant, matrix operation (``\\operatorname{eye}``, …),
  substitution (``f|_{x=a}``) or root index with a power or factorial (``\\sqrt[2^{9}]{x}``);
- the expression: an upper bound on the digits of every number in it — powers, ``e^x``,
  factorials, Γ, binomials — at most :data:`MAX_DIGITS` (``2^{3000}`` and ``300!`` pass,
  ``9999999!``, ``(9!)!`` and ``9^{9^{9}}`` do not); an upper bound on the terms of a
  polynomial expanded (the multinomial count: ``(x+1)^{n}`` has n + 1) at most
  :data:`MAX_TERMS`; no sum, product, integral, limit or derivative left unevaluated
  (a final answer is a value; sympy may iterate or integrate without end).

Leaves out: reading and comparing the answers (``colocate.assets.math_rule``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from sympy import (Add, Basic, Derivative, FallingFactorial, Integral, Limit, MatrixBase, Mul, Pow, Product,
                   RisingFactorial, Sum, Symbol, Tuple, binomial, exp, factorial, factorial2, gamma, subfactorial)
from sympy.logic.boolalg import Boolean
from sympy.matrices.expressions import MatAdd, MatMul, MatPow
from sympy.sets import Set

MAX_CHARS = 500
MAX_DEPTH = 6
MAX_DIGITS = 1000
MAX_TERMS = 64
MAX_EXPONENT_DIGITS = 6  # an exponent or a factorial's argument below 10**6

TOO_LONG = f"longer than {MAX_CHARS} characters"
TOO_DEEP = f"brackets nested over {MAX_DEPTH} deep"
TOO_BIG = "a number too big to evaluate"
TOO_MANY_TERMS = f"a polynomial of over {MAX_TERMS} terms"
UNEVALUATED = "an unevaluated sum, product, integral, limit or derivative"
PARSE_OP = "a determinant, matrix function, substitution or computed root (evaluated while parsing)"

_PARSE_EVALUATED = re.compile(r"\\(?:[dt]?binom|choose|gcd|lcm|Gamma|gamma)\b|\\operatorname\s*\{\s*(?:gcd|lcm)\s*\}")
_PARSE_OPS = re.compile(r"\\det\b|vmatrix|\|\s*_"  # a determinant; a substitution f(x)|_{x=a}
                        r"|\\sqrt\s*\[[^\]]*[\^!]"  # a root index computed: \sqrt[2^{9}]{x}
                        r"|\\operatorname\s*\{\s*(?:eye|rank|trace|tr|rref|nullspace|norm|eig\w*|diagonalize"
                        r"|svd|SVD|zeros|ones|diag|hstack|vstack|orth\w*)\s*\}")
_LONG_NUMBER = re.compile(r"\d{4}")
_GROWING = (factorial, factorial2, subfactorial, gamma, binomial, RisingFactorial, FallingFactorial)
_UNEVALUATED_TYPES = (Sum, Product, Integral, Limit, Derivative)
_ONE_OF = (Add, MatAdd, Set, Tuple, Boolean)  # the size of one of its parts: a sum, a set, a tuple, a relation


class _Refused(Exception):
    """An expression over a bound; the message is the reason."""


def refused_text(answer: str) -> str | None:
    """Why ``answer`` (LaTeX) is not parsed, or None (module docstring)."""
    if len(answer) > MAX_CHARS:
        return TOO_LONG
    if _depth(answer) > MAX_DEPTH:
        return TOO_DEEP
    if _PARSE_OPS.search(answer):
        return PARSE_OP
    evaluated = _PARSE_EVALUATED.findall(answer)
    if evaluated and (len(evaluated) > 1 or "^" in answer or "!" in answer or _LONG_NUMBER.search(answer)):
        return TOO_BIG
    return None


def refused_expr(parsed: list[Any]) -> str | None:
    """Why math-verify's parse of an answer (its sympy objects) is not compared, or None."""
    try:
        for expr in parsed:
            _digits(expr)
            if _terms(expr)[0] > MAX_TERMS:
                return TOO_MANY_TERMS
    except _Refused as refused:
        return str(refused)
    except RecursionError:
        return TOO_DEEP
    return None


def _depth(text: str) -> int:
    """The deepest nesting of ``( [ {`` in ``text``."""
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    return deepest


def _digits(expr: Any) -> float:
    """An upper bound of log10 |value| of ``expr`` (0 for a variable); raises :class:`_Refused`."""
    if isinstance(expr, MatrixBase):  # its largest element, times its size at each product
        return max((_digits(x) for x in expr), default=0.0) + math.log10(max(*expr.shape, 1))
    if not isinstance(expr, Basic):
        return 0.0
    if isinstance(expr, _UNEVALUATED_TYPES):
        raise _Refused(UNEVALUATED)
    if expr.is_Atom:
        return _atom_digits(expr)
    parts = [_digits(arg) for arg in expr.args]
    if isinstance(expr, (Pow, MatPow)):
        digits = parts[0] * _at_most(parts[1])
    elif isinstance(expr, exp):
        digits = math.log10(math.e) * _at_most(parts[0])
    elif isinstance(expr, _GROWING):
        n = _at_most(max(parts))
        digits = n * math.log10(n + 1)
    elif isinstance(expr, _ONE_OF):
        digits = max(parts, default=0.0) + math.log10(max(len(parts), 1))
    else:  # a product, and any other function: at most the product of its arguments
        digits = sum(parts)
    if digits > MAX_DIGITS:
        raise _Refused(TOO_BIG)
    return digits


def _at_most(digits: float) -> float:
    """10**digits, an exponent's or an argument's bound, refused from 10**6 up."""
    if digits >= MAX_EXPONENT_DIGITS:
        raise _Refused(TOO_BIG)
    return 10.0 ** digits


def _atom_digits(atom: Basic) -> float:
    if atom.is_Integer or atom.is_Rational:
        largest = max(abs(int(atom.p)), int(atom.q))
        return math.log10(largest) if largest else 0.0
    if atom.is_Float:
        _, mantissa, exponent, bits = atom._mpf_
        return max(exponent + bits, 0) * math.log10(2) if mantissa else 0.0
    return 0.5 if atom.is_NumberSymbol else 0.0  # π, e; a variable, i, ∞


def _terms(expr: Any) -> tuple[int, bool]:
    """(an upper bound of the terms of ``expr`` expanded, capped at MAX_TERMS + 1; whether it
    has a variable)."""
    if isinstance(expr, Symbol):
        return 1, True
    if not isinstance(expr, Basic) or expr.is_Atom:
        return 1, False
    parts = [_terms(arg) for arg in expr.args]
    if not any(has for _, has in parts):
        return 1, False
    counts = [n for n, has in parts if has]
    if isinstance(expr, Add):
        n = sum(counts) + (len(counts) < len(parts))  # the numbers add up to one term
    elif isinstance(expr, (Mul, MatMul)):
        n = math.prod(counts)
    elif isinstance(expr, Pow) and expr.exp.is_Integer:
        n = _powered(counts[0], abs(int(expr.exp)))
    else:  # a function of a variable (sin x) is one term more than its argument
        n = sum(counts) + 1
    return min(n, MAX_TERMS + 1), True


def _powered(terms: int, power: int) -> int:
    """The terms of a ``terms``-term sum to the ``power``: C(power + terms - 1, terms - 1)."""
    if terms == 1:
        return 1
    if power > MAX_TERMS:
        return MAX_TERMS + 1
    return math.comb(power + terms - 1, terms - 1)
