"""The Llama layout and its close relatives: Llama, Mistral (sliding window on every layer), Qwen2 (biases on
q/k/v, sliding window from `max_window_layers` on when `use_sliding_window`), Qwen3 (RMSNorm of q and k per
head)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchjob.engine.native.models.spec import PRE_NORM_RENAMES, Architecture, ModelSpec


def _qwen2(config: Any, spec: ModelSpec) -> ModelSpec:
    return replace(spec, qkv_bias=True, o_bias=False)


def _qwen3(config: Any, spec: ModelSpec) -> ModelSpec:
    return replace(spec, qk_norm="head")


LLAMA_FAMILY = (
    Architecture("LlamaForCausalLM", checkpoint_renames=PRE_NORM_RENAMES),
    Architecture("MistralForCausalLM", checkpoint_renames=PRE_NORM_RENAMES),
    Architecture("Qwen2ForCausalLM", adapt=_qwen2, checkpoint_renames=PRE_NORM_RENAMES),
    Architecture("Qwen3ForCausalLM", adapt=_qwen3, checkpoint_renames=PRE_NORM_RENAMES),
)
