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
non-finite from a function reaches advantages, the critic or a checkpoint.

A call that does not return within ``reward.fn_timeout_s`` (a verifier that hangs, a request
to a server that never answers): an ``async def`` function's call is cancelled there and
fails as above ("did not return within …"). A plain ``def`` function runs on the engines'
thread, where math_verify's and other signal-based timeouts work, and cannot be cut off
there: one line says, once, which function has run past the deadline on which sample, and
the step waits for it (:class:`Overdue`).

Leaves out: summing the reward (``colocate.rollout.generate_and_score``), what the shipped rules score
(``colocate.assets.tasks``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
import time
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


def start(fn: RewardFn, record: dict[str, Any], text: str, messages: Callable[[], Messages] | None,
          asks: bool) -> Any:
    """``fn``'s value as it returned it (an async function's: its awaitable); ``messages()``
    is built only when it asks."""
    return fn(record, text, messages=list(messages() if messages else ())) if asks else fn(record, text)


async def call(fn: RewardFn, record: dict[str, Any], text: str, messages: Callable[[], Messages] | None,
               asks: bool) -> Any:
    """``fn``'s value as it returned it (awaited)."""
    value = start(fn, record, text, messages, asks)
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


class Overdue:
    """Says once, through ``say``, that the synchronous call of ``name`` running now has
    passed ``after_s`` (it cannot be cut off on the thread it runs on). A call costs two
    attribute writes (the line is only made when said); a daemon thread looks once a second
    while calls come, and ends after a quiet minute (the next call starts it again)."""

    QUIET_S = 60.0

    def __init__(self, name: str, after_s: float, say: Callable[[str], None]):
        self.name, self.after_s, self.say = name, after_s, say
        self._running: tuple[float, int | None] | None = None  # (started, sample) of the call running now
        self._last = time.monotonic()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def begin(self, sample: int | None) -> None:
        self._running = (time.monotonic(), sample)
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._watch, daemon=True, name="colocate-reward-deadline")
                    self._thread.start()

    def end(self) -> None:
        self._running, self._last = None, time.monotonic()

    def _watch(self) -> None:
        said = None
        while True:
            time.sleep(min(1.0, self.after_s))
            running = self._running
            if running is None:
                if time.monotonic() - self._last > self.QUIET_S:
                    return
                continue
            started, sample = running
            if running is not said and time.monotonic() - started > self.after_s:
                said = running
                self.say(f"reward function {self.name}{_on(sample)} has run {time.monotonic() - started:.0f} s (reward.fn_timeout_s "
                         f"{self.after_s:g}); a plain def function cannot be cut off, the step waits for it "
                         "(make it async def, awaiting its slow call, to have the deadline end it)")


class Guarded:
    """``fn`` under ``reward.on_error`` and ``reward.fn_timeout_s`` (``timeout_s``, 0: none;
    ``say``: where a synchronous call past it is reported): awaited with ``(record, text,
    messages=, sample=)``, returns a finite float (module docstring)."""

    def __init__(self, fn: RewardFn, on_error: Literal["raise", "zero"], errors: RewardFnErrors,
                 timeout_s: float = 0.0, say: Callable[[str], None] | None = None):
        self.fn, self.on_error, self.errors, self.timeout_s = fn, on_error, errors, timeout_s
        self.asks = wants_messages(fn)
        self.__qualname__ = fn_name(fn)
        self.overdue = Overdue(self.__qualname__, timeout_s, say) if timeout_s > 0 and say is not None else None

    async def __call__(self, record: dict[str, Any], text: str, messages: Callable[[], Messages] | None = None,
                       sample: int | None = None) -> float:
        try:
            if self.overdue is not None:
                self.overdue.begin(sample)
            try:
                value = start(self.fn, record, text, messages, self.asks)
            finally:
                if self.overdue is not None:
                    self.overdue.end()
            if inspect.isawaitable(value):
                value = await self._awaited(value)
        except _Late:
            return self._failed(f"did not return within {self.timeout_s:g} s (reward.fn_timeout_s)", sample, None)
        except Exception as exc:  # noqa: BLE001 - the policy decides; nothing is swallowed silently
            return self._failed(f"raised {type(exc).__name__}: {cause_line(exc)}", sample, exc)
        x = number(value)
        return x if isinstance(x, float) else self._failed(x, sample, None)

    async def _awaited(self, value: Any) -> Any:
        """An async function's value; past ``timeout_s`` its call is cancelled (``_Late``)."""
        if self.timeout_s <= 0:
            return await value
        task = asyncio.ensure_future(value)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        finally:  # past the deadline, or the step itself cancelled (an engine died): the call ends too
            if not task.done():
                task.cancel()
        if not done:
            await asyncio.wait({task}, timeout=1.0)  # its cancellation runs (bounded: it may swallow it)
            raise _Late
        return task.result()

    def _failed(self, why: str, sample: int | None, exc: BaseException | None) -> float:
        what = f"reward function {self.__qualname__} {why}" + _on(sample, "(sample {})")
        if self.on_error == "raise":
            raise RewardFnError(f"{what}; fix it, or set reward.on_error=zero to score such "
                                "responses 0.0 (counted in reward/fn_errors)") from exc
        self.errors.count += 1
        self.errors.last = what
        return 0.0


class _Late(Exception):
    """An async reward function's call ran past ``reward.fn_timeout_s``."""


def _on(sample: int | None, form: str = "on sample {}") -> str:
    return " " + form.format(sample) if sample is not None else ""


def guarded(fn: RewardFn, on_error: Literal["raise", "zero"], errors: RewardFnErrors, timeout_s: float = 0.0,
            say: Callable[[str], None] | None = None) -> Guarded:
    """``fn`` (sync or async) as an async reward function that applies ``on_error`` and
    ``timeout_s`` (``reward.fn_timeout_s``; ``say``: the run's log, for a synchronous call
    past it)."""
    return Guarded(fn, on_error, errors, timeout_s, say)
