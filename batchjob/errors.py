"""Errors meant for the person running the job."""


class ConfigError(ValueError):
    """A problem with the configuration or the inputs, found before any generation: the message names
    what is wrong and how to fix it, and the job exits with status 2 without a traceback."""
