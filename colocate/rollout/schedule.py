"""One step's schedule over its samples: streamed scoring and/or the early cut, and the
stragglers parked in the engine across the step boundary.

Owns: :class:`Schedule` (an actor engine's steps: :meth:`Schedule.run`, or
:meth:`Schedule.run_then_score` for the sequential schedule; :class:`Stream` for streamed
scoring): running the launched samples concurrently on the actor engine; scoring each one as
it is generated (``streamed``: chunks to the feeder, intra-step overlap) or as soon as it
finishes (the caller's ``score``: one-shot on a reward model, reward functions); and, when
``cut_after`` is set (inter-step overlap), aborting the rest once that many groups are finished *and* scored (a group: the
launched samples of one group id; one sample without groups) — their partial tokens,
logprobs and versions stay on the :class:`Sample` for the next step. Scores land on
``Sample.score``; a shared prompt is prefilled once before its group's members run. A
sample whose scoring fails fails the step: the other requests are aborted and their tasks
cancelled before the error is raised, so nothing is left running on the engines' loop.

The one schedule of every mode and of the held-out evaluation: the sequential mode (and
evaluation) is the case without streaming and without a cut, scoring every sample after
generation ended (``score_all``: one batch on the reward model, as a sequential step always
scored).

Parking (requests kept in the actor engine across a step boundary: deferral that keeps its
place): the choice of what happens to a straggler at the cut (``overlap.pause_mode``):
``abort`` (its partial comes back; next step resumes it as prompt + partial, re-prefilled
after the weight sync's cache flush), ``in_place`` (the engine pauses with the request
and its KV; after the weight update it continues on that KV — PipelineRL's in-flight
update) or ``retract`` (the engine pauses and puts it back in its queue; on continue its
KV is recomputed under the new weights); :class:`LiveRequests`, the open streams of
parked stragglers between steps, and :class:`Relay`, which hands a parked stream's new
tokens to whichever step consumes them.

A parked sample is one object, never copied: the step hands back the stream's own
sample, ``Status.PARKED``, and it waits among the deferred ones, growing while its stream
runs on (until the engine pauses). When a later step launches it again, it adopts the
live stream instead of sending a new request: the tokens produced meanwhile, and the
finish, are already there; a stream that ended while parked is finished but not scored
(not ``Sample.done``), so the data source's plan launches it again and the step scores it
without a request. A checkpoint saves a parked sample as an abort at that point gives it
(``Sample.state``), so a resumed run re-generates its rest and nothing is trained twice.

Every change of a sample's status happens here: running while its stream runs, parked,
then finished or deferred as its stream ends (``Sample.settle``, whichever step or none
is consuming it).

Leaves out: which samples to launch and what to defer (``colocate.rollout.data_source``),
when the engine continues after a weight sync (the time-sharing, after the KV wake),
training.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Awaitable, Callable, Collection, Sequence

from colocate.engine.reward import Chunker, ScoreClient
from colocate.monitor.timeline import Timeline, mark
from colocate.rollout import generate_and_score
from colocate.errors import ConfigError
from colocate.rollout.sample import MultiTurn, OnTokens, Sample, Status, check_budget

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
    task: asyncio.Task  # the stream (colocate.rollout.generate_and_score.stream_sample)
    relay: Relay
    tag: str  # the step tag of its request id (for an abort)
    start_len: int = 0  # the sample's tokens when its request was sent

    @property
    def started(self) -> bool:
        """Whether its request has produced a token yet (else it still waits in the engine's queue)."""
        return len(self.sample.output_ids) > self.start_len


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
                generate_and_score.abort(engine, r.sample, r.tag)
        if reqs:
            await engine.continue_generation()  # a paused engine ends the aborted requests only once it runs
            await asyncio.wait([r.task for r in reqs], timeout=timeout_s)
            for r in reqs:
                if not r.task.done():
                    r.task.cancel()  # its stream settles the sample as it ends (`_life`)
                elif not r.task.cancelled():
                    r.task.exception()  # seen: an aborted stream's error is no one's
            cancelled = [r.task for r in reqs if not r.task.done()]
            if cancelled:  # their samples settle as the cancellation ends them; bounded, never forever
                await asyncio.wait(cancelled, timeout=5.0)
        return len(reqs)


# (finished samples in launch order, request id prefix, step) -> their rewards, after generation ended
ScoreAll = Callable[[list[Sample], str, int], Awaitable[list[float]]]
# (finished sample, its streamed reward-model score or None, request id prefix, step) -> its
# reward (``colocate.rollout.generate_and_score.Scorer``: a one-shot model score when none streamed, reward
# functions, reward.scale); without one a sample's reward is its streamed score (or 0.0)
SampleScore = Callable[[Sample, "float | None", str, int], Awaitable[float]]


@dataclasses.dataclass
class OverlapResult:
    completed: list[Sample]  # finished and scored (``score`` set), in completion order
    unfinished: list[Sample]  # aborted (partial) or never started
    seconds: dict[str, float]


@dataclasses.dataclass
class _Clock:
    start: float
    last_token: dict[int, float] = dataclasses.field(default_factory=dict)
    scored: dict[int, float] = dataclasses.field(default_factory=dict)
    cut: float | None = None


async def _one(actor, sample: Sample, sampling, tag: str, step: int, *, client: ScoreClient | None,
               score: SampleScore | None, chunk: int, clock: _Clock, on_done, run: "_Run") -> None:
    run.start(sample, tag, lambda s, relay: generate_and_score.stream_sample(
        actor, s, sampling, tag, relay, run.timeline, run.turns, go_on=run.next_turn(s.index, relay)))
    chunker = Chunker(client, step, sample.index, sample.prompt_ids + sample.output_ids, chunk) if client is not None else None
    if client is not None:
        client.expect(step, sample.index)
    run.streams[sample.index].relay.adopt(chunker.on_tokens if chunker else None)
    await asyncio.shield(run.streams[sample.index].task)  # a cut may park the stream: it lives on
    clock.last_token[sample.index] = time.perf_counter()
    if not sample.finished:
        if client is not None:
            client.forget(step, sample.index)
        return
    if run.score_at_end:
        return  # scored with every other one once generation ended (`_generate_then_score`)
    streamed = None
    if chunker is not None:
        await chunker.finish()
        streamed = await client.score(step, sample.index)
    value = await score(sample, streamed, f"{tag}rm", step) if score is not None else (streamed or 0.0)
    clock.scored[sample.index] = time.perf_counter()
    mark(run.timeline, "scored", sample.index)
    on_done(sample, value)


@dataclasses.dataclass
class _Run:
    """The streams of one step's samples: new ones, or parked ones adopted from ``live``."""

    live: LiveRequests | None
    timeline: Timeline | None = None
    turns: MultiTurn | None = None  # multi-turn trajectories: the environment's answers
    score_at_end: bool = False  # finished samples are scored together after generation (``score_all``)
    aborted: set[int] = dataclasses.field(default_factory=set)  # samples the cut aborted
    streams: dict[int, LiveRequest] = dataclasses.field(default_factory=dict)

    def next_turn(self, index: int, relay: Relay):
        """When trajectory ``index`` may send its next turn: never once this step's cut
        aborted it; parked in ``live``, once a later step adopts it."""
        async def go_on() -> bool:
            return index not in self.aborted and await relay.next_turn()

        return go_on

    def start(self, sample: Sample, tag: str, stream) -> None:
        """``sample``'s stream this step: its parked one adopted from ``live``, or a new one
        (none for a sample whose stream ended while parked: it is only scored)."""
        req = self.live.adopt(sample.index) if self.live is not None else None
        if req is None:
            relay = Relay()
            req = LiveRequest(sample, asyncio.ensure_future(_life(sample, lambda: stream(sample, relay))), relay, tag,
                              len(sample.output_ids))
        else:
            if req.sample is not sample:
                raise RuntimeError(f"sample {sample.index}: launched as another object than its parked stream's")
            mark(self.timeline, "adopt", sample.index, prior=len(sample.output_ids))
        self.streams[sample.index] = req


async def _life(sample: Sample, stream) -> Sample:
    """A sample's stream and its status around it: running while it streams (parked while
    a later step has not adopted it), then finished or deferred as it ends, however it ends
    (cancelled: cut where it was). A sample that finished before (its stream ended while
    parked, and is gone) sends nothing."""
    if sample.status is Status.FINISHED:
        return sample
    sample.status = Status.RUNNING
    try:
        await stream()
    finally:
        if sample.finish_reason is None:
            sample.finish_reason = "abort"  # cancelled mid-request: its partial is what came
        sample.settle()
    return sample


@dataclasses.dataclass(frozen=True)
class Stream:
    """Streamed scoring (intra-step overlap): each sample's tokens go to the reward feeder
    through ``client`` in chunks of ``chunk`` tokens as they are generated."""

    client: ScoreClient
    chunk: int = 64


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The schedule of one actor engine's steps: what stays the same from step to step (the
    engine, where stragglers go at a cut: ``pause_mode`` and the parked streams ``live``,
    the request ``timeline``, the multi-turn environment ``turns``). A step runs either way:
    :meth:`run` (each sample scored as it goes, optionally streamed and cut) or
    :meth:`run_then_score` (the sequential schedule)."""

    actor: Any
    pause_mode: str = "abort"
    live: LiveRequests | None = None
    timeline: Timeline | None = None
    turns: MultiTurn | None = None

    async def end_parked(self, indices: Sequence[int] | None = None) -> int:
        """End the parked streams of ``indices`` (all: None): their requests aborted, each
        sample deferred with what it generated (``LiveRequests.discard``); returns how many."""
        return await self.live.discard(self.actor, indices) if self.live is not None else 0

    async def run(self, samples: Sequence[Sample], sampling: dict[str, Any], step: int, *,
                  score: SampleScore | None = None, stream: Stream | None = None, cut_after: int | None = None,
                  keep_parked: Collection[int] = (), tag_prefix: str = "op") -> OverlapResult:
        """Generate ``samples``; score each as it goes (model scores streamed through
        ``stream``'s client, whose own deadline applies; each finished sample's reward by
        ``score``, which scores one-shot what did not stream); after ``cut_after`` groups have
        all their launched members finished and scored, stop the rest: abort them
        (``pause_mode="abort"``), or pause the engine and park their streams in ``live``
        (``in_place``/``retract``; the unfinished samples handed back are those streams'
        own samples, ``Status.PARKED``). A launched sample parked in ``live`` by an earlier step continues its
        stream instead of sending a new request. With ``turns`` each sample is a multi-turn
        trajectory (``colocate.rollout.generate_and_score.stream_sample``): an abort reaches it
        mid-turn (its request) or between turns (after the environment's answer); parked, its
        request waits in the paused engine, or, between turns, it waits after the
        environment's answer until a later step adopts it. A parked stream this step does not
        launch ends first (its sample deferred with what it generated: too stale to train on,
        or a step without a cut, which would let it run on unconsumed into the weight sync),
        but those of ``keep_parked`` (samples still deferred, parked on through a step that
        cuts). Request ids start with ``tag_prefix``."""
        actor, live, timeline, turns, pause_mode = self.actor, self.live, self.timeline, self.turns, self.pause_mode
        client, chunk = (stream.client, stream.chunk) if stream is not None else (None, 64)
        tag = f"{tag_prefix}{step:07d}"
        check_budget(samples, actor.context_length)
        launched = {s.index for s in samples}
        ending = [i for i in (live.indices() if live is not None else ()) if i not in launched and i not in keep_parked]
        if ending:
            await live.discard(actor, ending)
        clock = _Clock(time.perf_counter())
        completed: list[Sample] = []
        run = _Run(live if pause_mode != "abort" else None, timeline, turns)
        mark(timeline, "rollout")
        pending: dict[int, int] = {}  # group id -> launched members not yet finished and scored
        for s in samples:
            pending[s.group_id] = pending.get(s.group_id, 0) + 1
        groups_done: list[int] = []  # group ids in the order their last launched member was scored
        tasks: dict[int, asyncio.Future] = {}
        parking: list[asyncio.Future] = []

        def on_done(sample: Sample, score: float) -> None:
            completed.append(sample)
            sample.score = score
            pending[sample.group_id] -= 1
            if pending[sample.group_id] == 0:
                groups_done.append(sample.group_id)
            if cut_after is not None and len(groups_done) == cut_after and clock.cut is None:
                clock.cut = time.perf_counter()
                mark(timeline, "cut")
                stragglers = [i for i in run.streams if i not in clock.last_token]
                if pause_mode == "abort":
                    for i in stragglers:
                        mark(timeline, "aborted", i)
                        run.aborted.add(i)
                        generate_and_score.abort(actor, run.streams[i].sample, tag)
                else:
                    parking.append(asyncio.ensure_future(
                        _park(actor, pause_mode, stragglers, run, tasks, client, step, clock.scored)))

        if live is not None and pause_mode == "in_place" and live.unstarted():
            # queued at an in-place pause: their radix namespace (the weight version they were sent
            # under) would match the old weights' KV of their prompt while their tokens count as the
            # new version's; they end here and go again as new requests (their copies are deferred)
            await live.discard(actor, live.unstarted())
        await actor.continue_generation()  # stragglers parked by the last cut go on (no-op unpaused)
        await generate_and_score.prefill_shared_prompts(actor, samples, tag)  # before any member runs
        for s in samples:
            tasks[s.index] = asyncio.ensure_future(_one(
                actor, s, sampling, tag, step, client=client, score=score, chunk=chunk, clock=clock,
                on_done=on_done, run=run))
        try:
            await _wait_all(list(tasks.values()))
            await _wait_all(parking)
        except BaseException:
            await _stop(actor, run, list(tasks.values()) + parking, tag, client, step)
            raise
        end = time.perf_counter()
        mark(timeline, "rollout_end")
        done = {s.index for s in completed}
        first = set(groups_done if cut_after is None else groups_done[:cut_after])
        return OverlapResult(completed, [s for s in samples if s.index not in done],
                             _timings(clock, [s for s in completed if s.group_id in first], end))

    async def run_then_score(self, samples: Sequence[Sample], sampling: dict[str, Any], step: int,
                             score_all: ScoreAll, *, tag_prefix: str = "op") -> OverlapResult:
        """The sequential schedule (no streaming, no cut, nothing parked): every sample
        generated, then the finished ones scored together by ``score_all``, in launch order,
        which is also the order ``completed`` hands them back in. Request ids start with
        ``tag_prefix``."""
        tag = f"{tag_prefix}{step:07d}"
        check_budget(samples, self.actor.context_length)
        clock = _Clock(time.perf_counter())
        run = _Run(None, self.timeline, self.turns, score_at_end=True)
        mark(self.timeline, "rollout")
        return await _generate_then_score(self.actor, samples, sampling, step, tag, run, clock, score_all)


async def _generate_then_score(actor, samples: Sequence[Sample], sampling: dict[str, Any], step: int, tag: str,
                               run: _Run, clock: _Clock, score_all: ScoreAll) -> OverlapResult:
    """:meth:`Schedule.run_then_score`: every sample's stream (a shared prompt prefilled
    first), then the finished ones scored together in launch order."""
    await generate_and_score.prefill_shared_prompts(actor, samples, tag)
    tasks = [asyncio.ensure_future(_one(actor, s, sampling, tag, step, client=None, score=None, chunk=0, clock=clock,
                                        on_done=None, run=run)) for s in samples]
    try:
        await _wait_all(tasks)
    except BaseException:
        await _stop(actor, run, tasks, tag, None, step)
        raise
    generated = time.perf_counter()
    mark(run.timeline, "score")
    ended = [s for s in samples if s.finished]
    for sample, value in zip(ended, await score_all(ended, f"{tag}rm", step)):
        sample.score = value
    end = time.perf_counter()
    mark(run.timeline, "rollout_end")
    return OverlapResult(ended, [s for s in samples if not s.finished],
                         {"generate": generated - clock.start, "reward_tail": end - generated})


async def _park(actor, mode: str, stragglers: Sequence[int], run: _Run, tasks, client, step: int,
                clock_scored: dict[int, float]) -> None:
    """Pause the engine with the stragglers in it; their step tasks end, their streams are
    parked in ``run.live`` and the step hands back their samples, parked."""
    await actor.pause(mode)
    for i in stragglers:
        if i in clock_scored:
            continue  # it finished and was scored before the pause: a completed sample
        req = run.streams.get(i)
        if req is not None and req.task.done() and req.sample.finished:
            continue  # it finished while the pause was on its way: its task scores it, a completed sample
        tasks[i].cancel()
        if req is not None:
            mark(run.timeline, "parked", i, tokens=len(req.sample.output_ids))
            run.live.park(req)
        if client is not None:
            client.forget(step, i)


async def _wait_all(tasks: Sequence[asyncio.Future]) -> None:
    """Until every task ended; the first error of one raises (a cancelled task is parked)."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()


async def _stop(actor, run: _Run, tasks, tag: str, client: ScoreClient | None, step: int) -> None:
    """After a failure: abort the requests still generating (parked ones included), cancel
    every task, forget their scores; returns once all tasks have ended."""
    if run.live is not None:
        await run.live.discard(actor)
    for i, req in run.streams.items():
        if not req.task.done():
            generate_and_score.abort(actor, req.sample, req.tag)
    await actor.continue_generation()  # a paused engine finishes the aborts only once it runs
    for t in [*tasks, *(r.task for r in run.streams.values())]:
        t.cancel()
    await asyncio.gather(*tasks, *(r.task for r in run.streams.values()), return_exceptions=True)
    if client is not None:
        for i in run.streams:
            client.forget(step, i)


def _timings(clock: _Clock, trained: Sequence[Sample], end: float) -> dict[str, float]:
    if not trained:
        return {"generate": end - clock.start, "reward_tail": 0.0, "abort_wait": 0.0}
    last_tok = max(clock.last_token[s.index] for s in trained)
    last_score = max(clock.scored[s.index] for s in trained)
    return {"generate": last_tok - clock.start, "reward_tail": max(0.0, last_score - last_tok),
            "abort_wait": end - (clock.cut or end)}
