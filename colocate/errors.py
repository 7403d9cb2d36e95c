"""Exceptions colocate raises on purpose; catch `ColocateError` to catch them all."""


class ColocateError(Exception): """Base of every error colocate raises on purpose."""
class ModelSourceError(ColocateError): """A model, tokenizer or model file is missing or not in the expected form."""
class ConfigError(ColocateError): """A configuration value, file or CLI option is invalid; the message names the key."""
