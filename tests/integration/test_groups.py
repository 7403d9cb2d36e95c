"""Groups of samples per prompt on real engines (CPU, tiny models): a group's shared prompt
is served from the radix cache; group-aware deferral trains whole groups only, resumes
partial members within their budgets, never splits a group across steps and loses no
member across a checkpoint; the critic-free estimators train without a critic."""

from __future__ import annotations

import json
import random

import pytest

from colocate import api
from colocate.run import builder, checkpoint
from colocate.run import loop as ppo_loop
from colocate.run.loop import StepPhases
from colocate.config import load_config
from colocate.rollout import generate_and_score
from colocate.rollout.sample import Sample

pytestmark = pytest.mark.slow
SEEDS = (7, 8)  # its tiny_pair: modules with equal seeds run one after another on the pool's engines (conftest)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_group_members_are_served_the_shared_prompt_from_the_radix_cache(actor_engine):
    rng = random.Random(1404)
    prompts = [[1] + [rng.randrange(20, 250) for _ in range(40)] for _ in range(2)]  # unseen by other tests
    samples = [Sample(i, list(prompts[i // 3]), 4, group=i // 3) for i in range(6)]
    actor_engine.loop.run_until_complete(generate_and_score.generate(actor_engine, samples, GREEDY, "grp"))
    for s in samples:
        assert len(s.output_ids) == 4
        assert s.cached_tokens >= len(s.prompt_ids) - 1, (s.index, s.cached_tokens)  # prefilled once, shared


def _config(models, out, run_overrides, *extra):
    return load_config(overrides=run_overrides(
        models, out, "rollout.group_size=2", "rollout.max_new_tokens=96", "rollout.length_dist=lognormal",
        "rollout.length_median=8", "rollout.length_sigma=1.5", "rollout.ignore_eos=true",
        "overlap.delta_init=2", "overlap.delta_max=2", "overlap.delta_adaptive=false", "overlap.chunk_size=8",
        "run.eval_every=0", "run.save_every=100", *extra))


def _check_groups(samples, n=2):
    groups = [s.group for s in samples]
    assert all(groups.count(g) == n for g in groups), groups  # whole groups only
    for s in samples:
        assert s.finished and s.score is not None
        assert len(s.output_ids) == len(s.logprobs) == len(s.versions) == s.max_new_tokens  # ignore_eos: to budget


def test_group_deferral_trains_whole_groups_and_keeps_members_across_a_checkpoint(tiny_pair, run_overrides, tmp_path, engine_pool):
    models = tiny_pair("groups", *SEEDS)
    session = builder.build(_config(models, tmp_path, run_overrides, "overlap.mode=oppo"), log=lambda m: None, engines=engine_pool)
    try:
        steps = []
        for _ in range(2):
            steps.append(ppo_loop.rollout(session, StepPhases()))
            session.state.step += 1
        path = session.save_checkpoint()
        saved = [s["index"] for s in json.loads(json.dumps(session.data.state_dict()))["deferred"]]
        assert saved, "the premise: members deferred at the checkpoint"
        for _ in range(2):
            steps.append(ppo_loop.rollout(session, StepPhases()))
            session.state.step += 1
        for step in steps:
            assert len(step.samples) == 4
            _check_groups(step.samples)
        trained = [s.group for step in steps for s in step.samples]
        assert len(trained) == len(set(trained)) * 2  # no group trained in two steps
        stats = [step.stats for step in steps]
        assert sum(x["overlap/resumed"] for x in stats) > 0  # partial members resumed to their budget
        assert sum(x["overlap/waiting"] for x in stats) > 0  # finished members waited for a sibling
        assert sum(x["rollout/cached_prompt_tokens"] for x in stats) > 0

        session.restore(path)  # back to the checkpoint: every deferred member comes back
        later = []
        for _ in range(3):
            later += ppo_loop.rollout(session, StepPhases()).samples
            session.state.step += 1
        _check_groups(later)
        left = {s.index for s in session.data.deferred}
        assert set(saved) <= {s.index for s in later} | left
    finally:
        session.close()


@pytest.mark.parametrize("mode,advantage,kl_in", [("sequential", "grpo", "loss"), ("oppo", "rloo", "reward"),
                                                  ("inter", "reinforce_baseline", "reward")])
def test_critic_free_runs_train_whole_groups_without_a_critic(tiny_pair, run_overrides, tmp_path, mode, advantage,
                                                               kl_in, engine_pool):
    models = tiny_pair("critic-free", 9, 10)
    cfg = _config(models, tmp_path, run_overrides, f"overlap.mode={mode}", f"ppo.advantage={advantage}",
                  f"ppo.kl_in={kl_in}", "run.steps=3", "run.save_every=3", "ppo.actor_lr=1e-3")
    hist = api.train(cfg, quiet=True, engines=engine_pool).history
    assert [h["trained_samples"] for h in hist] == [4, 4, 4]
    for h in hist:
        assert h["rollout/groups"] == 2
        assert not [k for k in h if k.startswith("critic/") or k in ("time/critic", "time/values")], h.keys()
        assert ("actor/kl_loss" in h) == (kl_in == "loss")
    assert any(h["actor/grad_norm"] > 0 for h in hist)
    _, parts = checkpoint.load(checkpoint.latest(tmp_path))
    assert "critic" not in parts["trainer"] and "actor" in parts["trainer"]
