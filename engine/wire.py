"""Wire messages of the reward channel, and putting each request's chunks back in order.

Owns: the msgspec Structs that cross the ZeroMQ boundary (one tagged union, so one socket
carries every type; shapes and bounds checked at decode), and :class:`Reorderer`, which
releases each request's token chunks contiguously by ``seq``, so a scorer never sees a gap
or a repeat.

Leaves out: sockets and encoding limits (``engine.channel``), scoring (``engine.reward``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

_NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class TokenChunk(msgspec.Struct, frozen=True, tag="chunk"):
    """Tokens ``seq`` of response ``index`` in ``step``; the prompt rides on seq 0 only."""

    step: _NonNeg
    index: _NonNeg
    seq: _NonNeg
    prompt_ids: list[_NonNeg] | None
    tokens: list[_NonNeg]
    final: bool

    def __post_init__(self) -> None:
        if (self.seq == 0) != (self.prompt_ids is not None):
            raise ValueError("prompt_ids must be sent with seq 0 and only with seq 0")


class ScoreResult(msgspec.Struct, frozen=True, tag="score"):
    """Score of the response prefix made of the first ``tokens_scored`` tokens."""

    step: _NonNeg
    index: _NonNeg
    seq: _NonNeg
    score: float
    tokens_scored: _NonNeg
    final: bool = False


class ScoreError(msgspec.Struct, frozen=True, tag="score-error"):
    """Scoring response ``index`` in ``step`` failed at chunk ``seq``; no score will come.
    ``error`` is the one-line message the receiving side raises, ``fix`` its ``EngineError.fix``."""

    step: _NonNeg
    index: _NonNeg
    seq: _NonNeg
    error: Annotated[str, msgspec.Meta(max_length=2000)]
    fix: Annotated[str, msgspec.Meta(max_length=40)] = ""  # the error's EngineError.fix


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """I am alive; ``counts``: the sender's running totals (e.g. frames its receiver
    refused, chunks it scored), so a peer in another process can report them."""

    sender: str
    sent_at: float
    counts: dict[str, _NonNeg] = {}


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    reason: str = ""


Message = TokenChunk | ScoreResult | ScoreError | Heartbeat | Shutdown
MESSAGE_TYPES = (TokenChunk, ScoreResult, ScoreError, Heartbeat, Shutdown)



class Reorderer:
    """Releases the chunks of each request ``(step, index)`` in ``seq`` order, holding back
    any that arrive early. Repeats, and chunks past a request's final one, are dropped
    and counted in ``discarded``."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, int], int] = {}
        self._held: dict[tuple[int, int], dict[int, TokenChunk]] = {}
        self._closed: set[tuple[int, int]] = set()
        self.discarded = 0

    def push(self, chunk: TokenChunk) -> list[TokenChunk]:
        """Add ``chunk``; return the chunks now deliverable, in order (maybe none)."""
        key = (chunk.step, chunk.index)
        nxt, held = self._next.get(key, 0), self._held.get(key, {})
        if key in self._closed or chunk.seq < nxt or chunk.seq in held:
            self.discarded += 1
            return []
        held[chunk.seq] = chunk
        self._held[key] = held
        out = []
        while nxt in held:
            out.append(held.pop(nxt))
            nxt += 1
            if out[-1].final:
                self.discarded += len(held)
                self._closed.add(key)
                del self._held[key]
                self._next.pop(key, None)
                return out
        self._next[key] = nxt
        return out

    def pending(self) -> dict[tuple[int, int], int]:
        """Open requests with chunks held back, each with the ``seq`` it is waiting for."""
        return {k: self._next.get(k, 0) for k, held in self._held.items() if held}

    def forget_other_steps(self, step: int) -> int:
        """Drop all state of requests of steps other than ``step``; returns how many were
        still open (aborted requests: their missing chunks will never be delivered)."""
        open_keys = {k for k in set(self._held) | set(self._next) if k[0] != step}
        for k in open_keys:
            self._held.pop(k, None)
            self._next.pop(k, None)
        self._closed = {k for k in self._closed if k[0] == step}
        return len(open_keys)

    def tracked(self) -> int:
        """Requests this reorderer holds any state for (open or closed)."""
        return len(set(self._held) | set(self._next) | self._closed)
