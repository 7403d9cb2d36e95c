"""Streaming rollout on the actor engine: submit, stream, abort, resume.

Owns: :class:`Sample` (one prompt's generation state in plain Python: tokens, sampling
logprobs and the weight version of every token, for a multi-turn trajectory which tokens
came from the environment, and where it is in its life, :class:`Status`), request ids
that SGLang's prefix-matching abort cannot confuse, streaming one sample while calling back with each new chunk, resuming a partial
sample with exactly its remaining token budget, and the turn loop of a multi-turn
trajectory (:class:`MultiTurn`): after each model turn the caller's ``answer`` gives the
environment's tokens, which are appended out of the loss (``Sample.loss_mask``), and the
model goes on from there — token in, token out, nothing decoded and re-encoded.

Leaves out: which samples to launch or defer (the scheduler), scoring (``engine.reward``),
what an environment answers and how its text becomes tokens (``colocate.rollout.turns``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from typing import Any, Awaitable, Callable, Sequence

from .errors import EngineError
from .runtime import SglangEngine
from .timeline import Timeline, mark

OnTokens = Callable[["Sample", list[int]], Awaitable[None] | None]


@dataclasses.dataclass(frozen=True)
class TurnReply:
    """The environment's answer to a model turn: the tokens to append (out of the loss) and
    their chat message ({role, content}), a reward, and whether the trajectory ends (then
    nothing is appended)."""

    ids: list[int]
    message: dict[str, str] = dataclasses.field(default_factory=dict)
    reward: float = 0.0
    done: bool = False


@dataclasses.dataclass(frozen=True)
class MultiTurn:
    """How a trajectory goes on after a model turn: ``answer(sample)`` (async) gives the
    environment's reply; at most ``max_turns`` model turns, each at most ``turn_tokens``
    tokens (0: only the trajectory's budget, ``Sample.max_new_tokens``, which counts
    the environment's tokens too)."""

    answer: Callable[["Sample"], Awaitable[TurnReply]]
    max_turns: int = 4
    turn_tokens: int = 0


class PromptTooLongError(EngineError):
    """A prompt plus its token budget does not fit the engine's context."""


def sample_index(group: int, member: int, n: int) -> int:
    """The index of member ``member`` of group ``group`` (``n`` samples per group): samples
    of one group are ``n`` consecutive indices, group g holding g·n … g·n + n - 1. The one
    place this encoding lives (the session draws by it, the scheduler checks it, the ranks'
    union renames by it)."""
    return group * n + member


def group_member(index: int, n: int) -> tuple[int | None, int]:
    """(group, member) of sample ``index``; group None with ``n`` = 1 (a group of its own)."""
    return (index // n if n > 1 else None), index % n


class Status(str, enum.Enum):
    """Where a sample is in its life (``Sample.status``): made and not yet sent (waiting), its
    request in the engine or its environment answering (running), its request kept paused
    in the engine across a step boundary (parked, ``engine.live``), ended by a stop token,
    its budget or its environment (finished: to score and train, now or in a later batch),
    or cut at a step's end with its partial kept for a later step (deferred). Checkpoints
    store the value (a plain string)."""

    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    FINISHED = "finished"
    DEFERRED = "deferred"


ENDED = ("stop", "length")  # the engine's finish reasons of a finished request


@dataclasses.dataclass
class Sample:
    """One response to a prompt, from the prompt to the trained batch: the prompt (ids and
    source record), its group (the samples of one prompt), its budget, everything generated
    so far (tokens, sampling logprobs, the weight version of every token), its status and its
    score. Plain JSON-safe fields (`state` / `from_state`): checkpoints carry deferred
    samples as they are."""

    index: int  # unique over a run, increasing in launch order
    prompt_ids: list[int]
    max_new_tokens: int  # the response's token budget
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # sampling logprobs
    versions: list[int] = dataclasses.field(default_factory=list)  # weight version per token
    finish_reason: str | None = None  # the engine's, of its last request: stop | length | abort | None (not started)
    status: Status = Status.WAITING
    attempts: int = 0
    group: int | None = None  # samples of one prompt share it; None: a group of its own
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # the prompt's source record (rule rewards)
    score: float | None = None  # reward (model + functions) once scored
    reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)  # score's terms: model, env, each function
    cached_tokens: int = 0  # prompt tokens the engine served from its radix cache (first attempt)
    # multi-turn trajectories (empty/False/0 for a single response):
    loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1 model token, 0 environment token; [] all model
    observations: list[dict[str, str]] = dataclasses.field(default_factory=list)  # the environment's answers: {role, content}
    awaiting_env: bool = False  # the model's last turn ended and the environment has not answered it yet
    env_reward: float = 0.0  # the environment's rewards so far, summed
    turn_cached_tokens: int = 0  # context tokens later turns' requests found in the radix cache

    def __post_init__(self) -> None:
        self.status = Status(self.status)  # a stored value back to its member

    def state(self) -> dict[str, Any]:
        """The sample as plain JSON/torch-safe values (the status as its string)."""
        return {**dataclasses.asdict(self), "status": self.status.value}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Sample:
        """A sample from `state` (`state()`'s values, the status included)."""
        return cls(**state)

    def settle(self) -> None:
        """Its status once its stream ended, from the engine's finish reason: finished on
        stop or length, else deferred (cut by the step; its partial waits for a later one)."""
        self.status = Status.FINISHED if self.finish_reason in ENDED else Status.DEFERRED

    @property
    def group_id(self) -> int:
        return self.index if self.group is None else self.group

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def mask(self) -> list[int]:
        """1 on each output token the model sampled, 0 on the environment's tokens."""
        return self.loss_mask or [1] * len(self.output_ids)

    @property
    def turns(self) -> int:
        """The model's turns so far (runs of model tokens)."""
        m = self.mask()
        return sum(1 for i, x in enumerate(m) if x and (i == 0 or not m[i - 1]))

    @property
    def turn_tokens(self) -> int:
        """Tokens of the model's current turn (after the last environment token)."""
        m = self.mask()
        return len(m) - (max((i for i, x in enumerate(m) if not x), default=-1) + 1)

    def append_observation(self, ids: Sequence[int], message: dict[str, str], version: int) -> None:
        """The environment's answer: its tokens join the context, out of the loss (logprob
        0.0, the version of the model token before them)."""
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.output_ids)
        self.output_ids += list(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else version] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.observations.append(dict(message))

    def rid(self, tag: str) -> str:
        """Fixed-width id: SGLang's abort matches by prefix, so no id may prefix another."""
        return f"{tag}-{self.index:08d}-{self.attempts:04d}"


