"""The inline reward feeder drained before a release, on the real (CPU) reward engine: what
is in flight comes back, nothing more reaches the engine, and the scheduler is idle."""

from __future__ import annotations

import asyncio

from colocate.engine.reward_feeder import RewardFeeder
from colocate.engine.wire import ScoreResult, TokenChunk


class _Sent:
    """Stands in for the results socket: records what the feeder sends back."""

    def __init__(self) -> None:
        self.messages: list = []

    async def send(self, msg) -> None:
        self.messages.append(msg)


def _chunk(step: int, index: int, seq: int, final: bool = False) -> TokenChunk:
    return TokenChunk(step=step, index=index, seq=seq, prompt_ids=[1, 5, 9, 7] if seq == 0 else None,
                      tokens=[11 + seq, 12 + seq, 13 + seq], final=final)


def test_drain_waits_for_requests_in_flight_and_scores_nothing_more(reward_engine, tmp_path):
    feeder = RewardFeeder(reward_engine, f"ipc://{tmp_path}/chunks", f"ipc://{tmp_path}/results")
    tx = _Sent()
    before = reward_engine.requests

    async def cut_then_release() -> int:
        # request 0 has three chunks queued (the cut aborted it later), request 1 one
        for chunk in (_chunk(7, 0, 0), _chunk(7, 0, 1), _chunk(7, 0, 2), _chunk(7, 1, 0)):
            feeder.take(chunk, tx)
        await asyncio.sleep(0)  # the first chunk of each request is now on the reward engine
        assert reward_engine.requests - before == 2
        return await feeder.drain()

    waited = reward_engine.loop.run_until_complete(cut_then_release())
    assert waited == 2 and feeder.chunks_scored == 2  # both came back; request 0's queued chunks were not sent
    assert reward_engine.requests - before == 2 and feeder.open_requests() == 0
    # idle: the release may go ahead. Not asserted "at once": the scheduler frees a request
    # just after it returned, which under a loaded CPU failed an immediate flush (suite run of
    # 2026-11-25); the release path waits for idle the same way (SglangEngine.wait_idle)
    assert reward_engine.wait_idle(timeout_s=2.0) < 2.0

    async def late_then_next_step() -> None:
        feeder.take(_chunk(7, 1, 1, final=True), tx)  # still on the way when the engines slept
        feeder.take(_chunk(8, 0, 0, final=True), tx)  # the next step scores again
        await asyncio.gather(*list(feeder._tails.values()))

    reward_engine.loop.run_until_complete(late_then_next_step())
    assert feeder.dropped_after_drain == 1
    assert reward_engine.requests - before == 3
    assert [(m.step, m.index) for m in tx.messages if isinstance(m, ScoreResult)] == [(8, 0)]
