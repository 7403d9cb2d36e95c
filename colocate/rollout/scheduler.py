"""Length-aware scheduling of rollouts: OPPO's inter-step overlap, in plain Python.

Owns: :class:`LengthAwareScheduler`, which is handed, each step, the deferred samples and
a data source's fresh groups, and launches B+Δ samples (deferred partials first, oldest
first, then fresh ones), trains on the first B to finish and hands back the rest, with
their partial tokens, sampling logprobs and per-token weight versions, to be deferred;
dropping (and reporting) partials whose oldest token is more than
``max_staleness_versions`` behind. With groups (``group_size`` n > 1: n samples of one
prompt, GRPO's group) the unit is the group: B/n + Δ groups per step, a group is trained
only when every member is finished (and scored), in the order groups complete; an
incomplete group is deferred whole, its finished members waiting (not generated again)
beside its partial ones, and a group with a too-stale member is dropped whole. n = 1 is
exactly the per-sample schedule; :class:`DeltaController` (Δ follows the least-squares
slope of mean reward over a window); :class:`ChunkSizeTuner` (OPPO's intra-step chunk
size: try each candidate for one step every ``retune_every`` steps, keep the fastest);
:func:`staleness_stats`; JSON-safe ``state_dict``/``load_state_dict``. The configs'
defaults are those of the ``overlap``/``rollout`` fields they are built from
(``tests/unit/test_one_set_of_defaults.py``).

Samples that finish *after* the first B of a step are not thrown away and not trained
late in the same step: they are deferred as complete samples and trained first next step
(``Plan.ready``), so every step trains exactly B when at least B finish.

Leaves out: the samples themselves between steps, their prompts and indices (the data
source, ``colocate.rollout.data_source``), generating, aborting and resuming on the engine
(``colocate.rollout.generation``), correcting stale tokens (``trainer``), when to checkpoint (``colocate``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Iterator, Sequence

from colocate.engine.errors import EngineConfigError, EngineError
from colocate.rollout.sample import Sample, group_member

Groups = Iterator[list[Sample]]  # fresh groups of a data source, each its n new samples


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int = 8  # B: samples trained on per step
    delta_init: int = 2  # Δ: extra samples (groups) launched per step
    delta_min: int = 0
    delta_max: int = 8
    delta_inc: int = 1
    delta_dec: int = 1
    window: int = 5  # w: steps of mean reward the slope is fitted over
    adaptive: bool = True  # False: Δ stays delta_init
    max_staleness_versions: int = 4  # S_hard: drop partials whose oldest token lags more
    group_size: int = 1  # n: samples per prompt; B must be a multiple, Δ counts groups

    def __post_init__(self) -> None:
        checks = [
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("delta_min", self.delta_min >= 0, "must be >= 0"),
            ("delta_max", self.delta_max >= self.delta_min, "must be >= delta_min"),
            ("delta_init", self.delta_min <= self.delta_init <= self.delta_max,
             "must lie in [delta_min, delta_max]"),
            ("delta_inc", self.delta_inc >= 0, "must be >= 0"),
            ("delta_dec", self.delta_dec >= 0, "must be >= 0"),
            ("window", self.window >= 2, "must be >= 2 (a slope needs two points)"),
            ("max_staleness_versions", self.max_staleness_versions >= 0, "must be >= 0"),
            ("group_size", self.group_size >= 1 and self.batch_size % self.group_size == 0,
             f"must be >= 1 and divide batch_size {self.batch_size}"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise EngineConfigError(f"overlap.{name}: {getattr(self, name)!r} {why}")

    @property
    def batch_groups(self) -> int:
        return self.batch_size // self.group_size


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
    Δ ← max(Δmin, Δ−δdec). Non-finite rewards are skipped; fixed mode never moves."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.delta = config.delta_init
        self.rewards: list[float] = []

    def update(self, mean_reward: float) -> int:
        cfg = self.config
        if math.isfinite(mean_reward):
            self.rewards = (self.rewards + [float(mean_reward)])[-cfg.window :]
        if cfg.adaptive and len(self.rewards) >= 2:
            if reward_slope(self.rewards) > 0:
                self.delta = min(cfg.delta_max, self.delta + cfg.delta_inc)
            else:
                self.delta = max(cfg.delta_min, self.delta - cfg.delta_dec)
        return self.delta

    def state_dict(self) -> dict[str, Any]:
        return {"delta": self.delta, "rewards": list(self.rewards)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cfg = self.config  # the config may have changed across a resume: clamp into it
        self.delta = min(cfg.delta_max, max(cfg.delta_min, int(state["delta"])))
        self.rewards = [float(r) for r in state["rewards"]][-cfg.window :]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one step runs: ``ready`` + ``waiting`` + ``launch`` together are the B+Δ
    samples (groups)."""

    launch: list[Sample]  # to generate: deferred partials (oldest first), then new samples
    ready: list[Sample]  # complete samples (groups) deferred last step: trained first, not generated
    dropped: list[Sample]  # too stale to train on: never trained, report them
    resumed: int  # how many of ``launch`` are deferred partials
    delta: int
    waiting: list[Sample] = dataclasses.field(default_factory=list)  # finished members of launched groups
    kept: list[Sample] = dataclasses.field(default_factory=list)  # deferred samples this step does not take


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

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.delta_ctl = DeltaController(config)
        self._ready: list[Sample] = []
        self._waiting: list[Sample] = []  # finished members of the open plan's launched groups
        self._in_flight: set[int] | None = None  # indices launched by the open plan

    @property
    def delta(self) -> int:
        return self.delta_ctl.delta

    def plan(self, deferred: Sequence[Sample], fresh: Groups, current_version: int, defer: bool = True) -> Plan:
        """Choose the B+Δ samples (B/n + Δ groups) of this step from ``deferred`` (the
        samples carried from earlier steps) and then ``fresh`` (new groups, taken only as
        many as needed; an exhausted iterator: out of prompts); ``current_version`` is the
        weight version the actor will generate with. ``defer`` False (a step of
        ``overlap.mode=auto`` without deferral): B only, no Δ, deferred samples still
        first. ``Plan.kept``: the deferred samples this step does not take (still deferred)."""
        if self._in_flight is not None:
            raise EngineError("scheduler: plan() called again before select() closed the step")
        limit = self.config.max_staleness_versions
        groups = groups_of(sorted(deferred, key=lambda s: s.index))
        stale = [any(_too_stale(s, current_version, limit) for s in g) for g in groups]
        dropped = [s for g, bad in zip(groups, stale) if bad for s in g]
        keep = [g for g, bad in zip(groups, stale) if not bad]
        pool = self.config.batch_groups + (self.delta if defer else 0)
        ready = [g for g in keep if all(s.finished for s in g)][:pool]
        partial = [g for g in keep if not all(s.finished for s in g)][: pool - len(ready)]
        taken = {g[0].group_id for g in ready + partial}
        kept = [s for g in keep if g[0].group_id not in taken for s in g]
        resumed = [s for g in partial for s in g if not s.finished]
        launch = resumed + self._fresh(fresh, pool - len(ready) - len(partial))
        self._ready = [s for g in ready for s in g]
        self._waiting = [s for g in partial for s in g if s.finished]
        self._in_flight = {s.index for s in launch}
        return Plan(launch, list(self._ready), dropped, len(resumed), self.delta if defer else 0,
                    list(self._waiting), kept)

    def _fresh(self, fresh: Groups, groups: int) -> list[Sample]:
        """``groups`` new groups from ``fresh`` (fewer when it runs out), each checked: n
        new samples of one group under consecutive indices."""
        n = self.config.group_size
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
        keep = self.config.batch_groups
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


