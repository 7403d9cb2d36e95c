"""Reward scoring on the reward engine, one-shot and incremental.

Owns: scoring a finished sequence, and :class:`IncrementalScorer`, which scores a
sequence that grows chunk by chunk (prompt, prompt+chunk1, ...). Each call sends the
whole prefix; the reward engine's radix cache holds the earlier prefix, so only the new
chunk is prefilled. This is exact only for a causal reward model, which
``engine.start_checks.check_model`` enforces.

A request the reward engine refuses or fails (SGLang raises a ``ValueError`` for an input
longer than the model's context) becomes one :class:`RewardRequestError` line naming the
request and the cause. :func:`max_score_tokens` is the longest sequence SGLang scores.

Leaves out: when chunks are sent (the ZeroMQ feeder), reward shaping (``trainer``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

from .errors import EngineError, RewardRequestError
from .runtime import SglangEngine

# SGLang 0.5.23 refuses a score request of L tokens unless L < the context length (measured:
# context 40 scores 39 tokens, refuses 40 with a ValueError). One longer than the KV pool is
# never scheduled: it waits forever, so callers give it a deadline (``timeout_s``).
_SGLANG_INPUT_MARGIN = 1
_TOO_LONG = ("context length", "maximum allowed length")


def max_score_tokens(context_length: int) -> int:
    """The longest sequence (prompt + response) a reward engine of ``context_length`` scores."""
    return context_length - _SGLANG_INPUT_MARGIN


def describe(exc: BaseException) -> str:
    """``exc`` as one short line: its type and its text, whitespace folded."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def request_error(request: str, cause: str) -> RewardRequestError:
    """The one-line error of a failed reward request ``request`` (e.g. "(step 3, sample 5)")."""
    if any(m in cause for m in _TOO_LONG):
        return RewardRequestError(f"reward request {request} failed: {cause}; prompt + response is longer than "
                                  "the reward model takes", fix="reward_context")
    return RewardRequestError(f"reward request {request} failed: {cause}", fix="engine_log")


def _to_score(out: dict) -> float:
    emb = out["embedding"]
    return float(emb[0] if isinstance(emb, (list, tuple)) else emb)


async def score(engine: SglangEngine, input_ids: list[int], rid: str, *, request: str | None = None,
                timeout_s: float | None = None) -> float:
    """Score of the whole sequence (the reward head at its last token). A request the
    engine refuses or fails, or (``timeout_s``) does not answer in time (it is then
    aborted), raises :class:`RewardRequestError` naming ``request`` (or ``rid``); a
    cancelled one is aborted in the engine too (no request of a failed step stays there)."""
    try:
        return _to_score(await asyncio.wait_for(engine.score(rid, list(input_ids)), timeout_s))
    except EngineError:
        raise
    except asyncio.CancelledError:  # another request of the step failed: this one is dropped with it
        engine.abort(rid)
        raise
    except asyncio.TimeoutError:
        engine.abort(rid)
        raise RewardRequestError(
            f"reward request {request or rid}: no score within {timeout_s:g} s ({len(input_ids)} tokens); "
            "a stuck reward engine, or a sequence longer than its KV pool", fix="reward_kv_pool") from None
    except Exception as exc:  # SGLang: ValueError (a refused request) or an HTTP error
        raise request_error(request or rid, describe(exc)) from None


async def score_many(engine: SglangEngine, seqs: Sequence[list[int]], tag: str,
                     *, step: int | None = None, timeout_s: float | None = None,
                     indices: Sequence[int] | None = None) -> list[float]:
    """Scores of several sequences, requested concurrently, each within ``timeout_s``; the
    first failure cancels the rest and raises (its message names ``(step, sample i)`` when
    ``step`` is given; i: the sequence's entry of ``indices``, else its position)."""
    def name(i: int) -> str | None:
        return None if step is None else f"(step {step}, sample {i})"

    ids = list(indices) if indices is not None else list(range(len(seqs)))
    tasks = [asyncio.ensure_future(score(engine, s, f"{tag}-{i:08d}", request=name(i), timeout_s=timeout_s))
             for i, s in zip(ids, seqs)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@dataclasses.dataclass
class IncrementalScorer:
    """Scores one growing sequence; each :meth:`extend` prefills only the new tokens."""

    engine: SglangEngine
    rid_prefix: str
    tokens: list[int]
    request: str | None = None  # how errors name it, e.g. "(step 3, sample 5)"; None: by rid
    calls: int = 0
    last_score: float | None = None

    async def extend(self, new_tokens: Sequence[int]) -> float:
        """Append ``new_tokens`` and return the score of the sequence so far."""
        self.tokens = self.tokens + list(new_tokens)
        rid = f"{self.rid_prefix}-{self.calls:06d}"
        self.calls += 1
        self.last_score = await score(self.engine, self.tokens, rid, request=self.request)
        return self.last_score
