"""Which config keys exist, so that a misspelt one is refused (naming the closest) instead of ignored.

The packaged `conf/config.yaml` holds every key with its default; a preset or a `+key=value` override
that adds any other key is a typo. `engine.*` keys are the exception: they are the chosen backend's
options, which the backend checks itself (batchjob/engine). Hydra refuses a misspelt override without
`+` while composing, before batchjob runs; `composition_error` turns its exception into the same
one-line message.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from batchjob.errors import ConfigError

CONF_DIR = Path(importlib.import_module("batchjob.conf").__file__).parent
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


def closest_key(key: str, valid: list[str]) -> str:
    """` (did you mean X?)` for the valid key whose last part is closest to `key`'s (its siblings first, so
    a shared `engine.` prefix is no likeness), or an empty string."""
    parent, _, leaf = key.rpartition(".")
    siblings = [v for v in valid if v.rpartition(".")[0] == parent]
    for pool in (siblings, valid):
        by_leaf: dict[str, str] = {}
        for name in pool:
            by_leaf.setdefault(name.rpartition(".")[2], name)
        close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        if close:
            return f" (did you mean {by_leaf[close[0]]}?)"
    return ""


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
        named = ", ".join(f"{key}{closest_key(key, valid)}" for key in unknown)
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} {named}: {_HELP}")


def composition_error(err: Exception) -> str:
    """One line for an error Hydra raised while composing the config (before batchjob's code runs), or for a
    preset file that is not YAML (which Hydra lets through as PyYAML's exception)."""
    import yaml
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import GrammarParseError

    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        what = ", ".join(part for part in (err.problem, err.context) if part)
        return f"{mark.name} is not valid YAML (line {mark.line + 1}, column {mark.column + 1}: {what}): fix the file"
    if isinstance(err.__cause__, GrammarParseError):
        cause = err.__cause__
        reason = str(cause).splitlines()[0]
        return (
            f"a preset's value of {cause.full_key} holds a ${{...}} that cannot be parsed ({reason}): write the "
            "interpolation in full, ${key} or ${resolver:arguments}, or escape a literal $ as \\$"
        )
    not_a_mapping = re.match(r"In '([^']+)': ConfigTypeError raised while composing config:\s+Cannot merge", str(err))
    if not_a_mapping:
        preset = not_a_mapping.group(1)
        return (
            f"preset {preset}.yaml holds a list or a single value, not keys: write it as `key: value` lines ({_HELP})"
        )
    if isinstance(err, OverrideParseException) and "=" in err.override:
        # Brackets, braces, parentheses, `+` and `*` mean something to Hydra's override grammar: a regex, an
        # inline schema or a grammar must be quoted for it, inside the shell's quotes.
        key, _, value = err.override.partition("=")
        reason = " ".join(err.message.split("See https://hydra.cc")[0].split()).strip(" ;.")
        if '"' not in value:
            quoted = f"""'{key}="{value}"'"""
        else:  # single quotes for Hydra inside the shell's double quotes, which then expand \ " $ `
            shell = "".join("\\" + c if c in '\\"$`' else c for c in value)
            quoted = '"' + f"{key}='{shell}'" + '"'
        fix = f"quote it for Hydra inside the shell's quotes, {quoted}"
        if key.lstrip("+~") in ("sampling.json_schema", "sampling.grammar"):
            fix += ", or put it in a file and give the file's path"
        return f"{key}={value}: Hydra cannot read this value ({reason}); {fix}"
    sweep = re.match(r"Ambiguous value for argument '([^=']+)=([^']*)'", str(err))
    if sweep:  # `key=a,b` is a sweep to Hydra, which a single run refuses
        key, value = sweep.groups()
        parts = value.split(",")
        fixes = f"""a list takes brackets, {key}=[{value}]; a text with commas takes quotes, '{key}="{value}"'"""
        if len(parts) == 2 and all(part.strip().isdigit() for part in parts):
            fixes = f"a decimal number takes a point, {key}={parts[0].strip()}.{parts[1].strip()}; " + fixes
        return f"{key}={value}: a comma makes Hydra read several values; {fixes}"
    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return (
            f"{group}={option}: no such preset; choose one of {', '.join(err.options)}, or put {option}.yaml "
            f"in DIR/{group}/ and add --config-dir DIR"
        )
    cause = err.__cause__
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.full_key:
        # `sampling.max_new_token=8`: Hydra suggests adding `+`, which would only add the typo as a new key.
        key = cause.full_key
        siblings = cause.parent_node.keys() if isinstance(cause.parent_node, DictConfig) else ()
        parent = key.rpartition(".")[0]
        valid = [f"{parent}.{name}" if parent else str(name) for name in siblings]
        suggestion = closest_key(key, valid or list(dotted_keys(packaged_defaults())))
        if parent in _OPEN and not suggestion:
            foreign = _foreign_engine_option(key, cause.parent_node)
            if foreign:
                return foreign
            # A preset that sets only some of its backend's options leaves the others out of the config.
            return (
                f"{key} is not in this engine preset: if it is an option of the backend, add it with "
                f"+{key}=VALUE (the backend checks it)"
            )
        return f"unknown key {key}{suggestion}: {_HELP}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines)


def _foreign_engine_option(key: str, engine: Any) -> str | None:
    """Why `engine.KEY` is refused when the chosen backend has no such option (`engine=native
    engine.enforce_eager=true`), naming the backend that has it; None when it may be one the preset left out."""
    from batchjob.engine import BACKENDS, option_names

    backend = engine.get("name") if isinstance(engine, DictConfig) else None
    takes = option_names(backend) if isinstance(backend, str) and backend in (*BACKENDS, "auto") else None
    option = key.rpartition(".")[2]
    if takes is None or option in takes:
        return None
    owners = [name for name in ("native", "hf") if option in (option_names(name) or ())]
    where = (
        f"it is an option of engine={owners[0]}"
        if owners
        else f"if it is one of vLLM's engine arguments, it goes with engine=vllm as +{key}=VALUE"
    )
    return f"unknown key {key}: engine={backend} has no such option ({where}); {_HELP}"
