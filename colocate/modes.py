"""The rollout modes (``overlap.mode``) as values: which overlaps a step runs.

Owns: :class:`Mode` — ``streams`` (intra-step overlap: the response is scored chunk by
chunk through the reward feeder while it is generated) and ``defers`` (inter-step
overlap: B + Δ samples launched, the first B/n complete groups trained, the stragglers
carried into the next step with their partial tokens) — and the four modes. Every mode
runs through one rollout path (``colocate.rollout.rollouts``); sequential is its plain schedule
(Δ = 0, scoring after generation). Leaves out: ``overlap.mode=auto``'s picking
(``colocate.rollout.auto_mode``) and the Δ policy's knobs (``overlap.delta_*``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    streams: bool = False  # reward-model scoring streamed while the actor decodes
    defers: bool = False  # over-commit by Δ, cut after the first B, carry the stragglers

    @property
    def plain(self) -> bool:
        """The sequential schedule: generate all, then score all."""
        return not (self.streams or self.defers)


SEQUENTIAL = Mode("sequential")
_ALL = (SEQUENTIAL, Mode("intra", streams=True), Mode("inter", defers=True),
        Mode("oppo", streams=True, defers=True))
MODES = tuple(m.name for m in _ALL)  # the modes a step can run (``overlap.mode`` also takes auto)
STREAMED = frozenset(m.name for m in _ALL if m.streams)
DEFERRED = frozenset(m.name for m in _ALL if m.defers)


def by_name(name: str) -> Mode:
    """The mode called ``name`` (one of :data:`MODES`)."""
    return next(m for m in _ALL if m.name == name)
