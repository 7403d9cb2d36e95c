"""Exceptions colocate raises on purpose; catch :data:`USER_ERRORS` to catch them all.

Each layer owns its errors so that ``engine/`` and ``trainer/`` import nothing of
``colocate`` (layers import downward only): :class:`EngineError` (SGLang engines, rollout,
scoring, channel), :class:`TrainerError` (FSDP models, PPO math; :class:`ModelSourceError`
among them) and :class:`ColocateError` (configuration, the run). Every one carries a
one-line message naming what to change; the CLI prints it instead of a traceback.
"""

import contextlib
import os
from pathlib import Path
from typing import Iterator

from colocate.engine.errors import EngineConfigError, EngineError
from colocate.trainer.errors import ModelSourceError, TrainerConfigError, TrainerError


class ColocateError(Exception): """Base of every error the colocate layer (config, run, API) raises on purpose."""
class ConfigError(ColocateError): """A configuration value, file or CLI option is invalid; the message names the key."""


def cause_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of ``exc``'s message, at most ``limit`` characters ("" when it has none):
    what a one-line error quotes of a cause raised deep inside a library or a user's code."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else ""


def unwritable(folder: Path, exc: OSError) -> str:
    """Why ``folder`` could not be made or written, for a one-line error: a file where it or
    one of its parents should be a folder, else the system's words for ``exc``."""
    blocking = next((f for f in (folder, *folder.parents) if f.exists() and not f.is_dir()), None)
    if blocking is not None:
        return f"'{blocking}' is a file"
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


def first_line(exc: BaseException) -> str:
    """``exc`` as "Type: its first line" (one line, whatever its message holds)."""
    cause = cause_line(exc)
    return f"{type(exc).__name__}: {cause}" if cause else type(exc).__name__


# The config field that fixes an engine error (``EngineError.fix``, engine.errors.FIXES), as
# the end of its line ("{message}": the engine's own line)
FIELD_FIXES = {
    "reward_context": "{message}: lower rollout.max_new_tokens or data.max_prompt_tokens, or use a reward model "
                      "with a longer context",
    "reward_kv_pool": "{message} (engines.reward_max_total_tokens)",
    "engine_log": "{message}; set engines.log_level=info for SGLang's own log",
    "feeder_timeout": "{message} (overlap.feeder_timeout_s)",
    "feeder_slow": "{message} (raise overlap.feeder_timeout_s if scoring is this slow)",
    "remote_code": "{message}; set models.trust_remote_code=true if you trust it",
    "server_arg": "engines.sglang.{message}",
    "attention_backend": "engines.attention_backend: {message}; leave it unset for the machine's default",
    "stall_timeout": "{message} (engines.stall_timeout_s; raise it if generating or scoring is this slow)",
}


def in_config_terms(exc: BaseException) -> BaseException:
    """An engine error as colocate's user reads it: its line with the config field that
    fixes it (:data:`FIELD_FIXES`), the same type, translated once; any other error as it is."""
    fix = getattr(exc, "fix", "") if isinstance(exc, EngineError) else ""
    if not fix:
        return exc
    out = type(exc)(FIELD_FIXES[fix].format(message=str(exc)))
    out.__cause__, out.__suppress_context__ = exc.__cause__, exc.__suppress_context__
    return out


@contextlib.contextmanager
def config_terms() -> Iterator[None]:
    """Engine errors raised inside leave in colocate's terms (:func:`in_config_terms`)."""
    try:
        yield
    except EngineError as exc:
        named = in_config_terms(exc)
        if named is exc:
            raise
        raise named from None


USER_ERRORS = (ColocateError, EngineError, TrainerError)
CONFIG_ERRORS = (ConfigError, EngineConfigError, TrainerConfigError)

__all__ = ["ColocateError", "ConfigError", "EngineError", "EngineConfigError", "TrainerError",
           "TrainerConfigError", "ModelSourceError", "USER_ERRORS", "CONFIG_ERRORS", "FIELD_FIXES", "cause_line",
           "config_terms", "first_line", "in_config_terms"]
