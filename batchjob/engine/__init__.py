"""Backends behind one config key: `engine=auto | native | native_sync | hf | vllm`.

Each backend is a class taking `(model_path, **options)` with a `check_options(options)` classmethod that
raises `ValueError` naming the bad option and the fix. The same check lives in a module that imports no torch
(`OPTION_CHECKS`), where `check_engine_options` runs it before any engine module is imported, so a bad config
fails in a fraction of a second. A backend may also have a `check_model(model_path, options)` classmethod, which
reads the model's config files and weight-file headers only, raises `ValueError` for a model it cannot run or
weight files that cannot load (`weight_files.py`), and returns what it will run (the native engine: the
architecture).

`auto` is no backend of its own: `choose_backend` resolves it per model to `native` where the native engine
supports the architecture, else `vllm` where vLLM is installed, else `hf`. Its options are the native engine's
plus an `hf` mapping for the transformers fallback, which also receives the keys both backends share (`dtype`,
`device`, `max_model_len`, `deterministic`); the vLLM fallback receives the native options vLLM also has
(`VLLM_FROM_NATIVE`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchjob.engine.api import Completion, Engine, EngineFailure, EngineSetupError, Request, Sample, SamplingParams

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "Completion",
    "Engine",
    "EngineFailure",
    "EngineSetupError",
    "Request",
    "Sample",
    "SamplingParams",
    "check_engine_options",
    "choose_backend",
    "create_engine",
    "option_names",
]

BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "native": ("batchjob.engine.native.engine:NativeEngine", {"async_loop": True}),
    "native_sync": ("batchjob.engine.native.engine:NativeEngine", {"async_loop": False}),
    "hf": ("batchjob.engine.hf:HFEngine", {}),
    "vllm": ("batchjob.engine.vllm_engine:VLLMEngine", {}),
}
# Each backend's check of its options (raising ValueError), in a module that imports no torch: a job refuses a bad
# option, as it does a bad input or model file, before the engine's imports (seconds on a busy machine).
OPTION_CHECKS: dict[str, str] = {
    "native": "batchjob.engine.native.options:NativeOptions.from_mapping",
    "native_sync": "batchjob.engine.native.options:NativeOptions.from_mapping",
    "hf": "batchjob.engine.hf_options:check_options",
    "vllm": "batchjob.engine.vllm_options:check_options",
}
# What a backend begins on a model before its engine's imports (seconds of torch's), in a module that imports no
# torch: the native engine's check of its own reading of config.json, which then runs beside those imports.
EARLY_STARTS: dict[str, str] = {
    "native": "batchjob.engine.native.models.spec_check:begin_early",
    "native_sync": "batchjob.engine.native.models.spec_check:begin_early",
}
AUTO = "auto"
SHARED_OPTIONS = ("dtype", "device", "max_model_len", "deterministic")
# Native options that engine=auto's vLLM fallback takes as they are (vLLM has them, under the same meaning).
VLLM_FROM_NATIVE = (
    "dtype", "max_model_len", "deterministic", "tensor_parallel", "load_format", "quantization", "kv_cache_dtype",
    "gpu_memory_utilization", "seed",
)  # fmt: skip


@dataclass(frozen=True)
class BackendChoice:
    name: str  # a key of BACKENDS
    options: dict[str, Any]
    reason: str


def _known(name: str) -> None:
    if name not in BACKENDS:
        choices = ", ".join(sorted([AUTO, *BACKENDS]))
        raise ValueError(f"unknown engine {name!r}: choose one of {choices} (engine=NAME)")


def _imported(target: str) -> Any:
    """`package.module:Name.attribute` -> that object, importing the module."""
    module_name, attribute = target.split(":")
    return functools.reduce(getattr, attribute.split("."), importlib.import_module(module_name))


def _backend(name: str) -> tuple[type, dict[str, Any]]:
    _known(name)
    target, fixed = BACKENDS[name]
    return _imported(target), fixed


def _split_auto(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """engine=auto's options -> (the native engine's, the hf fallback's)."""
    native = dict(options)
    fallback = dict(native.pop("hf", None) or {})
    shared = {key: native[key] for key in SHARED_OPTIONS if key in native}
    return native, {**shared, **fallback}


def check_engine_options(name: str, options: Mapping[str, Any]) -> None:
    if name == AUTO:
        native, fallback = _split_auto(options)
        check_engine_options("native", native)
        try:
            check_engine_options("hf", fallback)
        except ValueError as err:
            raise ValueError(_under_hf(str(err))) from None
        return
    _known(name)
    _imported(OPTION_CHECKS[name])({**options, **BACKENDS[name][1]})