def staleness_stats(samples: Sequence[Sample], current_version: int) -> dict[str, float]:
    """Over every token: mean and max of (current_version − the token's version) and the
    fraction of tokens generated under older weights."""
    lags = [current_version - v for s in samples for v in s.versions]
    if not lags:
        return {"mean": 0.0, "max": 0.0, "frac_stale_tokens": 0.0}
    return {
        "mean": sum(lags) / len(lags),
        "max": float(max(lags)),
        "frac_stale_tokens": sum(1 for lag in lags if lag > 0) / len(lags),
    }


@dataclasses.dataclass(frozen=True)
class ChunkTunerConfig:
    candidates: tuple[int, ...] = (16, 32, 64, 128)  # tokens per chunk streamed to the RM
    retune_every: int = 50  # a tuning round starts every N steps (step 0 included)
    adaptive: bool = True  # False: always ``fixed``
    fixed: int = 16  # not adaptive: always; else until a round has a fastest (overlap.chunk_size or candidates[0])

    def __post_init__(self) -> None:
        if not self.candidates or any(int(c) < 1 for c in self.candidates):
            raise EngineConfigError(f"overlap.chunk_candidates: {self.candidates!r} must be positive sizes")
        if self.retune_every < len(self.candidates):
            raise EngineConfigError(
                f"overlap.retune_every: {self.retune_every} is less than the "
                f"{len(self.candidates)} candidates a tuning round tries"
            )
        if self.fixed < 1:
            raise EngineConfigError(f"overlap.chunk_size: {self.fixed} must be >= 1")


class ChunkSizeTuner:
    """Steps r·N … r·N+k−1 each try one of the k candidates; the rest of the round uses
    the fastest measured one. Before any round completes, ``fixed`` is used."""

    def __init__(self, config: ChunkTunerConfig):
        self.config = config
        self.best: int | None = None
        self.round = -1
        self.trials: dict[int, float] = {}  # candidate -> step seconds, this round

    def chunk_for_step(self, step: int) -> int:
        cfg = self.config
        if not cfg.adaptive:
            return cfg.fixed
        offset = step % cfg.retune_every
        if offset < len(cfg.candidates):
            return cfg.candidates[offset]
        return self.best if self.best is not None else cfg.fixed

    def record(self, step: int, chunk: int, seconds: float) -> None:
        """Measured time of ``step``, run with ``chunk``; only tuning steps count."""
        if not math.isfinite(seconds) or seconds < 0:
            raise EngineError(f"chunk tuner: step {step} took {seconds!r} s; expected >= 0")
        cfg = self.config
        offset = step % cfg.retune_every
        if not cfg.adaptive or offset >= len(cfg.candidates) or chunk != cfg.candidates[offset]:
            return
        if step // cfg.retune_every != self.round:
            self.round, self.trials = step // cfg.retune_every, {}
        self.trials[chunk] = float(seconds)
        if len(self.trials) == len(cfg.candidates):
            self.best = min(self.trials, key=self.trials.__getitem__)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "round": self.round,
                "trials": [[c, t] for c, t in self.trials.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        best = state["best"]
        self.best = int(best) if best in self.config.candidates else None
        self.round = int(state["round"])
        self.trials = {int(c): float(t) for c, t in state["trials"]}
