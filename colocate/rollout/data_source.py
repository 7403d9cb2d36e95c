"""The samples of one engine rank before and between the steps that run them.

Owns: :class:`TokenizedPrompt` (a prompt of the data set as token ids, with its source
record), :class:`DataSource`: the tokenized training prompts and the held-out ones, this
rank's position in its stream of prompts (groups drawn) and where the engine ranks'
streams start (:meth:`DataSource.position`: ``sample.union_id`` interleaves them, so their
union is one rank's stream), the seeded cycle over the prompt set, each member's token
budget (:func:`response_budget`: fixed or drawn from a long tail), the names of new
samples, given at birth in the engine ranks' union (this rank's g-th group is the union's
group g·R + r, ``sample.union_id``; its members consecutive, ``sample.sample_index``), so
the ranks' shares join by sorting on the index and a sample is never renamed; the
deferred samples (partial, or finished and waiting for their group or the next step: the
scheduler reads them each step, the ones the step takes or drops leave the buffer, and
what the step defers enters it), and its own state: :meth:`DataSource.state_dict` and
:func:`redistribute` (a resume on another number of engine ranks).

Leaves out: which samples run when (``colocate.rollout.scheduler``), generating and scoring
them (``colocate.rollout.rollouts``), the checkpoint's layout (``colocate.run.checkpoint_layout``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Iterator, Sequence

from colocate.config import RolloutConfig
from colocate.rollout.sample import Sample, sample_index, union_id


@dataclasses.dataclass(frozen=True)
class TokenizedPrompt:
    """One tokenized prompt of the data set with its source record (kept for rule rewards)."""

    ids: tuple[int, ...]
    record: dict[str, Any]


@dataclasses.dataclass
class DataSource:
    prompts: list[TokenizedPrompt]
    rollout: RolloutConfig  # group size n, the length distribution of token budgets
    seed: int  # run.seed: the budgets' draw
    rank: int = 0  # this engine rank (Placement.engine_rank) of
    ranks: int = 1  # the run's engine ranks
    eval_prompts: list[TokenizedPrompt] = dataclasses.field(default_factory=list)  # held out (data.eval_prompts)
    base: int = 0  # where the engine ranks' streams start (a resume on another world size moves it)
    drawn: int = 0  # groups this rank has drawn
    named: int = 0  # samples this rank has named (its next group is this rank's named / n-th)
    dropped_total: int = 0  # deferred samples dropped as too stale
    deferred: list[Sample] = dataclasses.field(default_factory=list)  # ascending index: oldest first

    def groups(self) -> Iterator[list[Sample]]:
        """New groups, one per ``next()``, named in the engine ranks' union: this rank's
        k-th group is the union's group u = k·R + r, its n members indices u·n … u·n + n − 1
        (:func:`group_names`; group None with n = 1). They share the next prompt of this rank's
        stream, drawn through a fixed, seeded cycle over the prompt set; each member has its
        own token budget (``response_budget`` at draw ``position · n + member``). Only the
        groups taken advance the position."""
        n = self.rollout.group_size
        while True:
            pos = self.position(self.drawn)
            prompt = self.prompts[pos % len(self.prompts)]
            indices, group = group_names(self.named // n, self.rank, self.ranks, n)
            members = [Sample(index, list(prompt.ids),
                              response_budget(self.rollout, self.seed, sample_index(pos, m, n)),
                              group=group, record=dict(prompt.record)) for m, index in enumerate(indices)]
            self.drawn += 1
            self.named += n
            yield members

    def position(self, drawn: int) -> int:
        """Data position of this rank's ``drawn``-th group (0-based): the engine ranks'
        streams interleaved from ``base``, disjoint, their union one rank's stream."""
        return self.base + union_id(drawn, self.rank, self.ranks)

    def take(self, samples: Sequence[Sample], dropped: Sequence[Sample] = ()) -> None:
        """``samples`` leave the deferred buffer for a step (launched again, or trained as
        they are), ``dropped`` leave it as too stale to train on (counted); the rest stay
        where they are."""
        gone = {s.index for s in (*samples, *dropped)}
        self.deferred = [s for s in self.deferred if s.index not in gone]
        self.dropped_total += len(dropped)

    def defer(self, samples: Sequence[Sample]) -> None:
        """Keep ``samples`` for a later step, the buffer oldest first."""
        self.deferred = sorted([*self.deferred, *samples], key=lambda s: s.index)

    def eval_samples(self, max_new_tokens: int) -> list[Sample]:
        """The held-out prompts, one sample each (index = position), each with the whole budget."""
        return prompt_samples(self.eval_prompts, max_new_tokens)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part (the stream's base is the run's: :func:`redistribute`)."""
        return {"data_pos": self.drawn, "named": self.named, "dropped_total": self.dropped_total,
                "deferred": [s.state() for s in self.deferred]}

    def load_state_dict(self, base: int, state: dict[str, Any]) -> None:
        self.base, self.drawn = int(base), int(state["data_pos"])
        self.named, self.dropped_total = int(state["named"]), int(state["dropped_total"])
        self.deferred = sorted((Sample.from_state(d) for d in state["deferred"]), key=lambda s: s.index)


def group_names(local: int, rank: int, ranks: int, n: int) -> tuple[list[int], int | None]:
    """The names of engine rank ``rank``'s ``local``-th group (of ``n`` samples) in the union
    of ``ranks`` ranks: its members' indices and its group id (None with n = 1)."""
    group = union_id(local, rank, ranks)
    return [sample_index(group, m, n) for m in range(n)], (group if n > 1 else None)


