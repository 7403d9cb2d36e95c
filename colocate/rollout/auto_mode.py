"""``overlap.mode=auto``: each step's overlaps picked by measuring them online.

Owns: :class:`AutoPolicy` (the frozen knobs, from ``overlap.auto_*``) and
:class:`ModePicker`, plain-Python state that names the mode of the next step and keeps
what each mode cost. A mode's cost is the rollout's wall seconds per trained sample
(generation, scoring and the cut; the trainer's phases are left out: in steady state every
mode trains B samples of the same length distribution per step, so they add the same
seconds and only their noise). The first step warms the engines up and is not measured;
then every candidate runs ``trials`` steps (sequential first), then the cheapest runs —
an overlap only when it beats sequential by ``margin`` — and every ``explore_every``
steps each candidate runs once more, so a change in the workload (longer responses as the
policy learns) is seen. A candidate's cost is the median of its last ``window`` measured
steps. An exploring step of an overlap that costs ``clear_loss`` (25 %) more than
sequential skips that mode's remaining trials, and each clear loss in a row halves how
often it is explored again (every 2nd, 4th, ... round, at most every 16th). A step that
switches deferral off while deferred samples remain finishes them (a draining step) and
is not measured.

Leaves out: running a step in a mode (``colocate.rollout.rollouts``), engine threads (they
are fixed at start: auto's engines get every core each, like sequential's).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from colocate.modes import MODES


@dataclasses.dataclass(frozen=True)
class AutoPolicy:
    candidates: tuple[str, ...] = MODES
    trials: int = 2  # measured steps per candidate in the first exploration
    explore_every: int = 20  # steps between re-explorations (one step per candidate)
    margin: float = 0.03  # an overlap must be this much cheaper than sequential to be run
    window: int = 3  # a candidate's cost: median of its last `window` measured steps
    clear_loss: float = 0.25  # an exploring step this much dearer than sequential is a clear loss


class ModePicker:
    """Per step: :meth:`choose`, run the step in that mode, :meth:`record` its cost."""

    def __init__(self, policy: AutoPolicy):
        self.policy = policy
        self.costs: dict[str, list[float]] = {m: [] for m in policy.candidates}
        self.queue: list[str] = [policy.candidates[0]]  # the warm-up step, not measured
        self.queue += [m for m in policy.candidates for _ in range(policy.trials)]
        self.measured = [False] + [True] * (len(self.queue) - 1)
        self.since_explore = 0
        self.steps = 0
        self.rounds = 0  # re-explorations so far
        self.losses = {m: 0 for m in policy.candidates}  # clear losses in a row

    def choose(self) -> tuple[str, bool]:
        """The mode of the next step and whether its cost will count."""
        if not self.queue and self.since_explore >= self.policy.explore_every:
            best = self.best()  # the incumbent last, so the step after exploring runs warm
            self.rounds += 1  # a mode that lost clearly k times in a row: every 2^k-th round
            self.queue = [m for m in self.policy.candidates if m != best and self.rounds % 2 ** self.losses[m] == 0]
            self.queue.append(best)
            self.measured = [True] * len(self.queue)
            self.since_explore = 0
        if self.queue:
            return self.queue[0], self.measured[0]
        return self.best(), True

    def record(self, mode: str, seconds: float, trained: int, measured: bool = True) -> None:
        """The step just run in ``mode``: its rollout ``seconds`` for ``trained`` samples."""
        exploring = bool(self.queue)
        if exploring:
            self.queue.pop(0)
            self.measured.pop(0)
        else:
            self.since_explore += 1
        self.steps += 1
        if measured and trained > 0:
            self.costs[mode] = (self.costs[mode] + [seconds / trained])[-self.policy.window:]
            if exploring and mode != "sequential":
                self._judge(mode)

    def _judge(self, mode: str) -> None:
        """After an exploring step of an overlap: a clear loss against sequential's cost
        skips its remaining trials and makes its next explorations rarer; else it is
        explored every round."""
        base = self.cost("sequential")
        if base is None or self.costs[mode][-1] <= base * (1 + self.policy.clear_loss):
            self.losses[mode] = 0
            return
        self.losses[mode] = min(self.losses[mode] + 1, 4)
        keep = [i for i, m in enumerate(self.queue) if m != mode]
        self.queue, self.measured = [self.queue[i] for i in keep], [self.measured[i] for i in keep]

    def cost(self, mode: str) -> float | None:
        values = self.costs.get(mode) or []
        return statistics.median(values) if values else None

    def best(self) -> str:
        """The cheapest measured candidate; sequential unless an overlap beats it by
        ``margin`` (and the first candidate while nothing is measured)."""
        measured = {m: c for m in self.policy.candidates if (c := self.cost(m)) is not None}
        if not measured:
            return self.policy.candidates[0]
        best = min(measured, key=measured.get)
        base = measured.get("sequential")
        if base is not None and best != "sequential" and measured[best] > base * (1 - self.policy.margin):
            return "sequential"
        return best

    def stats(self) -> dict[str, float]:
        """``overlap/auto_*`` metrics: each candidate's cost so far (s per trained sample)."""
        return {f"auto_cost_{m}": c for m in self.policy.candidates if (c := self.cost(m)) is not None}

    def state_dict(self) -> dict[str, Any]:
        return {"costs": {m: list(v) for m, v in self.costs.items()}, "queue": list(self.queue),
                "measured": list(self.measured), "since_explore": self.since_explore, "steps": self.steps,
                "rounds": self.rounds, "losses": dict(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Candidates may have changed across a resume: costs of the others are dropped,
        queued steps of modes no longer candidates are skipped. The first step after it
        warms the engines up (not measured)."""
        keep = set(self.policy.candidates)
        self.costs = {m: [float(c) for c in state["costs"].get(m, [])][-self.policy.window:] for m in keep}
        pairs = [(m, bool(x)) for m, x in zip(state["queue"], state["measured"]) if m in keep]
        self.queue, self.measured = [m for m, _ in pairs], [x for _, x in pairs]
        self.since_explore, self.steps = int(state["since_explore"]), int(state["steps"])
        self.rounds = int(state.get("rounds", 0))
        self.losses = {m: int(state.get("losses", {}).get(m, 0)) for m in self.policy.candidates}
        self.queue.insert(0, self.best())  # a resumed run's engines start cold: not measured
        self.measured.insert(0, False)
