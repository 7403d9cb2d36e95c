"""An environment in the rollout: its answers as tokens, under limits and one error policy.

Owns: :class:`ObservationTemplate` — how an observation's text becomes tokens: the text
the tokenizer's chat template puts between the model's end-of-turn token and the next
assistant turn (``<|im_end|>\\n<|im_start|>tool\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``
in ChatML), rendered once per role and tokenized once per answer, then appended after the
model's own tokens — token in, token out: the model's tokens are never decoded and
re-encoded, so the trained tokens are exactly the ones the engine saw (a model turn cut
by ``rollout.turn_tokens`` gets the end-of-turn token prepended to close it);
:class:`EnvTurns` — an :class:`~colocate.rollout.env.Environment` as the engine's
:class:`~colocate.engine.rollout.MultiTurn`: the conversation so far rebuilt from the
sample (the model's turns decoded for the environment to read, its own earlier answers as
it gave them), one call per model turn under ``rollout.env_timeout_s`` (an ``async``
step is awaited, a plain one runs in a daemon thread so a hung one cannot hold the
process), the answer checked, and failures as one line naming the environment, the turn
and the sample (``reward.on_error=raise``), or the trajectory ended there with nothing
added and the failure counted (``zero``; ``env/errors`` in metrics.jsonl).

Leaves out: the turn loop itself (``engine.rollout.stream_sample``), what an environment
answers (``colocate.rollout.calculator``, ``colocate.rollout.scripted_env``, the user's).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from typing import Any, Literal, Sequence

from colocate.engine.rollout import MultiTurn, Sample, TurnReply
from colocate.errors import ColocateError
from colocate.rollout.env import Environment, Observation
from colocate.rollout.reward_fns import RewardFnErrors

_ASSISTANT, _OBSERVATION = "\x1eASSISTANT\x1e", "\x1eOBSERVATION\x1e"  # sentinels no template alters


class EnvError(ColocateError):
    """An environment raised, hung or answered garbage (``reward.on_error=raise``)."""


EnvErrors = RewardFnErrors  # the same counter: failures scored as a zero since the last take


class ObservationTemplate:
    """Observation text -> the tokens appended after a model turn (see the module docstring)."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.stop_ids = set(int(i) for i in stop_ids)
        self._frames: dict[str, tuple[str, str]] = {}

    def frame(self, role: str) -> tuple[str, str]:
        """(text before, text after) an observation of ``role``: from the end of the model's
        turn (its end-of-turn marker included) to the start of the next assistant turn."""
        if role not in self._frames:
            self._frames[role] = self._render(role)
        return self._frames[role]

    def _render(self, role: str) -> tuple[str, str]:
        if not getattr(self.tokenizer, "chat_template", None):
            return "\n", "\n"
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ASSISTANT},
                    {"role": role, "content": _OBSERVATION}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if _ASSISTANT not in text or _OBSERVATION not in text:
            raise EnvError(f"rollout.env: the tokenizer's chat template does not render a {role!r} message "
                           "after an assistant one; answer with a role it knows (Observation.role)")
        end = text.index(_ASSISTANT) + len(_ASSISTANT)
        start = text.index(_OBSERVATION, end)
        return text[end:start], text[start + len(_OBSERVATION):]

    def ids(self, text: str, role: str, model_ids: Sequence[int]) -> list[int]:
        """The tokens of observation ``text`` after a model turn ending in ``model_ids``.
        The frame opens with the template's end-of-turn marker: dropped when the model
        ended its turn itself (its stop token is already in the context)."""
        before, after = self.frame(role)
        if model_ids and int(model_ids[-1]) in self.stop_ids:
            own = self.tokenizer.decode([int(model_ids[-1])])
            if own and before.startswith(own):
                before = before[len(own):]
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
            what = f"rollout.env {self.name}: turn {turn} of sample {sample.index} {exc}"
            if self.on_error == "raise":
                raise EnvError(f"{what}; fix the environment, or set reward.on_error=zero to end such "
                               "trajectories there (counted in env/errors)") from exc.__cause__
            self.errors.count += 1
            self.errors.last = what
            return TurnReply([], done=True)
        if obs.done:
            return TurnReply([], reward=float(obs.reward), done=True)
        ids = self.template.ids(obs.text, obs.role, sample.output_ids)
        return TurnReply(ids, {"role": obs.role, "content": obs.text}, float(obs.reward))

    async def _call(self, record: dict[str, Any], messages: list[dict[str, str]]) -> Any:
        step = self.env.step
        try:
            if inspect.iscoroutinefunction(step):
                return await asyncio.wait_for(step(record, messages), self.timeout_s)
            return await asyncio.wait_for(_in_daemon_thread(step, record, messages), self.timeout_s)
        except asyncio.TimeoutError:
            raise _Failure(f"did not answer within {self.timeout_s:g} s (rollout.env_timeout_s)") from None
        except Exception as exc:  # noqa: BLE001 - the policy decides; nothing is swallowed silently
            cause = (str(exc).strip().splitlines() or [""])[0][:200]
            raise _Failure(f"raised {type(exc).__name__}: {cause}") from exc


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
