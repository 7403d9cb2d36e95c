"""Choosing the environment of a multi-turn rollout by name (``rollout.env``).

Owns: the built-in names (:data:`BUILTIN`: ``calculator``, ``scripted``), the
``package.module:attr`` (or ``path/file.py:attr``, loaded by ``colocate.rollout.by_name``)
form for a user's environment (an instance, a class or a zero-argument factory; a dotted
``attr`` reaches into the module), the check that what it names implements the
:class:`Environment` protocol (a str ``name``, a str ``instruction``, a callable
``step``), and :func:`describe`, the one line that names the
environment in logs. Every failure is a one-line :class:`ConfigError` on ``rollout.env``
naming the fix.

Leaves out: the protocol (``colocate.rollout.env``), the built-in environments
themselves (``colocate.rollout.calculator``, ``colocate.rollout.scripted_env``) and
running them (``colocate.rollout.turns``).
"""

from __future__ import annotations

from typing import Any, Callable

from colocate.errors import ConfigError, first_line
from colocate.rollout.by_name import load_attribute
from colocate.rollout.calculator import CalculatorEnv
from colocate.rollout.env import Environment
from colocate.rollout.scripted_env import ScriptedEnv

FIELD = "rollout.env"
BUILTIN = ("calculator", "scripted")
_FACTORIES: dict[str, Callable[[], Any]] = {"calculator": CalculatorEnv, "scripted": ScriptedEnv}
_FORMS = (f"one of {', '.join(BUILTIN)}, or package.module:attr / path/file.py:attr "
          "(an environment, its class or a zero-argument factory)")


def load_environment(spec: str) -> Environment:
    """The environment ``spec`` names: a built-in name, or ``package.module:attr``."""
    name = spec.strip() if isinstance(spec, str) else ""
    if not name:
        raise ConfigError(f"{FIELD}: empty; use {_FORMS}")
    if name in _FACTORIES:
        return _FACTORIES[name]()
    if ":" not in name:
        raise ConfigError(f"{FIELD}: unknown environment {name!r}; use {_FORMS}")
    obj = load_attribute(name, FIELD, "name an environment, its class or a zero-argument factory defined there")
    attr = name.rpartition(":")[2].strip()
    if isinstance(obj, type) or (callable(obj) and not _is_environment(obj)):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001 - whatever the user's constructor raises
            raise ConfigError(
                f"{FIELD}={name}: calling {attr}() failed ({first_line(exc)}); "
                "it must build the environment with no arguments"
            ) from None
    return check_environment(obj, f"{FIELD}={name}")


def check_environment(obj: Any, where: str) -> Environment:
    """``obj`` if it has what an environment needs, else one line naming ``where`` it came
    from (``rollout.env``, or the API's ``env``)."""
    missing = _missing(obj)
    if missing:
        raise ConfigError(
            f"{where}: {type(obj).__name__} is not an environment (no {missing}); "
            "it needs a str name, a str instruction and a step(record, history) method"
        )
    return obj


def describe(env: Environment) -> str:
    """One line naming ``env`` and where it comes from, e.g. "calculator (colocate built-in)"."""
    cls = type(env)
    if cls in (CalculatorEnv, ScriptedEnv):
        return f"{env.name} (colocate built-in)"
    return f"{getattr(env, 'name', '?')} ({cls.__module__}.{cls.__qualname__})"


def _is_environment(obj: Any) -> bool:
    return not isinstance(obj, type) and not _missing(obj)


def _missing(obj: Any) -> str:
    """What of the protocol ``obj`` lacks ("" for nothing)."""
    lacks = []
    if not isinstance(getattr(obj, "name", None), str):
        lacks.append("str name")
    if not isinstance(getattr(obj, "instruction", None), str):
        lacks.append("str instruction")
    if not callable(getattr(obj, "step", None)):
        lacks.append("step method")
    return ", ".join(lacks)
