"""Specs of models read before, so that a job's start-up need not import transformers' config classes.

Reading config.json through transformers' config class (for its defaults and renamings) imports most of
transformers: seconds on a GPU node, the largest part of a warm start-up (docs/benchmarks.md). A spec depends
only on config.json, generation_config.json, the installed transformers (its defaults) and the code that builds
it, so it is kept under `$BATCHJOB_CACHE/model-specs`, keyed by a digest of all four: an edited config, another
transformers or a changed family rule all read the config again. An entry that cannot be read is read again
from the config; one that cannot be written (a read-only cache) is skipped.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from batchjob.caches import load_entry, store_entry
from batchjob.engine.native.layers.rope import RopeSpec
from batchjob.engine.native.models.quantization import QuantSpec
from batchjob.engine.native.models.spec import DTYPES, LayerSpec, ModelSpec, MoESpec
from batchjob.engine.native.models.spec_key import KIND

log = logging.getLogger("batchjob.engine.native")


def load_spec(key: str, model_dir: Path) -> ModelSpec | None:
    """The spec kept under `key` (for the model in `model_dir`), or None."""
    fields = load_entry(KIND, key)
    if fields is None:
        return None
    try:
        spec = spec_from_json(fields)
    except (ValueError, TypeError, KeyError) as err:
        log.debug("model spec %s unreadable (%s): reading the config again", key, err)
        return None
    return dataclasses.replace(spec, model_dir=str(model_dir))


def store_spec(key: str, spec: ModelSpec) -> None:
    store_entry(KIND, key, spec_to_json(spec))


def spec_to_json(spec: ModelSpec) -> dict[str, Any]:
    fields = dataclasses.asdict(spec)
    fields["dtype"] = str(spec.dtype).removeprefix("torch.")
    fields["kv_cache_dtype"] = None  # a job's choice, not the model's: applied after the cache (requested_spec)
    return fields


def spec_from_json(fields: dict[str, Any]) -> ModelSpec:
    def rope_of(params: dict[str, Any] | None) -> RopeSpec | None:
        if params is None:
            return None
        factors = {key: tuple(params[key]) for key in ("short_factor", "long_factor")}
        return RopeSpec(**{**params, **factors})

    moe, quantization = fields["moe"], fields.get("quantization")
    return ModelSpec(
        **{
            **fields,
            "rope": rope_of(fields["rope"]),
            "layers": tuple(LayerSpec(**{**layer, "rope": rope_of(layer["rope"])}) for layer in fields["layers"]),
            "dtype": DTYPES[fields["dtype"]],
            "kv_cache_dtype": None,
            "eos_token_ids": tuple(fields["eos_token_ids"]),
            "moe": None if moe is None else MoESpec(**moe),
            "quantization": None if quantization is None else _quant_spec(quantization),
        }
    )


def _quant_spec(fields: dict[str, Any]) -> QuantSpec:
    block = fields["block"]
    return QuantSpec(
        **{
            **fields,
            "block": None if block is None else tuple(block),
            "ignore": tuple(fields["ignore"]),
            "targets": tuple(fields["targets"]),
        }
    )
