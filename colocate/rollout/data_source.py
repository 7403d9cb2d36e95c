"""The samples of one engine rank outside the engine: before, between and around the steps
that run them, and which of them each step runs and trains (OPPO's inter-step overlap, in
plain Python).

Owns: :class:`TokenizedPrompt` (a prompt of the data set as token ids, with its source
record), :class:`DataSource`: the tokenized training prompts and the held-out ones, this
rank's position in its stream of prompts (groups drawn) and where the engine ranks'
streams start (:meth:`DataSource.position`: ``sample.union_id`` interleaves them, so their
union is one rank's stream), the seeded cycle over the prompt set, each member's token
budget (:func:`response_budget`: fixed or drawn from a long tail), the names of new
samples, given at birth in the engine ranks' union (this rank's g-th group is the union's
group g·R + r, ``sample.union_id``; its members consecutive, ``sample.sample_index``), so
the ranks' shares join by sorting on the index and a sample is never renamed; the
deferred samples (partial, or finished and waiting for their group or the next step),
and its own state: :meth:`DataSource.state_dict` and :func:`redistribute` (a resume on
another number of engine ranks).

Each step, the length-aware schedule over them: :meth:`DataSource.plan` takes the step's
B/n + Δ groups (B: the samples this rank trains per step, n: ``rollout.group_size``, Δ:
the groups launched beyond B, ``colocate.rollout.controllers.DeltaController``) —
complete deferred groups first (trained as they are), then partial ones (oldest first:
their unfinished members launched again, their finished ones waiting beside them), then
fresh groups — dropping (and counting) deferred groups with a member whose oldest token is
more than ``overlap.drop_staleness`` versions behind; :meth:`DataSource.select` trains the
first B/n groups to complete (the ready ones, then in the order their last member
finished), so every step trains exactly B when at least B finish, and defers the rest:
complete groups that finished late (trained first next step, not generated again) and
incomplete groups whole, with their partial tokens, sampling logprobs and per-token
weight versions. Complete means done (``Sample.done``: finished and scored); a parked
sample whose stream ended while it waited is finished but unscored, and is launched
again, for the step to score it. n = 1 is exactly the per-sample schedule. Between
``plan`` and ``select`` the step's samples are the step's: the buffer holds the rest, and
a checkpoint is taken between steps only.

Leaves out: Δ and the chunk size (``colocate.rollout.controllers``), generating and
scoring the launched samples (``colocate.rollout.schedule``, run by
``colocate.rollout.rollouts``), correcting stale tokens (``trainer``), the checkpoint's
layout (``colocate.run.checkpoint_layout``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Any, Iterator, Sequence

from colocate.config import RolloutConfig
from colocate.engine.errors import EngineError
from colocate.monitor.timeline import Timeline, mark_fates
from colocate.rollout.sample import Sample, group_member, sample_index, union_id


@dataclasses.dataclass(frozen=True)
class TokenizedPrompt:
    """One tokenized prompt of the data set with its source record (kept for rule rewards)."""

    ids: tuple[int, ...]
    record: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one step runs: ``ready`` + ``waiting`` + ``launch`` together are the B+Δ
    samples (groups)."""

    launch: list[Sample]  # to generate: deferred partials and parked ones (oldest first), then new samples
    ready: list[Sample]  # complete samples (groups) deferred last step: trained first, not generated
    dropped: list[Sample]  # too stale to train on: never trained, report them
    resumed: int  # how many of ``launch`` are deferred (partials, parked, or ended unscored)
    delta: int
    waiting: list[Sample] = dataclasses.field(default_factory=list)  # finished members of launched groups

    @property
    def taken(self) -> list[Sample]:
        """The deferred samples this step takes (ready, waiting, launched again); the rest,
        but ``dropped``, stay deferred."""
        return self.ready + self.waiting + self.launch[: self.resumed]


@dataclasses.dataclass(frozen=True)
class _OpenStep:
    """A planned step until its :meth:`DataSource.select`."""

    plan: Plan
    keep: int  # B/n: the groups it trains
    launched: frozenset[int]  # the indices of ``plan.launch``


def groups_of(samples: Sequence[Sample]) -> list[list[Sample]]:
    """``samples`` grouped by group id, groups in order of first appearance."""
    out: dict[int, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.group_id, []).append(s)
    return list(out.values())


def _too_stale(sample: Sample, version: int, limit: int) -> bool:
    return bool(sample.versions) and version - min(sample.versions) > limit


