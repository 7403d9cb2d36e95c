"""Parking (colocate/rollout/schedule.py) without an engine: which pause modes run where, how a
parked sample is saved and when it is done, its status around its stream, the relay of a parked
stream's tokens."""

import asyncio

import pytest

from colocate.errors import ConfigError
from colocate.rollout.schedule import LiveRequest, LiveRequests, Relay, _life, check_pause_mode
from colocate.rollout.sample import Sample, Status


def test_pause_mode_decisions():
    check_pause_mode("abort", "cuda")
    check_pause_mode("retract", "cuda")
    check_pause_mode("in_place", "cpu")
    with pytest.raises(ConfigError, match="overlap.pause_mode: in_place .* use retract"):
        check_pause_mode("in_place", "cuda")
    with pytest.raises(ConfigError, match="overlap.pause_mode: 'later' is not one of"):
        check_pause_mode("later", "cpu")


def test_a_parked_sample_is_saved_as_the_partial_an_abort_at_that_point_gives():
    """One object, never copied: the scheduler defers the parked sample itself; a checkpoint
    saves it as an abort now gives it (its request does not outlive the process)."""
    live = Sample(3, [1, 2], 10, output_ids=[5, 6], logprobs=[-0.1, -0.2], versions=[0, 0], attempts=1, group=1,
                  status=Status.PARKED)
    saved = live.state()
    live.output_ids.append(7), live.logprobs.append(-0.3), live.versions.append(1)
    assert (saved["output_ids"], saved["logprobs"], saved["versions"]) == ([5, 6], [-0.1, -0.2], [0, 0])
    copy = Sample.from_state(saved)
    assert copy.finish_reason == "abort" and not copy.finished  # a resumed run defers it as a partial
    assert copy.status is Status.DEFERRED and live.status is Status.PARKED and live.finish_reason is None
    assert (copy.index, copy.group, copy.attempts, copy.remaining) == (3, 1, 1, 8)
    running = Sample(4, [1], 8, output_ids=[5], logprobs=[-0.1], versions=[0], status=Status.RUNNING)
    assert (running.state()["status"], running.state()["finish_reason"]) == ("deferred", "abort")


def test_done_is_finished_and_scored():
    """A stream that ended while parked is finished, not done: the scheduler launches it again to be scored."""
    ended = Sample(1, [1], 4, output_ids=[5], logprobs=[0.0], versions=[0], finish_reason="stop", status=Status.FINISHED)
    assert ended.finished and not ended.done
    assert Sample.from_state(ended.state()).status is Status.FINISHED  # saved as it is, still unscored
    ended.score = 0.5
    assert ended.done
    assert not Sample(2, [1], 4, finish_reason="abort", status=Status.DEFERRED, score=0.5).done


def test_a_sample_is_running_while_its_stream_runs_and_settles_however_it_ends():
    loop = asyncio.new_event_loop()
    try:
        seen = []

        def stream_ending(reason):
            async def stream():
                seen.append(sample.status)
                sample.finish_reason = reason
            return stream

        sample = Sample(1, [1], 8)
        loop.run_until_complete(_life(sample, stream_ending("stop")))
        assert seen == [Status.RUNNING] and sample.status is Status.FINISHED
        loop.run_until_complete(_life(sample, stream_ending("length")))  # finished before: no stream
        assert seen == [Status.RUNNING] and sample.finish_reason == "stop"
        cut = Sample(2, [1], 8)
        loop.run_until_complete(_life(cut, stream_ending("abort")))
        assert cut.status is Status.DEFERRED

        async def forever():
            await asyncio.sleep(60)

        hung = Sample(3, [1], 8)
        task = loop.create_task(_life(hung, forever))
        loop.run_until_complete(asyncio.sleep(0.01))
        assert hung.status is Status.RUNNING
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        assert hung.status is Status.DEFERRED and hung.finish_reason == "abort"  # cut where it was
    finally:
        loop.close()


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
