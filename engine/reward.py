"""Reward scoring on the reward engine, one-shot and incremental.

Owns: scoring a finished sequence, and :class:`IncrementalScorer`, which scores a
sequence that grows chunk by chunk (prompt, prompt+chunk1, ...). Each call sends the
whole prefix; the reward engine's radix cache holds the earlier prefix, so only the new
chunk is prefilled. This is exact only for a causal reward model, which
``engine.runtime.check_model`` enforces.

Leaves out: when chunks are sent (the ZeroMQ feeder), reward shaping (``trainer``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

from .runtime import SglangEngine


def _to_score(out: dict) -> float:
    emb = out["embedding"]
    return float(emb[0] if isinstance(emb, (list, tuple)) else emb)


async def score(engine: SglangEngine, input_ids: list[int], rid: str) -> float:
    """Score of the whole sequence (the reward head at its last token)."""
    return _to_score(await engine.score(rid, list(input_ids)))


async def score_many(engine: SglangEngine, seqs: Sequence[list[int]], tag: str) -> list[float]:
    """Scores of several sequences, requested concurrently."""
    return list(
        await asyncio.gather(*(score(engine, s, f"{tag}-{i:08d}") for i, s in enumerate(seqs)))
    )


@dataclasses.dataclass
class IncrementalScorer:
    """Scores one growing sequence; each :meth:`extend` prefills only the new tokens."""

    engine: SglangEngine
    rid_prefix: str
    tokens: list[int]
    calls: int = 0
    last_score: float | None = None

    async def extend(self, new_tokens: Sequence[int]) -> float:
        """Append ``new_tokens`` and return the score of the sequence so far."""
        self.tokens = self.tokens + list(new_tokens)
        rid = f"{self.rid_prefix}-{self.calls:06d}"
        self.calls += 1
        self.last_score = await score(self.engine, self.tokens, rid)
        return self.last_score
