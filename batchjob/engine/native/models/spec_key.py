"""The key of a model's entry in the spec cache (`spec_cache.py`): its config files, the transformers version and
the code that builds a spec. It imports no torch, so a start-up can look for the entry before the engine's
imports (`spec_check.begin_early`)."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from batchjob.caches import files_key, load_entry
from batchjob.engine.transformers_import import transformers_version

CONFIG_FILES = ("config.json", "generation_config.json")
KIND = "model-specs"
# The rope parameters' normalisation, which builds a spec too.
ROPE_MODULE = Path(__file__).resolve().parents[1] / "layers" / "rope.py"


@cache
def _code_digest() -> str:
    """What builds a spec: the model families' modules and the rope parameters' normalisation."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")) + [ROPE_MODULE]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def spec_key(model_dir: Path) -> str:
    return files_key(model_dir, CONFIG_FILES, transformers_version(), _code_digest())


def is_kept(key: str) -> bool:
    """Whether the spec cache holds an entry under `key` (readable or not: `spec_cache.load_spec` decides)."""
    return load_entry(KIND, key) is not None
