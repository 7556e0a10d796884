"""Which config keys exist, so that a misspelt one is refused (naming the closest) instead of ignored.

The packaged `conf/config.yaml` holds every key with its default; a preset or a `+key=value` override
that adds any other key is a typo. `engine.*` keys are the exception: they are the chosen backend's
options, which the backend checks itself (batchjob/engine). Hydra refuses a misspelt override without
`+` while composing, before batchjob runs; `composition_error` turns its exception into the same
one-line message.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from batchjob.errors import ConfigError, did_you_mean

CONF_DIR = Path(__file__).parent / "conf"
# Free-form subtrees: the backend's own options, checked by the backend.
_OPEN = frozenset({"engine"})
_HELP = "`python -m batchjob --help` lists every key"


@functools.cache
def packaged_defaults() -> dict[str, Any]:
    """conf/config.yaml without its defaults list and Hydra's settings: every job key and its default."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"), resolve=False)
    return {k: v for k, v in raw.items() if k not in ("defaults", "hydra")}


def dotted_keys(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every leaf key of a nested dict as `a.b.c`."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from dotted_keys(value, f"{name}.")
        else:
            yield name


def _unknown(given: dict[str, Any], known: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in given.items():
        name = f"{prefix}{key}"
        if key not in known:
            yield name
        elif isinstance(known[key], dict) and isinstance(value, dict) and key not in _OPEN:
            yield from _unknown(value, known[key], f"{name}.")


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse every key of `cfg` that the packaged config does not have, naming the closest valid key."""
    given = OmegaConf.to_container(cfg, resolve=False)
    unknown = list(_unknown(given, packaged_defaults()))
    if unknown:
        valid = list(dotted_keys(packaged_defaults()))
        named = ", ".join(f"{key}{did_you_mean(key, valid)}" for key in unknown)
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} {named}: {_HELP}")


def composition_error(err: Exception) -> str:
    """One line for an error Hydra raised while composing the config (before batchjob's code runs)."""
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return (
            f"{group}={option}: no such preset; choose one of {', '.join(err.options)}, or put {option}.yaml "
            f"in DIR/{group}/ and add --config-dir DIR"
        )
    cause = err.__cause__
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.full_key:
        # `sampling.max_new_token=8`: Hydra suggests adding `+`, which would only add the typo as a new key.
        siblings = cause.parent_node.keys() if isinstance(cause.parent_node, DictConfig) else ()
        parent = cause.full_key.rpartition(".")[0]
        valid = [f"{parent}.{key}" if parent else str(key) for key in siblings] or dotted_keys(packaged_defaults())
        return f"unknown key {cause.full_key}{did_you_mean(cause.full_key, valid)}: {_HELP}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines)
