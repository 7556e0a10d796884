"""`spec_check.py`'s worker: `python -m batchjob.engine.native.models.spec_check_worker MODEL_DIR [MODEL_DIR ...]`
reads each model's config through transformers and prints, a line each, what its config object presents to the
spec (`config_fields`), as JSON. The engine's process builds transformers' spec from it (`registry.transformers_spec`),
keeps that in the spec cache and compares it with the native reading.

torch is hidden from it: transformers reads a config without torch (the dtype then stays a name, which the spec reads
as it reads a torch dtype), and with torch installed its imports take torch's distributed tensors and compiler parts
along, most of the worker's time: 6.8-7.3 s on a 2-core machine against 1.9-2.2 s without. On a 16-core GPU host,
under a cold start-up's load, it took 17-20 s with torch and held a cold W2's first results 0.56 s; without, 11.9 s,
holding none (docs/benchmarks.md). Hidden too
are packages transformers imports whenever they are installed and a config never uses: torchvision took 4.2 s of
12.5 s on such a host, and scikit-learn (which transformers 5.17 imports with its generation utilities) 1.4 s.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# A module set to None is one `importlib.util.find_spec` reports missing, and importing it fails.
HIDDEN = ("torch", "torchvision", "torchaudio", "sklearn")
# A nested config's fields are kept under this key (`registry.config_namespace` turns them back into an object).
NESTED = "__config__"


def config_fields(config: Any) -> dict[str, Any]:
    """The public attributes of transformers' config object that JSON can hold: its fields, class attributes and
    properties (what the spec reads through `getattr`), a nested config's as {NESTED: its own}."""
    fields: dict[str, Any] = {}
    for name in dir(config):
        if name.startswith("_"):
            continue
        try:
            value = getattr(config, name)
        except (AttributeError, NotImplementedError, TypeError, ValueError):
            continue  # a property this config cannot compute: the spec cannot read it either
        if callable(value):
            continue
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            fields[name] = {NESTED: config_fields(value)}
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        fields[name] = value
    return fields


def main(model_dirs: list[str]) -> None:
    for name in HIDDEN:
        sys.modules.setdefault(name, None)
    from batchjob.engine.transformers_import import from_transformers

    from_transformers("logging").set_verbosity_error()  # its notes on deprecated attributes, read here by `dir`
    auto_config = from_transformers("AutoConfig")
    for model_dir in model_dirs:
        print(json.dumps(config_fields(auto_config.from_pretrained(model_dir))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
