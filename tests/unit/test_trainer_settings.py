"""builder.trainer_settings: each ppo.* field reaches the trainer under its own name (no
field-by-field copy to drift), and the others come from the sections that own them."""

from __future__ import annotations

import dataclasses

import torch

from colocate.run import builder
from colocate.config import Config, PPOConfig, load_config
from colocate.trainer.settings import TrainerSettings

KL_CONTROLLER = {"kl_kind", "kl_coef", "kl_target", "kl_horizon"}  # the loop's, not the trainer's


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return value


def test_every_ppo_field_but_the_kl_controllers_is_a_trainer_setting():
    names = {f.name for f in dataclasses.fields(TrainerSettings)}
    assert {f.name for f in dataclasses.fields(PPOConfig)} - names == KL_CONTROLLER


def test_non_default_ppo_values_reach_the_trainer():
    ppo = PPOConfig()
    changed = {f.name: _changed(getattr(ppo, f.name)) for f in dataclasses.fields(PPOConfig)
               if f.name not in KL_CONTROLLER and isinstance(getattr(ppo, f.name), (bool, int, float))}
    cfg = dataclasses.replace(Config(), ppo=dataclasses.replace(ppo, **changed))
    got = builder.trainer_settings(cfg, "/actor", "/critic", torch.device("cpu"), micro_batch=3)
    assert {k: getattr(got, k) for k in changed} == changed
    assert (got.actor_path, got.critic_path, got.device, got.micro_batch) == ("/actor", "/critic", "cpu", 3)


def test_the_other_sections_settings():
    cfg = load_config(overrides=["overlap.mode=oppo", "overlap.staleness=is", "overlap.is_cap=3.0",
                                 "rollout.temperature=0.7", "run.seed=5", "lora.rank=4", "models.dtype=bfloat16"])
    got = builder.trainer_settings(cfg, "/a", "/a", torch.device("cpu"))
    assert (got.is_cap, got.max_staleness, got.temperature, got.seed, got.lora.rank, got.dtype) == \
        (3.0, None, 0.7, 5, 4, "bfloat16")
    seq = builder.trainer_settings(load_config(overrides=["overlap.staleness=is"]), "/a", "/a", torch.device("cpu"))
    assert seq.is_cap is None  # no deferral: every token is the current version's
