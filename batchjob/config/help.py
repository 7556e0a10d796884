"""`python -m batchjob --help`: every key with its value for this command line and what it means.

The meanings are the comments beside each key in the packaged config files (conf/config.yaml, and
conf/engine/<backend>.yaml for `engine.*`), so the files and the help never disagree. The conf's help
template calls `${batchjob_keys_help:}`, which Hydra resolves against the composed config.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from batchjob.config.keys import CONF_DIR, dotted_keys

KEYS_HELP_RESOLVER = "batchjob_keys_help"
_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<value>[^#]*)(#\s?(?P<comment>.*))?$")
_MORE_COMMENT = re.compile(r"^(?P<indent> +)#\s?(?P<comment>.*)$")
_SKIPPED_SECTIONS = ("defaults", "hydra")
_KEY_WIDTH = 44


def described_keys(path: Path, prefix: str = "") -> dict[str, str]:
    """Dotted key -> the comment on its line (and the comment lines right below it that are indented deeper than
    the key; one at the key's own indentation is a heading of the keys after it)."""
    meanings: dict[str, str] = {}
    parents: list[tuple[int, str]] = []
    last: str | None = None
    indent = 0
    skipping = False
    for line in path.read_text().splitlines():
        key_line = _KEY_LINE.match(line)
        if key_line:
            indent = len(key_line["indent"])
            if indent == 0:
                skipping = key_line["key"] in _SKIPPED_SECTIONS
            if skipping:
                continue
            while parents and parents[-1][0] >= indent:
                parents.pop()
            name = prefix + ".".join([p for _, p in parents] + [key_line["key"]])
            parents.append((indent, key_line["key"]))
            last = name if key_line["comment"] else None
            if last:
                meanings[name] = key_line["comment"].strip()
            continue
        more = _MORE_COMMENT.match(line)
        if last and more and not skipping and len(more["indent"]) > indent:
            meanings[last] += " " + more["comment"].strip()
        else:
            last = None
    return meanings


@functools.cache
def key_meanings(engine: str) -> dict[str, str]:
    """Meanings of the job's keys and of backend `engine`'s options (other backends' files fill gaps)."""
    meanings: dict[str, str] = {}
    engine_files = sorted((CONF_DIR / "engine").glob("*.yaml"), key=lambda p: p.stem != engine)
    for path in reversed(engine_files):
        meanings.update(described_keys(path, "engine."))
    meanings.update(described_keys(CONF_DIR / "config.yaml"))
    return meanings


def _shown(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def keys_help(cfg: DictConfig) -> str:
    """One line per key of `cfg`: `key=value`, then its meaning."""
    job = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    try:
        tree = OmegaConf.to_container(job, resolve=True)
    except InterpolationResolutionError:  # e.g. a Slurm array the shard defaults refuse: shown unresolved
        tree = OmegaConf.to_container(job, resolve=False)
    meanings = key_meanings(str(tree.get("engine", {}).get("name")))
    lines = []
    for key in dotted_keys(tree):
        value = tree
        for part in key.split("."):
            value = value[part]
        setting = f"  {key}={_shown(value)}"
        lines.append(f"{setting:<{_KEY_WIDTH}}  {meanings.get(key, '')}".rstrip())
    # Hydra fills the template with string.Template, where `$` starts a placeholder.
    return "\n".join(lines).replace("$", "$$")


def register_help_resolver() -> None:
    if not OmegaConf.has_resolver(KEYS_HELP_RESOLVER):
        OmegaConf.register_new_resolver(KEYS_HELP_RESOLVER, lambda *, _root_: keys_help(_root_))
