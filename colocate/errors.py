"""Exceptions colocate raises on purpose; catch :data:`USER_ERRORS` to catch them all.

Each layer owns its errors so that ``engine/`` and ``trainer/`` import nothing of
``colocate`` (layers import downward only): :class:`EngineError` (SGLang engines, rollout,
scoring, channel), :class:`TrainerError` (FSDP models, PPO math; :class:`ModelSourceError`
among them) and :class:`ColocateError` (configuration, the run). Every one carries a
one-line message naming what to change; the CLI prints it instead of a traceback.
"""

from colocate.engine.errors import EngineConfigError, EngineError
from colocate.trainer.errors import ModelSourceError, TrainerConfigError, TrainerError


class ColocateError(Exception): """Base of every error the colocate layer (config, run, API) raises on purpose."""
class ConfigError(ColocateError): """A configuration value, file or CLI option is invalid; the message names the key."""


def cause_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of ``exc``'s message, at most ``limit`` characters ("" when it has none):
    what a one-line error quotes of a cause raised deep inside a library or a user's code."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else ""


def first_line(exc: BaseException) -> str:
    """``exc`` as "Type: its first line" (one line, whatever its message holds)."""
    cause = cause_line(exc)
    return f"{type(exc).__name__}: {cause}" if cause else type(exc).__name__


USER_ERRORS = (ColocateError, EngineError, TrainerError)
CONFIG_ERRORS = (ConfigError, EngineConfigError, TrainerConfigError)

__all__ = ["ColocateError", "ConfigError", "EngineError", "EngineConfigError", "TrainerError",
           "TrainerConfigError", "ModelSourceError", "USER_ERRORS", "CONFIG_ERRORS", "cause_line", "first_line"]