def check_budget(samples: Sequence[Sample], context_length: int, field: str = "prompts") -> None:
    """Refuse a sample whose prompt + budget cannot fit ``context_length``."""
    for s in samples:
        need = len(s.prompt_ids) + s.max_new_tokens
        if need > context_length:
            raise PromptTooLongError(
                f"{field}[{s.index}]: {len(s.prompt_ids)} prompt tokens + max_new_tokens "
                f"{s.max_new_tokens} = {need} > the actor's context length {context_length}; "
                "shorten the prompt (data.max_prompt_tokens) or lower max_new_tokens"
            )


def _version(raw: Any, default: int) -> int:
    return int(raw) if isinstance(raw, str) and raw.isdigit() else default


def token_versions(meta: dict[str, Any], start: int, n: int, default: int) -> list[int]:
    """The weight version of this request's output tokens ``start .. start+n-1``: from
    SGLang's per-request version spans (exact when weights changed while the request ran,
    an in-flight update), else ``default``, the engine's version (no update happened while
    the request had tokens). Not ``meta_info["weight_version"]``: SGLang keeps that in a
    process-wide setting, which another actor engine of the process may have moved."""
    spans = meta.get("weight_versions") or []
    if not spans:
        return [default] * n
    out = []
    for pos in range(start, start + n):
        hit = next((sp for sp in spans if sp["start"] <= pos < sp["end"]), spans[-1])
        out.append(_version(hit["version"], default))
    return out


async def stream_sample(
    engine: SglangEngine,
    sample: Sample,
    sampling: dict[str, Any],
    tag: str,
    on_tokens: OnTokens | None = None,
    timeline: Timeline | None = None,
    turns: MultiTurn | None = None,
    go_on: Callable[[], Awaitable[bool]] | None = None,
) -> Sample:
    """Generate the rest of ``sample`` (at most ``sample.remaining`` tokens), appending
    tokens, logprobs and versions as chunks arrive. Ends on stop, length or abort.

    With ``turns``, the rest of the trajectory: after each model turn (a stop token, or
    ``turns.turn_tokens`` tokens) the environment answers (``turns.answer``) and the model
    goes on, until the environment is done, ``turns.max_turns``, the budget, or an abort.
    A sample deferred while its environment had not answered (``awaiting_env``) asks it
    first. ``go_on()``: awaited after each answer, before the next turn's request (when no
    request is in flight for an abort to reach): False ends the trajectory there as
    ``abort`` (the step cut it); it may also wait (a trajectory parked between steps).
    The sample is running meanwhile, and at the end finished (stop or length) or deferred
    (cut: its partial waits for a later step)."""
    sample.status = Status.RUNNING
    while True:
        if turns is not None and sample.awaiting_env:
            if not await _answer(engine, sample, turns, on_tokens, timeline):
                break
            if go_on is not None and not await go_on():
                sample.finish_reason = "abort"
                break
        if sample.remaining <= 0:
            sample.finish_reason = "length"
            break
        await _request(engine, sample, sampling, tag, on_tokens, timeline, turns)
        if turns is None or not _turn_ended(sample):
            break
        sample.awaiting_env = True
    sample.settle()
    mark(timeline, "end", sample.index, reason=sample.finish_reason, tokens=len(sample.output_ids))
    return sample


