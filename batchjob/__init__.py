"""batchjob: offline batch LLM generation with exactly-once resume.

From Python: `LLM(model, **engine options).generate(prompts, SamplingParams(...))` runs an engine in this
process; `run(**config)` runs a whole job as `python -m batchjob` does and returns its report.
"""

from __future__ import annotations

import os
from typing import Any

# An installed batchjob holds its config tree and prompt pipelines as the subpackages `batchjob.conf` and
# `batchjob.pipelines` (pyproject.toml maps the repository's conf/ and pipelines/ there). Run from a source checkout
# without installing (`PYTHONPATH=.`, or the repository root shadowing an installed batchjob), they sit beside
# this package instead: the checkout's root joins the package's search path, so the same names import.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(__path__[0], "conf")) and os.path.isfile(
    os.path.join(_CHECKOUT, "conf", "config.yaml")
):
    __path__.append(_CHECKOUT)

__all__ = ["LLM", "JobIncomplete", "SamplingParams", "TooManyFailedRows", "run"]

# Imported on first use: `python -m batchjob` and the IO layer should not pay for torch or Hydra here.
_EXPORTS = {
    "LLM": "batchjob.api.llm",
    "SamplingParams": "batchjob.engine.api",
    "JobIncomplete": "batchjob.api.job",
    "TooManyFailedRows": "batchjob.api.job",
    "run": "batchjob.api.job",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'batchjob' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
