"""The reward functions a config names: ``reward.rule`` (shipped rules) and ``reward.fns``
(the user's, ``package.module:fn`` or ``path/file.py:fn``).

Owns: each rule name's function (``vader``, ``reasoning-gym``, ``math``), and loading each
``reward.fns`` entry once at start with the check that it can be called as the API's
reward functions are, ``fn(record, text)`` (or with ``messages=``), sync or async
(:func:`check_reward_fn`, which checks the API's ``reward_fns`` too); every failure is one
:class:`ConfigError` line naming the field and the entry.

Leaves out: the error policy and calling convention (``colocate.rollout.reward_fns``),
summing the reward (``colocate.rollout.generate_and_score``), the rules themselves
(``colocate.assets.tasks``, ``colocate.assets.math_rule``), which names are valid
(``colocate.config_checks.RULES``, checked by ``validate``).
"""

from __future__ import annotations

import inspect
from typing import Any

from colocate.assets import tasks
from colocate.assets.math_rule import math_reward
from colocate.config import RewardConfig
from colocate.config_checks import RULES
from colocate.errors import ConfigError
from colocate.rollout.by_name import FORMS, load_attribute
from colocate.rollout.reward_fns import RewardFn, fn_name, wants_messages

FIELD = "reward.fns"
_SHAPE = "a reward function fn(record, text) (sync or async; a messages parameter optional)"


def named_reward_fns(reward: RewardConfig, source: str) -> list[RewardFn]:
    """``reward.rule``'s rules, then ``reward.fns``'s functions, in the order named;
    ``source`` is ``data.source`` (the reasoning-gym rule scores its task)."""
    return [rule_fn(name, source) for name in reward.rules] + [load_reward_fn(spec) for spec in reward.fn_names]


def rule_fn(name: str, source: str) -> RewardFn:
    """The rule ``name`` (one of ``colocate.config_checks.RULES``)."""
    if name == "vader":
        return tasks.sentiment_reward
    if name == "math":
        return math_reward
    if name == "reasoning-gym":
        if not source.startswith(tasks.REASONING_GYM_PREFIX):
            raise ConfigError("reward.rule=reasoning-gym needs data.source=reasoning-gym:<task>")
        return tasks.reasoning_gym_reward(source.removeprefix(tasks.REASONING_GYM_PREFIX))
    raise ConfigError(f"reward.rule: unknown rule {name!r}; the rules: {', '.join(RULES)}")


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function ``spec`` names, checked to take ``(record, text)``; a shipped
    rule's name is refused with the field that takes it (``reward.rule``)."""
    if isinstance(spec, str) and spec.strip() in RULES:
        name = spec.strip()
        raise ConfigError(f"{FIELD}: {name!r} is a shipped rule, not a function: --set reward.rule={name} "
                          f"({FIELD} names your own functions, {FORMS})")
    fn = load_attribute(spec, FIELD, f"name {_SHAPE} defined there")
    return check_reward_fn(fn, f"{FIELD}={spec.strip()}")


def check_reward_fn(fn: Any, where: str) -> RewardFn:
    """``fn`` if it can be called as ``fn(record, text)``, else one line naming ``where`` it
    came from (``reward.fns``, or the API's ``reward_fns``)."""
    if isinstance(fn, type):
        raise ConfigError(f"{where}: {fn.__name__} is a class; name {_SHAPE} (or an instance with __call__)")
    if not callable(fn):
        raise ConfigError(f"{where}: {type(fn).__name__} {str(fn)[:40]!r} is not callable; name {_SHAPE}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called with the two arguments
        return fn
    try:
        signature.bind(None, None, **({"messages": []} if wants_messages(fn) else {}))
    except TypeError as exc:
        raise ConfigError(f"{where}: {fn_name(fn)}{signature} cannot be called as fn(record, text) ({exc}); "
                          f"name {_SHAPE}") from None
    return fn