def _under_hf(message: str) -> str:
    """The hf check's message with its keys as engine=auto spells them: the fallback's own options live under
    `engine.hf.` (`engine.hf.lookahead`), the shared ones at `engine.` (`engine.dtype`)."""
    return re.sub(
        r"\bengine\.(\w+)", lambda key: key[0] if key[1] in SHARED_OPTIONS else f"engine.hf.{key[1]}", message
    )


def option_names(name: str) -> frozenset[str] | None:
    """The `engine.*` options backend `name` takes, read without importing it (no torch); None for vllm, whose
    options include vLLM's own `EngineArgs` fields (known only by importing vLLM)."""
    if name == "vllm":
        return None
    if name == AUTO:
        return option_names("native") | {"hf"}
    _known(name)
    if name == "hf":
        from batchjob.engine.hf_options import OPTION_DEFAULTS

        return frozenset(OPTION_DEFAULTS)
    from batchjob.engine.native.options import NativeOptions

    return frozenset(field.name for field in dataclasses.fields(NativeOptions))


def choose_backend(name: str, model_path: str, options: Mapping[str, Any]) -> BackendChoice:
    """The backend that will run `model_path` for `engine=name`, decided from the model's config files alone.
    Raises `ValueError` (the message says why and what to use instead) when an explicitly chosen backend
    cannot run the model; `auto` never refuses a model for its architecture."""
    if name == AUTO:
        from batchjob.engine.native.models.spec import UnsupportedModelError

        native, fallback = _split_auto(options)
        try:
            architecture = _check_model("native", model_path, native)
        except UnsupportedModelError as err:
            from batchjob.engine.vllm_options import vllm_device, vllm_version

            version = vllm_version()
            if version is not None and vllm_device():
                options = {key: native[key] for key in VLLM_FROM_NATIVE if key in native}
                _imported(OPTION_CHECKS["vllm"])(options)
                _check_model("vllm", model_path, options)
                return BackendChoice("vllm", options, f"the native engine cannot run it ({err}); vLLM {version} can")
            _check_fallback(native)
            _check_model("hf", model_path, fallback)
            why = "vLLM is not installed" if version is None else f"vLLM {version} finds no GPU here"
            return BackendChoice("hf", fallback, f"the native engine cannot run it ({err}) and {why}")
        return BackendChoice("native", native, f"the native engine supports {architecture}")
    _check_model(name, model_path, options)
    return BackendChoice(name, dict(options), f"engine={name} was asked for")


# Native engine options the hf fallback cannot honour, with the value that needs no native engine.
NATIVE_ONLY = {"tensor_parallel": 1, "load_format": "auto", "quantization": "auto", "kv_cache_dtype": "auto"}


def _check_fallback(native: Mapping[str, Any]) -> None:
    asked = [f"engine.{key}={native[key]}" for key, plain in NATIVE_ONLY.items() if native.get(key, plain) != plain]
    if asked:
        raise ValueError(
            f"{' and '.join(asked)} need the native engine, which cannot run this model (engine=auto would fall "
            "back to hf, which runs one device with the model's own weights): drop them, or use a model the "
            "native engine supports"
        )


def _begin_early(name: str, model_path: str, options: Mapping[str, Any]) -> None:
    target = EARLY_STARTS.get(name)
    if target is not None:
        with contextlib.suppress(OSError):  # an unreadable model directory: the backend's own checks name it
            _imported(target)(model_path, str(options.get("device", "auto")))


def _check_model(name: str, model_path: str, options: Mapping[str, Any]) -> str | None:
    _begin_early(name, model_path, options)
    cls, fixed = _backend(name)
    check_model = getattr(cls, "check_model", None)
    return None if check_model is None else check_model(model_path, {**options, **fixed})


def create_engine(name: str, model_path: str, options: Mapping[str, Any], asked: str | None = None) -> Engine:
    """Backend `name` started on `model_path`. `asked`: the backend the user named where `name` was chosen for it
    (`engine=auto`, resolved by `choose_backend`): a refusal while it starts then names options as that spells them
    (the hf fallback's `engine.hf.attn_implementation`)."""
    asked = asked or name
    if name == AUTO:
        choice = choose_backend(name, model_path, options)
        name, options = choice.name, choice.options
    _begin_early(name, model_path, options)
    cls, fixed = _backend(name)
    merged = {**options, **fixed}
    try:
        cls.check_options(merged)
        return cls(model_path, **merged)
    except EngineSetupError as err:
        if asked == AUTO and name == "hf":
            raise EngineSetupError(_under_hf(str(err))) from err
        raise
