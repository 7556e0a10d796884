"""SmolLM3: the Llama layout where the layers flagged 0 in `no_rope_layers` use no rotary embedding (NoPE);
a sliding window only with `use_sliding_window`, on the "sliding_attention" layers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchjob.engine.native.models.spec import PRE_NORM_RENAMES, Architecture, LayerSpec, ModelSpec


def _adapt(config: Any, spec: ModelSpec) -> ModelSpec:
    windowed = config.use_sliding_window and config.sliding_window
    layers = tuple(
        LayerSpec(
            rope=spec.rope if uses_rope else None,
            window=config.sliding_window if windowed and kind == "sliding_attention" else 0,
        )
        for uses_rope, kind in zip(config.no_rope_layers, config.layer_types, strict=True)
    )
    return replace(spec, layers=layers)


SMOLLM3 = Architecture("SmolLM3ForCausalLM", adapt=_adapt, checkpoint_renames=PRE_NORM_RENAMES)
