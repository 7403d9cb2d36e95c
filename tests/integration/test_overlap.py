"""OPPO overlaps on real SGLang (CPU, tiny models): streamed scoring, deferral, feeder loss."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time

import pytest

from colocate.engine import reward
from colocate.rollout import generate_and_score, schedule
from colocate.engine.reward_feeder import RewardFeeder
from colocate.rollout.sample import Sample
from colocate.engine.reward import ScoreClient
from colocate.rollout.generate_and_score import Scorer
from tests.conftest import THREADS  # one thread per engine: pooled across modes

pytestmark = pytest.mark.slow
SEEDS = (0, 2)  # the session's tiny_actor_path and tiny_rm_path: modules with equal seeds run one after another on the pool's engines (conftest)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _prompts(n):
    return [[1] + [10 + (7 * i + j) % 200 for j in range(5 + 3 * i)] for i in range(n)]


def _with_feeder(loop, reward_engine, body):
    """Runs `await body(feeder, client)` with an in-loop RewardFeeder on fresh ipc sockets,
    stops the feeder after, and returns (feeder, what body returned)."""
    with tempfile.TemporaryDirectory() as tmp:
        chunks, results = f"ipc://{tmp}/c", f"ipc://{tmp}/r"
        feeder = RewardFeeder(reward_engine, chunks, results)
        stop = asyncio.Event()
        task = loop.create_task(feeder.run(stop))

        async def go():
            try:
                async with ScoreClient(chunks, results, timeout_s=30) as client:
                    return await body(feeder, client)
            finally:
                stop.set()
                await task

        return feeder, loop.run_until_complete(go())


def test_streamed_rewards_equal_scoring_after_generation(actor_engine, reward_engine):
    loop = actor_engine.loop
    samples = [Sample(i, p, 10 + 5 * i) for i, p in enumerate(_prompts(4))]

    async def body(feeder, client):
        return await schedule.Schedule(actor_engine).run(samples, GREEDY, 0, stream=schedule.Stream(client, 4))

    feeder, res = _with_feeder(loop, reward_engine, body)
    assert len(res.completed) == 4 and not res.unfinished
    after = loop.run_until_complete(
        reward.score_many(reward_engine, [s.prompt_ids + s.output_ids for s in samples], "after"))
    for s, want in zip(samples, after):
        assert s.score == pytest.approx(want, abs=1e-5)
    assert feeder.chunks_seen >= sum(len(s.output_ids) // 4 for s in samples)
    assert res.seconds["reward_tail"] >= 0


def test_cut_defers_partials_that_resume_exactly(actor_engine, reward_engine):
    loop = actor_engine.loop
    prompts = _prompts(4)
    budgets = [6, 64, 64, 64]
    full = [Sample(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))]
    loop.run_until_complete(generate_and_score.generate(actor_engine, full, GREEDY, "unint"))

    samples = [Sample(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))]
    res = loop.run_until_complete(schedule.Schedule(actor_engine).run(
        samples, GREEDY, 1, score=Scorer(reward_engine), cut_after=1))
    assert [s.index for s in res.completed] == [0]  # exactly B=1 trained
    assert len(res.unfinished) == 3
    for s in res.unfinished:
        assert s.finish_reason == "abort" and len(s.output_ids) < s.max_new_tokens
    res2 = loop.run_until_complete(schedule.Schedule(actor_engine).run(
        res.unfinished, GREEDY, 2, score=Scorer(reward_engine)))
    assert len(res2.completed) == 3
    for s in res.unfinished:
        assert s.output_ids == full[s.index].output_ids
        assert len(s.output_ids) == len(s.logprobs) == len(s.versions) == s.max_new_tokens


def test_feeder_forgets_requests_the_cut_aborted(actor_engine, reward_engine):
    """A streamed step cut after B=1 leaves three aborted requests in the feeder, half
    scored; the next step's first chunk drops them, and that step still scores right."""
    loop = actor_engine.loop
    cut = [Sample(i, p, b) for i, (p, b) in enumerate(zip(_prompts(4), [6, 64, 64, 64]))]

    async def body(feeder, client):
        first = await schedule.Schedule(actor_engine).run(cut, GREEDY, 1, stream=schedule.Stream(client, 4), cut_after=1)
        left = feeder.open_requests()
        second = await schedule.Schedule(actor_engine).run(first.unfinished, GREEDY, 2, stream=schedule.Stream(client, 4))
        return first, left, second

    feeder, (first, left_after_cut, second) = _with_feeder(loop, reward_engine, body)
    assert len(first.completed) == 1 and len(first.unfinished) == 3
    assert left_after_cut >= 3  # the aborted requests' scorers / reorder state, still held
    assert feeder.forgotten == 3
    # after step 2 only its own (closed) requests remain: nothing of step 1
    assert feeder.open_requests() == 3
    assert len(second.completed) == 3
    after = loop.run_until_complete(reward.score_many(
        reward_engine, [s.prompt_ids + s.output_ids for s in second.completed], "after-cut"))
    for s, want in zip(second.completed, after):
        assert s.score == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("how,needle", [("SIGKILL", "reward feeder"), ("SIGSTOP", "stopped answering")])
