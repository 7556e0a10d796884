"""batchjob: offline batch LLM generation with exactly-once resume.

From Python: `LLM(model, **engine options).generate(prompts, SamplingParams(...))` runs an engine in this
process; `run(**config)` runs a whole job as `python -m batchjob` does and returns its report.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "JobIncomplete", "SamplingParams", "run"]

# Imported on first use: `python -m batchjob` and the IO layer should not pay for torch or Hydra here.
_EXPORTS = {
    "LLM": "batchjob.api.llm",
    "SamplingParams": "batchjob.engine.api",
    "JobIncomplete": "batchjob.api.job",
    "run": "batchjob.api.job",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'batchjob' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
