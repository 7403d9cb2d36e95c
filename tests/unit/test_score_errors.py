"""The error paths of streamed scoring without an engine: the wire's ScoreError and
heartbeat counts, the ScoreClient raising a feeder's error as one line, failing a score
that never comes, keeping a slow but progressing one, and counting refused frames; and
the start-up context check (colocate/run/preflight.py) on model folders alone."""

import asyncio
import json
import re
import time

import msgspec
import pytest
import zmq

from colocate.config import load_config
from colocate.engine.errors import EngineError, RewardRequestError
from colocate.engine.reward import ScoreClient, ScoreTimeoutError, max_score_tokens, request_error
from colocate.engine.engine_config import EngineConfig
from colocate.engine.wire import Heartbeat, Message, ScoreError, ScoreResult
from colocate.engine.channel import AsyncSender
from colocate.errors import ConfigError, in_config_terms
from colocate.run.preflight import check_contexts, model_context_length
from colocate.rollout.data_source import TokenizedPrompt


def test_score_error_and_heartbeat_counts_cross_the_wire():
    for msg in (ScoreError(step=2, index=5, seq=3, error="reward request (step 2, sample 5) failed: x"),
                Heartbeat("feeder", 1.0, counts={"chunks_malformed": 2}), Heartbeat("feeder", 1.0)):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=Message) == msg
    assert Heartbeat("old peer", 1.0).counts == {}
    with pytest.raises(msgspec.ValidationError):  # counts are never negative
        msgspec.msgpack.decode(msgspec.msgpack.encode(Heartbeat("f", 1.0, counts={"x": -1})), type=Message)


def test_request_error_is_one_line_naming_request_cause_and_fix():
    err = request_error("(step 3, sample 1)", "ValueError: The input (62 tokens) is longer than the "
                        "model's context length (40 tokens).")
    assert isinstance(err, RewardRequestError) and isinstance(err, EngineError)
    assert err.fix == "reward_context" and "rollout." not in str(err)  # the engine names no config field
    text = str(in_config_terms(err))  # colocate does
    assert "\n" not in text and "(step 3, sample 1)" in text and "62 tokens" in text
    assert "rollout.max_new_tokens" in text and isinstance(in_config_terms(err), RewardRequestError)
    assert max_score_tokens(40) == 39  # SGLang scores inputs shorter than the context


def _run_with_feeder_peer(tmp_path, body, timeout_s=10.0):
    """``await body(client, tx)``: a ScoreClient and a raw sender standing in for the feeder's
    end of the results channel (the channel, not SGLang, is what these tests exercise)."""
    results, chunks = f"ipc://{tmp_path}/r", f"ipc://{tmp_path}/c"

    async def go():
        async with ScoreClient(chunks, results, timeout_s=timeout_s) as client:
            async with AsyncSender(results) as tx:
                return await body(client, tx)

    return asyncio.run(go())


async def _until(ready, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not ready() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def test_a_feeder_error_fails_the_awaited_score_with_its_line(tmp_path):
    async def body(client, tx):
        client.expect(4, 2)
        client.expect(4, 3)
        await tx.send(ScoreError(step=4, index=2, seq=0, error="reward request (step 4, sample 2) failed: boom; fix"))
        await tx.send(ScoreError(step=4, index=3, seq=1, error="not awaited: sample 3 was aborted"))
        with pytest.raises(RewardRequestError, match=r"^reward request \(step 4, sample 2\) failed: boom; fix$"):
            await client.score(4, 2)
        await asyncio.sleep(0.3)
        client.forget(4, 3)  # an aborted request's error is dropped quietly
        return client.waiting(), client.errors

    assert _run_with_feeder_peer(tmp_path, body) == (0, 2)


def test_a_score_that_never_comes_fails_within_the_timeout(tmp_path):
    async def body(client, tx):
        async def beats():  # the feeder is alive but scores nothing
            while True:
                await tx.send(Heartbeat("f", time.time(), counts={"chunks_scored": 7}))
                await asyncio.sleep(0.05)

        beat = asyncio.ensure_future(beats())
        await _until(lambda: client.feeder_counts)  # connected
        started = time.monotonic()
        try:
            with pytest.raises(ScoreTimeoutError) as e:
                await client.score(1, 0)
        finally:
            beat.cancel()
        assert re.search(r"\(step 1, sample 0\).*overlap.feeder_timeout_s", str(in_config_terms(e.value)))
        assert "\n" not in str(e.value) and isinstance(e.value, RewardRequestError)
        return time.monotonic() - started, client.waiting()

    waited, left = _run_with_feeder_peer(tmp_path, body, timeout_s=2.0)
    assert 2.0 <= waited < 5.0 and left == 0


def test_a_slow_score_is_kept_while_the_feeder_makes_progress(tmp_path):
    async def body(client, tx):
        async def feeder():  # scores a chunk every 0.1 s for 2 s, then sends the score
            for n in range(20):
                await tx.send(Heartbeat("f", time.time(), counts={"chunks_scored": n}))
                await asyncio.sleep(0.1)
            await tx.send(ScoreResult(step=0, index=1, seq=9, score=0.5, tokens_scored=9, final=True))

        task = asyncio.ensure_future(feeder())
        got = await client.score(0, 1)
        await task
        return got

    assert _run_with_feeder_peer(tmp_path, body, timeout_s=1.0) == 0.5  # 2 s, twice the timeout


def test_channel_counts_report_both_ends(tmp_path):
    async def body(client, tx):
        ctx = zmq.Context()
        raw = ctx.socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"ipc://{tmp_path}/r")
        raw.send(b"\x01not msgpack")
        await tx.send(Heartbeat("f", 1.0, counts={"chunks_malformed": 2, "chunks_disconnects": 1,
                                                   "chunks_discarded": 3, "chunks_scored": 9}))
        await _until(lambda: client.feeder_counts and client.channel_counts()["results_malformed"])
        try:
            return client.channel_counts()
        finally:
            raw.close(0)
            ctx.term()

    assert _run_with_feeder_peer(tmp_path, body) == {
        "results_malformed": 1, "results_disconnects": 0,
        "chunks_malformed": 2, "chunks_disconnects": 1, "chunks_discarded": 3}


