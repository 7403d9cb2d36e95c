"""Run-time guards: checks that stop a run with one line instead of training on garbage.

Owns: the weight-version agreement between the trainer and the actor engine (every
sampled token carries the version the engine reports; none may be newer than the
trainer's, and in the sequential modes all must equal it), and the batch/world-size
agreement checked at start-up. Pure functions over plain Python values.

Leaves out: non-finite rewards/advantages/losses/grads (the loop and ``trainer.optim``
skip those updates with a logged reason), engine liveness (``engine.runtime``).
"""

from __future__ import annotations

from typing import Sequence

from colocate.errors import ColocateError, ConfigError


class WeightVersionMismatchError(ColocateError):
    """The actor engine served weights the trainer does not think it holds."""


def check_weight_versions(versions: Sequence[Sequence[int]], trainer_version: int, *,
                          carries_partials: bool) -> None:
    """Every token's weight version against the trainer's current version.

    A token newer than the trainer is always a mismatch. Without deferral
    (``carries_partials`` False) every token was sampled this step, so each must equal
    ``trainer_version``; with deferral, older tokens are the deferred partials, whose
    staleness the trainer corrects or masks.
    """
    for row, vs in enumerate(versions):
        for v in vs:
            if v > trainer_version or (not carries_partials and v != trainer_version):
                raise WeightVersionMismatchError(
                    f"weight-version mismatch: sample {row} has a token sampled under version {v} "
                    f"but the trainer is at version {trainer_version}; the engine does not hold the "
                    "trainer's weights (a lost sync): resume from the last checkpoint with --resume")


def check_world_size(batch_size: int, minibatches: int, world_size: int) -> None:
    """Each rank trains an equal share of every minibatch: B/minibatches rows split over ranks."""
    if batch_size < world_size:
        raise ConfigError(
            f"rollout.batch_size: {batch_size} is smaller than the world size {world_size}; "
            f"use at least {world_size} (one row per rank) or fewer processes")
    rows = batch_size // minibatches
    if rows % world_size:
        raise ConfigError(
            f"rollout.batch_size: {batch_size} / ppo.minibatches {minibatches} = {rows} rows per "
            f"minibatch do not split over {world_size} ranks; make rollout.batch_size a multiple "
            f"of {minibatches * world_size}")
