"""An environment in the rollout: its answers as tokens, under limits and one error policy.

Owns: :class:`ObservationTemplate` — how an observation's text becomes tokens: the text
the tokenizer's chat template puts between the model's end-of-turn token and the next
assistant turn (``<|im_end|>\\n<|im_start|>tool\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``
in ChatML), rendered once per role and tokenized once per answer, then appended after the
model's own tokens — token in, token out: the model's tokens are never decoded and
re-encoded, so the trained tokens are exactly the ones the engine saw (a model turn cut
by ``rollout.turn_tokens`` gets the end-of-turn token prepended to close it); the
observation's text is data: a special token's string in it is tokenized as characters, so
a tool's output cannot forge a turn (``colocate.assets.tasks.text_ids``);
:class:`EnvTurns` — an :class:`~colocate.rollout.env.Environment` as the engine's
:class:`~colocate.rollout.sample.MultiTurn`: the conversation so far rebuilt from the
sample (the model's turns decoded for the environment to read, its own earlier answers as
it gave them), one call per model turn under ``rollout.env_timeout_s`` of rollout time
(the trainer's phases, while a parked trajectory waits, do not count; an ``async`` step is awaited, a plain one runs in a daemon thread so a hung one cannot hold the
process), the answer checked, and failures as one line naming the environment, the turn
and the sample (``reward.on_error=raise``), or the trajectory ended there with nothing
added and the failure counted (``zero``; ``env/errors`` in metrics.jsonl).

Leaves out: the turn loop itself (``colocate.rollout.generate_and_score.stream_sample``), what an environment
answers (``colocate.rollout.calculator``, ``colocate.rollout.scripted_env``, the user's).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from typing import Any, Awaitable, Literal, Sequence

from colocate.assets.tasks import holds_special, plain_ids, text_ids
from colocate.rollout.sample import MultiTurn, Sample, TurnReply
from colocate.errors import ColocateError, cause_line
from colocate.rollout.env import Environment, Observation
from colocate.rollout.reward_fns import RewardFnErrors

_ASSISTANT, _OBSERVATION = "\x1eASSISTANT\x1e", "\x1eOBSERVATION\x1e"  # sentinels no template alters


class EnvError(ColocateError):
    """An environment raised, hung or answered garbage (``reward.on_error=raise``)."""


class TemplateRoleError(EnvError):
    """The chat template cannot render an observation of the role the environment used."""


# roles tried when a template refuses one, to name those it accepts
_COMMON_ROLES = ("tool", "user", "system", "ipython", "observation", "environment", "function")


EnvErrors = RewardFnErrors  # the same counter: failures scored as a zero since the last take


class ObservationTemplate:
    """Observation text -> the tokens appended after a model turn (see the module docstring)."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int], chat: bool = True):
        self.tokenizer = tokenizer
        self.chat = chat  # data.apply_chat_template: False frames observations as plain lines
        self.stop_ids = set(int(i) for i in stop_ids)
        self._frames: dict[str, tuple[str, str]] = {}

    def frame(self, role: str) -> tuple[str, str]:
        """(text before, text after) an observation of ``role``: from the end of the model's
        turn (its end-of-turn marker included) to the start of the next assistant turn."""
        if role not in self._frames:
            self._frames[role] = self._render(role)
        return self._frames[role]

    def _render(self, role: str) -> tuple[str, str]:
        if not self.chat or not getattr(self.tokenizer, "chat_template", None):
            return "\n", "\n"
        text = self._rendered(role)
        if text is None or _ASSISTANT not in text or _OBSERVATION not in text:
            accepted = [r for r in _COMMON_ROLES if r != role and self._renders(r)]
            hint = (f"answer with a role it accepts: {', '.join(accepted)}" if accepted
                    else f"it accepts none of {', '.join(_COMMON_ROLES)} there")
            raise TemplateRoleError(f"Observation.role {role!r}: the tokenizer's chat template does not render "
                                    f"such a message after an assistant one; {hint}")
        end = text.index(_ASSISTANT) + len(_ASSISTANT)
        start = text.index(_OBSERVATION, end)
        return text[end:start], text[start + len(_OBSERVATION):]

    def _rendered(self, role: str) -> str | None:
        """The template's text of a user, assistant, ``role`` conversation; None where the
        template refuses it (strict templates raise, e.g. Gemma's alternation check)."""
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ASSISTANT},
                    {"role": role, "content": _OBSERVATION}]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - jinja's TemplateError or the template's own raise_exception
            return None

    def _renders(self, role: str) -> bool:
        text = self._rendered(role)
        return text is not None and _ASSISTANT in text and _OBSERVATION in text

    def check(self, role: str) -> None:
        """Refuse ``role`` now, in one line, if the template cannot render it (start-up:
        an environment that declares the role it answers with)."""
        self.frame(role)

    def ids(self, text: str, role: str, model_ids: Sequence[int]) -> list[int]:
        """The tokens of observation ``text`` after a model turn ending in ``model_ids``.
        The frame opens with the template's end-of-turn marker: dropped when the model
        ended its turn itself (its stop token is already in the context)."""
        before, after = self.frame(role)
        if model_ids and int(model_ids[-1]) in self.stop_ids:
            own = self.tokenizer.decode([int(model_ids[-1])])
            if own and before.startswith(own):
                before = before[len(own):]
        if holds_special(self.tokenizer, text):  # tool output is data: it forges no turn (text_ids)
            return plain_ids(self.tokenizer, before) + text_ids(self.tokenizer, text) + plain_ids(self.tokenizer, after)
        return list(self.tokenizer(before + text + after, add_special_tokens=False)["input_ids"])


