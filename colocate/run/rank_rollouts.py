"""The engine ranks' rollouts joined into the step's one batch, and their checkpoint states.

Owns: :func:`gather` (every rank runs its share of the rollout; the parts, or the first
failure, are exchanged (``colocate.run.rank_failure.agree``), so a rank whose rollout fails
does not leave the others waiting in a collective: every rank raises, and a user error
lets every rank checkpoint the last completed step together), :func:`join` (the parts → one :class:`StepRollout`: samples
renamed into the union's index space (``placement.union_id``) and sorted, so groups stay
contiguous and the union is what one rank would have drawn; the phase seconds of the
slowest rank; counts summed; staleness over the union; per-rank engine metrics
``engines/<r>/…``), each rank's checkpointed rollout state (prompt stream position,
scheduler with its deferred buffer) and :func:`redistribute` for a resume on another
number of engine ranks.

Leaves out: where ranks run engines (``colocate.run.placement``); running a rollout
(``colocate.run.loop``, ``colocate.rollout.rollouts``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from colocate.engine.rollout import group_member, sample_index
from colocate.engine.scheduler import saved_groups, staleness_stats, state_holding
from colocate.run.placement import union_id
from colocate.run.rank_failure import RankFailedError, agree  # noqa: F401  (RankFailedError: re-exported)
from colocate.rollout.rollout_phase import StepRollout, rollout_stats
from colocate.rollout.rollouts import scheduler_state, with_scheduler_state

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
    union's group g·R + r (``placement.union_id``), member m of it index (g·R + r)·n + m."""
    if sample.group is None:
        return dataclasses.replace(sample, index=union_id(sample.index, rank, ranks))
    group = union_id(sample.group, rank, ranks)
    return dataclasses.replace(sample, index=sample_index(group, group_member(sample.index, n)[1], n), group=group)


# ---- checkpoints -----------------------------------------------------------------------------
def rank_state(data_pos: int, overlap: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint keeps of one engine rank: groups drawn from its prompt stream and
    its rollout state (``Rollouts.state_dict``: scheduler with the deferred buffer, chunk
    tuner; None in checkpoints of sequential runs written before every mode had one)."""
    return {"data_pos": int(data_pos), "overlap": overlap}


def saved_states(parts: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """(prompt stream base, per-engine-rank states) of a loaded checkpoint; a checkpoint
    written before engines ran on every rank holds one rank's."""
    if "rollout" in parts:
        return int(parts["rollout"]["base"]), list(parts["rollout"]["ranks"])
    return 0, [rank_state(parts.get("run", {}).get("data_pos", 0), parts.get("overlap"))]


def redistribute(base: int, states: Sequence[dict[str, Any]], ranks: int,
                 group_size: int) -> tuple[int, list[dict[str, Any]], str | None]:
    """The checkpointed states of ``len(states)`` engine ranks for ``ranks`` ranks:
    ``(base, states, note)``. Same count: unchanged (note None). Otherwise every stream
    restarts at the first position no old rank reached (a few prompts of the slower ranks'
    streams are skipped), the deferred groups are dealt round-robin, oldest first, under
    fresh local indices, and the Δ controller, chunk tuner (and auto's picker) of the old
    first rank go to every rank; ``note`` says what moved."""
    if len(states) == ranks:
        return base, list(states), None
    old = len(states)
    new_base = base + max(s["data_pos"] for s in states) * old
    overlaps = [s["overlap"] for s in states]
    if all(o is None for o in overlaps):
        return new_base, [rank_state(0, None) for _ in range(ranks)], (
            f"{old} engine ranks -> {ranks}: prompts continue from position {new_base}")
    groups: list[tuple[int, list[dict[str, Any]]]] = []  # (age in the union, members)
    for r, o in enumerate(overlaps):
        if o is not None:
            groups += [(union_id(members[0]["index"], r, old), members) for members in saved_groups(scheduler_state(o))]
    groups.sort(key=lambda g: g[0])
    first = next(o for o in overlaps if o is not None)
    dropped = sum(scheduler_state(o)["dropped_total"] for o in overlaps if o)
    out = []
    for r in range(ranks):
        mine = [members for i, (_, members) in enumerate(groups) if i % ranks == r]
        scheduler = state_holding(mine, group_size, dropped_total=dropped if r == 0 else 0,
                                  delta=scheduler_state(first)["delta"])
        out.append(rank_state(0, with_scheduler_state(first, scheduler)))  # tuner, picker, score scaling: the first's
    moved = sum(len(m) for _, m in groups)
    return new_base, out, (f"{old} engine ranks -> {ranks}: {moved} deferred samples ({len(groups)} groups) dealt "
                           f"round-robin over the {ranks} ranks; prompts continue from position {new_base}")
