"""The sequential PPO loop end to end on real SGLang engines (CPU, tiny random models)."""

from __future__ import annotations

import json

import pytest
import torch

from colocate import api
from colocate.config import load_config
from tests.conftest import THREADS  # one thread per engine: pooled across modes

pytestmark = pytest.mark.slow
SEEDS = (3, 4)  # its tiny_pair: modules with equal seeds run one after another on the pool's engines (conftest)


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair("loop", *SEEDS)


def config(models, out_dir, *extra):
    actor, rm = models
    return load_config(overrides=[
        f"models.actor={actor}", f"models.reward={rm}", f"run.out_dir={out_dir}",
        "rollout.batch_size=4", "rollout.max_new_tokens=12", "ppo.minibatches=2",
        "data.max_prompt_tokens=512", "ppo.actor_lr=1e-3", "ppo.critic_lr=1e-3",
        "engines.actor_max_total_tokens=8192", "engines.reward_max_total_tokens=8192",
        "run.save_every=1", "engines.device=cpu", "models.dtype=float32", *THREADS, *extra])


def test_three_steps_sync_weights_and_learn_something(models, tmp_path, engine_pool):
    from colocate.run import builder, loop

    cfg = config(models, tmp_path / "run", "run.steps=3")
    session = builder.build(cfg, log=lambda m: None, engines=engine_pool)
    try:
        history = loop.train(session)
        assert [h["step"] for h in history] == [1, 2, 3]
        for h in history:
            for key in ("actor/policy_loss", "critic/value_loss", "reward_mean", "kl"):
                assert torch.isfinite(torch.tensor(h[key])), key
            assert h["time/generate"] > 0 and h["time/sync"] > 0 and h["time/actor"] > 0
        # the policy moved away from the reference: its KL estimate (k1, a mean of log π/π_ref over
        # the step's sampled tokens) is off zero (exactly 0 with ppo.actor_lr=0); its sign is the
        # sample's (a pooled engine's sampler goes on from its last run: -0.067 was seen)
        assert history[-1]["kl"] != 0
        assert history[-1]["weight_version"] == 3
        # weights the engine serves now == the trainer's actor weights
        state = session.trainer.actor_state_for_sync()
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"):
            served = torch.tensor(session.actor.read_weight(name, truncate=50))
            mine = state[name].flatten()[: served.numel()] if served.dim() == 1 else state[name][: served.shape[0], : served.shape[1]]
            assert torch.allclose(served.reshape(mine.shape), mine, atol=1e-6), name
        # and the initial weights are not what it serves any more
        first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
        assert first["weight_version"] == 1
    finally:
        session.close()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == [
        "step_00000002", "step_00000003"]


def test_two_plus_resume_plus_two_equals_four(models, tmp_path, engine_pool):
    greedy = ("rollout.temperature=0",)  # sampling streams restart with an engine; greedy does not
    straight = api.train(config(models, tmp_path / "a", "run.steps=4", *greedy), quiet=True, engines=engine_pool)
    api.train(config(models, tmp_path / "b", "run.steps=2", *greedy), quiet=True, engines=engine_pool)
    resumed = api.train(config(models, tmp_path / "b", "run.steps=4", *greedy),
                        resume=str(tmp_path / "b"), quiet=True, engines=engine_pool)
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4]
    for a, b in zip(straight.history, resumed.history):
        for key in ("reward_mean", "kl", "actor/policy_loss", "critic/value_loss", "response_len"):
            # float32 sums over a save/load agree to ~1e-6 absolute; a lost optimizer state,
            # RNG or data position moves these by orders of magnitude more
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)


def test_with_the_kl_off_the_loop_builds_and_runs_no_reference(models, tmp_path, engine_pool):
    from colocate.run import builder, loop

    cfg = config(models, tmp_path / "nokl", "run.steps=1", "ppo.kl_kind=fixed", "ppo.kl_coef=0")
    session = builder.build(cfg, log=lambda m: None, engines=engine_pool)
    try:
        assert session.trainer.ref is None and not session.trainer.settings.reference
        [h] = loop.train(session)
        assert h["trained_samples"] == 4 and h["weight_version"] == 1 and h["kl_coef"] == 0
        assert "kl" not in h and "time/ref" not in h  # no pass, nothing to report
        assert torch.isfinite(torch.tensor(h["actor/policy_loss"]))
    finally:
        session.close()
