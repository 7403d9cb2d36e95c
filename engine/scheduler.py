"""Length-aware scheduling of rollouts: OPPO's inter-step overlap, in plain Python.

Owns: :class:`LengthAwareScheduler`, which launches B+Δ samples per step (deferred
partials first, oldest first, then new prompts under unique, ever-increasing indices),
trains on the first B to finish and carries the rest, with their partial tokens, sampling
logprobs and per-token weight versions, into a FIFO deferred buffer; dropping (and
reporting) partials whose oldest token is more than ``max_staleness_versions`` behind;
:class:`DeltaController` (Δ follows the least-squares slope of mean reward over a window);
:class:`ChunkSizeTuner` (OPPO's intra-step chunk size: try each candidate for one step
every ``retune_every`` steps, keep the fastest); :func:`staleness_stats`; JSON-safe
``state_dict``/``load_state_dict`` so checkpoints carry the deferred buffer.

Samples that finish *after* the first B of a step are not thrown away and not trained
late in the same step: they are deferred as complete samples and trained first next step
(``Plan.ready``), so every step trains exactly B when at least B finish.

Leaves out: generating, aborting and resuming on the engine (``engine.rollout``),
correcting stale tokens (``trainer``), when to checkpoint (``colocate``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from .errors import EngineConfigError, EngineError
from .rollout import Sample

MakeSample = Callable[[int], "Sample | None"]  # index -> new sample, None when out of prompts


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int = 8  # B: samples trained on per step
    delta_init: int = 0  # Δ: extra samples launched per step
    delta_min: int = 0
    delta_max: int = 8
    delta_inc: int = 1
    delta_dec: int = 1
    window: int = 5  # w: steps of mean reward the slope is fitted over
    adaptive: bool = True  # False: Δ stays delta_init
    max_staleness_versions: int = 4  # S_hard: drop partials whose oldest token lags more

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
        ]
        for name, ok, why in checks:
            if not ok:
                raise EngineConfigError(f"overlap.{name}: {getattr(self, name)!r} {why}")

    @property
    def max_launch(self) -> int:
        return self.batch_size + self.delta_max


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
    """What one step runs: ``ready`` + ``launch`` together are the B+Δ samples."""

    launch: list[Sample]  # to generate: deferred partials (oldest first), then new samples
    ready: list[Sample]  # complete samples deferred last step: trained first, not generated
    dropped: list[Sample]  # too stale to train on: never trained, report them
    resumed: int  # how many of ``launch`` are deferred partials
    delta: int


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
    """Per step: :meth:`plan`, generate, :meth:`select`, train, :meth:`observe_reward`."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.delta_ctl = DeltaController(config)
        self.next_index = 0
        self.dropped_total = 0
        self._deferred: list[Sample] = []  # FIFO: ascending index = order of first launch
        self._ready: list[Sample] = []
        self._in_flight: set[int] | None = None  # indices launched by the open plan

    @property
    def delta(self) -> int:
        return self.delta_ctl.delta

    @property
    def deferred(self) -> tuple[Sample, ...]:
        return tuple(self._deferred)

    def plan(self, make_sample: MakeSample, current_version: int) -> Plan:
        """Choose the B+Δ samples of this step; ``current_version`` is the weight version
        the actor will generate with."""
        if self._in_flight is not None:
            raise EngineError("scheduler: plan() called again before select() closed the step")
        limit = self.config.max_staleness_versions
        dropped = [s for s in self._deferred if _too_stale(s, current_version, limit)]
        keep = [s for s in self._deferred if not _too_stale(s, current_version, limit)]
        pool = self.config.batch_size + self.delta
        ready = [s for s in keep if s.finished][:pool]
        partial = [s for s in keep if not s.finished][: pool - len(ready)]
        taken = {s.index for s in ready + partial}
        self._deferred = [s for s in keep if s.index not in taken]
        launch = partial + self._new_samples(make_sample, pool - len(ready) - len(partial))
        self.dropped_total += len(dropped)
        self._ready = ready
        self._in_flight = {s.index for s in launch}
        return Plan(launch, ready, dropped, len(partial), self.delta)

    def _new_samples(self, make_sample: MakeSample, count: int) -> list[Sample]:
        out = []
        for _ in range(count):
            sample = make_sample(self.next_index)
            if sample is None:  # out of prompts
                break
            if sample.index != self.next_index or sample.output_ids:
                raise EngineError(
                    f"scheduler: make_sample({self.next_index}) returned sample "
                    f"{sample.index} with {len(sample.output_ids)} tokens; expected a fresh "
                    "sample with the index it was given"
                )
            self.next_index += 1
            out.append(sample)
        return out

    def select(self, ended: Sequence[Sample]) -> tuple[list[Sample], list[Sample]]:
        """``ended``: every launched sample, finished ones in completion order (unfinished
        ones anywhere). Returns ``(train, defer)``: the plan's ready samples, then the
        first finishers, B in all when that many finished; everything else is deferred."""
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
        done = self._ready + [s for s in ended if s.finished]
        train, late = done[: self.config.batch_size], done[self.config.batch_size :]
        defer = late + [s for s in ended if not s.finished]
        self._deferred = sorted(self._deferred + defer, key=lambda s: s.index)
        self._ready, self._in_flight = [], None
        return train, defer

    def observe_reward(self, mean_reward: float) -> int:
        """Feed this step's mean reward to the Δ controller; returns the new Δ."""
        return self.delta_ctl.update(mean_reward)

    def stats(self) -> dict[str, int]:
        return {"deferred": len(self._deferred), "dropped_total": self.dropped_total,
                "delta": self.delta, "next_index": self.next_index}

    def state_dict(self) -> dict[str, Any]:
        if self._in_flight is not None:
            raise EngineError("scheduler: state_dict() mid-step; checkpoint between steps")
        return {
            "next_index": self.next_index,
            "dropped_total": self.dropped_total,
            "deferred": [dataclasses.asdict(s) for s in self._deferred],
            "delta": self.delta_ctl.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = int(state["next_index"])
        self.dropped_total = int(state["dropped_total"])
        self._deferred = sorted((Sample(**d) for d in state["deferred"]), key=lambda s: s.index)
        self.delta_ctl.load_state_dict(state["delta"])
        self._ready, self._in_flight = [], None


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
    fixed: int = 64

    def __post_init__(self) -> None:
        if not self.candidates or any(int(c) < 1 for c in self.candidates):
            raise EngineConfigError(f"overlap.candidates: {self.candidates!r} must be positive sizes")
        if self.retune_every < len(self.candidates):
            raise EngineConfigError(
                f"overlap.retune_every: {self.retune_every} is less than the "
                f"{len(self.candidates)} candidates a tuning round tries"
            )
        if self.fixed < 1:
            raise EngineConfigError(f"overlap.fixed: {self.fixed} must be >= 1")


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
