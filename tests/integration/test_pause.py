"""Deferral that keeps its place (overlap.pause_mode) on real SGLang (CPU, tiny models):
stragglers paused in the engine at the cut and adopted by the next step, with and without a
weight update in between; the radix cache's version namespace (the CUDA decision: tests/unit/test_live.py)."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from colocate.rollout import generate_and_score, schedule
from colocate.rollout.schedule import LiveRequests
from colocate.rollout.sample import Sample, Status
from tests.integration.test_engine_weights import buckets

pytestmark = pytest.mark.slow
SEEDS = (0, 2)  # the session's tiny_actor_path and tiny_rm_path: modules with equal seeds run one after another on the pool's engines (conftest)
GREEDY = {"temperature": 0.0, "ignore_eos": True}
BUDGETS = [4, 160, 160, 160]  # one short sample is the batch (B = 1); three long stragglers


def _prompts(n):
    return [[1] + [10 + (7 * i + j) % 200 for j in range(5 + 3 * i)] for i in range(n)]


def _samples():
    return [Sample(i, p, b) for i, (p, b) in enumerate(zip(_prompts(4), BUDGETS))]


def _perturbed(path, seed=7):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std().clamp_min(1e-3))
    return model


@pytest.fixture(scope="module")
def in_place_engine(tiny_actor_path):
    """An actor engine as ``pause_mode=in_place`` builds it: no overlap scheduler (see
    ``EngineConfig.overlap_schedule``)."""
    from colocate.engine.engine_config import EngineConfig
    from colocate.engine.runtime import SglangEngine

    eng = SglangEngine(EngineConfig(tiny_actor_path, role="actor", device="cpu", max_total_tokens=16384,
                                    overlap_schedule=False))
    yield eng
    eng.shutdown()


@pytest.fixture
def engine_for(request, actor_engine):
    """The engine a pause mode runs on: in_place's own, retract the shared one."""
    return lambda mode: request.getfixturevalue("in_place_engine") if mode == "in_place" else actor_engine


def _cut(engine, mode, live, step=1):
    return engine.loop.run_until_complete(schedule.Schedule(engine, pause_mode=mode, live=live).run(
        _samples(), GREEDY, step, cut_after=1))


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_paused_stragglers_continue_to_the_uninterrupted_greedy_tokens(engine_for, mode):
    actor_engine = engine_for(mode)
    run = actor_engine.loop.run_until_complete
    full = _samples()
    run(generate_and_score.generate(actor_engine, full, GREEDY, "unint"))
    live = LiveRequests()
    res = _cut(actor_engine, mode, live)
    assert [s.index for s in res.completed] == [0]
    assert actor_engine.paused == mode and len(live) == 3
    assert res.completed[0].status is Status.FINISHED
    for s in res.unfinished:  # the parked streams' own samples (never copied): partials, saved as an abort gives
        assert s.finish_reason is None and 0 < len(s.output_ids) < s.max_new_tokens
        assert live._live[s.index].sample is s and s.status is Status.PARKED
        assert (s.state()["finish_reason"], s.state()["status"]) == ("abort", "deferred")
    sent = actor_engine.requests
    res2 = run(schedule.Schedule(actor_engine, pause_mode=mode, live=live).run(res.unfinished, GREEDY, 2))
    assert actor_engine.requests == sent  # adopted: no new request, nothing re-prefilled by us
    assert actor_engine.paused is None and len(live) == 0
    assert sorted(s.index for s in res2.completed) == [1, 2, 3]
    for s in res2.completed:
        assert s.output_ids == full[s.index].output_ids and s.status is Status.FINISHED
        assert len(s.logprobs) == len(s.versions) == s.max_new_tokens


def _hf_in_flight_logps(old, new, prompt, out, k):
    """Log-probs of ``out[k:]`` generated in place across an update after ``k`` tokens: the
    KV of prompt + out[:k-1] was computed by the old weights, every later forward (the one
    that feeds out[k-1] on) by the new ones."""
    with torch.no_grad():
        cache = DynamicCache()
        old(torch.tensor([prompt + out[: k - 1]]), past_key_values=cache, use_cache=True)
        logits = new(torch.tensor([out[k - 1 : -1]]), past_key_values=cache, use_cache=True).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    return [float(logp[i, t]) for i, t in enumerate(out[k:])]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_after_a_weight_update_tokens_carry_versions_and_behaviour_logprobs(engine_for, tiny_actor_path, mode):
    actor_engine = engine_for(mode)
    run = actor_engine.loop.run_until_complete
    old = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    new = _perturbed(tiny_actor_path)
    v0 = actor_engine.weight_version
    live = LiveRequests()
    res = _cut(actor_engine, mode, live)
    at_cut = {s.index: list(s.output_ids) for s in res.unfinished}  # the partials as of the cut
    try:
        actor_engine.update_weights(buckets(new, 20_000), version=v0 + 1)
        res2 = run(schedule.Schedule(actor_engine, pause_mode=mode, live=live).run(res.unfinished, GREEDY, 2))
        assert len(res2.completed) == 3
        for s in res2.completed:
            assert any(f is s for f in res.unfinished)  # the parked sample itself went on
            partial = at_cut[s.index]
            k = s.versions.count(v0)
            # versions: the old weights' tokens first (at least those of the partial at the cut), then the new
            assert s.versions == [v0] * k + [v0 + 1] * (s.max_new_tokens - k)
            assert len(partial) <= k < s.max_new_tokens
            assert s.output_ids[:len(partial)] == partial
            if mode == "retract":  # KV recomputed under the new weights: a fresh request's continuation
                fresh = Sample(50 + s.index, s.prompt_ids + s.output_ids[:k], s.max_new_tokens - k)
                run(generate_and_score.generate(actor_engine, [fresh], GREEDY, "fresh"))
                assert fresh.output_ids == s.output_ids[k:]
                assert max(abs(a - b) for a, b in zip(fresh.logprobs, s.logprobs[k:])) < 1e-4
            else:  # in place: the new weights decode on the old weights' KV
                want = _hf_in_flight_logps(old, new, s.prompt_ids, s.output_ids, k)
                assert max(abs(a - b) for a, b in zip(want, s.logprobs[k:])) < 1e-4
    finally:  # restore the session engine's weights for other tests
        actor_engine.update_weights(buckets(old, 20_000), version=v0 + 2)


