"""Errors the trainer layer raises on purpose: one-line messages naming what to change.

Owns: :class:`TrainerError` (the base), :class:`TrainerConfigError` (an invalid trainer
setting) and :class:`ModelSourceError` (a model folder missing or malformed).
``colocate.errors.USER_ERRORS`` groups them with the other layers' errors; this module
imports nothing of colocate, so the trainer layer needs no upward edge.
"""


class TrainerError(Exception):
    """Base of every error the trainer layer (FSDP models, PPO math, optimizers) raises on purpose."""


class TrainerConfigError(TrainerError):
    """A trainer setting is invalid; the message names the key."""


class ModelSourceError(TrainerError):
    """A model, tokenizer or model file is missing or not in the expected form."""
