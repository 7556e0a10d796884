"""`${...}` interpolations that cannot be resolved, refused before the job reads any value: a key or resolver that
does not exist, an unset environment variable, a value left `???`, each named with its fix."""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    InterpolationKeyError,
    InterpolationResolutionError,
    InterpolationToMissingValueError,
    MissingMandatoryValue,
    UnsupportedInterpolationType,
)

from batchjob.errors import ConfigError


def check_resolvable(cfg: DictConfig) -> None:
    """Resolve every `${...}` of `cfg` once, so that one that cannot be resolved (a key or resolver that does not
    exist, an unset environment variable, a value left `???`) is a `ConfigError` naming the key and the fix, not
    OmegaConf's exception wherever the value is first read."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (InterpolationResolutionError, MissingMandatoryValue) as err:
        raise ConfigError(_unresolvable(cfg, err)) from None


def _unresolvable(cfg: DictConfig, err: InterpolationResolutionError | MissingMandatoryValue) -> str:
    key = err.full_key
    # OmegaConf's first line says what failed; a resolver's own exception is rewrapped there without its cause.
    reason = str(err).splitlines()[0].split(" while resolving interpolation: ", 1)[-1].strip("\"'")
    named = re.search(r"'([^']*)'", reason) or re.search(r"(\S+)$", reason)
    if isinstance(err, MissingMandatoryValue):
        return f"{key} is not set (???): set {key}=VALUE"
    given = f"{key}={raw_value(cfg, key)}"
    if isinstance(err, InterpolationToMissingValueError):
        return f"{given}: it refers to {named.group(1)}, which is not set (???): set {named.group(1)}=VALUE"
    if isinstance(err, InterpolationKeyError):
        return (
            f"{given}: the config has no key {named.group(1)} to refer to; give the value itself, or a key that "
            "`python -m batchjob --cfg job` shows (an environment variable: ${oc.env:NAME})"
        )
    if isinstance(err, UnsupportedInterpolationType):
        return (
            f"{given}: there is no resolver named {named.group(1)}; give the value itself (an environment "
            "variable: ${oc.env:NAME})"
        )
    if str(err).startswith(f"{ConfigError.__name__} raised"):  # batchjob's own resolvers say what to fix
        return f"{key}: {reason}"
    return f"{given} cannot be resolved ({reason}): give the value itself, or fix the interpolation"


def raw_value(cfg: DictConfig, key: str) -> Any:
    """The value of dotted `key` (`a.b`, `a.b[0]`) as written, before resolving."""
    value: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in re.findall(r"[^.\[\]]+", key):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value