def _turn_ended(sample: Sample) -> bool:
    """A model turn ended and the trajectory may go on: a stop token, or the turn's own
    token cap (``length`` with budget left)."""
    return sample.finish_reason == "stop" or (sample.finish_reason == "length" and sample.remaining > 0)


async def _answer(engine: SglangEngine, sample: Sample, turns: MultiTurn, on_tokens: OnTokens | None,
                  timeline: Timeline | None) -> bool:
    """The environment's answer to the model's last turn appended; False when the
    trajectory ends there (done, the turn limit, or no room left for a model token)."""
    reply = await turns.answer(sample)
    sample.env_reward += reply.reward
    sample.awaiting_env = False
    if reply.done or sample.turns >= turns.max_turns:
        sample.finish_reason = "stop" if reply.done else "length"
        return False
    if len(reply.ids) >= sample.remaining:
        sample.finish_reason = "length"
        return False
    sample.append_observation(reply.ids, reply.message, engine.weight_version)
    sample.finish_reason = None
    mark(timeline, "observation", sample.index, tokens=len(reply.ids))
    if on_tokens is not None:  # streamed scoring covers the environment's tokens too
        maybe = on_tokens(sample, list(reply.ids))
        if maybe is not None:
            await maybe
    return True


async def _request(engine: SglangEngine, sample: Sample, sampling: dict[str, Any], tag: str,
                   on_tokens: OnTokens | None, timeline: Timeline | None, turns: MultiTurn | None) -> None:
    """One request: the model's (rest of its) turn, streamed onto ``sample``."""
    budget = sample.remaining
    if turns is not None and turns.turn_tokens > 0:
        budget = min(budget, turns.turn_tokens - sample.turn_tokens)
    params = {**sampling, "max_new_tokens": budget}
    rid = sample.rid(tag)
    sample.attempts += 1
    seen = 0
    mark(timeline, "launch", sample.index, prior=len(sample.output_ids))
    stream = engine.generate_stream(rid, sample.prompt_ids + sample.output_ids, params)
    async for chunk in stream:
        meta = chunk["meta_info"]
        if not seen:
            cached = int(meta.get("cached_tokens") or 0)
            if sample.attempts == 1:
                sample.cached_tokens = max(sample.cached_tokens, cached)
            elif sample.loss_mask:  # a later turn of a trajectory: its context so far from the cache
                sample.turn_cached_tokens += cached
        ids = list(chunk["output_ids"][seen:])  # cumulative and live: copy the new part
        lps = meta.get("output_token_logprobs") or []
        if ids:
            if not seen:
                mark(timeline, "first_token", sample.index)
            if sample.loss_mask:
                sample.loss_mask += [1] * len(ids)
            sample.output_ids += ids
            sample.logprobs += [float(lp[0]) for lp in lps[seen : seen + len(ids)]]
            sample.versions += token_versions(meta, seen, len(ids), engine.weight_version)
            seen += len(ids)
            if on_tokens is not None:
                maybe = on_tokens(sample, ids)
                if maybe is not None:
                    await maybe
        reason = meta.get("finish_reason")
        if reason:
            sample.finish_reason = reason["type"] if isinstance(reason, dict) else str(reason)


async def prefill_shared_prompts(engine: SglangEngine, samples: Sequence[Sample], tag: str) -> int:
    """Prefill once the prompt of every group with two or more fresh members (no token
    yet), so that the members' requests find it in the radix cache instead of each
    prefilling it (SGLang does the same for its own parallel sampling). Returns the groups."""
    fresh: dict[int, Sample] = {}
    counts: dict[int, int] = {}
    for s in samples:
        if not s.output_ids and s.group is not None:
            fresh.setdefault(s.group, s)
            counts[s.group] = counts.get(s.group, 0) + 1
    shared = [s for g, s in fresh.items() if counts[g] > 1]

    async def prefill(s: Sample) -> None:
        async for _ in engine.generate_stream(f"{tag}-pf{s.group:08d}", list(s.prompt_ids), {"max_new_tokens": 0}):
            pass

    await asyncio.gather(*(prefill(s) for s in shared))
    return len(shared)


async def generate(
    engine: SglangEngine,
    samples: Sequence[Sample],
    sampling: dict[str, Any],
    tag: str,
    on_tokens: OnTokens | None = None,
    timeline: Timeline | None = None,
    turns: MultiTurn | None = None,
) -> list[Sample]:
    """Stream every sample (every trajectory, with ``turns``) concurrently (a shared
    prompt prefilled once first); return them when all have ended."""
    check_budget(samples, engine.context_length)
    await prefill_shared_prompts(engine, samples, tag)
    await asyncio.gather(*(stream_sample(engine, s, sampling, tag, on_tokens, timeline, turns) for s in samples))
    return list(samples)


def abort(engine: SglangEngine, sample: Sample, tag: str) -> None:
    """Abort the in-flight request of ``sample``; its stream returns the partial."""
    engine.abort(f"{tag}-{sample.index:08d}-{sample.attempts - 1:04d}")