def _checked(members: list[Sample], n: int) -> list[Sample]:
    """A fresh group as :meth:`DataSource.groups` must draw it: ``n`` new samples of one group
    under consecutive indices."""
    first = members[0].index if members else None
    group = group_member(first, n)[0] if first is not None else None
    ok = len(members) == n and all(s.index == first + m and not s.output_ids and (n == 1 or s.group == group)
                                   for m, s in enumerate(members))
    if not ok:
        got = ", ".join(f"{s.index} (group {s.group}, {len(s.output_ids)} tokens)" for s in members) or "nothing"
        raise EngineError(f"data source: drew samples {got}; expected {n} fresh samples of group {group} "
                          "under consecutive indices")
    return members


def _check_sample(s: Sample) -> None:
    n = len(s.output_ids)
    if n > s.max_new_tokens or len(s.logprobs) != n or len(s.versions) != n:
        raise EngineError(
            f"sample {s.index}: {n} tokens, {len(s.logprobs)} logprobs, {len(s.versions)} "
            f"versions, budget {s.max_new_tokens}: a resumed request overran its budget or "
            "lost per-token data"
        )


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
    _open: _OpenStep | None = dataclasses.field(default=None, repr=False)  # between plan() and select()

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

    def plan(self, batch_groups: int, delta: int, version: int, *, drop_staleness: int) -> Plan:
        """The step's ``batch_groups`` + ``delta`` groups (B/n + Δ): the deferred ones first
        (complete, then partial, oldest first; a group with a member more than
        ``drop_staleness`` versions behind ``version``, the weight version the actor will
        generate with, is dropped whole), then fresh groups (fewer when out of prompts).
        What the step takes or drops leaves the buffer; the rest stays where it is."""
        if self._open is not None:
            raise EngineError("data source: plan() called again before select() closed the step")
        groups = groups_of(sorted(self.deferred, key=lambda s: s.index))
        stale = [any(_too_stale(s, version, drop_staleness) for s in g) for g in groups]
        dropped = [s for g, bad in zip(groups, stale) if bad for s in g]
        keep = [g for g, bad in zip(groups, stale) if not bad]
        pool = batch_groups + delta
        ready = [g for g in keep if all(s.done for s in g)][:pool]
        partial = [g for g in keep if not all(s.done for s in g)][: pool - len(ready)]
        resumed = [s for g in partial for s in g if not s.done]
        fresh = [s for members in itertools.islice(self.groups(), pool - len(ready) - len(partial))
                 for s in _checked(members, self.rollout.group_size)]
        plan = Plan(resumed + fresh, [s for g in ready for s in g], dropped, len(resumed), delta,
                    [s for g in partial for s in g if s.done])
        self.take(plan.taken, dropped=dropped)
        self._open = _OpenStep(plan, batch_groups, frozenset(s.index for s in plan.launch))
        return plan

    def select(self, ended: Sequence[Sample], timeline: Timeline | None = None) -> tuple[list[Sample], list[Sample]]:
        """Close the step: ``ended`` is every launched sample, finished ones in completion
        order (unfinished ones anywhere). Returns ``(train, defer)``: the plan's ready groups,
        then the groups in the order their last member finished, B samples in all when that
        many groups complete; everything else (incomplete groups whole) goes back to the
        buffer. The fates (trained, deferred) are marked on ``timeline``."""
        step = self._open
        if step is None:
            raise EngineError("data source: select() called without an open plan()")
        got = sorted(s.index for s in ended)
        if got != sorted(step.launched):
            raise EngineError(
                f"data source: select() got samples {got}, expected the launched "
                f"{sorted(step.launched)}: every launched sample must come back"
            )
        for s in ended:
            _check_sample(s)
        order = {s.index: i for i, s in enumerate(s for s in ended if s.finished)}
        ready = groups_of(step.plan.ready)
        ran = groups_of(sorted(step.plan.waiting + list(ended), key=lambda s: s.index))
        complete = sorted((g for g in ran if all(s.finished for s in g)),
                          key=lambda g: max(order.get(s.index, -1) for s in g))
        done = ready + complete
        train = [s for g in done[: step.keep] for s in g]
        defer = [s for g in done[step.keep:] for s in g] + [s for g in ran if not all(m.finished for m in g) for s in g]
        self._open = None
        self.defer(defer)
        mark_fates(timeline, [s.index for s in train], [s.index for s in defer])
        return train, defer

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
        if self._open is not None:
            raise EngineError("data source: state_dict() mid-step (the step holds samples); checkpoint between steps")
        return {"data_pos": self.drawn, "named": self.named, "dropped_total": self.dropped_total,
                "deferred": [s.state() for s in self.deferred]}

    def load_state_dict(self, base: int, state: dict[str, Any]) -> None:
        self.base, self.drawn = int(base), int(state["data_pos"])
        self.named, self.dropped_total = int(state["named"]), int(state["dropped_total"])
        self.deferred = sorted((Sample.from_state(d) for d in state["deferred"]), key=lambda s: s.index)
        self._open = None


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
