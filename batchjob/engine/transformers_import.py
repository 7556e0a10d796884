"""transformers' classes, imported by one thread at a time, and a model's tokenizer loaded with as little of
transformers as possible.

A job imports transformers beside the engine's start-up, in the threads that load the tokenizer, which takes
seconds of imports off the path to "ready to generate". Two threads importing transformers' lazily loaded
modules at once can each meet a module the other has half imported, so a job's imports of it go through here.

`AutoTokenizer` (transformers 5) loads the model's config class to choose a tokenizer class, which imports the
model auto-classes, the generation utilities and with them torch's compiler stack: seconds on a GPU node, far
more than the tokenizer itself. The class it chose for a model directory is kept in
`$BATCHJOB_CACHE/tokenizer-classes`, keyed by the directory, the files it chose from and the transformers
version; a later load imports that class's module alone and calls its `from_pretrained` as `AutoTokenizer`
would.

Importing transformers calls `importlib.metadata.packages_distributions()`, which lists every file of every
installed distribution that ships no `top_level.txt` (a GPU node's environment holds the CUDA wheels' tens of
thousands): seconds of Python on such a node, holding the interpreter lock beside the engine's start-up. Its
result is kept in `$BATCHJOB_CACHE/package-distributions`, keyed by every `sys.path` folder and the time it last
gained or lost an entry (installing, upgrading or removing a distribution adds or removes its `.dist-info`
folder), and the first import through here makes the process's `packages_distributions` read it (the same
mapping; recomputed whenever the key changes).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

from batchjob.caches import files_key, load_entry, store_entry

_LOCK = threading.RLock()
KIND = "tokenizer-classes"
# What AutoTokenizer's choice reads: the model type, the tokenizer config's class and auto_map, and the path
# (some model names are matched to a class), which is part of the key too.
CHOICE_FILES = ("config.json", "tokenizer_config.json")


PACKAGES_KIND = "package-distributions"
_computed_packages_distributions = metadata.packages_distributions


def environment_key() -> str:
    """The installed distributions' state: every `sys.path` entry with the time it last changed (a folder gains or
    loses an entry when a distribution is installed, upgraded or removed), and the interpreter."""
    digest = hashlib.sha256(sys.version.encode())
    for entry in sys.path:
        try:
            changed = os.stat(entry or ".").st_mtime_ns
        except OSError:
            changed = -1
        digest.update(f"{entry}\0{changed}\0".encode())
    return digest.hexdigest()[:32]


def kept_packages_distributions() -> dict[str, list[str]]:
    """`importlib.metadata.packages_distributions()`, from `$BATCHJOB_CACHE` when an earlier process computed it
    for the same `environment_key()`."""
    key = environment_key()
    kept = load_entry(PACKAGES_KIND, key)
    if isinstance(kept, dict):
        return kept
    mapping = _computed_packages_distributions()
    store_entry(PACKAGES_KIND, key, mapping)
    return mapping


def _import(module: str) -> Any:
    """`importlib.import_module(module)` under the process's one lock, with the distributions' mapping kept."""
    with _LOCK:
        metadata.packages_distributions = kept_packages_distributions
        return importlib.import_module(module)


def from_transformers(name: str) -> Any:
    """`from transformers import <name>`, under the process's one lock."""
    return getattr(_import("transformers"), name)


def transformers_version() -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"


def _kept_class(key: str) -> type | None:
    entry = load_entry(KIND, key)
    if not isinstance(entry, dict) or not str(entry.get("module", "")).startswith("transformers."):
        return None
    try:
        return getattr(_import(entry["module"]), entry["name"])
    except (ImportError, AttributeError, KeyError, TypeError):
        return None


def load_tokenizer(model_path: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(model_path)`; for a local directory whose choice of class is kept, that
    class's own `from_pretrained`, called as AutoTokenizer calls it."""
    model_dir = Path(model_path)
    if not model_dir.is_dir():  # a hub id: AutoTokenizer fetches the files
        return from_transformers("AutoTokenizer").from_pretrained(str(model_path))
    key = files_key(model_dir, CHOICE_FILES, transformers_version(), str(model_dir))
    chosen = _kept_class(key)
    if chosen is not None:
        return chosen.from_pretrained(str(model_dir), _from_auto=True)
    tokenizer = from_transformers("AutoTokenizer").from_pretrained(str(model_dir))
    cls = type(tokenizer)
    if cls.__module__.startswith("transformers."):  # not a model's own code (trust_remote_code)
        store_entry(KIND, key, {"module": cls.__module__, "name": cls.__qualname__})
    return tokenizer
