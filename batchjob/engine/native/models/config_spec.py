"""A Llama-layout decoder's spec from transformers' config of it (`common_spec`): what every family shares, in the
dtype the checkpoint declares and for the model's whole length, with the readers a family's `adapt` uses too
(`rope_spec`, `layer_windows`). Every model the engine cannot run this way is refused here with
`UnsupportedModelError`, naming what it met and `engine=hf` as the way to run it.
"""

from __future__ import annotations

from typing import Any

import torch

from batchjob.engine.native.layers.rope import ROPE_TYPES, RopeSpec
from batchjob.engine.native.models.quantization import QuantSpec, UnsupportedQuantizationError, quant_spec_from_config
from batchjob.engine.native.models.spec import DTYPES, LayerSpec, ModelSpec, UnsupportedModelError

HIDDEN_ACTIVATION_FAMILIES = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM"})


def common_spec(
    config: Any,
    architecture: str,
    model_dir: str,
    generation: dict[str, Any],
) -> ModelSpec:
    """The spec of a Llama-layout decoder from transformers' `config`: what every family shares, in the dtype
    it declares and for its whole length (`requested_spec` applies a job's)."""
    # Gemma's configs name their activation `hidden_activation` (its family checks it) and may also carry a
    # `hidden_act` (Gemma 2's published configs do) that transformers' Gemma models never read.
    # "swish" is transformers' other name for SiLU (its ACT2FN maps it to torch's SiLU).
    activation = getattr(config, "hidden_act", "silu")
    if architecture not in HIDDEN_ACTIVATION_FAMILIES and activation not in ("silu", "swish"):
        raise UnsupportedModelError(f"{model_dir}: hidden_act {activation!r} is not silu; use engine=hf")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    rope = rope_spec(global_rope_parameters(config), config, model_dir)
    rotary_dim = int(head_dim * partial_rotary_factor(config))
    if rotary_dim % 2 or rotary_dim <= 0:
        raise UnsupportedModelError(f"{model_dir}: rotary dimension {rotary_dim} is not even; use engine=hf")
    eos = generation.get("eos_token_id")
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        architecture=architecture,
        model_dir=model_dir,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_model_len=config.max_position_embeddings,
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        rope=rope,
        layers=tuple(LayerSpec(rope=rope, window=window) for window in layer_windows(config)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        dtype=declared_dtype(config, model_dir),
        eos_token_ids=_token_ids(eos if eos is not None else config.eos_token_id),
        bos_token_id=generation.get("bos_token_id", config.bos_token_id),
        pad_token_id=generation.get("pad_token_id", config.pad_token_id),
        rotary_dim=rotary_dim,
        attn_scale=head_dim**-0.5,
        quantization=_quantization(config, model_dir),
    )


def _quantization(config: Any, model_dir: str) -> QuantSpec | None:
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    try:
        return quant_spec_from_config(quantization, model_dir)
    except UnsupportedQuantizationError as err:
        raise UnsupportedModelError(str(err)) from err


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if isinstance(value, int) else list(value)
    return tuple(dict.fromkeys(int(i) for i in ids))


def rope_spec(params: dict[str, Any], config: Any, model_dir: str) -> RopeSpec:
    """A `RopeSpec` from one standardised `rope_parameters` dict of transformers' config."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{model_dir}: rope type {rope_type!r} is not supported by the native engine "
            f"(supported: {', '.join(ROPE_TYPES)}); run it with engine=hf"
        )
    max_positions = config.max_position_embeddings
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if rope_type in ("llama3", "yarn", "longrope"):
        original = original or max_positions
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / original if rope_type in ("yarn", "longrope") else 1.0
    optional = {
        key: params[key]
        for key in ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim")
        if params.get(key) is not None
    }
    return RopeSpec(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", 10000.0)),
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        **optional,
    )


def global_rope_parameters(config: Any) -> dict[str, Any]:
    """The rope parameters of the full-attention layers: configs with a rope per layer type (Gemma 3) key them
    by type."""
    params = config.rope_parameters or {}
    return params.get("full_attention", params)


def partial_rotary_factor(config: Any) -> float:
    params = global_rope_parameters(config)
    return float(params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0)


def layer_windows(config: Any) -> list[int]:
    """Each layer's sliding window as transformers applies it: `layer_types` where the config has them (the
    "sliding_attention" layers), else `sliding_window` on every layer."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else 0 for kind in layer_types]


def declared_dtype(config: Any, model_dir: str) -> torch.dtype:
    """The dtype the checkpoint declares (float32 where it declares none, as transformers reads it)."""
    declared = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    dtype = declared.removeprefix("torch.")
    if dtype not in DTYPES:
        raise UnsupportedModelError(
            f"{model_dir}: config.json declares dtype {declared!r}; the native engine runs "
            f"{', '.join(DTYPES)} checkpoints; use engine=hf"
        )
    return DTYPES[dtype]
