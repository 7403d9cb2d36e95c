"""One set of defaults: the settings the trainer runs with default to the config fields
users configure, and the builders carry every field they are built from.

The ``ppo`` and ``lora`` sections are the trainer's own (`colocate.trainer.sections`):
`TrainerSettings` holds them as they are, so they cannot drift. Its other fields that come
from a config field of another section (`FROM_CONFIG`) default to that field's default,
and a non-default value there arrives; the rest are listed in `NOT_FROM_CONFIG` with the
reason. A bench or test that builds `TrainerSettings` directly then trains as a default
configured run does, and a new field has to be placed here. The Δ controller and the chunk
tuner have no settings of their own: they take the `overlap` section itself
(`colocate.rollout.controllers`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from colocate.config import Config
from colocate.run import builder
from colocate.tools import export
from colocate.trainer.settings import TrainerSettings

SECTIONS = {"ppo", "lora"}  # the config's sections, held whole
# TrainerSettings field -> the "section.field" it is built from
FROM_CONFIG = {"seed": "run.seed", "temperature": "rollout.temperature", "host_offload": "engines.host_offload",
               "trust_remote_code": "models.trust_remote_code"}
NOT_FROM_CONFIG = {
    "actor_path": "models.actor resolved to a folder", "critic_path": "models.critic resolved (None: the actor's)",
    "dtype": "models.dtype resolved for the device (auto)", "device": "engines.device resolved (auto)",
    "is_cap": "overlap.is_cap only under deferral with staleness=is (None: off)",
    "max_staleness": "overlap.max_staleness only under deferral with staleness=mask (None: off)",
    "micro_batch": "no config field (padded rows per pass)", "reference": "derived: kl_on(cfg)"}
CHANGED = {"rollout.temperature": 0.5, "engines.host_offload": "pageable"}  # where "the next value" is not valid


def _default(cls: type, name: str) -> Any:
    return {f.name: f for f in dataclasses.fields(cls)}[name].default


def _config_default(path: str) -> Any:
    section, name = path.split(".")
    return _default(type(getattr(Config(), section)), name)


def _next(value: Any) -> Any:
    return not value if isinstance(value, bool) else value + 1


def _trainer(cfg: Config) -> TrainerSettings:
    return builder.trainer_settings(cfg, "/actor", None, torch.device("cpu"))


def test_every_field_is_placed():
    fields = {f.name for f in dataclasses.fields(TrainerSettings)}
    placed = [SECTIONS, set(FROM_CONFIG), set(NOT_FROM_CONFIG)]
    assert fields == set().union(*placed) and sum(map(len, placed)) == len(fields), (
        f"TrainerSettings: fields placed nowhere: {sorted(fields - set().union(*placed))}; "
        f"placed but gone: {sorted(set().union(*placed) - fields)}; or placed twice")
    for section in SECTIONS:
        assert _default(TrainerSettings, section) == getattr(Config(), section)


def test_shared_defaults_are_the_configs():
    wrong = [f"TrainerSettings.{name} defaults to {_default(TrainerSettings, name)!r}, {path} to "
             f"{_config_default(path)!r}: set trainer/settings.py's default to {_config_default(path)!r} (the config "
             "is the user-facing default)"
             for name, path in sorted(FROM_CONFIG.items())
             if _default(TrainerSettings, name) != _config_default(path)
             or type(_default(TrainerSettings, name)) is not type(_config_default(path))]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("changed", [False, True], ids=["default-config", "every-field-changed"])
def test_the_builder_passes_every_field_built_from_the_config(changed):
    cfg = Config()
    if changed:
        updates: dict[str, dict[str, Any]] = {}
        for path in FROM_CONFIG.values():
            section, name = path.split(".")
            updates.setdefault(section, {})[name] = CHANGED[path] if path in CHANGED else _next(_config_default(path))
        cfg = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **u) for s, u in updates.items()})
    built = _trainer(cfg)
    wrong = [f"colocate/run/builder.py: trainer_settings gave TrainerSettings.{name}={getattr(built, name)!r} for "
             f"{path}={getattr(getattr(cfg, path.split('.')[0]), path.split('.')[1])!r}: pass {path} there"
             for name, path in sorted(FROM_CONFIG.items())
             if getattr(built, name) != getattr(getattr(cfg, path.split(".")[0]), path.split(".")[1])]
    assert not wrong, "\n".join(wrong)
    assert not changed or all(getattr(built, name) != _config_default(path) for name, path in FROM_CONFIG.items())
    assert built.ppo is cfg.ppo and built.lora is cfg.lora


def test_the_export_reads_every_lora_field(tmp_path):
    cfg = Config()
    lora = dataclasses.replace(cfg.lora, rank=cfg.lora.rank + 1, alpha=cfg.lora.alpha + 1, dropout=0.1,
                               target_modules="q_proj,v_proj", actor=not cfg.lora.actor, critic=not cfg.lora.critic)
    assert all(getattr(lora, f.name) != getattr(cfg.lora, f.name) for f in dataclasses.fields(lora))
    cfg = dataclasses.replace(cfg, lora=lora)
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    assert export.lora_section(tmp_path) == cfg.lora


def test_bare_settings_are_a_default_configured_run():
    """On CPU, the trainer of a default config is the bare dataclass."""
    # but for the dtype auto resolves to: float32 unless this CPU multiplies bf16 natively (trainer/precision.py)
    assert _trainer(Config()) == TrainerSettings(actor_path="/actor", dtype=builder.trainer_dtype(Config(), "cpu"))
    assert builder.trainer_dtype(Config(), "cpu", frozenset()) == TrainerSettings.dtype
