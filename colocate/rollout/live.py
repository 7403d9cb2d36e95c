"""Requests kept in the actor engine across a step boundary: deferral that keeps its place.

Owns: the choice of what happens to a straggler at the cut (``overlap.pause_mode``):
``abort`` (its partial comes back; next step resumes it as prompt + partial, re-prefilled
after the weight sync's cache flush), ``in_place`` (the engine pauses with the request
and its KV; after the weight update it continues on that KV — PipelineRL's in-flight
update) or ``retract`` (the engine pauses and puts it back in its queue; on continue its
KV is recomputed under the new weights); :class:`LiveRequests`, the open streams of
parked stragglers between steps, and :class:`Relay`, which hands a parked stream's new
tokens to whichever step consumes them.

The scheduler never sees a parked stream: at the cut it gets a frozen copy of the sample
(the partial as of the cut, deferred with ``finish_reason="abort"``, exactly what ``abort``
gives; the stream's own sample is parked, ``Status.PARKED``, until a step adopts it), and
checkpoints carry that copy, so a resumed run re-generates from it and nothing is trained
twice. When a later step launches the sample again it adopts the live stream instead of
sending a new request: the tokens produced meanwhile, and the finish, are already there.

Leaves out: when to pause and continue the engine (``colocate.rollout.schedule`` pauses at the cut; the
time-sharing continues it after the weight sync and the KV wake), what to defer (``colocate.rollout.scheduler``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

from colocate.errors import ConfigError
from colocate.rollout import generation
from colocate.rollout.sample import OnTokens, Sample, Status

PAUSE_MODES = ("abort", "in_place", "retract")


def check_pause_mode(mode: str, device: str) -> None:
    """Refuse a pause mode that cannot work on ``device``: on CUDA the time-sharing releases
    the actor engine's KV cache for training, which SGLang allows only once no request holds
    KV — a request paused ``in_place`` does, ``retract`` frees it (the engine then counts
    as idle with the retracted requests waiting), ``abort`` ends the request."""
    if mode not in PAUSE_MODES:
        raise ConfigError(f"overlap.pause_mode: {mode!r} is not one of {', '.join(PAUSE_MODES)}")
    if mode == "in_place" and device == "cuda":
        raise ConfigError(
            "overlap.pause_mode: in_place keeps the stragglers' KV on the GPU, which time-sharing "
            "releases for training; use retract (KV recomputed after the update) or abort")


class Relay:
    """The ``on_tokens`` of one stream: forwards to the current consumer (a step's chunker),
    or to nobody while the stream is parked. A parked multi-turn trajectory whose turn
    ended waits here (:meth:`next_turn`) before it sends its next turn (a new request
    would continue the paused engine): until a step adopts it, or it is discarded."""

    def __init__(self, target: OnTokens | None = None):
        self.target = target
        self.parked = False
        self.dropped = False
        self._changed = asyncio.Event()

    def __call__(self, sample: Sample, ids: list[int]):
        return self.target(sample, ids) if self.target is not None else None

    def park(self) -> None:
        self.target, self.parked = None, True

    def adopt(self, target: OnTokens | None) -> None:
        self.target, self.parked = target, False
        self._changed.set()

    def drop(self) -> None:
        self.dropped = True
        self._changed.set()

    async def next_turn(self) -> bool:
        """Whether the stream may send its trajectory's next turn: at once unless parked;
        parked, once a step adopts it (True) or when it is discarded (False)."""
        while self.parked and not self.dropped:
            self._changed.clear()
            await self._changed.wait()
        return not self.dropped


@dataclasses.dataclass
class LiveRequest:
    sample: Sample  # the stream's own sample: it keeps growing while parked
    task: asyncio.Task  # the stream (colocate.rollout.generation.stream_sample)
    relay: Relay
    tag: str  # the step tag of its request id (for an abort)
    start_len: int = 0  # the sample's tokens when its request was sent

    @property
    def started(self) -> bool:
        """Whether its request has produced a token yet (else it still waits in the engine's queue)."""
        return len(self.sample.output_ids) > self.start_len


def frozen(sample: Sample) -> Sample:
    """The scheduler's copy of a parked sample: its partial as of now."""
    return dataclasses.replace(sample, output_ids=list(sample.output_ids), logprobs=list(sample.logprobs),
                               versions=list(sample.versions), loss_mask=list(sample.loss_mask),
                               observations=list(sample.observations), finish_reason="abort",
                               status=Status.DEFERRED)


class LiveRequests:
    """Streams of parked stragglers, by sample index."""

    def __init__(self) -> None:
        self._live: dict[int, LiveRequest] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, index: int) -> bool:
        return index in self._live

    def indices(self) -> tuple[int, ...]:
        """The sample indices of the parked streams."""
        return tuple(self._live)

    def park(self, req: LiveRequest) -> None:
        req.relay.park()
        if not req.task.done():  # a stream that ended is finished or deferred already
            req.sample.status = Status.PARKED
        self._live[req.sample.index] = req

    def adopt(self, index: int) -> LiveRequest | None:
        """The parked stream of sample ``index`` (removed from here; running again unless it
        ended while parked), or None."""
        req = self._live.pop(index, None)
        if req is not None and req.sample.status is Status.PARKED:
            req.sample.status = Status.RUNNING
        return req

    def unstarted(self) -> list[int]:
        """Parked requests that have produced no token: they were still queued at the pause."""
        return [i for i, r in self._live.items() if not r.started]

    async def discard(self, engine, indices: Sequence[int] | None = None, timeout_s: float = 30.0) -> int:
        """Abort the parked requests of ``indices`` (all: None) and wait for their streams
        to end (bounded); returns how many were discarded."""
        keys = list(self._live) if indices is None else [i for i in indices if i in self._live]
        reqs = [self._live.pop(i) for i in keys]
        for r in reqs:
            r.relay.drop()  # a trajectory waiting between turns ends there
            if not r.task.done():
                generation.abort(engine, r.sample, r.tag)
        if reqs:
            await engine.continue_generation()  # a paused engine ends the aborted requests only once it runs
            await asyncio.wait([r.task for r in reqs], timeout=timeout_s)
            for r in reqs:
                if not r.task.done():
                    r.task.cancel()
                elif not r.task.cancelled():
                    r.task.exception()  # seen: an aborted stream's error is no one's
        return len(reqs)
