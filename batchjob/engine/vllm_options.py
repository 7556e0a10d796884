"""The vllm backend's options (`engine.*` with `engine=vllm`) and how a job's settings map onto vLLM's.

batchjob's own keys keep batchjob's names (`tensor_parallel`, `deterministic`, ...); every other key must be one
of vLLM's `EngineArgs` fields and is passed through as it is (`+engine.enforce_eager=true`). The arguments
batchjob sets itself (the model, its tokenizer, the seed) cannot be passed. Checking the pass-through keys imports
vLLM (seconds; no GPU work); a machine without vLLM is told how to install it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from collections.abc import Mapping
from typing import Any

from batchjob.engine.api import SamplingParams
from batchjob.errors import did_you_mean

OPTION_DEFAULTS: dict[str, Any] = {
    "dtype": "auto",
    "max_model_len": None,
    "tensor_parallel": 1,
    "gpu_memory_utilization": 0.9,
    "load_format": "auto",
    "quantization": "auto",
    "kv_cache_dtype": "auto",
    "seed": 0,
    "deterministic": False,
    "detokenize": True,
}
# batchjob's name -> EngineArgs' name, where they differ
RENAMED = {"tensor_parallel": "tensor_parallel_size"}
# EngineArgs fields batchjob sets from the job itself
RESERVED = {
    "model": "model.path",
    "tokenizer": "model.path (the tokenizer beside the model)",
    "tensor_parallel_size": "engine.tensor_parallel",
    "skip_tokenizer_init": "nothing (batchjob needs the tokenizer for stop strings and text)",
}
INSTALL = "pip install 'batchjob[vllm]' (vLLM needs an NVIDIA GPU; its version must match the installed torch)"


def vllm_version() -> str | None:
    """The installed vLLM's version, without importing it (None: not installed)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from importlib.metadata import version

    return version("vllm")


NO_DEVICE = (
    "vLLM finds no device to run on here (no GPU visible, or a vLLM built for another kind of device): run the job "
    "on a GPU machine, or use engine=native or engine=hf here"
)


def vllm_device() -> str:
    """The kind of device the installed vLLM runs on here ("cuda", ...), or "" where it finds none."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type or "")


@functools.cache
def engine_arg_fields() -> frozenset[str]:
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(field.name for field in dataclasses.fields(EngineArgs))


def check_options(options: Mapping[str, Any]) -> None:
    """Raise `ValueError` naming the first bad option and what it takes."""
    if vllm_version() is None:
        raise ValueError(f"vLLM is not installed here: {INSTALL}; or use engine=native or engine=hf")
    reserved = [f"engine.{key} (batchjob sets it from {RESERVED[key]})" for key in options if key in RESERVED]
    if reserved:
        raise ValueError(f"{', '.join(reserved)} cannot be set")
    fields = engine_arg_fields()
    known = set(OPTION_DEFAULTS) | fields
    unknown = sorted(set(options) - known)
    if unknown:
        named = ", ".join(f"engine.{key}{did_you_mean(key, known, prefix='engine.')}" for key in unknown)
        raise ValueError(
            f"unknown vllm engine option(s) {named}: the vllm engine takes {', '.join(OPTION_DEFAULTS)} and "
            "vLLM's EngineArgs fields (https://docs.vllm.ai/en/latest/configuration/engine_args.html)"
        )
    opts = {**OPTION_DEFAULTS, **options}
    if (
        not isinstance(opts["tensor_parallel"], int)
        or isinstance(opts["tensor_parallel"], bool)
        or (opts["tensor_parallel"] < 1)
    ):
        raise ValueError(f"engine.tensor_parallel must be an integer >= 1, got {opts['tensor_parallel']!r}")
    for key in ("deterministic", "detokenize"):
        if not isinstance(opts[key], bool):
            raise ValueError(f"engine.{key} must be true or false, got {opts[key]!r}")
    if not isinstance(opts["seed"], int) or isinstance(opts["seed"], bool):
        raise ValueError(f"engine.seed must be an integer, got {opts['seed']!r}")
    utilization = opts["gpu_memory_utilization"]
    if not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"engine.gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if opts["max_model_len"] is not None and (not isinstance(opts["max_model_len"], int) or opts["max_model_len"] < 2):
        raise ValueError(f"engine.max_model_len must be null or an integer >= 2, got {opts['max_model_len']!r}")


def engine_kwargs(model_path: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` (its `EngineArgs`) for a job's model and `engine.*` options."""
    opts = {**OPTION_DEFAULTS, **options}
    kwargs: dict[str, Any] = {"model": model_path, "tokenizer": model_path}
    for key, value in opts.items():
        if key in ("deterministic", "detokenize"):
            continue  # vLLM's environment switch (VLLM_BATCH_INVARIANT) and a sampling setting: the engine's
        if key in ("quantization", "max_model_len") and value in ("auto", None):
            continue  # vLLM reads them from the checkpoint
        kwargs[RENAMED.get(key, key)] = value
    return kwargs


def sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """The keyword arguments of `vllm.SamplingParams` for a request's sampling settings (structured outputs as a
    dict of `StructuredOutputsParams`' arguments under `structured_outputs`)."""
    kwargs: dict[str, Any] = {
        "n": sampling.n,
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # 0: off, in both
        "min_p": sampling.min_p,
        "seed": sampling.seed,
        "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "logprobs": sampling.logprobs,
    }
    constraint = sampling.constraint
    if constraint is not None:
        if constraint.kind == "json_schema":
            structured = {"json": constraint.text, "disable_any_whitespace": not constraint.json_whitespace}
        elif constraint.kind == "choice":
            structured = {"choice": json.loads(constraint.text)}
        else:
            structured = {constraint.kind: constraint.text}  # regex, grammar
        kwargs["structured_outputs"] = structured
        # A constrained row ends where its constraint is complete: stop strings and ids would cut it short.
        kwargs["stop"], kwargs["stop_token_ids"] = [], []
    return kwargs
