"""The generate and score phases of one PPO step (on each engine rank, its share).

Owns: :class:`Prompt` (a tokenized prompt of the data set with its source record),
:func:`response_budget`, :class:`StepRollout` (what a step's rollout hands to training,
in every mode: the trained :class:`colocate.rollout.sample.Sample` s, scored), the sampling
parameters and the step's rollout stats.

Leaves out: the schedule (``colocate.rollout.schedule.run_step``, every mode's), which samples a step
runs (``colocate.rollout.rollouts``) and training.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Sequence

from colocate.rollout.sample import Sample


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One tokenized prompt of the data set with its source record (kept for rule rewards)."""

    ids: tuple[int, ...]
    record: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StepRollout:
    """A step's rollout, in every mode: the samples to train on (scored, groups whole and
    contiguous), the phase seconds and the mode's stats."""

    samples: list[Sample]
    seconds: dict[str, float]
    stats: dict[str, float] = dataclasses.field(default_factory=dict)

    def with_stats(self, extra: dict[str, float]) -> "StepRollout":
        return dataclasses.replace(self, stats={**self.stats, **extra})


def response_budget(rollout_cfg, seed: int, position: int) -> int:
    """Token budget of the request at data ``position``: ``max_new_tokens``, or a draw from
    a long-tailed distribution capped at it (deterministic in seed and position)."""
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


def sampling_params(temperature: float, top_p: float, stop_ids: Sequence[int],
                    ignore_eos: bool = False) -> dict[str, Any]:
    params = {"temperature": temperature, "top_p": top_p, "stop_token_ids": list(stop_ids)}
    if ignore_eos:
        params = {"temperature": temperature, "top_p": top_p, "ignore_eos": True}
    return params


def rollout_stats(samples: Sequence[Sample], multi_turn: bool = False) -> dict[str, float]:
    """Metrics of the trained samples in every mode: groups, and prompt tokens the actor
    engine served from its radix cache (a group's shared prompt: n - 1 of its members).
    Multi-turn: model turns and environment answers (tool calls) per trajectory, the
    share of trajectories with at least one, environment tokens per trajectory, the
    environment's rewards, and the context tokens later turns found in the radix cache."""
    stats = {"rollout/groups": len({s.group_id for s in samples}),
             "rollout/cached_prompt_tokens": sum(s.cached_tokens for s in samples)}
    if multi_turn and samples:
        n = len(samples)
        stats |= {"rollout/turns": sum(s.turns for s in samples) / n,
                  "rollout/tool_calls": sum(len(s.observations) for s in samples) / n,
                  "rollout/tool_call_rate": sum(1 for s in samples if s.observations) / n,
                  "rollout/env_tokens": sum(len(s.output_ids) - sum(s.mask()) for s in samples) / n,
                  "rollout/env_reward": sum(s.env_reward for s in samples) / n,
                  "rollout/cached_turn_tokens": sum(s.turn_cached_tokens for s in samples)}
    return stats


def prompt_samples(prompts: Sequence[Prompt], max_new_tokens: int) -> list[Sample]:
    """One sample per prompt (index = position), each with the whole budget."""
    return [Sample(i, list(p.ids), max_new_tokens, record=dict(p.record)) for i, p in enumerate(prompts)]
