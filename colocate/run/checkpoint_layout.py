"""The one checkpoint layout colocate reads: the one it writes.

Owns: :data:`LAYOUT` and :func:`check`, which refuses a checkpoint of any other layout in
one line naming the colocate that wrote it. Today's layout, each owner's state side by side:

- ``run``: the run's progress (``RunState``: step, weight version, KL controller);
- ``rng``, ``trainer``: Python's and torch's RNG, the trainer (actor, critic, optimizers);
- ``data``: ``{"base", "ranks": [DataSource.state_dict() of each engine rank]}`` (stream
  position, samples named, dropped count, deferred samples with their status, score and
  record, named in the engine ranks' union);
- ``rollout``: ``{"ranks": [Rollouts.state_dict() of each engine rank, or None]}`` (Δ
  controller, chunk tuner, auto's picker).

colocate has not been released: earlier layouts are not read, so no reader of old state
lives beside the code that writes the new one.

Leaves out: writing and finding checkpoints (``colocate.run.checkpoint``), loading the parts
into a session's owners (``colocate.run.session``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from colocate.run.checkpoint import CheckpointError

LAYOUT = 4
# who wrote the layouts this colocate no longer reads (1 and 0 had no number of their own)
WRITERS = {0: "colocate before 2026-11-26 (one engine rank)",
           1: "colocate of 2026-11-26 (the deferred samples inside the scheduler's state)",
           2: "colocate of 2026-11-27, commits 690168a-17469b8 (deferred samples with or without a status)",
           3: "colocate of 2026-11-27 to 2026-12-02, commits e3b6196-9117faf (deferred samples named per engine rank)"}


def check(parts: Mapping[str, Any], where: Path | str) -> None:
    """Nothing, where ``parts`` (a loaded checkpoint) is in :data:`LAYOUT`; else one line."""
    layout = parts.get("layout", 1 if "rollout" in parts else 0)
    if layout == LAYOUT:
        return
    writer = WRITERS.get(layout, f"a colocate newer than this one (layout {layout})")
    raise CheckpointError(f"--resume: checkpoint '{where}' is in layout {layout}, written by {writer}; this "
                          f"colocate reads layout {LAYOUT} only: start a new run (another run.out_dir) or resume "
                          "it with the colocate that wrote it")