def test_no_stale_prefix_is_served_while_paused_requests_keep_the_cache(in_place_engine, tiny_actor_path):
    """A request paused in place holds KV, so the update cannot flush the radix cache; a new
    request with the same prompt must still not reuse the old weights' KV."""
    actor_engine = in_place_engine
    run = actor_engine.loop.run_until_complete
    old = AutoModelForCausalLM.from_pretrained(tiny_actor_path, dtype=torch.float32)
    new = _perturbed(tiny_actor_path, seed=11)
    v0 = actor_engine.weight_version
    live = LiveRequests()
    res = _cut(actor_engine, "in_place", live)
    try:
        actor_engine.update_weights(buckets(new, 20_000), version=v0 + 1)
        assert actor_engine.paused == "in_place"  # the flush was skipped, the stragglers still hold KV
        probe = Sample(90, list(res.unfinished[0].prompt_ids), 8)
        run(generate_and_score.generate(actor_engine, [probe], GREEDY, "probe"))  # continues the engine too
        assert probe.cached_tokens == 0
        with torch.no_grad():
            want = new.generate(torch.tensor([probe.prompt_ids]), max_new_tokens=8, do_sample=False)[0]
        assert probe.output_ids == want[len(probe.prompt_ids):].tolist()
        run(live.discard(actor_engine))
        assert len(live) == 0 and actor_engine.paused is None
    finally:
        actor_engine.update_weights(buckets(old, 20_000), version=v0 + 2)



class _PauseAfter:
    """The real engine, whose pause first waits until ``sample`` has finished (at most 60 s):
    the window where a straggler ends while the cut's pause is on its way."""

    def __init__(self, engine, sample: Sample):
        self._engine, self._sample = engine, sample

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def pause(self, mode: str) -> None:
        import asyncio

        for _ in range(6000):
            if self._sample.finished:
                break
            await asyncio.sleep(0.01)
        await self._engine.pause(mode)


def test_a_straggler_that_finishes_while_the_pause_is_on_its_way_is_a_finished_sample(actor_engine):
    """Issue 39.5: the cut's pause cancelled every straggler not yet scored, one that had
    just ended with its whole output included, and parked a frozen copy saying "abort" (a
    resume would then continue it past its end)."""
    import asyncio

    samples = [Sample(i, p, b) for i, (p, b) in enumerate(zip(_prompts(4), [4, 24, 160, 160]))]
    actor = _PauseAfter(actor_engine, samples[1])

    async def score(sample, streamed, rid, step):  # sample 1's reward takes a while (a reward model)
        await asyncio.sleep(1.0 if sample.index == 1 else 0.0)
        return 1.0

    live = LiveRequests()
    res = actor_engine.loop.run_until_complete(schedule.Schedule(actor, pause_mode="retract", live=live).run(
        samples, GREEDY, 1, score=score, cut_after=1))
    try:
        done = {s.index: s for s in res.completed}
        assert 1 in done and done[1].finish_reason == "length" and len(done[1].output_ids) == 24
        assert 1 not in live and all(s.index != 1 for s in res.unfinished)
        assert {s.index for s in res.unfinished} == {2, 3}
        assert all(s.status is Status.PARKED and s.state()["finish_reason"] == "abort" for s in res.unfinished)
    finally:
        actor_engine.loop.run_until_complete(live.discard(actor_engine))
    assert actor_engine.paused is None


