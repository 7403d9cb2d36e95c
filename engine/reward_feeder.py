"""The reward feeder: the far side of the ZeroMQ channel of streamed reward scoring.

Owns: :class:`RewardFeeder`, which pulls :class:`~engine.wire.TokenChunk` messages, puts
each request's chunks back in order, scores every request incrementally on the reward
engine (each chunk prefills only its own tokens, the radix cache holds the rest) and pushes
a final :class:`~engine.wire.ScoreResult` per finished response — or, the first time a
request fails on the reward engine, one :class:`~engine.wire.ScoreError` carrying the
one-line error (the request's later chunks are then skipped) — plus heartbeats so the
sender can tell a live feeder from a dead one; each heartbeat carries the feeder's counts
(frames its receiver refused or lost, chunks discarded or scored, requests failed). It runs
as an asyncio task beside the engines (default) or alone in its own process with its own
reward engine:

    python -m colocate.engine.reward_feeder --model RM_DIR --chunks ipc:///tmp/c --results ipc:///tmp/r

Started by a run, it is given the run's pid (``--parent-pid``) and ends, with its engine's
processes, when that process is gone (``engine.parent_watch``).

Leaves out: when chunks are cut (``engine.reward.Chunker``) and reward shaping.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

from . import reward as rm
from .channel import AsyncReceiver, AsyncSender, ChannelStats, validate_endpoint
from .errors import RewardRequestError
from .parent_watch import watch_parent
from .wire import Heartbeat, Reorderer, ScoreError, ScoreResult, Shutdown, TokenChunk


class RewardFeeder:
    """Scores streamed responses; one in-order scoring chain per request."""

    def __init__(self, engine, chunks_endpoint: str, results_endpoint: str, heartbeat_s: float = 0.5):
        self.engine = engine
        self.chunks_endpoint = validate_endpoint(chunks_endpoint, "the reward channel's chunk endpoint")
        self.results_endpoint = validate_endpoint(results_endpoint, "the reward channel's result endpoint")
        self.heartbeat_s = heartbeat_s
        self._reorder = Reorderer()
        self._scorers: dict[tuple[int, int], rm.IncrementalScorer] = {}
        self._tails: dict[tuple[int, int], asyncio.Future] = {}
        self._prompt_len: dict[tuple[int, int], int] = {}
        self._failed: set[tuple[int, int]] = set()  # requests whose ScoreError was sent
        self._step: int | None = None  # step of the latest chunk
        self._drained: int | None = None  # the step `drain` closed: its late chunks are dropped
        self.rx_stats = ChannelStats()  # the chunk receiver's (the live one while running)
        self.chunks_seen = 0
        self.chunks_scored = 0
        self.forgotten = 0  # requests dropped unfinished (aborted by the step's cut)
        self.scored = 0
        self.failed = 0  # requests whose scoring failed (each answered with a ScoreError)
        self.dropped_after_drain = 0  # chunks of a drained step, never scored

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until ``stop`` is set or a Shutdown message arrives."""
        stop = stop or asyncio.Event()
        async with AsyncReceiver(self.chunks_endpoint, bind=True) as rx, \
                AsyncSender(self.results_endpoint, bind=False) as tx:
            self.rx_stats = rx.stats
            beat = asyncio.ensure_future(self._heartbeats(tx, stop))
            try:
                while not stop.is_set():
                    msg = await rx.recv(timeout_s=0.05)
                    if isinstance(msg, Shutdown):
                        break
                    if isinstance(msg, TokenChunk):
                        self.take(msg, tx)
                pending = [t for t in self._tails.values() if not t.done()]
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
            finally:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat

    def take(self, msg: TokenChunk, tx: AsyncSender) -> None:
        """One chunk off the channel: dropped when its step was drained, else scored in
        order after the request's earlier chunks."""
        self.chunks_seen += 1
        if msg.step == self._drained:
            self.dropped_after_drain += 1
            return
        if msg.step != self._step:  # a new step: the last one's leftovers are dead
            self._forget_other_steps(msg.step)
            self._step, self._drained = msg.step, None
        for chunk in self._reorder.push(msg):
            self._schedule(chunk, tx)

    async def drain(self) -> int:
        """Stop scoring before the reward engine releases its memory; returns the scoring
        requests waited for. The step's cut leaves chunks of aborted requests queued or
        still on the way; scored after this, one would reach the scheduler between the
        deferred flush and the release (SGLang asserts it is idle and the scheduler dies)
        or while its KV is released (an illegal memory access). So: close the current step
        (its queued chunks skip, later ones are dropped), wait for the requests already
        sent to the reward engine to come back (cancelled, SGLang would still run them),
        and forget every open request. The next step's first chunk opens scoring again."""
        self._drained, self._step = self._step, None  # each chain's queued chunks now see their request forgotten
        pending = [t for t in self._tails.values() if not t.done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self._forget_other_steps(None)
        return len(pending)

    def _forget_other_steps(self, step: int | None) -> None:
        """Drop the state of every request of another step. A step's client awaits the
        scores of all its finished requests before the next step sends anything, and one
        ZeroMQ socket keeps the sender's order, so what is left of other steps are requests
        the step's cut aborted: their final chunk never comes."""
        self._reorder.forget_other_steps(step)
        for key in [k for k in self._scorers.keys() | self._tails.keys() if k[0] != step]:
            tail = self._tails.pop(key, None)
            if tail is not None and not tail.done():
                tail.cancel()
            self._scorers.pop(key, None)
            self._prompt_len.pop(key, None)
            self.forgotten += 1
        self._failed = {k for k in self._failed if k[0] == step}

    def open_requests(self) -> int:
        """Requests the feeder holds scoring state for (bounded by one step's B+Δ)."""
        return len(self._scorers.keys() | self._tails.keys()) + self._reorder.tracked()

    def counts(self) -> dict[str, int]:
        """Running totals a heartbeat carries: frames the chunk receiver refused
        (``chunks_malformed``) or lost with a dropped connection (``chunks_disconnects``),
        repeated or late chunks dropped (``chunks_discarded``), chunks scored, requests failed."""
        return {"chunks_malformed": self.rx_stats.malformed, "chunks_disconnects": self.rx_stats.disconnects,
                "chunks_discarded": self._reorder.discarded, "chunks_scored": self.chunks_scored,
                "requests_failed": self.failed}

    async def _heartbeats(self, tx: AsyncSender, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await tx.send(Heartbeat(sender="reward-feeder", sent_at=time.time(), counts=self.counts()))
            await asyncio.sleep(self.heartbeat_s)

    def _schedule(self, chunk: TokenChunk, tx: AsyncSender) -> None:
        key = (chunk.step, chunk.index)
        prev = self._tails.get(key)
        self._tails[key] = asyncio.ensure_future(self._score_after(prev, chunk, tx))

    async def _score_after(self, prev: asyncio.Future | None, chunk: TokenChunk, tx: AsyncSender) -> None:
        if prev is not None:
            await asyncio.shield(prev)
        key = (chunk.step, chunk.index)
        if chunk.step != self._step or key in self._failed:  # forgotten (aborted), or already failed
            return
        try:
            await self._score(chunk, tx)
        except Exception as exc:  # every failure goes back to the waiting client, as one line
            await self._fail(chunk, exc, tx)

    async def _score(self, chunk: TokenChunk, tx: AsyncSender) -> None:
        key = (chunk.step, chunk.index)
        if chunk.seq == 0:
            self._scorers[key] = rm.IncrementalScorer(
                self.engine, f"fd{chunk.step:07d}-{chunk.index:08d}", list(chunk.prompt_ids),
                request=_name(chunk))
            self._prompt_len[key] = len(chunk.prompt_ids)
        scorer = self._scorers[key]
        score = await scorer.extend(chunk.tokens)
        self.chunks_scored += 1
        if chunk.final:
            self.scored += 1
            scored = len(scorer.tokens) - self._prompt_len.pop(key)
            await tx.send(ScoreResult(step=chunk.step, index=chunk.index, seq=chunk.seq,
                                      score=score, tokens_scored=scored, final=True))
            del self._scorers[key]
            self._tails.pop(key, None)

    async def _fail(self, chunk: TokenChunk, exc: Exception, tx: AsyncSender) -> None:
        """Answer the request with its one-line error now (no score will come) and drop it."""
        key = (chunk.step, chunk.index)
        self._failed.add(key)
        self.failed += 1
        self._scorers.pop(key, None)
        self._prompt_len.pop(key, None)
        self._tails.pop(key, None)  # later chunks of the request see it failed and skip
        error = exc if isinstance(exc, RewardRequestError) else rm.request_error(_name(chunk), rm.describe(exc))
        await tx.send(ScoreError(step=chunk.step, index=chunk.index, seq=chunk.seq, error=str(error)[:2000],
                                  fix=error.fix))


def _name(chunk: TokenChunk) -> str:
    return f"(step {chunk.step}, sample {chunk.index})"


def main() -> None:
    """Run a feeder with its own reward engine in this process."""
    ap = argparse.ArgumentParser(description="colocate reward feeder (streamed reward scoring)")
    ap.add_argument("--model", required=True, help="causal reward model folder")
    ap.add_argument("--chunks", required=True, help="endpoint to bind for token chunks")
    ap.add_argument("--results", required=True, help="endpoint to connect for score results")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--trust-remote-code", action="store_true", help="run code the model folder ships")
    ap.add_argument("--engine-json", default=None,
                    help="every EngineConfig field as JSON (how colocate starts it); the flags above then only name the model")
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="end (with this process's engine) once this process, the one that started it, is gone")
    args = ap.parse_args()
    if args.parent_pid is not None:
        watch_parent(args.parent_pid)  # before the engine starts: a kill -9 of the run leaves no orphan
    from .engine_config import EngineConfig
    from .runtime import SglangEngine

    if args.engine_json:
        fields = {**json.loads(args.engine_json), "model_path": args.model, "role": "reward"}
        config = EngineConfig(**fields)
    else:
        config = EngineConfig(args.model, role="reward", max_total_tokens=args.max_total_tokens,
                              trust_remote_code=args.trust_remote_code)
    engine = SglangEngine(config, field="--model")
    try:
        feeder = RewardFeeder(engine, args.chunks, args.results)
        engine.loop.run_until_complete(feeder.run())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
