"""transformers' classes, imported by one thread at a time.

A job imports transformers beside the engine's start-up, in the threads that load the tokenizer, which takes
seconds of imports off the path to "ready to generate". Two threads importing transformers' lazily loaded
modules at once can each meet a module the other has half imported, so a job's imports of it go through here.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

_LOCK = threading.RLock()


def from_transformers(name: str) -> Any:
    """`from transformers import <name>`, under the process's one lock."""
    with _LOCK:
        return getattr(importlib.import_module("transformers"), name)
