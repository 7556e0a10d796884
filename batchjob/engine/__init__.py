"""Backends behind one config key: `engine=native | native_sync | hf`.

Each backend is a class taking `(model_path, **options)` with a `check_options(options)` classmethod that
raises `ValueError` naming the bad option and the fix, and a `check_model(model_path, options)` classmethod
that reads the model's config files only and raises `ValueError` for a model it cannot run (an
architecture, a weight format); `check_engine_options` and `check_engine_model` run them before any model
is loaded, so a bad config fails before any GPU work.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from batchjob.engine.api import Completion, Engine, Request, Sample, SamplingParams

__all__ = [
    "BACKENDS",
    "Completion",
    "Engine",
    "Request",
    "Sample",
    "SamplingParams",
    "check_engine_model",
    "check_engine_options",
    "create_engine",
]

BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "native": ("batchjob.engine.native.engine:NativeEngine", {"async_loop": True}),
    "native_sync": ("batchjob.engine.native.engine:NativeEngine", {"async_loop": False}),
    "hf": ("batchjob.engine.hf:HFEngine", {}),
}


def _backend(name: str) -> tuple[type, dict[str, Any]]:
    if name not in BACKENDS:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(sorted(BACKENDS))} (engine=NAME)")
    target, fixed = BACKENDS[name]
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name), fixed


def check_engine_options(name: str, options: Mapping[str, Any]) -> None:
    cls, fixed = _backend(name)
    cls.check_options({**options, **fixed})


def check_engine_model(name: str, model_path: str, options: Mapping[str, Any]) -> None:
    cls, fixed = _backend(name)
    cls.check_model(model_path, {**options, **fixed})


def create_engine(name: str, model_path: str, options: Mapping[str, Any]) -> Engine:
    cls, fixed = _backend(name)
    merged = {**options, **fixed}
    cls.check_options(merged)
    return cls(model_path, **merged)
