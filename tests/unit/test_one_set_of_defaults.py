"""One set of defaults: the settings the trainer runs with default to the config fields
users configure, and the builders carry every field the two share.

A bench or test that builds `TrainerSettings` or `LoraSettings` directly then trains as a
default configured run does, and a field the builder forgets is caught by a non-default
value that does not arrive.

Each lower field is mapped to the config field it is built from (same name in its section
unless `RENAMED` says otherwise) or listed in `NOT_FROM_CONFIG` with the reason; a new
field on either side has to be placed here. The scheduler and the chunk tuner have no
settings of their own: they take the `overlap` section itself (`colocate.rollout.scheduler`).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Callable

import pytest
import torch

from colocate.config import Config, LoraConfig
from colocate.run import builder
from colocate.tools import export
from colocate.trainer.lora import LoraSettings
from colocate.trainer.settings import TrainerSettings

# lower field -> "section.field" it is built from, where the name or the section differs
RENAMED: dict[type, dict[str, str]] = {
    TrainerSettings: {"seed": "run.seed", "temperature": "rollout.temperature",
                      "host_offload": "engines.host_offload", "trust_remote_code": "models.trust_remote_code"},
    LoraSettings: {},
}
SECTION = {TrainerSettings: "ppo", LoraSettings: "lora"}
FILE = {TrainerSettings: "trainer/settings.py", LoraSettings: "trainer/lora.py"}
BUILDER = {TrainerSettings: "colocate/run/builder.py: trainer_settings",
           LoraSettings: "colocate/run/builder.py: trainer_settings (lora=...)"}
NOT_FROM_CONFIG: dict[type, dict[str, str]] = {
    TrainerSettings: {
        "actor_path": "models.actor resolved to a folder", "critic_path": "models.critic resolved (None: the actor's)",
        "dtype": "models.dtype resolved for the device (auto)", "device": "engines.device resolved (auto)",
        "is_cap": "overlap.is_cap only under deferral with staleness=is (None: off)",
        "max_staleness": "overlap.max_staleness only under deferral with staleness=mask (None: off)",
        "micro_batch": "no config field (padded rows per pass)", "reference": "derived: kl_on(cfg)",
        "lora": "the LoraSettings pair below"},
    LoraSettings: {},
}
# sections whose every field reaches the lower class, but these (ppo: the loop's KL controller)
CONFIG_ONLY = {"ppo": {"kl_kind", "kl_coef", "kl_target", "kl_horizon"}, "lora": set()}
# non-default values where "the next value" (+1, not, another Literal choice) would not be valid
CHANGED = {"rollout.temperature": 0.5, "ppo.loss_agg": "seq-mean-token-sum", "lora.dropout": 0.1,
           "lora.target_modules": "q_proj,v_proj"}


def _default(cls: type, name: str) -> Any:
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _mapping(lower: type) -> dict[str, str]:
    """lower field -> "section.field" for every lower field built from the config."""
    section = SECTION[lower]
    shared = {f.name for f in dataclasses.fields(type(getattr(Config(), section)))}
    out = {n: f"{section}.{n}" for n in shared if n in {f.name for f in dataclasses.fields(lower)}}
    return out | RENAMED[lower]


def _config_value(cfg: Config, path: str) -> Any:
    section, name = path.split(".")
    return getattr(getattr(cfg, section), name)


def _config_default(path: str) -> Any:
    section, name = path.split(".")
    return _default(type(getattr(Config(), section)), name)


@pytest.mark.parametrize("lower", [TrainerSettings, LoraSettings], ids=lambda c: c.__name__)
def test_every_field_is_placed(lower):
    fields = {f.name for f in dataclasses.fields(lower)}
    mapped, other = set(_mapping(lower)), set(NOT_FROM_CONFIG[lower])
    assert fields == mapped | other and not mapped & other, (
        f"{lower.__name__}: fields neither mapped to a config field nor listed here: "
        f"{sorted(fields - mapped - other)}; "
        f"listed but gone: {sorted((mapped | other) - fields)}; both: {sorted(mapped & other)}")
    section = SECTION[lower]
    if section not in CONFIG_ONLY:
        return
    section_fields = {f.name for f in dataclasses.fields(type(getattr(Config(), section)))}
    reached = {p.split(".")[1] for p in _mapping(lower).values() if p.startswith(section + ".")}
    unread = section_fields - reached - CONFIG_ONLY[section]
    assert not unread, f"{section}.* fields {sorted(unread)} reach no {lower.__name__} field: map or list them here"


@pytest.mark.parametrize("lower", [TrainerSettings, LoraSettings], ids=lambda c: c.__name__)
def test_shared_defaults_are_the_configs(lower):
    wrong = []
    for name, path in sorted(_mapping(lower).items()):
        mine, theirs = _default(lower, name), _config_default(path)
        if mine != theirs or type(mine) is not type(theirs):
            wrong.append(f"{lower.__name__}.{name} defaults to {mine!r}, {path} to {theirs!r}: "
                         f"set {FILE[lower]}'s default to {theirs!r} (the config is the user-facing default)")
    assert not wrong, "\n".join(wrong)


def _next(section: type, name: str, value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    choices = typing.get_args(typing.get_type_hints(section)[name])
    others = [c for c in choices if isinstance(c, str) and c != value]
    assert others, f"give {section.__name__}.{name} a non-default value in CHANGED"
    return others[0]


def _changed_config(paths: list[str], fixed: dict[str, Any]) -> Config:
    """A default config with every field in ``paths`` changed, and ``fixed`` ("section.field": value) set."""
    updates: dict[str, dict[str, Any]] = {}
    for path in paths:
        section, name = path.split(".")
        value = CHANGED[path] if path in CHANGED else _next(type(getattr(Config(), section)), name,
                                                            _config_default(path))
        updates.setdefault(section, {})[name] = value
    for path, value in fixed.items():
        section, name = path.split(".")
        updates.setdefault(section, {})[name] = value
    cfg = Config()
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **u) for s, u in updates.items()})


def _trainer(cfg: Config) -> TrainerSettings:
    return builder.trainer_settings(cfg, "/actor", None, torch.device("cpu"))


def _lora_via_trainer(cfg: Config) -> LoraSettings:
    return _trainer(cfg).lora


# lower class, its builder, fields every test config sets
BUILDERS: list[tuple[type, Callable[[Config], Any], dict[str, Any]]] = [
    (TrainerSettings, _trainer, {}),
    (LoraSettings, _lora_via_trainer, {}),
]


@pytest.mark.parametrize("lower, build, fixed", BUILDERS, ids=[b[0].__name__ for b in BUILDERS])
@pytest.mark.parametrize("changed", [False, True], ids=["default-config", "every-field-changed"])
def test_the_builder_passes_every_shared_field(lower, build, fixed, changed):
    mapping = _mapping(lower)
    cfg = _changed_config(sorted(mapping.values()) if changed else [], fixed)
    built = build(cfg)
    wrong = [f"{BUILDER[lower]} gave {lower.__name__}.{name}={getattr(built, name)!r} for {path}="
             f"{_config_value(cfg, path)!r}: pass {path} there"
             for name, path in sorted(mapping.items()) if getattr(built, name) != _config_value(cfg, path)]
    assert not wrong, "\n".join(wrong)


def test_the_export_reads_every_lora_field(tmp_path):
    cfg = _changed_config(sorted(_mapping(LoraSettings).values()), {})
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    assert export.lora_settings(tmp_path) == LoraSettings(**dataclasses.asdict(cfg.lora))


def test_bare_settings_are_a_default_configured_run():
    """On CPU, the trainer of a default config is the bare dataclass."""
    # but for the dtype auto resolves to: float32 unless this CPU multiplies bf16 natively (trainer/precision.py)
    assert _trainer(Config()) == TrainerSettings(actor_path="/actor", dtype=builder.trainer_dtype(Config(), "cpu"))
    assert builder.trainer_dtype(Config(), "cpu", frozenset()) == TrainerSettings.dtype
    assert LoraSettings(**dataclasses.asdict(LoraConfig())) == LoraSettings()
