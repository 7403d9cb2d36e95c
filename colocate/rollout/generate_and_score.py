"""What the schedule does to each sample: generate it on the actor engine, then score it.

The two halves of one sample's rollout (slime's ``generate`` and ``generate_and_rm`` side by
side); which samples run, when, and what becomes of them is the schedule's
(``colocate.rollout.schedule``).

Generating (uses of ``colocate.engine.runtime.SglangEngine``: ``generate_stream``,
``abort``, ``weight_version``, ``context_length``): a rollout's sampling parameters
(:func:`sampling_params`), streaming one sample while calling back with each new chunk
(tokens, sampling logprobs and each token's weight version appended to the
:class:`Sample`), resuming a partial sample with exactly its remaining token budget,
prefilling a group's shared prompt once, aborting a request, and the turn loop of a
multi-turn trajectory (:class:`MultiTurn`): after each model turn the caller's ``answer``
gives the environment's tokens, which are appended out of the loss (``Sample.loss_mask``),
and the model goes on from there — token in, token out, nothing decoded and re-encoded.

Scoring, in every mode and in the held-out evaluation, the one place where the reward is
summed and scaled: :class:`Scorer` — reward = (reward model's score + each reward
function's value on the model's text and the prompt record + the environment's rewards of
a multi-turn trajectory) × ``reward.scale``; the model's text is the response, or a
trajectory's model turns only (:func:`model_text`). The model's score comes from wherever
the step got it: streamed chunk by chunk through the feeder (then handed in), one-shot
from the inline reward engine, or — when the reward model lives in the feeder's own
process (``overlap.feeder=process``) — one-shot through the feeder
(:func:`engine.reward.score_whole`).

Leaves out: which samples to launch or defer (``colocate.rollout.data_source``), the step's
schedule (``colocate.rollout.schedule``), what an environment answers and how its text
becomes tokens (``colocate.rollout.turns``), the reward functions' error policy
(``colocate.rollout.reward_fns``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from colocate.engine import reward as rm
from colocate.monitor.timeline import Timeline, mark
from colocate.rollout import reward_fns
from colocate.rollout.reward_fns import Guarded, RewardFn, fn_name
from colocate.rollout.sample import MultiTurn, OnTokens, Sample, check_budget
from colocate.rollout.turns import history

if TYPE_CHECKING:
    from colocate.engine.runtime import SglangEngine


def sampling_params(temperature: float, top_p: float, stop_ids: Sequence[int],
                    ignore_eos: bool = False) -> dict[str, Any]:
    """SGLang's sampling parameters of a rollout: stop at ``stop_ids`` unless ``ignore_eos``."""
    params = {"temperature": temperature, "top_p": top_p, "stop_token_ids": list(stop_ids)}
    if ignore_eos:
        params = {"temperature": temperature, "top_p": top_p, "ignore_eos": True}
    return params


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
    It ends finished (``finish_reason`` stop or length) or cut (abort: its partial waits
    for a later step); the sample's status is the schedule's (``colocate.rollout.schedule``)."""
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


# (step id, [(prompt ids, response ids)], [sample indices]) -> the reward model's scores
WholeScores = Callable[[int, Sequence[tuple[Sequence[int], Sequence[int]]], Sequence[int]], Awaitable[list[float]]]


def model_text(sample: Sample, decode: Callable[[list[int]], str], messages: Callable[[], list]) -> str:
    """What reward functions score: the response, or a trajectory's model turns (of
    ``messages()``, its chat messages) joined by a newline: the environment's answers left
    out (``colocate.rollout.reward_fns``)."""
    if not sample.loss_mask:
        return decode(sample.output_ids)
    return "\n".join(m["content"] for m in messages() if m["role"] == "assistant")


async def call_reward_fn(fn: RewardFn, sample: Sample, text: str, messages: Callable[[], list]) -> float:
    """``fn``'s value on ``sample``: a :class:`Guarded` function applies ``reward.on_error``
    and names the sample; a bare one (tests, the API's own wrappers) is taken as a float."""
    if isinstance(fn, Guarded):
        return await fn(sample.record, text, messages, sample.index)
    return float(await reward_fns.call(fn, sample.record, text, messages, reward_fns.wants_messages(fn)))


def _unique(taken: dict[str, float], name: str) -> str:
    """``name``, or ``name#2``, ``name#3``… when a part of that name is already there."""
    k, out = 1, name
    while out in taken:
        k += 1
        out = f"{name}#{k}"
    return out


@dataclasses.dataclass(frozen=True)
class Scorer:
    """``reward_engine``: the inline reward engine; ``whole``: the reward model behind the
    feeder's process (one of them, or neither: functions only); ``timeout_s``: the deadline
    of one reward-model request (``overlap.feeder_timeout_s``)."""

    reward_engine: Any = None
    fns: tuple[RewardFn, ...] = ()
    decode: Callable[[list[int]], str] | None = None
    scale: float = 1.0
    timeout_s: float | None = None
    whole: WholeScores | None = None

    @property
    def engines(self) -> list[Any]:
        """The engines scoring runs on in this process (watched while a step waits)."""
        return [self.reward_engine] if self.reward_engine is not None else []

    async def reward(self, sample: Sample, model_score: float) -> float:
        """The sample's reward from the model's score (0.0 without a reward model), plus a
        multi-turn trajectory's environment rewards."""
        parts = {"model": model_score, "env": sample.env_reward}
        if self.fns:
            messages = functools.cache(lambda: history(sample, self.decode))  # decoded once, if read
            text = model_text(sample, self.decode, messages)
            for fn in self.fns:
                name = fn_name(fn).rsplit(".", 1)[-1]  # "offset", not "test_x.<locals>.offset"
                parts[_unique(parts, name)] = await call_reward_fn(fn, sample, text, messages)
        sample.reward_parts = {name: value * self.scale for name, value in parts.items()}  # samples.jsonl
        return sum(parts.values()) * self.scale

    async def __call__(self, sample: Sample, streamed: float | None, tag: str, step: int) -> float:
        """A finished sample's reward (``colocate.rollout.schedule``'s scoring): its streamed model score,
        or a one-shot one; request ids start with ``tag``."""
        if streamed is None:
            [streamed] = await self.model_scores([sample], tag, step)
        return await self.reward(sample, streamed)

    async def model_scores(self, samples: Sequence[Sample], tag: str, step: int) -> list[float]:
        """One-shot reward-model scores of whole responses. A request the engine refuses, or
        does not answer within ``timeout_s``, raises one `RewardRequestError` line naming
        (step, sample)."""
        if self.reward_engine is not None:
            seqs = [s.prompt_ids + s.output_ids for s in samples]
            return await rm.score_many(self.reward_engine, seqs, tag, step=step, timeout_s=self.timeout_s,
                                       indices=[s.index for s in samples])
        if self.whole is not None:
            return await self.whole(step, [(s.prompt_ids, s.output_ids) for s in samples], [s.index for s in samples])
        return [0.0] * len(samples)

    async def score_all(self, samples: Sequence[Sample], tag: str, step: int) -> list[float]:
        """Every sample's reward (the sequential schedule: after generation ended)."""
        model = await self.model_scores(samples, tag, step)
        return list(await asyncio.gather(*(self.reward(s, m) for s, m in zip(samples, model))))
