"""OLMo 2: norms after each sublayer instead of before (`post_attention_layernorm`,
`post_feedforward_layernorm`), RMSNorm of q and k over the whole projection (all heads at once), norm weights
multiplied in float32."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchjob.engine.native.models.spec import Architecture, ModelSpec


def _adapt(config: Any, spec: ModelSpec) -> ModelSpec:
    return replace(spec, qk_norm="full", norm_placement="post", norm_weight_fp32=True)


OLMO2 = Architecture("Olmo2ForCausalLM", adapt=_adapt)
