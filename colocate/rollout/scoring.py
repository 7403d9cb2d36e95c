"""The reward of a response, in every mode and in the held-out evaluation: the one place
where it is summed and scaled.

Owns: :class:`Scorer` — reward = (reward model's score + each reward function's value on
the decoded response and the prompt record + the environment's rewards of a multi-turn
trajectory) × ``reward.scale``. The model's score comes
from wherever the step got it: streamed chunk by chunk through the feeder (then handed
in), one-shot from the inline reward engine, or — when the reward model lives in the
feeder's own process (``overlap.feeder=process``) — one-shot through the feeder
(:func:`engine.streamed.score_whole`). Leaves out: how the step schedules scoring
(``colocate.rollout.rollout_phase``, ``engine.oppo``) and the reward functions' error policy
(``colocate.rollout.reward_fns``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any, Awaitable, Callable, Sequence

from colocate.engine import reward as rm
from colocate.engine.rollout import Sample
from colocate.rollout.reward_fns import RewardFn

# (step id, [(prompt ids, response ids)], [sample indices]) -> the reward model's scores
WholeScores = Callable[[int, Sequence[tuple[Sequence[int], Sequence[int]]], Sequence[int]], Awaitable[list[float]]]


async def call_reward_fn(fn: RewardFn, record: dict[str, Any], text: str) -> float:
    value = fn(record, text)
    if inspect.isawaitable(value):
        value = await value
    return float(value)


@dataclasses.dataclass(frozen=True)
class Scorer:
    """``reward_engine``: the inline reward engine; ``whole``: the reward model behind the
    feeder's process (one of them, or neither: functions only); ``timeout_s``: the deadline
    of one reward-model request (``overlap.feeder_timeout_s``)."""

    reward_engine: Any = None
    fns: tuple[RewardFn, ...] = ()
    decode: Callable[[list[int]], str] | None = None
    scale: float = 1.0
    timeout_s: float | None = None
    whole: WholeScores | None = None

    @property
    def engines(self) -> list[Any]:
        """The engines scoring runs on in this process (watched while a step waits)."""
        return [self.reward_engine] if self.reward_engine is not None else []

    async def reward(self, sample: Sample, model_score: float) -> float:
        """The sample's reward from the model's score (0.0 without a reward model), plus a
        multi-turn trajectory's environment rewards."""
        total = model_score + sample.env_reward
        if self.fns:
            text = self.decode(sample.output_ids)
            for fn in self.fns:
                total += await call_reward_fn(fn, sample.record, text)
        return total * self.scale

    async def __call__(self, sample: Sample, streamed: float | None, tag: str, step: int) -> float:
        """A finished sample's reward (``engine.oppo``'s scoring): its streamed model score,
        or a one-shot one; request ids start with ``tag``."""
        if streamed is None:
            [streamed] = await self.model_scores([sample], tag, step)
        return await self.reward(sample, streamed)

    async def model_scores(self, samples: Sequence[Sample], tag: str, step: int) -> list[float]:
        """One-shot reward-model scores of whole responses. A request the engine refuses, or
        does not answer within ``timeout_s``, raises one `RewardRequestError` line naming
        (step, sample)."""
        if self.reward_engine is not None:
            seqs = [s.prompt_ids + s.output_ids for s in samples]
            return await rm.score_many(self.reward_engine, seqs, tag, step=step, timeout_s=self.timeout_s,
                                       indices=[s.index for s in samples])
        if self.whole is not None:
            return await self.whole(step, [(s.prompt_ids, s.output_ids) for s in samples], [s.index for s in samples])
        return [0.0] * len(samples)

    async def score_all(self, samples: Sequence[Sample], tag: str, step: int) -> list[float]:
        """Every sample's reward (the sequential schedule: after generation ended)."""
        model = await self.model_scores(samples, tag, step)
        return list(await asyncio.gather(*(self.reward(s, m) for s, m in zip(samples, model))))