def _flushes(engine, within_s: float = 5.0) -> bool:
    """The radix cache flushes at once within ``within_s``: the scheduler may hold a request
    for an iteration after its last output reached us (a timed flush would wait for retracted
    requests too, which a paused engine keeps)."""
    deadline = time.monotonic() + within_s
    while not engine.flush_cache():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_step_without_a_cut_leaves_no_parked_request_running_into_the_sync(tmp_path, tiny_pair, run_overrides,
                                                                            engine_pool):
    """Issue 39.6: under overlap.mode=auto with a pause mode, a step that does not defer
    continued the engine (every parked request with it) but launched only what fits, and
    nothing paused the engine again: the weight sync met requests running, unconsumed, and
    SGLang refused the cache flush (on CUDA the release would wait for them). Such a step
    now ends the parked requests it does not launch (their samples stay deferred, cut there,
    and resume as prompt + partial)."""
    from colocate.config import load_config
    from colocate.run import builder, loop as ppo_loop
    from colocate.run.loop import StepPhases

    overrides = run_overrides(tiny_pair("ppo", 0, 2), tmp_path, "rollout.batch_size=4", "rollout.group_size=4",
                              "ppo.advantage=grpo", "ppo.minibatches=1", "overlap.mode=auto",
                              "overlap.auto_modes=inter,sequential", "overlap.auto_trials=1",
                              "overlap.pause_mode=retract", "overlap.delta_init=3", "overlap.delta_max=3",
                              "overlap.delta_adaptive=false", "rollout.max_new_tokens=512",
                              "rollout.length_dist=pareto", "rollout.length_median=8", "rollout.ignore_eos=true",
                              "overlap.drop_staleness=100")
    s = builder.build(load_config(overrides=overrides), log=lambda m: None, engines=engine_pool)
    try:
        ran = []
        for _ in range(3):  # auto's queue: inter (warm-up), inter, sequential
            part = ppo_loop.rollout(s, StepPhases())
            ran.append(part.stats["overlap/auto_deferral"])
            if ran[-1] == 1.0:
                assert part.stats["overlap/parked"] > 0  # stragglers left in the paused engine
            # nothing but the parked requests is in the engine (one of them may have ended in SGLang
            # as the pause came, its last output not yet read: parked, no longer in flight)
            assert s.actor.in_flight() <= part.stats["overlap/parked"], ran  # nothing else runs into the sync:
            assert _flushes(s.actor), ran  # the scheduler lets go in a moment (retracted ones count as idle)
            s.state.weight_version += 1  # the step's sync, as the loop makes it
            s.engines.sharing.wake_and_sync(s.gather_weights, s.push_weights)
        assert ran == [1.0, 1.0, 0.0]
        assert part.stats["overlap/parked"] == 0 and s.actor.paused is None
        assert s.data.deferred  # the ended ones stay deferred, partials kept
    finally:
        s.close()


@pytest.fixture(scope="module")
def one_at_a_time_engine(tiny_actor_path):
    """An in-place actor engine that runs one request at a time: the others wait in its queue."""
    from colocate.engine.engine_config import EngineConfig
    from colocate.engine.runtime import SglangEngine

    eng = SglangEngine(EngineConfig(tiny_actor_path, role="actor", device="cpu", max_total_tokens=16384,
                                    overlap_schedule=False, max_running_requests=1))
    yield eng
    eng.shutdown()


def test_in_place_requests_still_queued_at_the_pause_run_on_the_new_weights_only(one_at_a_time_engine,
                                                                                 tiny_actor_path):
    """Issue 39.7: the radix namespace of a request is fixed when it is sent, and in_place
    never flushes; a group member still queued at the pause matched its group's prompt KV
    of the old weights while its tokens counted as the new version's (a row that looks
    on-policy). Such members now go again as new requests: every token of theirs is the new
    weights' own, prompt KV included."""
    eng = one_at_a_time_engine
    run = eng.loop.run_until_complete
    shared = _prompts(2)[1]
    samples = [Sample(0, _prompts(1)[0], 4)] + [Sample(i, list(shared), 24, group=1) for i in (1, 2, 3)]
    v0 = eng.weight_version
    live = LiveRequests()
    res = run(schedule.Schedule(eng, pause_mode="in_place", live=live).run(samples, GREEDY, 1, cut_after=1))
    assert eng.paused == "in_place" and {s.index for s in res.unfinished} == {1, 2, 3}
    new = _perturbed(tiny_actor_path, seed=5)
    eng.update_weights(buckets(new, 20_000), version=v0 + 1)
    res2 = run(schedule.Schedule(eng, pause_mode="in_place", live=live).run(res.unfinished, GREEDY, 2))
    assert {s.index for s in res2.completed} == {1, 2, 3}
    # the member in the running batch at the pause got its first token from the old weights
    # (in place: its KV stays, as designed); those still queued have every token from the new
    queued = [s for s in res2.completed if s.versions[0] == v0 + 1]
    assert len(queued) >= 2  # one request runs at a time: at least two members waited
    for s in queued:
        assert s.versions == [v0 + 1] * 24
        with torch.no_grad():
            logits = new(torch.tensor([s.prompt_ids + s.output_ids[:-1]])).logits[0, len(s.prompt_ids) - 1:]
        want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.output_ids)[:, None])[:, 0]
        assert max(abs(a - float(b)) for a, b in zip(s.logprobs, want)) < 1e-4, s.index
