"""Streaming rollout on the actor engine: submit, stream, abort, resume.

Owns: :class:`Sample` (one prompt's generation state in plain Python: tokens, sampling
logprobs and the weight version of every token), request ids that SGLang's prefix-matching
abort cannot confuse, streaming one sample while calling back with each new chunk, and
resuming a partial sample with exactly its remaining token budget.

Leaves out: which samples to launch or defer (the scheduler), scoring (``engine.reward``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable, Sequence

from .errors import EngineError
from .runtime import SglangEngine
from .timeline import Timeline, mark

OnTokens = Callable[["Sample", list[int]], Awaitable[None] | None]


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


@dataclasses.dataclass
class Sample:
    """One response to a prompt, from the prompt to the trained batch: the prompt (ids and
    source record), its group (the samples of one prompt), its budget, everything generated
    so far (tokens, sampling logprobs, the weight version of every token) and its score.
    Plain JSON-safe fields: checkpoints carry deferred samples as they are."""

    index: int  # unique over a run, increasing in launch order
    prompt_ids: list[int]
    max_new_tokens: int  # the response's token budget
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # sampling logprobs
    versions: list[int] = dataclasses.field(default_factory=list)  # weight version per token
    finish_reason: str | None = None  # stop | length | abort | None (not started)
    attempts: int = 0
    group: int | None = None  # samples of one prompt share it; None: a group of its own
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # the prompt's source record (rule rewards)
    score: float | None = None  # reward (model + functions) once scored
    cached_tokens: int = 0  # prompt tokens the engine served from its radix cache (first attempt)

    @property
    def group_id(self) -> int:
        return self.index if self.group is None else self.group

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason in ("stop", "length")

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
) -> Sample:
    """Generate the rest of ``sample`` (at most ``sample.remaining`` tokens), appending
    tokens, logprobs and versions as chunks arrive. Ends on stop, length or abort."""
    if sample.remaining <= 0:
        sample.finish_reason = "length"
        return sample
    params = {**sampling, "max_new_tokens": sample.remaining}
    rid = sample.rid(tag)
    sample.attempts += 1
    seen = 0
    mark(timeline, "launch", sample.index, prior=len(sample.output_ids))
    stream = engine.generate_stream(rid, sample.prompt_ids + sample.output_ids, params)
    async for chunk in stream:
        meta = chunk["meta_info"]
        if sample.attempts == 1 and not seen:
            sample.cached_tokens = max(sample.cached_tokens, int(meta.get("cached_tokens") or 0))
        ids = list(chunk["output_ids"][seen:])  # cumulative and live: copy the new part
        lps = meta.get("output_token_logprobs") or []
        if ids:
            if not seen:
                mark(timeline, "first_token", sample.index)
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
    mark(timeline, "end", sample.index, reason=sample.finish_reason, tokens=len(sample.output_ids))
    return sample


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
) -> list[Sample]:
    """Stream every sample concurrently (a shared prompt prefilled once first); return
    them when all have ended."""
    check_budget(samples, engine.context_length)
    await prefill_shared_prompts(engine, samples, tag)
    await asyncio.gather(*(stream_sample(engine, s, sampling, tag, on_tokens, timeline) for s in samples))
    return list(samples)


def abort(engine: SglangEngine, sample: Sample, tag: str) -> None:
    """Abort the in-flight request of ``sample``; its stream returns the partial."""
    engine.abort(f"{tag}-{sample.index:08d}-{sample.attempts - 1:04d}")
