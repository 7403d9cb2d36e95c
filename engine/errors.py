"""Errors the engine layer raises on purpose: one-line messages naming what to change.

Owns: :class:`EngineError` (the base) and :class:`EngineConfigError` (a configured value
the engine layer checks). ``colocate.errors.USER_ERRORS`` groups them with the other
layers' errors for callers that catch them all; this module imports nothing of colocate,
so the engine layer needs no upward edge.
"""


class EngineError(Exception):
    """Base of every error the engine layer (SGLang engines, rollout, scoring, channel) raises on purpose."""


class EngineConfigError(EngineError):
    """A configuration value the engine layer checks is invalid; the message names the key."""


class RewardRequestError(EngineError):
    """The reward engine refused or failed one scoring request; the message names the
    request (step, sample) and the cause."""


class EngineStartError(EngineError):
    """An engine could not be started; the message is one line naming the cause."""
