"""builder.trainer_settings: the ``ppo`` and ``lora`` sections reach the trainer as they
are (no field-by-field copy to drift), and the others come from the sections that own
them; the section's choices are the names the trainer's math knows; a section built in
Python checks itself."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from colocate.run import builder
from colocate.config import Config, LoraConfig, PPOConfig, load_config
from colocate.trainer.settings import TrainerSettings


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, float) and 0 < value <= 1:  # stays in the bounds of gamma, lam
        return value / 2
    if isinstance(value, (int, float)):
        return value + 1
    return value


def test_the_ppo_and_lora_sections_are_the_trainers():
    assert typing.get_type_hints(TrainerSettings)["ppo"] is PPOConfig
    assert typing.get_type_hints(TrainerSettings)["lora"] is LoraConfig


def test_non_default_ppo_values_reach_the_trainer():
    ppo = PPOConfig()
    changed = {f.name: _changed(getattr(ppo, f.name)) for f in dataclasses.fields(PPOConfig)
               if isinstance(getattr(ppo, f.name), (bool, int, float))}
    cfg = dataclasses.replace(Config(), ppo=dataclasses.replace(ppo, **changed),
                              lora=LoraConfig(rank=4, alpha=8.0, critic=False))
    got = builder.trainer_settings(cfg, "/actor", "/critic", torch.device("cpu"), micro_batch=3)
    assert got.ppo is cfg.ppo and got.lora is cfg.lora
    assert {k: getattr(got.ppo, k) for k in changed} == changed
    assert (got.actor_path, got.critic_path, got.device, got.micro_batch) == ("/actor", "/critic", "cpu", 3)


def test_the_other_sections_settings():
    cfg = load_config(overrides=["overlap.mode=oppo", "overlap.staleness=is", "overlap.is_cap=3.0",
                                 "rollout.temperature=0.7", "run.seed=5", "lora.rank=4", "models.dtype=bfloat16"])
    got = builder.trainer_settings(cfg, "/a", "/a", torch.device("cpu"))
    assert (got.is_cap, got.max_staleness, got.temperature, got.seed, got.lora.rank, got.dtype) == \
        (3.0, None, 0.7, 5, 4, "bfloat16")
    seq = builder.trainer_settings(load_config(overrides=["overlap.staleness=is"]), "/a", "/a", torch.device("cpu"))
    assert seq.is_cap is None  # no deferral: every token is the current version's


def test_a_section_built_in_python_checks_itself_in_one_line_naming_the_field():
    from colocate.trainer.errors import TrainerConfigError

    for section, values, field in ((PPOConfig, {"kl_coef": -1.0}, "ppo.kl_coef"),
                                   (PPOConfig, {"epochs": 0}, "ppo.epochs"),
                                   (PPOConfig, {"loss_agg": "sum"}, "ppo.loss_agg"),
                                   (PPOConfig, {"rollout_correction": "token_mis", "rollout_correction_upper": 0.5},
                                    "ppo.rollout_correction_lower/upper"),
                                   (LoraConfig, {"alpha": 0.0}, "lora.alpha")):
        try:
            section(**values)
        except TrainerConfigError as exc:
            assert str(exc).startswith(field) and "\n" not in str(exc), exc
        else:
            raise AssertionError(f"{section.__name__}({values}) was accepted")
    with pytest.raises(TrainerConfigError, match=r"^ppo\.minibatches must be >= 1"):
        dataclasses.replace(PPOConfig(), minibatches=0)
