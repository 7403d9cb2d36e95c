"""Environments in the rollout loop: the protocol a multi-turn task implements.

Owns: :class:`Observation` (what an environment answers to one model turn: text appended
to the trajectory as a ``role`` turn, a reward, whether the trajectory ends) and
:class:`Environment`, the protocol: an object with a ``name``, an ``instruction`` added to
every prompt (how to call the tool; "" for none) and ``step(record, history)`` — sync or
``async`` — which gets the task record (the prompt's source record, as rule rewards get
it) and the conversation so far as chat messages (``{"role": "assistant", "content": …}``
for the model's turns, ``{"role": <observation role>, "content": …}`` for earlier
observations), ending with the model's latest turn, and returns an :class:`Observation`.

An environment is a function of the record and the conversation: whatever state it needs
it rebuilds from ``history`` (or caches keyed by it). That is what makes a trajectory
resumable anywhere — deferred to the next step between or within turns, or restored from
a checkpoint after a crash — without the environment saving anything.

Leaves out: running environments in the rollout (``colocate.rollout.turns``: limits,
timeouts, error policy, token-exact observations), the built-in ones
(``colocate.rollout.calculator``, ``colocate.rollout.scripted_env``) and choosing one by
name (``colocate.rollout.environments``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Mapping, Protocol, Sequence, runtime_checkable

Message = Mapping[str, str]  # {"role": ..., "content": ...}


@dataclasses.dataclass(frozen=True)
class Observation:
    """An environment's answer to one model turn. ``text`` is appended as a ``role`` turn
    through the tokenizer's chat template (ignored when ``done``); ``reward`` is added to
    the trajectory's reward (per-turn rewards are summed: the trajectory is scored at its
    last token); ``done`` ends the trajectory after the model's turn."""

    text: str = ""
    reward: float = 0.0
    done: bool = False
    role: str = "tool"


@runtime_checkable
class Environment(Protocol):
    """See the module docstring. ``step`` may be a plain or an ``async`` method."""

    name: str
    instruction: str

    def step(self, record: Mapping[str, Any], history: Sequence[Message]) -> Observation | Awaitable[Observation]:
        ...
