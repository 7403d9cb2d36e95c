"""The scripted environment: canned observations, for tests and documentation.

Owns: :class:`ScriptedEnv`, an :class:`Environment` whose answer to the model's turn k
(k = the number of assistant messages in the history, minus one) is its k-th reply,
then, once the replies run out, the end of the trajectory with ``final_reward``; and its
fault knobs (raise, hang, answer something that is not an :class:`Observation` at a
given turn), which exercise the rollout's error and timeout paths. Deterministic and
stateless: the same history always gets the same answer, whatever came before.

Leaves out: anything a real task does (it ignores the record and what the model wrote),
running turns (``colocate.rollout.turns``) and choosing it by name
(``colocate.rollout.environments``: ``rollout.env=scripted``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Mapping, Sequence

from colocate.rollout.env import Message, Observation

GARBAGE = 42  # what ``garbage_at`` answers instead of an Observation


@dataclasses.dataclass(frozen=True)
class ScriptedEnv:
    """Reply k is ``replies[k]`` with reward ``turn_rewards[k]`` (0.0 past its end), as a
    ``role`` turn; after the replies, ``done`` with ``final_reward``. At turn ``fail_at``
    ``step`` raises RuntimeError, at ``hang_at`` it never returns, at ``garbage_at`` it
    returns :data:`GARBAGE`. ``step`` is ``async``."""

    replies: tuple[str, ...] = ("observation one", "observation two")
    turn_rewards: tuple[float, ...] = ()
    final_reward: float = 1.0
    role: str = "tool"
    name: str = "scripted"
    instruction: str = ""
    fail_at: int | None = None
    hang_at: int | None = None
    garbage_at: int | None = None

    @staticmethod
    def turn(history: Sequence[Message]) -> int:
        """The index of the model's latest turn: assistant messages in ``history``, minus one (0 for none)."""
        return max(sum(1 for m in history if m.get("role") == "assistant") - 1, 0)

    async def step(self, record: Mapping[str, Any], history: Sequence[Message]) -> Observation:
        k = self.turn(history)
        if k == self.fail_at:
            raise RuntimeError(f"scripted failure at turn {k}")
        if k == self.hang_at:
            await asyncio.Event().wait()  # nobody sets it: only a timeout or a cancel ends this
        if k == self.garbage_at:
            return GARBAGE  # type: ignore[return-value] - on purpose: the rollout must reject it
        if k < len(self.replies):
            reward = float(self.turn_rewards[k]) if k < len(self.turn_rewards) else 0.0
            return Observation(self.replies[k], reward=reward, role=self.role)
        return Observation(done=True, reward=float(self.final_reward), role=self.role)
