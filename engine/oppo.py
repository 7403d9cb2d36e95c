"""One step's overlapped rollout: streamed scoring and/or early cut with deferral.

Owns: running the launched samples concurrently on the actor engine; scoring each one as
it is generated (``streamed``: chunks to the feeder, intra-step overlap) or as soon as it
finishes (one-shot on the reward engine); and, when ``cut_after`` is set (inter-step
overlap), aborting the rest once that many groups are finished *and* scored (a group: the
launched samples of one group id; one sample without groups) — their partial tokens,
logprobs and versions stay on the :class:`Sample` for the next step. Scores land on
``Sample.score``; a shared prompt is prefilled once before its group's members run. A
sample whose scoring fails fails the step: the other requests are aborted and their tasks
cancelled before the error is raised, so nothing is left running on the engines' loop.

Leaves out: which samples to launch and what to defer (``engine.scheduler``), training.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Awaitable, Callable, Sequence

from . import reward as rm
from . import rollout
from .rollout import Sample
from .streamed import Chunker, ScoreClient

ExtraScore = Callable[[Sample], Awaitable[float]]  # e.g. rule rewards on the decoded text


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
               reward_engine, extra_score: ExtraScore | None, chunk: int, clock: _Clock, on_done,
               score_timeout_s: float | None) -> None:
    chunker = Chunker(client, step, sample, chunk) if client is not None else None
    if client is not None:
        client.expect(step, sample.index)
    await rollout.stream_sample(actor, sample, sampling, tag, chunker.on_tokens if chunker else None)
    clock.last_token[sample.index] = time.perf_counter()
    if not sample.finished:
        if client is not None:
            client.forget(step, sample.index)
        return
    score = 0.0
    if chunker is not None:
        await chunker.finish()
        score = await client.score(step, sample.index)
    elif reward_engine is not None:
        seq = sample.prompt_ids + sample.output_ids
        score = await rm.score(reward_engine, seq, f"{tag}rm-{sample.index:08d}",
                               request=f"(step {step}, sample {sample.index})", timeout_s=score_timeout_s)
    if extra_score is not None:
        score += await extra_score(sample)
    clock.scored[sample.index] = time.perf_counter()
    on_done(sample, score)


async def run_step(
    actor, samples: Sequence[Sample], sampling: dict[str, Any], step: int, *,
    reward_engine=None, client: ScoreClient | None = None, chunk: int = 64,
    cut_after: int | None = None, extra_score: ExtraScore | None = None, score_timeout_s: float | None = None,
) -> OverlapResult:
    """Generate ``samples``; score each as it goes (streamed through ``client``, whose own
    deadline applies, else one-shot on ``reward_engine`` within ``score_timeout_s``, plus
    ``extra_score``); abort the rest after ``cut_after`` groups have all their launched
    members finished and scored."""
    tag = f"op{step:07d}"
    rollout.check_budget(samples, actor.context_length)
    clock = _Clock(time.perf_counter())
    completed: list[Sample] = []
    running = {s.index: s for s in samples}
    pending: dict[int, int] = {}  # group id -> launched members not yet finished and scored
    for s in samples:
        pending[s.group_id] = pending.get(s.group_id, 0) + 1
    groups_done: list[int] = []  # group ids in the order their last launched member was scored

    def on_done(sample: Sample, score: float) -> None:
        completed.append(sample)
        sample.score = score
        pending[sample.group_id] -= 1
        if pending[sample.group_id] == 0:
            groups_done.append(sample.group_id)
        if cut_after is not None and len(groups_done) == cut_after and clock.cut is None:
            clock.cut = time.perf_counter()
            for other in running.values():
                if other.index not in clock.last_token:
                    rollout.abort(actor, other, tag)

    await rollout.prefill_shared_prompts(actor, samples, tag)  # before any member runs
    tasks = [asyncio.ensure_future(_one(actor, s, sampling, tag, step, client=client, reward_engine=reward_engine,
                                        extra_score=extra_score, chunk=chunk, clock=clock, on_done=on_done,
                                        score_timeout_s=score_timeout_s))
             for s in samples]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        await _stop(actor, samples, tasks, tag, client, step)
        raise
    end = time.perf_counter()
    done = {s.index for s in completed}
    first = set(groups_done if cut_after is None else groups_done[:cut_after])
    return OverlapResult(completed, [s for s in samples if s.index not in done],
                         _timings(clock, [s for s in completed if s.group_id in first], end))


async def _stop(actor, samples: Sequence[Sample], tasks, tag: str, client: ScoreClient | None, step: int) -> None:
    """After a failure: abort the requests still generating, cancel every task, forget
    their scores; returns once all tasks have ended."""
    for s in samples:
        if s.attempts > 0 and s.finish_reason is None:
            rollout.abort(actor, s, tag)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if client is not None:
        for s in samples:
            client.forget(step, s.index)


def _timings(clock: _Clock, trained: Sequence[Sample], end: float) -> dict[str, float]:
    if not trained:
        return {"generate": end - clock.start, "reward_tail": 0.0, "abort_wait": 0.0}
    last_tok = max(clock.last_token[s.index] for s in trained)
    last_score = max(clock.scored[s.index] for s in trained)
    return {"generate": last_tok - clock.start, "reward_tail": max(0.0, last_score - last_tok),
            "abort_wait": end - (clock.cut or end)}