def saved_groups(state: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The deferred groups of a saved rank state (:meth:`DataSource.state_dict`): each its
    samples' dicts in member order, the groups oldest first (by first index)."""
    by_group: dict[int, list[dict[str, Any]]] = {}
    for d in state["deferred"]:
        by_group.setdefault(d["index"] if d.get("group") is None else d["group"], []).append(d)
    groups = [sorted(members, key=lambda d: d["index"]) for members in by_group.values()]
    return sorted(groups, key=lambda g: g[0]["index"])


def state_holding(groups: Sequence[Sequence[dict[str, Any]]], group_size: int, rank: int, ranks: int, *,
                  dropped_total: int = 0) -> dict[str, Any]:
    """A saved state of engine rank ``rank`` of ``ranks``, at the stream's start, whose
    deferred buffer is ``groups`` (:func:`saved_groups` of other states) under fresh names:
    they are this rank's first groups, named as :meth:`DataSource.groups` names them
    (:func:`group_names`), and the next new group comes after them."""
    deferred = []
    for j, members in enumerate(groups):
        indices, group = group_names(j, rank, ranks, group_size)
        deferred += [dict(d, index=index, group=group) for index, d in zip(indices, members)]
    return {"data_pos": 0, "named": len(groups) * group_size, "dropped_total": int(dropped_total),
            "deferred": deferred}


def redistribute(base: int, states: Sequence[dict[str, Any]], ranks: int,
                 group_size: int) -> tuple[int, list[dict[str, Any]], str | None]:
    """The saved data states of ``len(states)`` engine ranks for ``ranks`` ranks:
    ``(base, states, note)``. Same count: unchanged (note None). Otherwise every stream
    restarts at the first position no old rank reached (a few prompts of the slower ranks'
    streams are skipped) and the deferred groups are dealt round-robin, oldest first, under
    fresh local indices (the dropped count to the first rank); ``note`` says what moved."""
    if len(states) == ranks:
        return base, list(states), None
    old = len(states)
    new_base = base + max(s["data_pos"] for s in states) * old
    groups = sorted((members for state in states for members in saved_groups(state)), key=lambda g: g[0]["index"])
    dropped = sum(s["dropped_total"] for s in states)
    out = [state_holding(groups[r::ranks], group_size, r, ranks, dropped_total=dropped if r == 0 else 0)
           for r in range(ranks)]
    if not groups:
        return new_base, out, f"{old} engine ranks -> {ranks}: prompts continue from position {new_base}"
    moved = sum(len(m) for m in groups)
    return new_base, out, (f"{old} engine ranks -> {ranks}: {moved} deferred samples ({len(groups)} groups) dealt "
                           f"round-robin over the {ranks} ranks; prompts continue from position {new_base}")


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


def prompt_samples(prompts: Sequence[TokenizedPrompt], max_new_tokens: int) -> list[Sample]:
    """One sample per prompt (index = position), each with the whole budget."""
    return [Sample(i, list(p.ids), max_new_tokens, record=dict(p.record)) for i, p in enumerate(prompts)]
