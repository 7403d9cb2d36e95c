"""`TrainerSettings` for tests from one flat mapping of fields by their own names.

`settings_of(actor_path=..., epochs=1, micro_batch=3)`: a field of the ``ppo:`` section
(`PPOConfig`) goes into the settings' ``ppo``, every other is `TrainerSettings`' own
(``lora``: a `LoraConfig`). For tests that vary fields of both in one mapping
(parametrised cases, the overrides `world2_step` hands its spawned ranks).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from colocate.trainer.sections import PPOConfig
from colocate.trainer.settings import TrainerSettings

PPO_FIELDS = frozenset(f.name for f in dataclasses.fields(PPOConfig))
assert not PPO_FIELDS & {f.name for f in dataclasses.fields(TrainerSettings)}, "a field name in both: say which"


def settings_of(**fields: Any) -> TrainerSettings:
    ppo = {k: fields.pop(k) for k in list(fields) if k in PPO_FIELDS}
    return TrainerSettings(ppo=PPOConfig(**ppo), **fields)
