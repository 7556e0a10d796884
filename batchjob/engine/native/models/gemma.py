"""Gemma 2 and Gemma 3 (text): norms before and after each sublayer, all scaling by `1 + weight` in float32;
GELU-tanh MLP; embeddings scaled by sqrt(hidden_size); attention scaled by `query_pre_attn_scalar`;
sliding-window layers interleaved with global ones (`layer_types`). Gemma 3 adds RMSNorm of q and k per head
and a rope base per layer type (`rope_local_base_freq` for the sliding layers); Gemma 2 soft-caps attention
scores and the final logits."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchjob.engine.native.models.config_spec import layer_windows, rope_spec
from batchjob.engine.native.models.spec import Architecture, LayerSpec, ModelSpec, UnsupportedModelError


def _gemma(config: Any, spec: ModelSpec) -> ModelSpec:
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(
            f"{spec.model_dir}: hidden_activation {config.hidden_activation!r} is not gelu_pytorch_tanh; use engine=hf"
        )
    return replace(
        spec,
        norm_placement="sandwich",
        norm_unit_offset=True,
        activation="gelu_tanh",
        embed_scale=config.hidden_size**0.5,
        attn_scale=config.query_pre_attn_scalar**-0.5,
        final_softcap=config.final_logit_softcapping or 0.0,
    )


def _gemma2(config: Any, spec: ModelSpec) -> ModelSpec:
    return replace(_gemma(config, spec), attn_softcap=config.attn_logit_softcapping or 0.0)


def _gemma3(config: Any, spec: ModelSpec) -> ModelSpec:
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{spec.model_dir}: bidirectional attention (an encoder); use engine=hf")
    ropes = {kind: rope_spec(params, config, spec.model_dir) for kind, params in config.rope_parameters.items()}
    layers = tuple(
        LayerSpec(rope=ropes[kind], window=window)
        for kind, window in zip(config.layer_types, layer_windows(config), strict=True)
    )
    return replace(_gemma(config, spec), qk_norm="head", layers=layers)


GEMMA2 = Architecture("Gemma2ForCausalLM", adapt=_gemma2)
GEMMA3 = Architecture("Gemma3ForCausalLM", adapt=_gemma3)
