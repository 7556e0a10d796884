"""Mixtral: the Mistral layout with a mixture of experts in every layer (top-k of a softmax, renormalised).
Its checkpoints call the MoE block `block_sparse_moe` and an expert's gate/down/up projections w1/w2/w3."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchjob.engine.native.models.spec import PRE_NORM_RENAMES, Architecture, ModelSpec, MoESpec


def _adapt(config: Any, spec: ModelSpec) -> ModelSpec:
    moe = MoESpec(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        renormalize=True,
    )
    return replace(spec, moe=moe, layers=tuple(replace(layer, sparse=True) for layer in spec.layers))


MIXTRAL = Architecture(
    "MixtralForCausalLM",
    adapt=_adapt,
    checkpoint_renames=(
        *PRE_NORM_RENAMES,
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
    ),
)
