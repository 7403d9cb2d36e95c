"""`ppo.old_logp=rollout` end to end on real SGLang engines (CPU, fp32, tiny random models):
the old-logp phase does no forward, and the engine-vs-trainer log-prob drift on on-policy
tokens, logged every step, is below 1e-4 (sampled at temperature 1 and greedy)."""

from __future__ import annotations

import json
import math

import pytest

from colocate import api
from colocate.config import load_config

pytestmark = pytest.mark.slow
SEEDS = (0, 2)  # the session's tiny_actor_path and tiny_rm_path: modules with equal seeds run one after another on the pool's engines (conftest)


@pytest.mark.parametrize("temperature", ["1.0", "0"])
def test_rollout_old_logp_costs_nothing_and_drift_is_logged(tiny_actor_path, tiny_rm_path, tmp_path,
                                                            run_overrides, temperature, engine_pool):
    out = tmp_path / f"t{temperature}"
    cfg = load_config(overrides=run_overrides(
        (tiny_actor_path, tiny_rm_path), out, "run.steps=2", "run.save_every=0", "rollout.max_new_tokens=12",
        f"rollout.temperature={temperature}", "ppo.old_logp=rollout"))
    api.train(cfg, quiet=True, engines=engine_pool)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "time/old_logp" in r]
    assert len(steps) == 2
    for rec in steps:
        assert rec["time/old_logp"] < 0.05 * rec["time/ref"] + 0.01  # no forward: a tensor select
        assert math.isfinite(rec["actor/policy_loss"])
        assert 0 <= rec["actor/logp_drift_mean"] <= rec["actor/logp_drift_max"] < 1e-4


def test_drift_is_logged_with_recompute_too(tiny_actor_path, tiny_rm_path, tmp_path, run_overrides, engine_pool):
    out = tmp_path / "recompute"
    cfg = load_config(overrides=run_overrides(
        (tiny_actor_path, tiny_rm_path), out, "run.steps=1", "run.save_every=0", "rollout.max_new_tokens=12"))
    api.train(cfg, quiet=True, engines=engine_pool)
    [rec] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert rec["actor/logp_drift_max"] < 1e-4 and rec["time/old_logp"] > 0
