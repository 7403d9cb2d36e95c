"""Scores from the reward model: one request, a growing sequence, and streamed through the feeder.

Owns, on the reward engine: scoring a finished sequence (:func:`score`, :func:`score_many`)
and :class:`IncrementalScorer`, which scores a sequence that grows chunk by chunk (prompt,
prompt+chunk1, ...). Each call sends the whole prefix; the reward engine's radix cache holds
the earlier prefix, so only the new chunk is prefilled. This is exact only for a causal
reward model, which ``engine.start_checks.check_model`` enforces. A request the reward
engine refuses or fails (SGLang raises a ``ValueError`` for an input longer than the
model's context) becomes one :class:`RewardRequestError` line naming the request and the
cause. :func:`max_score_tokens` is the longest sequence SGLang scores.

Owns, on the actor's side of streamed scoring (OPPO's intra-step overlap, the feeder
scoring with :class:`IncrementalScorer` beside or away from the actor): :class:`ScoreClient`,
which pushes token chunks to the reward feeder and collects the final score of each response
— raising the feeder's one-line error for a request it could not score, and failing a score
that does not come (:class:`ScoreTimeoutError`) or a feeder that stopped answering
(:class:`FeederLostError`) — and reports the frames both ends of the channel refused or lost
(:meth:`ScoreClient.channel_counts`); :class:`Chunker`, which cuts one sample's stream into
chunks of ``k`` tokens, and :func:`score_whole`, which scores already complete responses
through the same feeder.

Leaves out: the feeder (``engine.reward_feeder``) and the channel (``engine.channel``), which
samples run and when chunks are sent (``colocate.rollout.schedule``), reward shaping.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Sequence

from .channel import AsyncReceiver, AsyncSender, validate_endpoint
from .errors import EngineError, RewardRequestError
from .runtime import SglangEngine
from .wire import Heartbeat, ScoreError, ScoreResult, TokenChunk

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



class FeederLostError(EngineError):
    """The reward feeder stopped answering."""


class ScoreTimeoutError(RewardRequestError):
    """An awaited score did not come while the feeder, alive, made no scoring progress."""


class ScoreClient:
    """Sends chunks, resolves one future per (step, index) when its final score arrives."""

    def __init__(self, chunks_endpoint: str, results_endpoint: str, timeout_s: float = 30.0):
        self.chunks_endpoint = validate_endpoint(chunks_endpoint, "the reward channel's chunk endpoint")
        self.results_endpoint = validate_endpoint(results_endpoint, "the reward channel's result endpoint")
        self.timeout_s = timeout_s
        self._futures: dict[tuple[int, int], asyncio.Future] = {}
        self.last_heard = time.monotonic()
        self.last_progress = time.monotonic()  # the feeder's last score, error or scored chunk
        self.feeder_counts: dict[str, int] = {}  # running totals of its latest heartbeat
        self.chunks_sent = 0
        self.errors = 0  # requests the feeder answered with an error

    async def __aenter__(self) -> "ScoreClient":
        self._rx = AsyncReceiver(self.results_endpoint, bind=True)
        self._tx = AsyncSender(self.chunks_endpoint, bind=False)
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        self._tx.close()
        self._rx.close()

    async def _read(self) -> None:
        while True:
            msg = await self._rx.recv(timeout_s=0.1)
            if msg is None:
                continue
            self.last_heard = time.monotonic()
            if isinstance(msg, Heartbeat):
                if msg.counts.get("chunks_scored") != self.feeder_counts.get("chunks_scored"):
                    self.last_progress = self.last_heard
                self.feeder_counts = dict(msg.counts)
                continue
            if not isinstance(msg, (ScoreResult, ScoreError)):
                continue
            self.last_progress = self.last_heard
            fut = self._futures.get((msg.step, msg.index))
            if fut is None or fut.done():
                continue
            if isinstance(msg, ScoreError):
                self.errors += 1
                fut.set_exception(RewardRequestError(msg.error, fix=msg.fix))
            elif msg.final:
                fut.set_result(msg.score)

    def expect(self, step: int, index: int) -> asyncio.Future:
        key = (step, index)
        if key not in self._futures:
            self._futures[key] = asyncio.get_running_loop().create_future()
        return self._futures[key]

    async def send(self, chunk: TokenChunk) -> None:
        self.check_alive()
        await self._tx.send(chunk, timeout_s=self.timeout_s)
        self.chunks_sent += 1

    def check_alive(self) -> None:
        silent = time.monotonic() - self.last_heard
        if silent > self.timeout_s:
            raise FeederLostError(
                f"the reward feeder stopped answering ({silent:.0f} s without a message on "
                f"{self.results_endpoint}); is its process alive?", fix="feeder_timeout")

    def _check_progress(self, step: int, index: int, since: float) -> None:
        idle = time.monotonic() - max(since, self.last_progress)
        if idle > self.timeout_s:
            raise ScoreTimeoutError(
                f"reward request (step {step}, sample {index}): no score {idle:.0f} s after its "
                f"last chunk, and the feeder scored nothing else meanwhile; a lost chunk or a "
                f"stuck reward engine", fix="feeder_slow")

    async def score(self, step: int, index: int) -> float:
        """Wait for the final score of (step, index). Raises the feeder's error for it
        (:class:`RewardRequestError`), or fails when the feeder goes silent or, alive,
        scores nothing for ``timeout_s`` while this score is awaited."""
        fut = self.expect(step, index)
        since = time.monotonic()
        try:
            while True:
                self.check_alive()
                self._check_progress(step, index, since)
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), timeout=0.25)
                except asyncio.TimeoutError:
                    continue
        finally:
            self.forget(step, index)

    def channel_counts(self) -> dict[str, int]:
        """Running totals of frames refused or lost on both ends of the channel: the results
        this client received (``results_*``) and the chunks the feeder received, as of its
        latest heartbeat (``chunks_*``, plus ``chunks_discarded``: repeats and late chunks)."""
        stats = self._rx.stats
        feeder = {k: self.feeder_counts.get(k, 0) for k in ("chunks_malformed", "chunks_disconnects",
                                                            "chunks_discarded")}
        return {"results_malformed": stats.malformed, "results_disconnects": stats.disconnects, **feeder}

    def waiting(self) -> int:
        """Responses expected and not yet collected (a step's in flight; none between steps)."""
        return len(self._futures)

    def forget(self, step: int, index: int) -> None:
        fut = self._futures.pop((step, index), None)
        if fut is not None and fut.done() and not fut.cancelled():
            fut.exception()  # an error for a request no one awaits any more (aborted): seen


class Chunker:
    """Cuts the tokens one response produces in one step into chunks of ``k`` tokens: the
    response ``index`` of ``step``, whose tokens so far (its prompt, and a resumed response's
    earlier tokens) are ``prefix``."""

    def __init__(self, client: ScoreClient, step: int, index: int, prefix: Sequence[int], k: int):
        self.client, self.step, self.index, self.k = client, step, index, k
        self.prefix = list(prefix)
        self.buffer: list[int] = []
        self.seq = 0

    async def _flush(self, final: bool) -> None:
        chunk = TokenChunk(step=self.step, index=self.index, seq=self.seq,
                           prompt_ids=self.prefix if self.seq == 0 else None,
                           tokens=self.buffer, final=final)
        self.buffer = []
        self.seq += 1
        await self.client.send(chunk)

    async def on_tokens(self, _response: object, new_ids: list[int]) -> None:
        self.buffer += new_ids
        if len(self.buffer) >= self.k:
            await self._flush(final=False)

    async def finish(self) -> None:
        """The sample ended (stop or length): send the rest and mark it final."""
        await self._flush(final=True)


async def score_whole(client: ScoreClient, step: int, seqs: Sequence[tuple[Sequence[int], Sequence[int]]],
                      indices: Sequence[int] | None = None) -> list[float]:
    """Final scores of complete (prompt ids, response ids) pairs, each sent as one final
    chunk under ``step`` (a step id no streamed training step uses: the feeder drops the
    state of every other step when it sees it, and the next training step drops this
    one's) and its entry of ``indices`` (distinct; default: its position)."""
    ids = list(indices) if indices is not None else list(range(len(seqs)))
    for i in ids:
        client.expect(step, i)
    try:
        for i, (prompt, response) in zip(ids, seqs):
            await client.send(TokenChunk(step=step, index=i, seq=0, prompt_ids=list(prompt),
                                         tokens=list(response), final=True))
        return list(await asyncio.gather(*(client.score(step, i) for i in ids)))
    finally:
        for i in ids:
            client.forget(step, i)
