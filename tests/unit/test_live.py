"""Parking (colocate/rollout/schedule.py) without an engine: which pause modes run where, the frozen copy the
scheduler sees, the relay of a parked stream's tokens."""

import asyncio

import pytest

from colocate.errors import ConfigError
from colocate.rollout.schedule import LiveRequest, LiveRequests, Relay, check_pause_mode, frozen
from colocate.rollout.sample import Sample, Status


def test_pause_mode_decisions():
    check_pause_mode("abort", "cuda")
    check_pause_mode("retract", "cuda")
    check_pause_mode("in_place", "cpu")
    with pytest.raises(ConfigError, match="overlap.pause_mode: in_place .* use retract"):
        check_pause_mode("in_place", "cuda")
    with pytest.raises(ConfigError, match="overlap.pause_mode: 'later' is not one of"):
        check_pause_mode("later", "cpu")


def test_frozen_copy_is_the_partial_as_of_now_and_does_not_grow_with_the_stream():
    live = Sample(3, [1, 2], 10, output_ids=[5, 6], logprobs=[-0.1, -0.2], versions=[0, 0], attempts=1, group=1)
    copy = frozen(live)
    live.output_ids.append(7), live.logprobs.append(-0.3), live.versions.append(1)
    live.finish_reason = "stop"
    assert (copy.output_ids, copy.logprobs, copy.versions) == ([5, 6], [-0.1, -0.2], [0, 0])
    assert copy.finish_reason == "abort" and not copy.finished  # the scheduler defers it as a partial
    assert copy.status is Status.DEFERRED and live.status is Status.WAITING  # the stream's own sample: not the copy
    assert (copy.index, copy.group, copy.attempts, copy.remaining) == (3, 1, 1, 8)


def test_relay_forwards_to_its_current_target_or_to_nobody():
    got = []
    relay = Relay()
    assert relay(None, [1]) is None  # parked: nobody consumes
    relay.target = lambda sample, ids: got.append(ids)
    relay(None, [2, 3])
    assert got == [[2, 3]]


def test_a_parked_stream_is_parked_until_a_step_adopts_it():
    loop = asyncio.new_event_loop()
    try:
        going, ended = loop.create_future(), loop.create_future()
        ended.set_result(None)
        a = Sample(1, [1], 8, status=Status.RUNNING)
        b = Sample(2, [1], 8, finish_reason="stop", status=Status.FINISHED)
        live = LiveRequests()
        live.park(LiveRequest(a, going, Relay(), "op"))
        live.park(LiveRequest(b, ended, Relay(), "op"))
        assert a.status is Status.PARKED and b.status is Status.FINISHED  # a stream that ended keeps its own
        assert live.adopt(1).sample.status is Status.RUNNING and live.adopt(2).sample.status is Status.FINISHED
        assert live.adopt(1) is None and len(live) == 0
    finally:
        loop.close()
