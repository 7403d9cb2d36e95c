"""Errors the engine layer raises on purpose: one-line messages naming what to change.

Owns: :class:`EngineError` (the base) and :class:`EngineConfigError` (a configured value
the engine layer checks), and :data:`FIXES`, the settings an error may say fix it. ``colocate.errors.USER_ERRORS`` groups them with the other
layers' errors for callers that catch them all; this module imports nothing of colocate,
so the engine layer needs no upward edge.
"""


# What an error leaves to the layer that configures the engines (``EngineError.fix``): the
# setting that fixes it. The engine layer names no configuration of that layer; colocate
# adds its config field to the line (``colocate.errors.in_config_terms``).
FIXES = {
    "reward_context": "the reward model's context: shorter prompts or responses, or a reward model with a longer one",
    "reward_kv_pool": "the reward engine's KV pool",
    "engine_log": "SGLang's own log, at its log level info",
    "feeder_timeout": "the reward feeder's timeout",
    "feeder_slow": "the reward feeder's timeout, if scoring is this slow",
    "remote_code": "trusting the model folder's own code",
    "server_arg": "an SGLang argument the engine was given (the message starts with its name)",
    "attention_backend": "the engines' attention backend",
    "stall_timeout": "the engines' stall timeout, if generating or scoring is this slow",
}


class EngineError(Exception):
    """Base of every error the engine layer (SGLang engines, generation and reward
    requests, weight pushes, channel) raises on purpose. ``fix``: a key of :data:`FIXES`
    (the setting that fixes it, left to the layer above to name), or empty."""

    def __init__(self, *args: object, fix: str = "") -> None:
        super().__init__(*args)
        if fix and fix not in FIXES:
            raise ValueError(f"unknown fix {fix!r}; one of {sorted(FIXES)}")
        self.fix = fix


class EngineConfigError(EngineError):
    """A configuration value the engine layer checks is invalid; the message names the key."""


class RewardRequestError(EngineError):
    """The reward engine refused or failed one scoring request; the message names the
    request (step, sample) and the cause."""


class EngineStalledError(EngineError):
    """An engine with requests in flight sent nothing back for longer than its stall
    timeout while its processes were alive and generation was not paused."""


class EngineStartError(EngineError):
    """An engine could not be started; the message is one line naming the cause."""
