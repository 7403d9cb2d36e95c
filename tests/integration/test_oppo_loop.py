"""The PPO loop in the overlapped modes on real engines (CPU, tiny models)."""

from __future__ import annotations

import json

import pytest

from colocate import api
from colocate.config import load_config
from colocate.rollout.data_source import response_budget
from tests.conftest import THREADS  # one thread per engine: pooled across modes

pytestmark = pytest.mark.slow
SEEDS = (5, 6)  # its tiny_pair: modules with equal seeds run one after another on the pool's engines (conftest)


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair("oppo", *SEEDS)


def config(models, out_dir, *extra):
    actor, rm = models
    return load_config(overrides=[
        f"models.actor={actor}", f"models.reward={rm}", f"run.out_dir={out_dir}",
        "rollout.batch_size=4", "rollout.max_new_tokens=24", "ppo.minibatches=2",
        "data.max_prompt_tokens=512", "ppo.actor_lr=1e-3", "ppo.critic_lr=1e-3",
        "engines.actor_max_total_tokens=8192", "engines.reward_max_total_tokens=8192",
        "run.save_every=1", "engines.device=cpu", "models.dtype=float32", *THREADS, *extra])


@pytest.mark.parametrize("mode", ["intra", "inter", "oppo"])
def test_mode_trains_exactly_b_and_defers_without_loss(models, tmp_path, mode, engine_pool):
    # Long-tailed budgets (seed 0): step 1 launches budgets [33, 55, 128, 9, 9, 1, 17], so the
    # first B=4 finish by token 17 while the 128-token request is still far from done and
    # must be carried as a partial (with fixed budgets all 7 could finish before the abort).
    cfg = config(models, tmp_path / mode, f"overlap.mode={mode}", "run.steps=3",
                 "overlap.delta_init=3", "overlap.delta_adaptive=false", "overlap.chunk_size=8",
                 "rollout.max_new_tokens=128", "rollout.length_dist=lognormal", "rollout.length_median=8",
                 "rollout.length_sigma=1.5", "rollout.ignore_eos=true", "run.timeline=true")
    budgets = sorted(response_budget(cfg.rollout, cfg.run.seed, p) for p in range(7))
    assert budgets[-1] >= 4 * budgets[3], budgets  # the premise above
    summary = api.train(cfg, quiet=True, engines=engine_pool)
    hist = summary.history
    assert [h["step"] for h in hist] == [1, 2, 3]
    for h in hist:
        assert h["trained_samples"] == 4
    if mode != "intra":
        assert any(h["overlap/deferred"] > 0 for h in hist)  # B+Δ launched, stragglers kept
        assert any(h["overlap/resumed"] > 0 for h in hist[1:])
    # each step's fates on the timeline: its B trained samples, and (deferring) its stragglers
    events = [json.loads(line) for line in (tmp_path / mode / "timeline.jsonl").read_text().splitlines()]
    fates = [[e["event"] for e in events if e["step"] == h["step"] and e["event"] in ("trained", "deferred")]
             for h in hist]
    assert [f.count("trained") for f in fates] == [4, 4, 4], fates
    assert (sum(f.count("deferred") for f in fates) > 0) == (mode != "intra"), fates
    from colocate.run import checkpoint

    _, parts = checkpoint.load(checkpoint.latest(tmp_path / mode))
    [rank] = parts["data"]["ranks"]  # one engine rank
    assert rank["named"] >= 12


def test_auto_runs_every_candidate_drains_deferral_and_resumes_its_costs(models, tmp_path, engine_pool):
    # auto with one trial each and a re-exploration every 2 steps: steps 1-5 are the
    # warm-up (sequential) and one step of sequential, intra, inter, oppo; the long tail
    # (as above) makes inter/oppo defer, and the next step without deferral finishes them
    out = tmp_path / "auto"
    extra = ["overlap.mode=auto", "overlap.auto_trials=1", "overlap.auto_explore_every=2",
             "overlap.delta_init=3", "overlap.delta_adaptive=false", "overlap.chunk_size=8",
             "rollout.max_new_tokens=128", "rollout.length_dist=lognormal", "rollout.length_median=8",
             "rollout.length_sigma=1.5", "rollout.ignore_eos=true"]
    hist = api.train(config(models, out, "run.steps=6", *extra), quiet=True, engines=engine_pool).history
    ran = [(h["overlap/auto_streamed"], h["overlap/auto_deferral"]) for h in hist]
    assert ran[:5] == [(0, 0), (0, 0), (1, 0), (0, 1), (1, 1)], ran
    assert all(h["trained_samples"] == 4 for h in hist)
    assert hist[3]["overlap/deferred"] > 0 and hist[3]["overlap/delta"] == 3  # inter deferred stragglers
    assert hist[2]["overlap/delta"] == 0 and hist[1]["overlap/launched"] == 4  # no Δ without deferral
    assert hist[1]["overlap/chunk_size"] == 0 and hist[2]["overlap/chunk_size"] == 8  # intra streamed
    assert all(f"overlap/auto_cost_{m}" in hist[4] for m in ("sequential", "intra", "inter"))
    for prev, h in zip(hist, hist[1:]):
        if prev["overlap/deferred"] and not h["overlap/auto_deferral"]:
            assert h["overlap/deferred"] == 0  # what deferral left (<= Δ < B) is finished first
    from colocate.run import checkpoint

    every = api.train(config(models, out, "run.steps=8", *extra), quiet=True, resume=out, engines=engine_pool).history
    assert [h["step"] for h in every] == list(range(1, 9))  # the run's whole history
    hist2 = every[6:]
    assert all(f"overlap/auto_cost_{m}" in hist2[0] for m in ("sequential", "intra", "inter", "oppo"))
    _, parts = checkpoint.load(checkpoint.latest(out))
    [scheduler] = parts["data"]["ranks"]  # one engine rank
    trained = sum(h["trained_samples"] for h in hist + hist2)
    assert trained + len(scheduler["deferred"]) + scheduler["dropped_total"] == scheduler["named"]
