"""A deliberate test hook: end the run at a named point of a step (``run.fault_at``).

Off by default (empty). ``run.fault_at`` is a comma list of ``POINT:STEP`` or
``POINT:STEP:RANK`` (one rank only; default every rank). What happens there is
``run.fault_action``: ``kill`` (SIGKILL of this process: nothing runs after it, as the
out-of-memory killer or a lost machine would) or ``raise`` (:class:`FaultInjected`, a
colocate error: the failure path of a step runs). ``engine`` kills the actor engine's
processes instead (SIGKILL), and the run goes on to find out.

Each fault fires once per run folder: it is written to ``<out_dir>/faults_fired`` (and
flushed to disk) before it acts, so ``colocate train --resume DIR`` of the same run passes
it and stops at the next one: one config and one launch per fault (the fault matrix in
``tests/integration/test_fault_matrix.py``).

Leaves out: calling them: the session fires the step's points at the boundaries of its
phases (``colocate.run.loop.StepPhases``), the checkpoint's inside its write.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Sequence

from colocate.errors import ColocateError, ConfigError

POINTS = {
    "generate": "as step S's generation begins (its first prompt drawn, the deferred buffer planned)",
    "score": "after step S's rollout (generated and scored), before training",
    "logprobs": "after step S's reference log-probs, before the old log-probs and values",
    "update": "after step S's critic update, before the actor's (critic-free: after the advantages)",
    "sync": "in step S's weight sync: weights gathered, before the push into the engine",
    "checkpoint": "while step S's checkpoint is written: its files written, no manifest, not in place",
    "engine": "the actor engine's processes are killed as step S's generation begins",
}
FIRED = "faults_fired"
# the points at the boundaries of a step's phases (colocate.run.loop.StepPhases: (event, phase) -> points,
# in firing order; "push": this rank's push into its engine, once the weights are gathered);
# "checkpoint" is the checkpoint write's own
AT_BOUNDARY = {("begin", "rollout"): ("engine", "generate"), ("end", "rollout"): ("score",),
               ("begin", "old_logp"): ("logprobs",), ("begin", "actor"): ("update",),
               ("begin", "push"): ("sync",)}


class FaultInjected(ColocateError):
    """``run.fault_at`` with ``run.fault_action=raise``: a failure asked for by a test."""


def parse(spec: str) -> list[tuple[str, int, int | None]]:
    """``run.fault_at`` -> [(point, step, rank or None)]; a bad entry is one ConfigError line."""
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        parts = item.split(":")
        ok = len(parts) in (2, 3) and parts[0] in POINTS and all(p.isdigit() for p in parts[1:])
        if not ok or int(parts[1]) < 1:
            raise ConfigError(f"run.fault_at: {item!r} is not POINT:STEP[:RANK] with STEP >= 1 and POINT one of "
                              f"{sorted(POINTS)} (a test hook; leave it empty to train)")
        out.append((parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None))
    return out


def due(spec: str, point: str, step: int, rank: int, fired: Sequence[str]) -> str | None:
    """The key of the fault at (``point``, ``step``) on ``rank`` not yet ``fired``, or None."""
    for p, s, r in parse(spec):
        key = f"{p}:{s}:{rank}"
        if (p, s) == (point, step) and r in (None, rank) and key not in fired:
            return key
    return None


def fire(spec: str, action: str, point: str, step: int, rank: int, out_dir: Path,
         engine_pids: Sequence[int] = ()) -> None:
    """Act on the fault at (``point``, ``step``) if one is due: record it, then kill or raise."""
    record = Path(out_dir) / FIRED
    fired = record.read_text().split() if record.exists() else []
    key = due(spec, point, step, rank, fired)
    if key is None:
        return
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record, "a") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    if point == "engine":
        for pid in engine_pids:
            os.kill(pid, signal.SIGKILL)
        return
    if action == "raise":
        raise FaultInjected(f"fault injected at {point} of step {step} on rank {rank} (run.fault_at: a test hook)")
    os.kill(os.getpid(), signal.SIGKILL)
