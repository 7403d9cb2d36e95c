"""The reward of a response, in every mode and in the held-out evaluation: the one place
where it is summed and scaled.

Owns: :class:`Scorer` — reward = (reward model's score + each reward function's value on
the model's text and the prompt record + the environment's rewards of a multi-turn
trajectory) × ``reward.scale``; the model's text is the response, or a trajectory's model
turns only (:func:`model_text`). The model's score comes
from wherever the step got it: streamed chunk by chunk through the feeder (then handed
in), one-shot from the inline reward engine, or — when the reward model lives in the
feeder's own process (``overlap.feeder=process``) — one-shot through the feeder
(:func:`engine.reward.score_whole`). Leaves out: how the step schedules scoring
(``colocate.rollout.schedule``) and the reward functions' error policy
(``colocate.rollout.reward_fns``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any, Awaitable, Callable, Sequence

from colocate.engine import reward as rm
from colocate.rollout.sample import Sample
from colocate.rollout import reward_fns
from colocate.rollout.reward_fns import Guarded, RewardFn, fn_name
from colocate.rollout.turns import history

# (step id, [(prompt ids, response ids)], [sample indices]) -> the reward model's scores
WholeScores = Callable[[int, Sequence[tuple[Sequence[int], Sequence[int]]], Sequence[int]], Awaitable[list[float]]]


def model_text(sample: Sample, decode: Callable[[list[int]], str], messages: Callable[[], list]) -> str:
    """What reward functions score: the response, or a trajectory's model turns (of
    ``messages()``, its chat messages) joined by a newline: the environment's answers left
    out (``colocate.rollout.reward_fns``)."""
    if not sample.loss_mask:
        return decode(sample.output_ids)
    return "\n".join(m["content"] for m in messages() if m["role"] == "assistant")


async def call_reward_fn(fn: RewardFn, sample: Sample, text: str, messages: Callable[[], list]) -> float:
    """``fn``'s value on ``sample``: a :class:`Guarded` function applies ``reward.on_error``
    and names the sample; a bare one (tests, the API's own wrappers) is taken as a float."""
    if isinstance(fn, Guarded):
        return await fn(sample.record, text, messages, sample.index)
    return float(await reward_fns.call(fn, sample.record, text, messages, reward_fns.wants_messages(fn)))


def _unique(taken: dict[str, float], name: str) -> str:
    """``name``, or ``name#2``, ``name#3``… when a part of that name is already there."""
    k, out = 1, name
    while out in taken:
        k += 1
        out = f"{name}#{k}"
    return out


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
        parts = {"model": model_score, "env": sample.env_reward}
        if self.fns:
            messages = functools.cache(lambda: history(sample, self.decode))  # decoded once, if read
            text = model_text(sample, self.decode, messages)
            for fn in self.fns:
                name = fn_name(fn).rsplit(".", 1)[-1]  # "offset", not "test_x.<locals>.offset"
                parts[_unique(parts, name)] = await call_reward_fn(fn, sample, text, messages)
        sample.reward_parts = {name: value * self.scale for name, value in parts.items()}  # samples.jsonl
        return sum(parts.values()) * self.scale

    async def __call__(self, sample: Sample, streamed: float | None, tag: str, step: int) -> float:
        """A finished sample's reward (``colocate.rollout.schedule``'s scoring): its streamed model score,
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
