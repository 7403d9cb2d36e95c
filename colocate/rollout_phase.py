"""The generate and score phases of one PPO step (rank 0, where the engines live).

Owns: turning prompts into :class:`engine.rollout.Sample` requests, running them on the
actor engine, and scoring the results with the reward engine and/or Python reward
functions (sync or async). Sequential mode: scoring starts after generation ends.

Leaves out: the overlapped variants (streamed scoring, deferral) and training.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any, Callable, Sequence

from colocate.engine import reward as rm
from colocate.engine import rollout
from colocate.engine.rollout import Sample
from colocate.reward_fns import RewardFn  # noqa: F401  (re-exported: the reward functions' type)



@dataclasses.dataclass(frozen=True)
class Prompt:
    """One tokenized prompt with its source record (kept for rule rewards) and, once
    drawn for a step, its response token budget."""

    ids: tuple[int, ...]
    record: dict[str, Any]
    budget: int | None = None


def response_budget(rollout_cfg, seed: int, position: int) -> int:
    """Token budget of the request at data ``position``: ``max_new_tokens``, or a draw from
    a long-tailed distribution capped at it (deterministic in seed and position)."""
    import math
    import random

    cap = rollout_cfg.max_new_tokens
    if rollout_cfg.length_dist == "fixed":
        return cap
    rng = random.Random(seed * 1_000_003 + position)
    median = rollout_cfg.length_median or max(1, cap // 4)
    if rollout_cfg.length_dist == "lognormal":
        draw = math.exp(rng.gauss(math.log(median), rollout_cfg.length_sigma))
    else:  # pareto with the given median: x_m = median / 2^(1/alpha)
        draw = median / 2 ** (1 / rollout_cfg.pareto_alpha) * rng.paretovariate(rollout_cfg.pareto_alpha)
    return int(min(cap, max(1, round(draw))))


@dataclasses.dataclass
class RolloutOutput:
    samples: list[Sample]
    scores: list[float]
    seconds: dict[str, float]


def sampling_params(temperature: float, top_p: float, stop_ids: Sequence[int],
                    ignore_eos: bool = False) -> dict[str, Any]:
    params = {"temperature": temperature, "top_p": top_p, "stop_token_ids": list(stop_ids)}
    if ignore_eos:
        params = {"temperature": temperature, "top_p": top_p, "ignore_eos": True}
    return params


async def call_reward_fn(fn: RewardFn, record: dict[str, Any], text: str) -> float:
    value = fn(record, text)
    if inspect.isawaitable(value):
        value = await value
    return float(value)


async def score_samples(
    samples: Sequence[Sample],
    prompts: Sequence[Prompt],
    *,
    reward_engine=None,
    reward_fns: Sequence[RewardFn] = (),
    decode: Callable[[list[int]], str] | None = None,
    tag: str,
    step: int | None = None,
) -> list[float]:
    """Sum of the reward model's score (if any) and every reward function's value. A reward
    request the engine refuses raises one `RewardRequestError` line naming (step, sample)."""
    totals = [0.0] * len(samples)
    if reward_engine is not None:
        seqs = [list(p.ids) + s.output_ids for s, p in zip(samples, prompts)]
        for i, v in enumerate(await rm.score_many(reward_engine, seqs, tag, step=step)):
            totals[i] += v
    if reward_fns:
        texts = [decode(s.output_ids) for s in samples]
        for fn in reward_fns:
            vals = await asyncio.gather(*(call_reward_fn(fn, p.record, t) for p, t in zip(prompts, texts)))
            totals = [a + b for a, b in zip(totals, vals)]
    return totals


def run_sequential(
    actor, prompts: Sequence[Prompt], max_new_tokens: int, sampling: dict[str, Any], step: int,
    *, reward_engine=None, reward_fns: Sequence[RewardFn] = (), decode=None, tag_prefix: str = "st",
) -> RolloutOutput:
    """Generate all samples, then score them (request ids start with ``tag_prefix``)."""
    import time

    samples = [Sample(i, list(p.ids), p.budget or max_new_tokens) for i, p in enumerate(prompts)]
    tag = f"{tag_prefix}{step:07d}"
    from colocate.engine.runtime import run_guarded

    engines = [actor, reward_engine]
    t0 = time.perf_counter()
    run_guarded(engines, rollout.generate(actor, samples, sampling, tag))
    t1 = time.perf_counter()
    scores = run_guarded(engines, score_samples(
        samples, prompts, reward_engine=reward_engine, reward_fns=reward_fns, decode=decode, tag=tag + "rm",
        step=step))
    t2 = time.perf_counter()
    return RolloutOutput(samples, scores, {"generate": t1 - t0, "reward_tail": t2 - t1})
