"""The engine ranks' rollouts joined into the step's one batch.

Owns: :func:`gather` (every rank runs its share of the rollout; the parts, or the first
failure, are exchanged (``colocate.run.rank_failure.agree``), so a rank whose rollout fails
does not leave the others waiting in a collective: every rank raises, and a user error
lets every rank checkpoint the last completed step together), :func:`join` (the parts → one :class:`StepRollout`: samples
renamed into the union's index space (``sample.union_id``) and sorted, so groups stay
contiguous and the union is what one rank would have drawn; the phase seconds of the
slowest rank; counts summed; staleness over the union; per-rank engine metrics
``engines/<r>/…``).

Leaves out: where ranks run engines (``colocate.run.placement``); running a rollout
(``colocate.run.loop``, ``colocate.rollout.rollouts``); each rank's checkpointed data
source and its redistribution over another number of ranks (``colocate.rollout.data_source``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from colocate.rollout.sample import group_member, sample_index, union_id
from colocate.rollout.rollouts import StepRollout, rollout_stats, staleness_stats
from colocate.run.rank_failure import agree

SAME_ON_EVERY_RANK = ("overlap/delta", "overlap/chunk_size")  # reported from the first engine rank
PER_RANK = {"engine/busy_s": "busy_s", "engine/actor_requests": "actor_requests",
            "engine/reward_requests": "reward_requests", "overlap/deferred": "deferred"}


def gather(run: Callable[[], StepRollout | None], dist, version: int, group_size: int) -> StepRollout:
    """``run()`` on this rank (its part; None without engines), then the step's joined
    rollout on every rank. ``version``: the weight version the step trains from. A rank's
    failure raises on every rank (``rank_failure.agree``: "rank R failed in rollout (…)")."""
    parts = agree(run, dist, "rollout", share=True)
    return join(parts, version, group_size)


def join(parts: Sequence[StepRollout | None], version: int, group_size: int) -> StepRollout:
    """One step's rollout from each engine rank's part (``parts`` in rank order; None: a
    rank without engines)."""
    own = [p for p in parts if p is not None]
    samples = sorted((_renamed(x, r, len(own), group_size) for r, part in enumerate(own) for x in part.samples),
                     key=lambda x: x.index)
    slowest = max(own, key=lambda p: sum(p.seconds.values()))
    stats: dict[str, float] = {}
    for key in dict.fromkeys(k for p in own for k in p.stats):
        values = [p.stats[key] for p in own if key in p.stats]
        if key in SAME_ON_EVERY_RANK:
            stats[key] = values[0]
        elif not key.startswith("engine/"):
            stats[key] = sum(values)
    if any(k.startswith("overlap/staleness_") for k in stats):
        stats |= {f"overlap/staleness_{k}": v for k, v in staleness_stats(samples, version).items()}
    stats |= rollout_stats(samples, multi_turn="rollout/turns" in stats)  # means over the union, not sums
    for r, part in enumerate(own):
        busy = {"engine/busy_s": sum(part.seconds.values())}
        for key, name in PER_RANK.items():
            value = busy.get(key, part.stats.get(key))
            if value is not None:
                stats[f"engines/{r}/{name}"] = value
    return StepRollout(samples, dict(slowest.seconds), stats)


def _renamed(sample, rank: int, ranks: int, n: int):
    """``sample`` of engine rank ``rank`` as the union names it: its local group g is the
    union's group g·R + r (``sample.union_id``), member m of it index (g·R + r)·n + m."""
    if sample.group is None:
        return dataclasses.replace(sample, index=union_id(sample.index, rank, ranks))
    group = union_id(sample.group, rank, ranks)
    return dataclasses.replace(sample, index=sample_index(group, group_member(sample.index, n)[1], n), group=group)
