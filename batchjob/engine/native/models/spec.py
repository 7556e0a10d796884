"""`ModelSpec`: what the engine needs to know about a model, read from its config files alone (no weights),
so the cache can be sized and a bad model refused before any GPU work."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchjob.engine.native.layers import ROPE_TYPES, RopeSpec

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The native engine cannot run this model; the message says why and what to use instead."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    model_dir: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int  # longest sequence (prompt + generation) the engine may build
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]  # generation_config.json's, else config.json's
    bos_token_id: int | None
    pad_token_id: int | None

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes over all layers (K and V) in `dtype`."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if isinstance(value, int) else list(value)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _rope_spec(config: dict[str, Any], model_dir: str) -> RopeSpec:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs have `rope_theta` and an
    # optional `rope_scaling` whose type key was once called `type`.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{model_dir}: rope type {rope_type!r} is not supported by the native engine "
            f"(supported: {', '.join(ROPE_TYPES)}); run it with engine=hf"
        )
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{model_dir}: partial rotary embeddings are not supported; use engine=hf")
    max_positions = config["max_position_embeddings"]
    original = params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn"):
        original = original or max_positions
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / original if rope_type == "yarn" else 1.0
    optional = {
        key: params[key]
        for key in ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim")
        if params.get(key) is not None
    }
    return RopeSpec(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        **optional,
    )


def _max_model_len(config: dict[str, Any], model_dir: str, requested: int | None) -> int:
    limit = config["max_position_embeddings"]
    window = config.get("sliding_window")
    windowed = config.get("use_sliding_window", True) if config.get("model_type") in ("qwen2", "qwen3") else True
    # Attention past a sliding window is not implemented; below the window it equals full attention.
    if windowed and window is not None and window < limit:
        logger.warning(
            "%s: sliding window %d < max_position_embeddings %d; capping max_model_len at the window",
            model_dir,
            window,
            limit,
        )
        limit = window
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds what {model_dir} supports ({limit}); lower it")
    return requested


def resolve_dtype(dtype: str, config: dict[str, Any]) -> torch.dtype:
    name = (config.get("dtype") or config.get("torch_dtype") or "float32") if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def spec_from_config_files(model_dir: Path, dtype: str = "auto", max_model_len: int | None = None) -> ModelSpec:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: is it a Hugging Face model directory?")
    config = json.loads(config_path.read_text())
    architecture = (config.get("architectures") or ["<none>"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{model_dir}: architecture {architecture} is not supported by the native engine "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); run it with engine=hf"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{model_dir}: hidden_act {config['hidden_act']!r} is not silu; use engine=hf")
    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    eos = generation.get("eos_token_id")
    num_heads = config["num_attention_heads"]
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = bool(config.get("attention_bias", False))
    return ModelSpec(
        architecture=architecture,
        model_dir=str(model_dir),
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        vocab_size=config["vocab_size"],
        max_model_len=_max_model_len(config, str(model_dir), max_model_len),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope=_rope_spec(config, str(model_dir)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=not is_qwen2 and attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        dtype=resolve_dtype(dtype, config),
        eos_token_ids=_token_ids(eos if eos is not None else config.get("eos_token_id")),
        bos_token_id=generation.get("bos_token_id", config.get("bos_token_id")),
        pad_token_id=generation.get("pad_token_id", config.get("pad_token_id")),
    )
