"""Qwen3-MoE: Qwen3 attention (q/k norms per head) with a mixture-of-experts MLP: softmax top-k routing,
renormalised when `norm_topk_prob`. Layers listed in `mlp_only_layers`, and all but every
`decoder_sparse_step`-th layer, keep a dense MLP."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchjob.engine.native.models.spec import PRE_NORM_RENAMES, Architecture, ModelSpec, MoESpec


def _adapt(config: Any, spec: ModelSpec) -> ModelSpec:
    dense_only = set(config.mlp_only_layers or ())
    step = config.decoder_sparse_step
    sparse = [i not in dense_only and config.num_experts > 0 and (i + 1) % step == 0 for i in range(spec.num_layers)]
    moe = MoESpec(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
    )
    layers = tuple(replace(layer, sparse=s) for layer, s in zip(spec.layers, sparse, strict=True))
    return replace(spec, qk_norm="head", moe=moe if any(sparse) else None, layers=layers)


QWEN3_MOE = Architecture("Qwen3MoeForCausalLM", adapt=_adapt, checkpoint_renames=PRE_NORM_RENAMES)
