"""CPU thread budget of the engines' scheduler processes, per mode; the engine configs."""

from __future__ import annotations

import pytest

import dataclasses
import json

from colocate.run.builder import engine_configs, engine_threads
from colocate.config import load_config


@pytest.mark.parametrize("mode,feeder,cores,expected", [
    ("sequential", "inline", 2, (2, 2)),
    ("inter", "inline", 2, (1, 1)),        # finished samples scored while the others decode
    ("intra", "inline", 2, (1, 1)),        # decode and chunk prefill at the same time
    ("oppo", "inline", 8, (4, 4)),
    ("oppo", "process", 8, (4, 4)),        # the feeder process's own engine prefills beside decode
    ("oppo", "inline", 1, (1, 1)),
])
def test_auto_budget(mode, feeder, cores, expected):
    cfg = load_config(overrides=[f"overlap.mode={mode}", f"overlap.feeder={feeder}"])
    assert engine_threads(cfg, cores) == expected


def test_explicit_budget_wins():
    cfg = load_config(overrides=["overlap.mode=oppo", "engines.actor_threads=3", "engines.reward_threads=1"])
    assert engine_threads(cfg, 8) == (3, 1)


def test_reward_engine_config_carries_the_run_settings_and_survives_json():
    """The feeder process gets its reward engine's config as JSON (``--engine-json``)."""
    from colocate.engine.engine_config import EngineConfig

    cfg = load_config(overrides=["overlap.mode=oppo", "overlap.feeder=process", "models.dtype=bfloat16",
                                 "run.seed=7", "engines.reward_max_total_tokens=4096",
                                 "engines.reward_threads=1", "engines.log_level=info"])
    actor, reward = engine_configs(cfg, "/models/a", "/models/r")
    assert (reward.model_path, reward.role, reward.dtype, reward.seed) == ("/models/r", "reward", "bfloat16", 7)
    assert (reward.max_total_tokens, reward.threads, reward.log_level) == (4096, 1, "info")
    assert actor.role == "actor" and actor.max_total_tokens == cfg.engines.actor_max_total_tokens
    assert EngineConfig(**json.loads(json.dumps(dataclasses.asdict(reward)))) == reward
    assert engine_configs(cfg, "/models/a", None)[1] is None


def test_cuda_engines_are_the_same_in_every_mode_so_a_pool_keeps_them():
    """Found on an H100: the CPU thread budget made each mode's CUDA engines differ, and an
    EnginePool started a new actor and reward engine (~50 s) for every mode change."""
    def configs(device: str, mode: str):
        return engine_configs(load_config(overrides=[f"engines.device={device}", f"overlap.mode={mode}"]),
                              "/m/actor", "/m/rm")
    cuda = [configs("cuda", m) for m in ("sequential", "intra", "inter", "oppo")]
    assert all(c == cuda[0] for c in cuda) and cuda[0][0].threads == cuda[0][1].threads == 0
    cpu = configs("cpu", "sequential"), configs("cpu", "oppo")
    assert cpu[0][0].threads != cpu[1][0].threads or len(__import__("os").sched_getaffinity(0)) == 1