# ---------------------------------------------------------------- start-up check


def _model(tmp_path, name, **config):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _prompts(*lengths):
    return [TokenizedPrompt(tuple(range(n)), {}) for n in lengths]


def test_context_length_is_read_as_sglang_derives_it(tmp_path):
    assert model_context_length(_model(tmp_path, "a", max_position_embeddings=40)) == (40, "config.json max_position_embeddings")
    # an earlier key wins, a rope factor scales it (not a llama3 one)
    both = _model(tmp_path, "b", seq_length=64, max_position_embeddings=4096, rope_scaling={"factor": 2.0})
    assert model_context_length(both)[0] == 128
    llama3 = _model(tmp_path, "c", max_position_embeddings=100, rope_scaling={"factor": 8.0, "rope_type": "llama3"})
    assert model_context_length(llama3)[0] == 100
    assert model_context_length(both, configured=50) == (50, "its configured context_length")


def test_start_up_check_names_both_numbers_and_the_fix(tmp_path):
    actor = EngineConfig(_model(tmp_path, "actor", max_position_embeddings=1024))
    rm = EngineConfig(_model(tmp_path, "rm", max_position_embeddings=40), role="reward", max_total_tokens=8192)
    cfg = load_config(overrides=["rollout.max_new_tokens=48"])
    with pytest.raises(ConfigError) as e:
        check_contexts(cfg, actor, rm, _prompts(10, 14))
    text = str(e.value)
    assert "\n" not in text and text.startswith("models.reward:")
    assert "(14 tokens) + rollout.max_new_tokens (48) = 62 tokens > the 39 tokens" in text
    assert "context length 40" in text and "lower rollout.max_new_tokens" in text
    check_contexts(load_config(overrides=["rollout.max_new_tokens=25"]), actor, rm, _prompts(10, 14))  # 39 fits
    check_contexts(cfg, actor, None, _prompts(10, 14))  # no reward model: only the actor


def test_start_up_check_covers_the_actor_and_the_kv_pools(tmp_path):
    actor = EngineConfig(_model(tmp_path, "actor", max_position_embeddings=60), max_total_tokens=8192)
    cfg = load_config(overrides=["rollout.max_new_tokens=48"])
    with pytest.raises(ConfigError, match=r"^models.actor: .* = 62 tokens > the actor's context length 60"):
        check_contexts(cfg, actor, None, _prompts(14))
    big = EngineConfig(_model(tmp_path, "big", max_position_embeddings=4096), max_total_tokens=32)
    with pytest.raises(ConfigError, match=r"^engines.actor_max_total_tokens: .* KV pool of 32 tokens"):
        check_contexts(cfg, big, None, _prompts(14))
    rm = EngineConfig(big.model_path, role="reward", max_total_tokens=50)
    with pytest.raises(ConfigError, match=r"^engines.reward_max_total_tokens: .* KV pool of 50 tokens"):
        check_contexts(cfg, EngineConfig(big.model_path), rm, _prompts(14))