def history(sample: Sample, decode) -> list[dict[str, str]]:
    """The conversation after the prompt as chat messages: each run of model tokens decoded
    as an ``assistant`` message, each environment span as the message it came from."""
    mask, out, answers = sample.mask(), [], iter(sample.observations)
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            if mask[start]:
                out.append({"role": "assistant", "content": decode(sample.output_ids[start:i])})
            else:
                out.append(dict(next(answers)))
            start = i
    return out


class EnvTurns:
    """``env`` as the engine's turn loop (:meth:`multi_turn`); see the module docstring."""

    def __init__(self, env: Environment, template: ObservationTemplate, decode, *, max_turns: int,
                 turn_tokens: int = 0, timeout_s: float = 30.0,
                 on_error: Literal["raise", "zero"] = "raise", errors: EnvErrors | None = None):
        self.env, self.template, self.decode = env, template, decode
        self.max_turns, self.turn_tokens, self.timeout_s = max_turns, turn_tokens, timeout_s
        self.on_error = on_error
        self.errors = errors if errors is not None else EnvErrors()
        self._away, self._away_since = 0.0, None  # seconds the rollout was out of the loop (training)

    @property
    def name(self) -> str:
        return str(getattr(self.env, "name", type(self.env).__name__))

    def multi_turn(self) -> MultiTurn:
        return MultiTurn(self.answer, max_turns=self.max_turns, turn_tokens=self.turn_tokens)

    async def answer(self, sample: Sample) -> TurnReply:
        turn = sample.turns
        try:
            obs = _checked(await self._call(sample.record, history(sample, self.decode)))
        except _Failure as exc:
            return self._failed(sample, turn, exc)
        if obs.done:
            return TurnReply([], reward=float(obs.reward), done=True)
        try:
            ids = self.template.ids(obs.text, obs.role, sample.output_ids)
        except TemplateRoleError as exc:
            return self._failed(sample, turn, _Failure(f"answered with {exc}"))
        return TurnReply(ids, {"role": obs.role, "content": obs.text}, float(obs.reward))

    def _failed(self, sample: Sample, turn: int, exc: _Failure) -> TurnReply:
        """``reward.on_error``: raise one line naming the environment, turn and sample, or end
        the trajectory there with nothing added and count it."""
        what = f"rollout.env {self.name}: turn {turn} of sample {sample.index} {exc}"
        if self.on_error == "raise":
            raise EnvError(f"{what}; fix the environment, or set reward.on_error=zero to end such "
                           "trajectories there (counted in env/errors)") from exc.__cause__
        self.errors.count += 1
        self.errors.last = what
        return TurnReply([], done=True)

    # ---- the clock of rollout.env_timeout_s: a step's time, not training's --------------------
    def step_started(self) -> None:
        """The rollout runs the engines' loop again: the time since :meth:`step_ended` (the
        trainer held the process; no environment call could be heard) is not counted."""
        if self._away_since is not None:
            self._away += time.monotonic() - self._away_since
            self._away_since = None

    def step_ended(self) -> None:
        """The rollout leaves the loop until the next step (calls parked across it wait)."""
        self._away_since = time.monotonic()

    def _clock(self) -> float:
        now = time.monotonic()
        return now - self._away - (now - self._away_since if self._away_since is not None else 0.0)

    async def _within_timeout(self, call: Awaitable[Any]) -> Any:
        """``call``'s result, or TimeoutError once it ran ``timeout_s`` of rollout time: a call
        parked across a training phase (``overlap.pause_mode``) is not timed out by it."""
        task = asyncio.ensure_future(call)
        started = self._clock()
        try:
            while True:
                left = self.timeout_s - (self._clock() - started)
                if left <= 0:
                    raise asyncio.TimeoutError
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()

    async def _call(self, record: dict[str, Any], messages: list[dict[str, str]]) -> Any:
        step = self.env.step
        try:
            if inspect.iscoroutinefunction(step):
                return await self._within_timeout(step(record, messages))
            return await self._within_timeout(_in_daemon_thread(step, record, messages))
        except asyncio.TimeoutError:
            raise _Failure(f"did not answer within {self.timeout_s:g} s (rollout.env_timeout_s)") from None
        except Exception as exc:  # noqa: BLE001 - the policy decides; nothing is swallowed silently
            raise _Failure(f"raised {type(exc).__name__}: {cause_line(exc)}") from exc


class _Failure(Exception):
    pass


def _checked(obs: Any) -> Observation:
    if not isinstance(obs, Observation):
        raise _Failure(f"returned {type(obs).__name__} {str(obs)[:60]!r}, not an Observation")
    if not isinstance(obs.text, str) or not isinstance(obs.role, str) or not obs.role:
        raise _Failure(f"returned an Observation whose text/role is not a string ({obs!r:.80})")
    if not isinstance(obs.reward, (int, float)) or not math.isfinite(obs.reward):
        raise _Failure(f"returned a non-finite or non-numeric reward {obs.reward!r}")
    return obs


def _in_daemon_thread(fn, *args) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread, as a future of this loop: a call that never
    returns is abandoned at its timeout and cannot keep the process from exiting."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(value)

    def run() -> None:
        value, error = None, None
        try:
            value = fn(*args)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting loop
            error = exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits any more
            pass

    threading.Thread(target=run, daemon=True, name="colocate-env").start()
    return fut


async def _awaited(value):
    return await value
