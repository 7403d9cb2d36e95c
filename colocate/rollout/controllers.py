"""OPPO's two online controllers of the overlap, in plain Python.

Owns: :class:`DeltaController` (Δ, the groups a step launches beyond the B/n it trains,
follows the least-squares slope of the mean reward over a window: +δinc while it rises,
else −δdec, within the section's bounds) and :class:`ChunkSizeTuner` (the intra-step
chunk size of streamed scoring: try each candidate for one step every ``retune_every``
steps, keep the fastest); their JSON-safe ``state_dict``/``load_state_dict``. Each takes
the ``overlap`` section as it is; what follows from it (Δ's bounds when no step defers,
the tuner's fixed chunk) are properties; the values were checked when the config was
loaded (``colocate.config_checks``).

Leaves out: the samples, and which of them a step runs and trains
(``colocate.rollout.data_source``: handed Δ each step), the mode of a step under
``overlap.mode=auto`` (``colocate.rollout.auto_mode``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from colocate.config import OverlapConfig
from colocate.engine.errors import EngineError

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
