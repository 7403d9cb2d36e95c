"""How one rank's failure ends every rank within seconds, in one line naming it.

Two cases, by whether a collective can be in flight when the failure happens:

- Outside the trainer's collectives (the rollout, the push into this rank's own engine,
  rank 0's held-out evaluation): :func:`agree` runs the phase and then every rank
  exchanges its outcome in one all-gather, so every rank raises together — the failed
  rank its own error, the others :class:`RankFailedError` naming its rank and phase — and
  a user error lets every rank checkpoint together (a checkpoint is collective).
- Inside them (training, the weight gather): the others wait in a collective the failed
  rank will never join, and joining any other one would hang until the process-group
  timeout (gloo matches collectives by order). So the failed rank only leaves its line in
  the process group's store (:func:`post`) and exits; its closed connections break the
  others' collective at once (gloo; under torchrun the launcher also ends them), and
  :func:`lost_line` turns that into one line naming the failed rank and phase read
  back from the store. No checkpoint is written then: the last one stays.

Leaves out: the store itself and telling a lost peer (``trainer.distributed``), when a
checkpoint is safe (``colocate.run.session.Session.save_after_failure``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

from colocate.errors import USER_ERRORS, ColocateError, in_config_terms
from colocate.trainer.distributed import all_gather_object, lost_peer, post_failure, posted_failure

T = TypeVar("T")


class RankFailedError(ColocateError):
    """Another rank failed (with an error of its own, printed by that rank)."""


class RankCrashedError(RuntimeError):
    """Another rank failed with an error that is not colocate's (a bug, out of memory):
    nobody checkpoints (the failed rank does not)."""


@dataclasses.dataclass(frozen=True)
class Failure:
    rank: int
    phase: str
    message: str
    user_error: bool


def describe(exc: BaseException) -> str:
    """``exc`` as one short line: its type and the first line of its text (an engine's error
    with the config field that fixes it)."""
    exc = in_config_terms(exc)
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def line(rank: int, phase: str, message: str) -> str:
    return f"rank {rank} failed in {phase} ({message}); every rank stops"


def agree(run: Callable[[], T], dist, phase: str, *, share: bool = False) -> Any:
    """``run()`` on this rank, then one all-gather of every rank's outcome: the first
    failure raises on every rank (its own error on the failed rank; ``RankFailedError``,
    or ``RankCrashedError`` when the failure was not a colocate error, on the others). Returns
    this rank's result, or (``share``) every rank's in rank order. Only where no collective
    can be in flight when ``run`` fails (see the module docstring)."""
    try:
        result = run()
    except BaseException as exc:
        if dist.world_size > 1:
            all_gather_object(Failure(dist.rank, phase, describe(exc), isinstance(exc, USER_ERRORS)), dist)
        raise
    outcomes = all_gather_object(result if share else None, dist)
    failed = [o for o in outcomes if isinstance(o, Failure)]
    if failed:
        first = failed[0]
        text = line(first.rank, first.phase, first.message)
        raise RankFailedError(text) if first.user_error else RankCrashedError(text)
    return outcomes if share else result


def post(dist, phase: str, exc: BaseException) -> None:
    """Leave this rank's failure for the others in the process group's store (the first
    rank to post wins; a failure exchanged by :func:`agree` or a lost peer posts nothing)."""
    if dist.world_size > 1 and not isinstance(exc, (RankFailedError, RankCrashedError)) and not lost_peer(exc):
        post_failure(line(dist.rank, phase, describe(exc)), dist)


def lost_line(dist, phase: str, exc: BaseException) -> str:
    """The one line of a rank whose collective broke because another rank went away: the
    failed rank's posted line, else (killed: it posted nothing) this rank's phase."""
    posted = posted_failure(dist)
    if posted is not None:
        return posted
    return (f"another rank went away during a collective in {phase} ({describe(exc)[:160]}); every rank stops "
            "(killed by a signal, or its error is printed above; under --nproc the launcher's last line names it)")
