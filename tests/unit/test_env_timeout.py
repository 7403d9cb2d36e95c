"""Issue 39.4: ``rollout.env_timeout_s`` counts rollout time. An environment call parked
across a training phase (``overlap.pause_mode``: the trajectory waits in the engines' loop,
which does not run while the trainer trains) is not timed out by the training's seconds."""

from __future__ import annotations

import asyncio
import time

import pytest

from colocate.rollout.env import Observation
from colocate.rollout.turns import EnvTurns, ObservationTemplate, _Failure


class Piecewise:
    """An async tool that needs several turns of the loop (a reply read in pieces from a
    subprocess or a socket)."""

    name = "piecewise"

    async def step(self, record, history):
        await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        for _ in range(3):
            await asyncio.sleep(0)
        return Observation(text="42")


def _turns(timeout_s: float) -> EnvTurns:
    return EnvTurns(Piecewise(), ObservationTemplate(object(), [2]), str, max_turns=2, timeout_s=timeout_s)


def _across_training(turns: EnvTurns, mark: bool, train_s: float = 1.5):
    """Start a call, leave the loop mid-call for ``train_s`` (the trainer's phase), come back."""
    loop = asyncio.new_event_loop()
    try:
        call = loop.create_task(turns._call({}, []))
        loop.run_until_complete(asyncio.sleep(0.1))  # the step's rollout: the call is under way
        if mark:
            turns.step_ended()
        time.sleep(train_s)  # training: the loop does not run
        if mark:
            turns.step_started()
        return loop.run_until_complete(call)
    finally:
        loop.close()


def test_a_call_parked_across_training_is_not_timed_out_by_it():
    obs = _across_training(_turns(timeout_s=1.0), mark=True)
    assert obs.text == "42"


def test_the_time_a_step_runs_still_counts():
    turns = _turns(timeout_s=0.2)  # the call itself needs 0.35 s of rollout time
    with pytest.raises(_Failure, match=r"did not answer within 0.2 s \(rollout.env_timeout_s\)"):
        asyncio.run(turns._call({}, []))
    turns = _turns(timeout_s=1.0)  # out of the loop without the marks (main before the fix): timed out
    with pytest.raises(_Failure, match="did not answer within 1 s"):
        _across_training(turns, mark=False)
