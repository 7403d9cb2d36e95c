"""Length-aware scheduling of rollouts: OPPO's inter-step overlap, in plain Python.

Owns: :class:`LengthAwareScheduler`, which is handed, each step, the deferred samples and
a data source's fresh groups, and launches B+Δ samples (deferred partials first, oldest
first, then fresh ones), trains on the first B to finish and hands back the rest, with
their partial tokens, sampling logprobs and per-token weight versions, to be deferred;
dropping (and reporting) partials whose oldest token is more than
``overlap.drop_staleness`` behind. With groups (``group_size`` n > 1: n samples of one
prompt, GRPO's group) the unit is the group: B/n + Δ groups per step, a group is trained
only when every member is finished (and scored), in the order groups complete; an
incomplete group is deferred whole, its finished members waiting (not generated again)
beside its partial ones, and a group with a too-stale member is dropped whole. n = 1 is
exactly the per-sample schedule; :class:`DeltaController` (Δ follows the least-squares
slope of mean reward over a window); :class:`ChunkSizeTuner` (OPPO's intra-step chunk
size: try each candidate for one step every ``retune_every`` steps, keep the fastest);
JSON-safe ``state_dict``/``load_state_dict``. Each takes the
``overlap`` section as it is (the scheduler also this rank's B and ``rollout.group_size``);
what follows from it (Δ's bounds when no step defers, the tuner's fixed chunk) are
properties; the values were checked when the config was loaded (``colocate.config_checks``).

Samples that finish *after* the first B of a step are not thrown away and not trained
late in the same step: they are deferred as complete samples and trained first next step
(``Plan.ready``), so every step trains exactly B when at least B finish. Complete means
done (``Sample.done``: finished and scored); a parked sample whose stream ended while it
waited is finished but unscored, and is launched again, for the step to score it.

Leaves out: the samples themselves between steps, their prompts and indices (the data
source, ``colocate.rollout.data_source``), generating, aborting and resuming on the engine
(``colocate.rollout.generation``), correcting stale tokens (``trainer``), when to checkpoint (``colocate``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Iterator, Sequence

from colocate.config import OverlapConfig
from colocate.engine.errors import EngineError
from colocate.rollout.sample import Sample, group_member

Groups = Iterator[list[Sample]]  # fresh groups of a data source, each its n new samples


# OPPO's Δ steps (no config field): +δinc while the reward rises, else −δdec
DELTA_INC = 1
DELTA_DEC = 1


def reward_slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against 0, 1, 2, ...; 0.0 for fewer than 2."""
    n = len(values)
    if n < 2:
        return 0.0
    x_mean, y_mean = (n - 1) / 2, sum(values) / n
    num = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    den = sum((i - x_mean) ** 2 for i in range(n))
    return num / den


