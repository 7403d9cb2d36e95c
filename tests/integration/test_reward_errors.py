"""A reward request that fails fails the step, in every mode, on real SGLang (CPU, tiny
models): a reward model of context 64 refuses a prompt + response longer than that.

The start-up check (colocate/run/preflight.py) refuses such a configuration before any engine
starts. The run-time path is what it cannot see; here: prompts that grow after the start
(the session's prompt list swapped after step 1 for longer ones, as a dataset whose later
prompts are longer would). Step 2 then fails with one line within the feeder timeout, the
checkpoint of step 1 is written, and the engines shut down."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from colocate.run import builder, checkpoint
from colocate.run import loop as ppo_loop
from colocate.config import load_config
from colocate.rollout import schedule
from colocate.engine.errors import RewardRequestError
from colocate.engine.reward_feeder import RewardFeeder
from colocate.rollout.sample import Sample
from colocate.engine.engine_config import EngineConfig
from colocate.engine.runtime import SglangEngine, run_guarded
from colocate.engine.reward import ScoreClient
from colocate.assets.random_models import build_tiny_reward_model
from colocate.rollout.data_source import TokenizedPrompt
from colocate.rollout.generate_and_score import Scorer
from colocate.assets.tasks import chat_prompt_ids

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 64  # the reward model's: it scores at most 63 tokens
TIMEOUT_S = 20.0  # overlap.feeder_timeout_s of these runs
GREEDY = {"temperature": 0.0, "ignore_eos": True}
TOO_LONG = "longer than the model's context length (64 tokens)"


@pytest.fixture(scope="module")
def short_rm_path(tmp_path_factory):
    return str(build_tiny_reward_model(tmp_path_factory.mktemp("short") / "rm", seed=3, max_positions=CONTEXT))


@pytest.fixture(scope="module")
def short_rm(short_rm_path):
    eng = SglangEngine(EngineConfig(short_rm_path, role="reward", device="cpu", max_total_tokens=4096))
    yield eng
    eng.shutdown()


def _samples():
    """Samples 0 and 2 fit the reward model (10 + 8 tokens); 1 and 3 do not (40 + 40)."""
    return [Sample(i, [1] + [20 + i] * (39 if i % 2 else 9), 40 if i % 2 else 8) for i in range(4)]


def _one_line_about_a_long_sample(err: BaseException, step: int) -> None:
    text = str(err)
    assert "\n" not in text and TOO_LONG in text, text
    assert f"(step {step}, sample 1)" in text or f"(step {step}, sample 3)" in text, text


def _streamed(actor, reward, cut_after):
    """schedule.run_step streaming to an in-loop feeder on ``reward``: (error, seconds, client
    leftovers, feeder failures), then a clean step on the same engines and feeder."""
    loop = actor.loop
    with tempfile.TemporaryDirectory() as tmp:
        chunks, results = f"ipc://{tmp}/c", f"ipc://{tmp}/r"
        feeder, stop = RewardFeeder(reward, chunks, results), asyncio.Event()
        task = loop.create_task(feeder.run(stop))

        async def go():
            try:
                async with ScoreClient(chunks, results, timeout_s=TIMEOUT_S) as client:
                    started = time.monotonic()
                    with pytest.raises(RewardRequestError) as e:
                        await schedule.Schedule(actor).run(_samples(), GREEDY, 5, stream=schedule.Stream(client, 4), cut_after=cut_after)
                    took, left = time.monotonic() - started, client.waiting()
                    ok = await schedule.Schedule(actor).run([s for s in _samples() if s.index % 2 == 0], GREEDY, 6,
                                                      stream=schedule.Stream(client, 4))
                    return e.value, took, left, ok
            finally:
                stop.set()
                await task

        err, took, left, ok = loop.run_until_complete(go())
    return err, took, left, feeder.failed, ok


@pytest.mark.parametrize("mode,cut_after", [("intra", None), ("oppo", 3)])  # 3: a long one must finish
def test_streamed_score_error_fails_the_step_in_one_line(actor_engine, short_rm, mode, cut_after):
    err, took, left, failed, ok = _streamed(actor_engine, short_rm, cut_after)
    _one_line_about_a_long_sample(err, 5)
    assert took < TIMEOUT_S and left == 0 and failed >= 1
    assert len(ok.completed) == 2  # the engines, feeder and client serve the next step as before


def test_one_shot_score_error_fails_the_inter_step(actor_engine, short_rm):
    loop = actor_engine.loop
    started = time.monotonic()
    with pytest.raises(RewardRequestError) as e:
        loop.run_until_complete(schedule.Schedule(actor_engine).run(_samples(), GREEDY, 5,
                                                       score=Scorer(short_rm, timeout_s=TIMEOUT_S), cut_after=3))
    _one_line_about_a_long_sample(e.value, 5)
    assert time.monotonic() - started < TIMEOUT_S
    left = [t for t in asyncio.all_tasks(loop) if not t.done() and t.get_coro().__qualname__ == "_one"]
    assert not left  # every request of the failed step was aborted or cancelled


def run_sequential(actor, samples, sampling, step: int, scorer: Scorer) -> None:
    """The sequential schedule: ``schedule.run_step`` scoring every sample after generation."""
    run_guarded([actor, *scorer.engines], schedule.Schedule(actor).run_then_score(samples, sampling, step, scorer.score_all,
                                                                         tag_prefix="st"))


def test_sequential_score_error_is_one_line(actor_engine, short_rm):
    with pytest.raises(RewardRequestError) as e:
        run_sequential(actor_engine, _samples(), GREEDY, 5, Scorer(short_rm))
    _one_line_about_a_long_sample(e.value, 5)


def test_sequential_score_that_never_comes_ends_the_step_in_one_line(actor_engine, short_rm):
    """A reward engine that never answers (its processes stopped: alive, silent, as with a
    request its KV pool cannot hold) fails the sequential step within the deadline; the
    engine serves again once it runs."""
    fits = [s for s in _samples() if s.index % 2 == 0]
    deadline = 3.0
    children = [psutil.Process(p) for p in short_rm.child_pids]
    for child in children:
        child.suspend()
    try:
        started = time.monotonic()
        with pytest.raises(RewardRequestError) as e:
            run_sequential(actor_engine, fits, GREEDY, 7, Scorer(short_rm, timeout_s=deadline))
        took = time.monotonic() - started
    finally:
        for child in children:
            child.resume()
    text = str(e.value)
    assert "\n" not in text and f"no score within {deadline:g} s" in text and "(step 7, sample " in text, text
    assert took < deadline + 15  # generation (a few tokens) + the deadline, not forever
    again = [s for s in _samples() if s.index % 2 == 0]
    run_sequential(actor_engine, again, GREEDY, 8, Scorer(short_rm, timeout_s=60))
    assert all(s.score is not None for s in again)


# ---------------------------------------------------------------- whole runs


@pytest.fixture(scope="module")
def models(tmp_path_factory, short_rm_path):
    from colocate.assets.random_models import build_tiny_causal_lm

    return str(build_tiny_causal_lm(tmp_path_factory.mktemp("actor") / "actor", seed=4)), short_rm_path


@pytest.fixture(scope="module")
def short_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "short.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("hi", "yo", "ok", "no", "go", "up", "so", "do")))
    return str(path)


def _overrides(run_overrides, models, out, short_prompts, *extra):
    return run_overrides(models, out, f"data.source={short_prompts}", "rollout.max_new_tokens=16",
                         "run.steps=3", "run.save_every=100", "run.eval_every=0", "overlap.chunk_size=4",
                         f"overlap.feeder_timeout_s={TIMEOUT_S}", "overlap.delta_adaptive=false", *extra)


@pytest.mark.parametrize("mode,extra", [("sequential", ()), ("intra", ("overlap.feeder=process",)),
                                        ("inter", ()), ("oppo", ())])
def test_reward_error_fails_the_run_and_keeps_the_last_step(models, short_prompts, run_overrides, tmp_path, mode, extra):
    out = tmp_path / mode
    cfg = load_config(overrides=_overrides(run_overrides, models, out, short_prompts, f"overlap.mode={mode}", *extra))
    session = builder.build(cfg, log=lambda m: None)  # 21-token prompts + 16 fit the context of 64
    children = [p for e in (session.actor, session.reward_engine) if e is not None for p in e.child_pids]
    if session.rollouts is not None and session.rollouts.feeder_pid():
        children.append(session.rollouts.feeder_pid())
    long_prompt = TokenizedPrompt(tuple(chat_prompt_ids(session.run.tokenizer, "z" * 60)), {})  # 79 tokens: too long
    swapped = []

    def longer_prompts_after_step_1(rec):
        session.data.prompts = [long_prompt] * 8
        swapped.append(time.monotonic())

    try:
        with pytest.raises(RewardRequestError) as e:
            ppo_loop.train(session, callbacks=[longer_prompts_after_step_1])
        assert time.monotonic() - swapped[0] < TIMEOUT_S
        text = str(e.value)
        assert "\n" not in text and TOO_LONG in text and "(step 1, sample " in text, text
    finally:
        session.close()
    step, parts = checkpoint.load(checkpoint.latest(out))
    assert step == 1 and parts["run"]["step"] == 1  # the last completed step, written on the failure
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_start_up_check_refuses_the_run_before_any_engine(models, run_overrides, tmp_path):
    """The default prompts (up to 93 tokens) + 48 new tokens cannot fit a context of 64: refused
    while building, before SGLang is even imported."""
    overrides = run_overrides(models, tmp_path / "pre", "rollout.max_new_tokens=48", "run.eval_every=0")
    code = ("import sys\nfrom colocate.run import builder\nfrom colocate.config import load_config\n"
            "from colocate.errors import ConfigError\n"
            f"cfg = load_config(overrides={overrides!r})\n"
            "try:\n    builder.build(cfg, log=lambda m: None)\nexcept ConfigError as exc:\n"
            "    print('ERROR', exc)\n    print('sglang imported:', 'sglang' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ERROR", "sglang imported"))]
    assert lines[1] == "sglang imported: False", proc.stdout + proc.stderr[-2000:]
    assert lines[0].startswith("ERROR models.reward: the longest prompt (")
    assert "+ rollout.max_new_tokens (48)" in lines[0] and "context length 64" in lines[0]


def test_failing_held_out_evaluation_fails_like_a_step(models, short_prompts, run_overrides, tmp_path, engine_pool):
    """The evaluation after step 1 meets held-out prompts too long for the reward model (swapped
    in after the start, as for the steps above): one line, and step 1's checkpoint written by
    the failure path (run.save_every=100 writes none)."""
    out = tmp_path / "eval"
    cfg = load_config(overrides=_overrides(run_overrides, models, out, short_prompts, "overlap.mode=sequential",
                                           "run.eval_every=1", "data.eval_prompts=2"))
    session = builder.build(cfg, log=lambda m: None, engines=engine_pool)
    long_prompt = TokenizedPrompt(tuple(chat_prompt_ids(session.run.tokenizer, "z" * 60)), {})

    def longer_held_out_prompts(rec):
        session.data.eval_prompts = [long_prompt] * 2

    try:
        with pytest.raises(RewardRequestError) as e:
            ppo_loop.train(session, callbacks=[longer_held_out_prompts])
    finally:
        session.close()
    text = str(e.value)
    assert "\n" not in text and TOO_LONG in text and "(step 1, sample " in text, text
    step, parts = checkpoint.load(checkpoint.latest(out))
    assert step == 1 and parts["run"]["step"] == 1 and parts["run"]["weight_version"] == 1
