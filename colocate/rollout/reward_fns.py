"""Python reward functions (rule rewards and the user's ``reward_fns``) run under one policy.

Owns: how a function is called and what it may return. A function is ``fn(record, text)``
(sync or async): ``record`` is the prompt's source record, ``text`` the model's own text —
a single response decoded, or a multi-turn trajectory's model turns joined by a newline
(the environment's answers are not in it: a tool's output cannot be credited as the
model's answer). A function that asks for them by a parameter named ``messages`` (or
``**kwargs``) also gets the whole trajectory after the prompt as chat messages
(``[{"role": "assistant", "content": …}, {"role": <observation role>, …}, …]``, as TRL
passes conversational completions). It returns a finite real number.

What happens when it does not — it raises, returns NaN or ±inf, or returns a non-number
(a string, None, a list): ``reward.on_error=raise`` (default) fails the step with one line
naming the function, the sample and the cause (the checkpoint of the last completed step
is written, as for every failure); ``zero``: the response scores 0.0 from that function and
the failure is counted (``reward/fn_errors`` in metrics.jsonl), never silently. So nothing
non-finite from a function reaches advantages, the critic or a checkpoint. Leaves out:
summing the reward (``colocate.rollout.scoring``), what the shipped rules score
(``colocate.assets.tasks``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Literal, Sequence

from colocate.errors import ColocateError, cause_line

RewardFn = Callable[..., Any]  # (prompt record, model text[, messages=...]) -> float
Messages = Sequence[dict[str, str]]


class RewardFnError(ColocateError):
    """A reward function raised or returned no finite number (``reward.on_error=raise``)."""


@dataclasses.dataclass
class RewardFnErrors:
    """Failures of reward functions scored as 0.0 since the last :meth:`take` (``on_error=zero``)."""

    count: int = 0
    last: str = ""

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


def fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def wants_messages(fn: Callable) -> bool:
    """Whether ``fn`` asks for the trajectory as chat messages (a ``messages`` parameter or
    ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the two positional arguments
        return False
    return any(p.name == "messages" or p.kind is p.VAR_KEYWORD for p in params)


async def call(fn: RewardFn, record: dict[str, Any], text: str, messages: Callable[[], Messages] | None,
               asks: bool) -> Any:
    """``fn``'s value as it returned it (awaited); ``messages()`` is built only when it asks."""
    value = fn(record, text, messages=list(messages() if messages else ())) if asks else fn(record, text)
    if inspect.isawaitable(value):
        value = await value
    return value


def number(value: Any) -> float | str:
    """``value`` as a finite float, or why it is not one (a short phrase)."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return f"returned {type(value).__name__} {str(value)[:40]!r}, not a number"
    try:
        x = float(value)
    except (TypeError, ValueError) as exc:  # e.g. a tensor of several elements
        return f"returned {type(value).__name__} that is not one number ({exc})"[:160]
    return x if math.isfinite(x) else f"returned {x} (not finite)"


class Guarded:
    """``fn`` under ``reward.on_error``: awaited with ``(record, text, messages=, sample=)``,
    returns a finite float (module docstring)."""

    def __init__(self, fn: RewardFn, on_error: Literal["raise", "zero"], errors: RewardFnErrors):
        self.fn, self.on_error, self.errors = fn, on_error, errors
        self.asks = wants_messages(fn)
        self.__qualname__ = fn_name(fn)

    async def __call__(self, record: dict[str, Any], text: str, messages: Callable[[], Messages] | None = None,
                       sample: int | None = None) -> float:
        try:
            value = await call(self.fn, record, text, messages, self.asks)
        except Exception as exc:  # noqa: BLE001 - the policy decides; nothing is swallowed silently
            return self._failed(f"raised {type(exc).__name__}: {cause_line(exc)}", sample, exc)
        x = number(value)
        return x if isinstance(x, float) else self._failed(x, sample, None)

    def _failed(self, why: str, sample: int | None, exc: BaseException | None) -> float:
        what = f"reward function {self.__qualname__} {why}" + (f" (sample {sample})" if sample is not None else "")
        if self.on_error == "raise":
            raise RewardFnError(f"{what}; fix it, or set reward.on_error=zero to score such "
                                "responses 0.0 (counted in reward/fn_errors)") from exc
        self.errors.count += 1
        self.errors.last = what
        return 0.0


def guarded(fn: RewardFn, on_error: Literal["raise", "zero"], errors: RewardFnErrors) -> Guarded:
    """``fn`` (sync or async) as an async reward function that applies ``on_error``."""
    return Guarded(fn, on_error, errors)