def test_feeder_killed_or_hung_mid_step_gives_clear_error(tiny_actor_path, tiny_rm_path, tmp_path, how, needle, engine_pool):
    """SIGKILL: the feeder is gone; SIGSTOP: it is alive but silent (a hang). Either way the
    step fails within the feeder timeout with one line, and nothing waits forever."""
    from colocate.run import builder, loop as ppo_loop
    from colocate.config import load_config
    from colocate.engine.reward import FeederLostError

    cfg = load_config(overrides=[
        f"models.actor={tiny_actor_path}", f"models.reward={tiny_rm_path}", f"run.out_dir={tmp_path}",
        "overlap.mode=intra", "overlap.feeder=process", "overlap.feeder_timeout_s=5",
        "overlap.chunk_size=2", "rollout.batch_size=4", "rollout.max_new_tokens=200",
        "data.max_prompt_tokens=512", "run.steps=1",
        "engines.actor_max_total_tokens=8192", "engines.reward_max_total_tokens=8192", "engines.device=cpu", "models.dtype=float32", *THREADS])
    session = builder.build(cfg, log=lambda m: None, engines=engine_pool)
    pid = session.rollouts.feeder_pid()
    assert pid is not None

    def killer():
        while session.rollouts.client.chunks_sent < 3:
            time.sleep(0.01)
        import os, signal
        os.kill(pid, getattr(signal, how))

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    started = time.monotonic()
    try:
        with pytest.raises(FeederLostError, match=needle) as e:
            ppo_loop.step(session)
        assert "\n" not in str(e.value)
        assert time.monotonic() - started < 60
    finally:
        session.close()


def test_held_out_evaluation_scores_through_the_feeder_process(tiny_actor_path, tiny_rm_path, tmp_path, engine_pool):
    """With ``overlap.feeder=process`` the reward model lives only in the feeder's process:
    the held-out evaluation scores through it, equal to the in-process reward engine's scores
    of the same greedy responses; under ``overlap.mode=auto`` the steps that do not stream
    (sequential, inter) score through it too (the model's score is in every reward); and
    training steps and evaluations alternate on one feeder."""
    import math

    from colocate.run import builder, loop as ppo_loop
    from colocate.run.loop import StepPhases
    from colocate.rollout import evaluation
    from colocate.config import load_config

    def session(feeder, *extra):
        return builder.build(load_config(overrides=[
            f"models.actor={tiny_actor_path}", f"models.reward={tiny_rm_path}", f"run.out_dir={tmp_path / feeder}",
            "overlap.mode=intra", f"overlap.feeder={feeder}", "overlap.chunk_size=4", "rollout.batch_size=4",
            "rollout.max_new_tokens=8", "data.max_prompt_tokens=512", "data.eval_prompts=4", "run.steps=2",
            "engines.actor_max_total_tokens=8192", "engines.reward_max_total_tokens=8192", "engines.device=cpu", "models.dtype=float32", *THREADS,
            *extra]), log=lambda m: None, engines=engine_pool)

    inline = session("inline")
    try:
        assert inline.reward_engine is not None and not inline.rollouts.hosts_reward_model
        want = evaluation.evaluate(inline)["scores"]
        s = session("process", "overlap.mode=auto", "overlap.auto_modes=sequential,intra,inter",
                    "overlap.auto_trials=1", "overlap.delta_init=1")
        try:
            assert s.reward_engine is None and s.rollouts.hosts_reward_model
            got = evaluation.evaluate(s)
            assert got["prompts"] == 4 and got["scores"] == pytest.approx(want, abs=1e-5)
            assert len(set(want)) > 1  # four different responses, four different scores
            ran = set()
            for _ in range(4):  # auto: a warm-up step, then sequential, intra and inter once each
                part = ppo_loop.rollout(s, StepPhases())
                ran.add((part.stats["overlap/auto_streamed"], part.stats["overlap/auto_deferral"]))
                seqs = [x.prompt_ids + x.output_ids for x in part.samples]
                model = inline.actor.loop.run_until_complete(reward.score_many(inline.reward_engine, seqs, "check"))
                assert [x.score for x in part.samples] == pytest.approx(model, abs=1e-4), ran
            assert {(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)} <= ran  # sequential, intra, inter
            for step in (1, 2):  # a training step after an evaluation, and an evaluation after it
                ppo_loop.step(s)
                rec = evaluation.evaluate(s)
                assert rec["step"] == step and rec["non_finite"] == 0 and all(math.isfinite(v) for v in rec["scores"])
            assert s.rollouts.client.waiting() == 0  # every expected score collected, none kept
        finally:
            s.close()
    finally:
        inline.close()
