"""The phases of one step, and the hooks attached at their boundaries.

Owns: :class:`StepPhases`. The step loop (``colocate.run.loop``) names its phases and does
nothing else about them: ``phases.enter("train")`` changes the run's phase (rollout | train
| sync | idle: what a failure checkpoints, what a rank-failure line names, what the progress
bar and the timeline show) and ``with phases("ref"):`` runs one part of it, timed
(``time/ref``; ``timed=False``: a boundary only). Whatever watches a step attaches to those
boundaries as a hook, called with ``(event, phase)``: ``"enter"`` (the run's phase),
``"begin"``, ``"end"`` (a part; ``end`` only when the part completed). The session attaches
its phase record and watchers, and ``run.fault_at``'s test faults
(``colocate.faults.AT_BOUNDARY``).

Leaves out: what each phase does (the loop), what a hook does (its owner).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Sequence

Hook = Callable[[str, str], None]  # (event: enter | begin | end, phase)


class StepPhases:
    """One step's phases: the seconds of each timed part, and the hooks told of every boundary."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.hooks = tuple(hooks)
        self.seconds: dict[str, float] = {}

    def enter(self, phase: str) -> None:
        """The run's phase becomes ``phase``."""
        self._tell("enter", phase)

    @contextlib.contextmanager
    def __call__(self, phase: str, timed: bool = True) -> Iterator[None]:
        """Run one part of the step: hooks at its begin and (completed) end, its seconds added up."""
        self._tell("begin", phase)
        started = time.perf_counter()
        try:
            yield
        finally:
            if timed:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started
        self._tell("end", phase)

    def _tell(self, event: str, phase: str) -> None:
        for hook in self.hooks:
            hook(event, phase)
