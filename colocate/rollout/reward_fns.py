"""Python reward functions (rule rewards and the user's ``reward_fns``) run under one policy.

Owns: what happens when a reward function raises — ``reward.on_error=raise`` (default):
the step fails with one line naming the function and the cause (the checkpoint of the
last completed step is written, as for every failure); ``zero``: the response scores 0.0
from that function and the failure is counted (``reward/fn_errors`` in metrics.jsonl), never
silently. Leaves out: calling them (``colocate.rollout.scoring``), what they score
(``colocate.assets.tasks``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Literal

from colocate.errors import ColocateError

RewardFn = Callable[[dict[str, Any], str], Any]  # (prompt record, response text) -> float


class RewardFnError(ColocateError):
    """A reward function raised (``reward.on_error=raise``)."""


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


def guarded(fn: RewardFn, on_error: Literal["raise", "zero"], errors: RewardFnErrors) -> RewardFn:
    """``fn`` (sync or async) as an async reward function that applies ``on_error``."""

    async def call(record: dict[str, Any], text: str) -> float:
        try:
            value = fn(record, text)
            if inspect.isawaitable(value):
                value = await value
            return float(value)
        except Exception as exc:  # noqa: BLE001 - the policy decides; nothing is swallowed silently
            cause = (str(exc).strip().splitlines() or [""])[0][:200]
            what = f"reward function {fn_name(fn)} raised {type(exc).__name__}: {cause}"
            if on_error == "raise":
                raise RewardFnError(f"{what}; fix it, or set reward.on_error=zero to score such "
                                    "responses 0.0 (counted in reward/fn_errors)") from exc
            errors.count += 1
            errors.last = what
            return 0.0

    call.__qualname__ = fn_name(fn)
    return call
