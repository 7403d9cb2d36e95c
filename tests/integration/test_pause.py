"""Deferral that keeps its place (overlap.pause_mode) on real SGLang (CPU, tiny models):
stragglers paused in the engine at the cut and adopted by the next step, with and without a
weight update in between; the radix cache's version namespace (the CUDA decision: tests/unit/test_live.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from colocate.engine import oppo, rollout
from colocate.engine.live import LiveRequests
from colocate.engine.rollout import Sample
from tests.integration.test_engine_weights import buckets

pytestmark = pytest.mark.slow
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
    from colocate.engine.runtime import EngineConfig, SglangEngine

    eng = SglangEngine(EngineConfig(tiny_actor_path, role="actor", device="cpu", max_total_tokens=16384,
                                    overlap_schedule=False))
    yield eng
    eng.shutdown()


@pytest.fixture
def engine_for(request, actor_engine):
    """The engine a pause mode runs on: in_place's own, retract the shared one."""
    return lambda mode: request.getfixturevalue("in_place_engine") if mode == "in_place" else actor_engine


def _cut(engine, mode, live, step=1):
    return engine.loop.run_until_complete(oppo.run_step(
        engine, _samples(), GREEDY, step, cut_after=1, pause_mode=mode, live=live))


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_paused_stragglers_continue_to_the_uninterrupted_greedy_tokens(engine_for, mode):
    actor_engine = engine_for(mode)
    run = actor_engine.loop.run_until_complete
    full = _samples()
    run(rollout.generate(actor_engine, full, GREEDY, "unint"))
    live = LiveRequests()
    res = _cut(actor_engine, mode, live)
    assert [s.index for s in res.completed] == [0]
    assert actor_engine.paused == mode and len(live) == 3
    for s in res.unfinished:  # the scheduler's frozen copies: partials, like an abort gives
        assert s.finish_reason == "abort" and 0 < len(s.output_ids) < s.max_new_tokens
        assert s.index in live
    sent = actor_engine.requests
    res2 = run(oppo.run_step(actor_engine, res.unfinished, GREEDY, 2, pause_mode=mode, live=live))
    assert actor_engine.requests == sent  # adopted: no new request, nothing re-prefilled by us
    assert actor_engine.paused is None and len(live) == 0
    assert sorted(s.index for s in res2.completed) == [1, 2, 3]
    for s in res2.completed:
        assert s.output_ids == full[s.index].output_ids
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
    try:
        actor_engine.update_weights(buckets(new, 20_000), version=v0 + 1)
        res2 = run(oppo.run_step(actor_engine, res.unfinished, GREEDY, 2, pause_mode=mode, live=live))
        assert len(res2.completed) == 3
        for s in res2.completed:
            frozen = next(f for f in res.unfinished if f.index == s.index)
            k = s.versions.count(v0)
            # versions: the old weights' tokens first (at least those of the frozen partial), then the new
            assert s.versions == [v0] * k + [v0 + 1] * (s.max_new_tokens - k)
            assert len(frozen.output_ids) <= k < s.max_new_tokens
            assert s.output_ids[:len(frozen.output_ids)] == frozen.output_ids
            if mode == "retract":  # KV recomputed under the new weights: a fresh request's continuation
                fresh = Sample(50 + s.index, s.prompt_ids + s.output_ids[:k], s.max_new_tokens - k)
                run(rollout.generate(actor_engine, [fresh], GREEDY, "fresh"))
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
        run(rollout.generate(actor_engine, [probe], GREEDY, "probe"))  # continues the engine too
        assert probe.cached_tokens == 0
        with torch.no_grad():
            want = new.generate(torch.tensor([probe.prompt_ids]), max_new_tokens=8, do_sample=False)[0]
        assert probe.output_ids == want[len(probe.prompt_ids):].tolist()
        run(live.discard(actor_engine))
        assert len(live) == 0 and actor_engine.paused is None
    finally:
        actor_engine.update_weights(buckets(old, 20_000), version=v0 + 2)

