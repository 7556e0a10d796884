"""One config value checked: a count, a number of seconds, a fraction, a flag; each refusal a `ConfigError` naming
the key, the value and what it must be."""

from __future__ import annotations

from typing import Any

from batchjob.errors import ConfigError


def positive_int(value: Any, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r}: must be an integer >= {minimum}")
    return value


def seconds(value: Any, key: str, zero: bool = False, meaning: str = "") -> float:
    """A number of seconds, > 0 (or >= 0 with `zero`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or (value == 0 and not zero):
        raise ConfigError(f"{key}={value!r}: must be a number of seconds {'>= 0' if zero else '> 0'}{meaning}")
    return float(value)


def fraction(value: Any, key: str, meaning: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(f"{key}={value!r}: must be a number from 0 to 1 ({meaning})")
    return float(value)


def flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: must be true or false")
    return value
