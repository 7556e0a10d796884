"""What the engine needs to know about a model (`ModelSpec`), and how one Hugging Face architecture is
described (`Architecture`).

A spec is read from the config files alone (no weights), so the cache can be sized, a bad model refused and
`engine=auto` decided before any GPU work. transformers' own config class reads config.json, so defaults
and the renamings of older configs (`rope_scaling`, `sliding_window_pattern`, ...) are exactly theirs; the
spec is then kept (`spec_cache.py`), so later jobs on the same config skip importing those classes.

`config_spec.common_spec` reads what every decoder shares in the Llama layout; an `Architecture` then adjusts it
for its family (`adapt`) and names the checkpoint tensors that differ from ours (`checkpoint_renames`);
`requested_spec` applies a job's dtype, length and quantization. The same spec drives the loader, the forward pass
(`models/decoder.py`) and the benchmark's roofline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from batchjob.engine.native.layers.rope import RopeSpec
from batchjob.engine.native.models.quantization import SUPPORTED_FORMATS, QuantSpec, engine_fp8
from batchjob.engine.native.options import QUANTIZATIONS

# engine.kv_cache_dtype: auto, the model's dtype; fp8_e4m3, K and V stored in e4m3 (a scale of 1, saturating).
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NORM_PLACEMENTS = ("pre", "post", "sandwich")


class UnsupportedModelError(ValueError):
    """The native engine cannot run this model; the message says why and what to use instead."""


@dataclass(frozen=True)
class LayerSpec:
    """What may differ between the layers of one model."""

    rope: RopeSpec | None  # None: this layer has no rotary embedding (SmolLM3's NoPE layers)
    window: int = 0  # > 0: sliding-window attention over that many positions (0: full attention)
    sparse: bool = False  # the MLP is a mixture of experts


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k routing weights are rescaled to sum to one


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    model_dir: str
    num_layers: int
    hidden_size: int
    intermediate_size: int  # of the dense MLP
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int  # longest sequence (prompt + generation) the engine may build
    rms_norm_eps: float
    rope: RopeSpec  # of the global (full-attention) layers
    layers: tuple[LayerSpec, ...]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]  # generation_config.json's, else config.json's
    bos_token_id: int | None
    pad_token_id: int | None
    rotary_dim: int  # leading channels of each head that rope rotates (head_dim unless partial)
    attn_scale: float  # multiplies q.k (head_dim ** -0.5 unless the family says otherwise)
    qk_norm: str = "none"  # "head": RMSNorm of q and k per head (Qwen3, Gemma 3); "full": over all heads (OLMo 2)
    norm_placement: str = "pre"  # "pre": before each sublayer; "post": after (OLMo 2); "sandwich": both (Gemma)
    norm_weight_fp32: bool = False  # norms multiply their weight in float32 (see layers.RMSNorm)
    norm_unit_offset: bool = False  # norms scale by 1 + weight (Gemma)
    activation: str = "silu"  # of the gated MLP: silu | gelu_tanh
    embed_scale: float = 1.0  # input embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    attn_softcap: float = 0.0  # > 0: attention scores -> softcap * tanh(scores / softcap) (Gemma 2)
    final_softcap: float = 0.0  # the same on the output logits (Gemma 2)
    moe: MoESpec | None = None
    quantization: QuantSpec | None = None  # FP8 weights and activations (models/quantization.py)
    kv_cache_dtype: torch.dtype | None = None  # of the paged KV cache (None: `dtype`); float8_e4m3fn: FP8 K/V
    # engine.deterministic: every projection computes a row alike whatever the batch (layers/batch_invariant.py)
    batch_invariant: bool = False

    def quantized(self, module: str) -> bool:
        """Whether the checkpoint module `module` (`model.layers.0.self_attn.q_proj`) holds FP8 weights: the
        quantization config quantizes it under every name a family's checkpoints give it (`MODULE_ALIASES`)."""
        if self.quantization is None:
            return False
        names = [module] + [
            module.removesuffix(ours) + theirs for ours, theirs in MODULE_ALIASES if module.endswith(ours)
        ]
        return all(self.quantization.quantizes(name) for name in names)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes over all layers (K and V) in the cache's dtype."""
        element_size = torch.empty((), dtype=self.cache_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


# Modules whose checkpoint names differ by family, as a quantization config's `ignore` list may name them: a
# mixture's router and experts in Mixtral's naming (the loader's renames map its tensors onto ours).
MODULE_ALIASES = (
    (".mlp.gate", ".block_sparse_moe.gate"),
    (".mlp.experts.0.gate_proj", ".block_sparse_moe.experts.0.w1"),
)


def _no_change(config: Any, spec: ModelSpec) -> ModelSpec:
    return spec


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture (config.json's `architectures[0]`) on the native decoder.

    `adapt(config, spec)` turns the common Llama-layout spec into this family's (raising
    `UnsupportedModelError` for variants it cannot run); `checkpoint_renames` are (regex, replacement) pairs
    applied in order to checkpoint tensor names (without the leading `model.`) before the loader's own fused
    q/k/v, gate/up and expert slots (see `checkpoint.py`). Our module names follow the Gemma layout: the norm
    before the MLP is `pre_feedforward_layernorm`, which Llama-layout checkpoints call `post_attention_layernorm`.
    """

    name: str
    adapt: Callable[[Any, ModelSpec], ModelSpec] = _no_change
    checkpoint_renames: tuple[tuple[str, str], ...] = field(default=())


# Llama-layout checkpoints name the pre-MLP norm after the attention it follows.
PRE_NORM_RENAMES = ((r"\.post_attention_layernorm\.", ".pre_feedforward_layernorm."),)


def check_batch_invariant(spec: ModelSpec) -> None:
    """Raise ValueError where `engine.deterministic` cannot make a row's output independent of its batch."""
    q = spec.quantization
    if q is not None and q.activations == "tensor":
        raise ValueError(
            f"{spec.model_dir}: its FP8 activations take one scale per step (dynamic per-tensor), so a row's output "
            "depends on the rows beside it and engine.deterministic cannot hold; use a checkpoint with per-token or "
            "static activation scales, or engine.deterministic=false"
        )


def requested_spec(
    spec: ModelSpec, dtype: str, requested_len: int | None, quantization: str = "auto", kv_cache_dtype: str = "auto"
) -> ModelSpec:
    """`spec` as read (the declared dtype, the model's whole length) for a job's `dtype` (auto: the declared
    one), `max_model_len` (None: the model's), `quantization` (auto: the checkpoint's; fp8: an unquantized
    checkpoint's projections quantized as they load, an FP8 checkpoint as it is) and `kv_cache_dtype` (auto: the
    model's dtype; fp8_e4m3)."""
    if requested_len is not None and requested_len > spec.max_model_len:
        raise ValueError(
            f"max_model_len={requested_len} exceeds what {spec.model_dir} supports ({spec.max_model_len}); lower it"
        )
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: choose auto, {', '.join(DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}: choose {' or '.join(QUANTIZATIONS)}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}: choose {' or '.join(KV_CACHE_DTYPES)}")
    return check_quantization(
        replace(
            spec,
            max_model_len=spec.max_model_len if requested_len is None else requested_len,
            dtype=spec.dtype if dtype == "auto" else DTYPES[dtype],
            quantization=engine_fp8() if quantization == "fp8" and spec.quantization is None else spec.quantization,
            kv_cache_dtype=KV_CACHE_DTYPES[kv_cache_dtype],
        )
    )


def check_quantization(spec: ModelSpec) -> ModelSpec:
    """`UnsupportedModelError` where the model's FP8 layout is one the engine cannot run: a quantized lm_head or
    mixture of experts, or weight blocks that do not tile its fused projections."""
    q = spec.quantization
    if q is None:
        return spec
    problems = []
    if not spec.tie_word_embeddings and spec.quantized("lm_head"):
        problems.append("a quantized lm_head")
    sparse = [index for index, layer in enumerate(spec.layers) if layer.sparse]
    if sparse and spec.quantized(f"model.layers.{sparse[0]}.mlp.gate"):
        problems.append("a quantized router (a mixture of experts' gate)")
    if (
        sparse
        and spec.quantized(f"model.layers.{sparse[0]}.mlp.experts.0.gate_proj")
        and q.activations
        not in (
            "token",
            "group",
        )
    ):
        problems.append(f"FP8 experts with {q.activations} activation scales (dynamic per token or group only)")
    if q.block is not None:
        rows, cols = q.block
        widths = {
            "query width": spec.num_heads * spec.head_dim,
            "key/value width": spec.num_kv_heads * spec.head_dim,
            "MLP width": spec.intermediate_size,
            "expert width": spec.moe.intermediate_size if spec.moe else 0,
        }
        problems += [f"its {name} {width} in blocks of {rows} rows" for name, width in widths.items() if width % rows]
        if cols % 16:
            problems.append(f"weight blocks of {cols} columns (a multiple of 16 is needed)")
    if problems:
        raise UnsupportedModelError(
            f"{spec.model_dir}: the native engine cannot run {'; '.join(problems)}. It runs {SUPPORTED_FORMATS}, "
            "with the lm_head and routers unquantized; use engine=hf"
        )
    return spec


def check_spec(spec: ModelSpec) -> ModelSpec:
    """Internal consistency of what an `adapt` produced (a family bug, not a user error)."""
    if len(spec.layers) != spec.num_layers or spec.norm_placement not in NORM_PLACEMENTS:
        raise ValueError(f"{spec.architecture}: inconsistent spec ({len(spec.layers)} layer specs, {spec})")
    if any(layer.sparse for layer in spec.layers) and spec.moe is None:
        raise ValueError(f"{spec.architecture}: sparse layers without a MoESpec")
    return spec
