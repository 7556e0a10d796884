"""The hf backend's options (`engine.*` keys with `engine=hf`), checked before anything is loaded; nothing here
needs torch, so a job refuses a bad option before importing the engine."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from batchjob.errors import did_you_mean

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# transformers' attention implementations (flash_attention_N for any FlashAttention version it knows), optionally
# `paged|`-prefixed, or a kernel from the hub (`org/name`, `org/name:function`): anything else is a typo.
ATTENTION = re.compile(r"(paged\|)?(sdpa|eager|flex_attention|flash_attention_\d|[\w.-]+/[\w.:@-]+)")
OPTION_DEFAULTS: dict[str, Any] = {
    "dtype": "auto",
    "device": "auto",
    "max_batch_size": 32,
    "max_batch_tokens": 65536,
    "lookahead": 4,
    "max_model_len": None,
    "attn_implementation": "sdpa",
    "tensor_parallel": 1,
    "deterministic": False,
}


def check_options(options: Mapping[str, Any]) -> None:
    """Raise `ValueError` naming the first bad option and what it takes."""
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        named = ", ".join(f"engine.{key}{did_you_mean(key, OPTION_DEFAULTS, prefix='engine.')}" for key in unknown)
        raise ValueError(f"unknown hf engine option(s) {named}: the hf engine takes {', '.join(OPTION_DEFAULTS)}")
    opts = {**OPTION_DEFAULTS, **options}
    if opts["dtype"] != "auto" and opts["dtype"] not in DTYPE_NAMES:
        raise ValueError(f"engine.dtype={opts['dtype']!r}: use auto, {', '.join(DTYPE_NAMES)}")
    if opts["device"] not in ("auto", "cpu") and not str(opts["device"]).startswith("cuda"):
        raise ValueError(f"engine.device={opts['device']!r}: use auto, cpu, cuda or cuda:N")
    if not isinstance(opts["deterministic"], bool):
        raise ValueError(f"engine.deterministic must be true or false, got {opts['deterministic']!r}")
    attention = opts["attn_implementation"]
    if attention is not None and not (isinstance(attention, str) and ATTENTION.fullmatch(attention)):
        raise ValueError(
            f"engine.attn_implementation={attention!r}: use sdpa, eager, flex_attention or flash_attention_2 (3, 4: "
            "with the package of that FlashAttention installed), or a kernel from the hub as org/name"
        )
    for key in ("max_batch_size", "max_batch_tokens", "lookahead"):
        if not isinstance(opts[key], int) or isinstance(opts[key], bool) or opts[key] < 1:
            raise ValueError(f"engine.{key} must be a positive integer, got {opts[key]!r}")
    if opts["tensor_parallel"] != 1:
        raise ValueError(
            f"engine.tensor_parallel={opts['tensor_parallel']}: the hf engine runs a model on one device; "
            "use engine=native to split a model over GPUs, or engine.data_parallel to use more GPUs"
        )
    if opts["max_model_len"] is not None and (not isinstance(opts["max_model_len"], int) or opts["max_model_len"] < 2):
        raise ValueError(f"engine.max_model_len must be null or an integer >= 2, got {opts['max_model_len']!r}")