class DeltaController:
    """Δ ← min(Δmax, Δ+δinc) while the reward slope over the last w steps is > 0, else
    Δ ← max(Δmin, Δ−δdec). Non-finite rewards are skipped; fixed mode never moves. When
    no step defers (``overlap.deferral`` false), Δ is 0 and never moves."""

    def __init__(self, overlap: OverlapConfig, *, inc: int = DELTA_INC, dec: int = DELTA_DEC):
        self.overlap = overlap
        self.inc, self.dec = inc, dec  # OPPO's δinc, δdec
        self.delta = self.delta_init
        self.rewards: list[float] = []

    @property
    def delta_init(self) -> int:
        return self.overlap.delta_init if self.overlap.deferral else 0

    @property
    def delta_min(self) -> int:
        return self.overlap.delta_min if self.overlap.deferral else 0

    @property
    def delta_max(self) -> int:
        return self.overlap.delta_max if self.overlap.deferral else 0

    @property
    def adaptive(self) -> bool:
        """False: Δ stays ``delta_init``."""
        return self.overlap.delta_adaptive and self.overlap.deferral

    def update(self, mean_reward: float) -> int:
        if math.isfinite(mean_reward):
            self.rewards = (self.rewards + [float(mean_reward)])[-self.overlap.window :]
        if self.adaptive and len(self.rewards) >= 2:
            if reward_slope(self.rewards) > 0:
                self.delta = min(self.delta_max, self.delta + self.inc)
            else:
                self.delta = max(self.delta_min, self.delta - self.dec)
        return self.delta

    def state_dict(self) -> dict[str, Any]:
        return {"delta": self.delta, "rewards": list(self.rewards)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # the config may have changed across a resume: clamp into it
        self.delta = min(self.delta_max, max(self.delta_min, int(state["delta"])))
        self.rewards = [float(r) for r in state["rewards"]][-self.overlap.window :]


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


def groups_of(samples: Sequence[Sample]) -> list[list[Sample]]:
    """``samples`` grouped by group id, groups in order of first appearance."""
    out: dict[int, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.group_id, []).append(s)
    return list(out.values())


def _too_stale(sample: Sample, version: int, limit: int) -> bool:
    return bool(sample.versions) and version - min(sample.versions) > limit


def _check_sample(s: Sample) -> None:
    n = len(s.output_ids)
    if n > s.max_new_tokens or len(s.logprobs) != n or len(s.versions) != n:
        raise EngineError(
            f"sample {s.index}: {n} tokens, {len(s.logprobs)} logprobs, {len(s.versions)} "
            f"versions, budget {s.max_new_tokens}: a resumed request overran its budget or "
            "lost per-token data"
        )


class LengthAwareScheduler:
    """Per step: :meth:`plan` (handed the deferred samples and a data source's fresh
    groups), generate, :meth:`select`, train, :meth:`observe_reward`. It keeps no samples
    between steps: what it defers goes back to the caller (the data source,
    ``colocate.rollout.data_source``)."""

    def __init__(self, overlap: OverlapConfig, batch_size: int, group_size: int):
        """``batch_size``: B, the samples this rank trains per step (its share of
        ``rollout.batch_size``, a multiple of ``group_size``); ``group_size``: n
        (``rollout.group_size``); Δ counts groups."""
        self.overlap = overlap
        self.batch_size, self.group_size = batch_size, group_size
        self.delta_ctl = DeltaController(overlap)
        self._ready: list[Sample] = []
        self._waiting: list[Sample] = []  # finished members of the open plan's launched groups
        self._in_flight: set[int] | None = None  # indices launched by the open plan

    @property
    def delta(self) -> int:
        return self.delta_ctl.delta

    @property
    def batch_groups(self) -> int:
        """B/n: the groups trained per step."""
        return self.batch_size // self.group_size

    def plan(self, deferred: Sequence[Sample], fresh: Groups, current_version: int, defer: bool = True) -> Plan:
        """Choose the B+Δ samples (B/n + Δ groups) of this step from ``deferred`` (the
        samples carried from earlier steps) and then ``fresh`` (new groups, taken only as
        many as needed; an exhausted iterator: out of prompts); ``current_version`` is the
        weight version the actor will generate with. ``defer`` False (a step of
        ``overlap.mode=auto`` without deferral): B only, no Δ, deferred samples still
        first. ``deferred`` is only read: ``Plan.taken`` and ``Plan.dropped`` say which leave it."""
        if self._in_flight is not None:
            raise EngineError("scheduler: plan() called again before select() closed the step")
        limit = self.overlap.drop_staleness
        groups = groups_of(sorted(deferred, key=lambda s: s.index))
        stale = [any(_too_stale(s, current_version, limit) for s in g) for g in groups]
        dropped = [s for g, bad in zip(groups, stale) if bad for s in g]
        keep = [g for g, bad in zip(groups, stale) if not bad]
        pool = self.batch_groups + (self.delta if defer else 0)
        ready = [g for g in keep if all(s.done for s in g)][:pool]
        partial = [g for g in keep if not all(s.done for s in g)][: pool - len(ready)]
        resumed = [s for g in partial for s in g if not s.done]
        launch = resumed + self._fresh(fresh, pool - len(ready) - len(partial))
        self._ready = [s for g in ready for s in g]
        self._waiting = [s for g in partial for s in g if s.done]
        self._in_flight = {s.index for s in launch}
        return Plan(launch, list(self._ready), dropped, len(resumed), self.delta if defer else 0,
                    list(self._waiting))

    def _fresh(self, fresh: Groups, groups: int) -> list[Sample]:
        """``groups`` new groups from ``fresh`` (fewer when it runs out), each checked: n
        new samples of one group under consecutive indices."""
        n = self.group_size
        out = []
        for members in itertools.islice(fresh, groups):
            first = members[0].index if members else None
            group = group_member(first, n)[0] if first is not None else None
            ok = len(members) == n and all(
                s.index == first + m and not s.output_ids and (n == 1 or s.group == group)
                for m, s in enumerate(members))
            if not ok:
                got = ", ".join(f"{s.index} (group {s.group}, {len(s.output_ids)} tokens)" for s in members) or "nothing"
                raise EngineError(f"scheduler: the data source handed samples {got}; expected {n} fresh samples of "
                                  f"group {group} under consecutive indices")
            out += members
        return out

    def select(self, ended: Sequence[Sample]) -> tuple[list[Sample], list[Sample]]:
        """``ended``: every launched sample, finished ones in completion order (unfinished
        ones anywhere). Returns ``(train, defer)``: the plan's ready groups, then the groups
        in the order their last member finished, B samples in all when that many groups
        complete; everything else (incomplete groups whole) is deferred."""
        if self._in_flight is None:
            raise EngineError("scheduler: select() called without an open plan()")
        got = sorted(s.index for s in ended)
        if got != sorted(self._in_flight):
            raise EngineError(
                f"scheduler: select() got samples {got}, expected the launched "
                f"{sorted(self._in_flight)}: every launched sample must come back"
            )
        for s in ended:
            _check_sample(s)
        order = {s.index: i for i, s in enumerate(s for s in ended if s.finished)}
        ready = groups_of(self._ready)
        ran = groups_of(sorted(self._waiting + list(ended), key=lambda s: s.index))
        complete = sorted((g for g in ran if all(s.finished for s in g)),
                          key=lambda g: max(order.get(s.index, -1) for s in g))
        done = ready + complete
        keep = self.batch_groups
        train = [s for g in done[:keep] for s in g]
        defer = [s for g in done[keep:] for s in g] + [s for g in ran if not all(m.finished for m in g) for s in g]
        self._ready, self._waiting, self._in_flight = [], [], None
        return train, defer

    def observe_reward(self, mean_reward: float) -> int:
        """Feed this step's mean reward to the Δ controller; returns the new Δ."""
        return self.delta_ctl.update(mean_reward)

    def state_dict(self) -> dict[str, Any]:
        if self._in_flight is not None:
            raise EngineError("scheduler: state_dict() mid-step; checkpoint between steps")
        return {"delta": self.delta_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.delta_ctl.load_state_dict(state["delta"])
        self._ready, self._waiting, self._in_flight = [], [], None


class ChunkSizeTuner:
    """Steps r·N … r·N+k−1 (N ``overlap.retune_every``) each try one of the k candidates
    (``overlap.chunk_candidates``); the rest of the round uses the fastest measured one.
    Before any round completes, :attr:`fixed` is used; with ``overlap.chunk_size`` set,
    always."""

    def __init__(self, overlap: OverlapConfig):
        self.overlap = overlap
        self.best: int | None = None
        self.round = -1
        self.trials: dict[int, float] = {}  # candidate -> step seconds, this round

    @property
    def adaptive(self) -> bool:
        """``overlap.chunk_size`` 0: tune online among the candidates (OPPO's rule)."""
        return self.overlap.chunk_size == 0

    @property
    def fixed(self) -> int:
        """Not adaptive: always; else until a round has a fastest."""
        return self.overlap.chunk_size or self.overlap.candidates[0]

    def chunk_for_step(self, step: int) -> int:
        if not self.adaptive:
            return self.fixed
        candidates, offset = self.overlap.candidates, step % self.overlap.retune_every
        if offset < len(candidates):
            return candidates[offset]
        return self.best if self.best is not None else self.fixed

    def record(self, step: int, chunk: int, seconds: float) -> None:
        """Measured time of ``step``, run with ``chunk``; only tuning steps count."""
        if not math.isfinite(seconds) or seconds < 0:
            raise EngineError(f"chunk tuner: step {step} took {seconds!r} s; expected >= 0")
        candidates, every = self.overlap.candidates, self.overlap.retune_every
        offset = step % every
        if not self.adaptive or offset >= len(candidates) or chunk != candidates[offset]:
            return
        if step // every != self.round:
            self.round, self.trials = step // every, {}
        self.trials[chunk] = float(seconds)
        if len(self.trials) == len(candidates):
            self.best = min(self.trials, key=self.trials.__getitem__)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "round": self.round,
                "trials": [[c, t] for c, t in self.trials.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        best = state["best"]
        self.best = int(best) if best in self.overlap.candidates else None
        self.round = int(state["round"])
        self.trials = {int(c): float(t) for c, t in state["trials"]}
