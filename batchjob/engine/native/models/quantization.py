"""FP8 checkpoints and on-the-fly FP8: which formats the native engine runs, read from config.json's
`quantization_config` alone (no weights), and which of a model's projections they quantize.

Formats (each a `QuantSpec` once read; anything else is refused before a weight is read, naming these):

- compressed-tensors `float-quantized` / `naive-quantized` FP8 (llm-compressor's exports: FP8, FP8_DYNAMIC,
  FP8_BLOCK): weights per tensor, per output channel or in blocks; activations dynamic per token, dynamic per
  token and group of channels (with block weights), static per tensor (`input_scale`) or dynamic per tensor.
- `quant_method: fp8` with `weight_block_size` (DeepSeek-V3, Qwen3-FP8 and transformers' fine-grained FP8):
  block weights (`weight_scale_inv`), activations dynamic per token and group of the block's width.
- `quant_method: fbgemm_fp8` (Meta's FP8 Llamas): per-channel weights, dynamic per-token activations whose amax
  is capped at `activation_scale_ub`.
- `engine.quantization=fp8` on a bf16/fp16/fp32 checkpoint: per-channel weights quantized as they load, dynamic
  per-token activations.

Inside the engine a weight is always one of two layouts: per output channel (a checkpoint's per-tensor scale is
written into every row it covers: exact, and it lets q/k/v or gate/up of different scales share one fused
projection) or blocks of `block` = (rows, columns). The projections quantized are the attention and MLP
projections and a mixture's experts; embeddings, norms, routers and the lm_head stay in the model's dtype unless
a checkpoint says otherwise (its `ignore` list decides; an lm_head it quantizes is refused).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# What a dynamic activation scale is computed over: each token's row ("token"), each token's groups of
# `block[1]` channels ("group"), the whole step ("tensor"); "static": the checkpoint's `input_scale`.
ACTIVATIONS = ("token", "group", "tensor", "static")
WEIGHTS = ("channel", "block")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SUPPORTED_FORMATS = (
    "compressed-tensors FP8 (float-quantized: per-tensor, per-channel or block weights; dynamic per-token, "
    "per-group or per-tensor, or static per-tensor activations), fp8 with weight_block_size (DeepSeek / Qwen3 "
    "block FP8), fbgemm_fp8"
)


class UnsupportedQuantizationError(ValueError):
    """config.json declares a quantization the native engine cannot run; the message names the ones it can."""


@dataclass(frozen=True)
class QuantSpec:
    source: str  # compressed-tensors | fp8 | fbgemm_fp8 | engine (quantized as the weights load)
    activations: str  # one of ACTIVATIONS
    # (rows, columns) of a weight block; None: a scale per output channel (per-tensor checkpoints are read into
    # per-channel scales)
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"  # the checkpoint's name for a weight's scales (`weight_scale_inv`: fp8)
    activation_scale_ub: float | None = None  # fbgemm_fp8: a token's amax is capped at this
    ignore: tuple[str, ...] = ()  # checkpoint module names (or `re:` patterns) left unquantized
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors: the module classes or names quantized

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. `model.layers.0.self_attn.q_proj`) is quantized."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return False
        return any(target == "Linear" or _matches(target, module) for target in self.targets)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern) or module.removeprefix("model.") == pattern


def engine_fp8() -> QuantSpec:
    """`engine.quantization=fp8`: per-channel weights quantized at load, dynamic per-token activations."""
    return QuantSpec(
        source="engine",
        activations="token",
        ignore=("lm_head", r"re:.*\.mlp\.gate$", r"re:.*\.mlp\.experts\."),
    )


def quant_spec_from_config(config: dict[str, Any] | None, model_dir: str) -> QuantSpec | None:
    """The `QuantSpec` of config.json's `quantization_config` (None: the model is not quantized);
    `UnsupportedQuantizationError` for a method or scheme the native engine does not run."""
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _block_fp8, "fbgemm_fp8": _fbgemm_fp8}
    if method not in readers:
        raise _refuse(model_dir, f"quantization method {method or '<none>'!r}")
    return readers[method](config, model_dir)


def _refuse(model_dir: str, what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"{model_dir}: {what} is not supported by the native engine; it runs {SUPPORTED_FORMATS}. "
        "Use an unquantized checkpoint (engine.quantization=fp8 quantizes one as it loads) or engine=hf"
    )


def _ignored(config: dict[str, Any], key: str) -> tuple[str, ...]:
    return tuple(str(name) for name in config.get(key) or ())


def _block_fp8(config: dict[str, Any], model_dir: str) -> QuantSpec:
    fmt = config.get("fmt", "e4m3")
    block = config.get("weight_block_size")
    if fmt != "e4m3":
        raise _refuse(model_dir, f"fp8 format {fmt!r}")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(model_dir, f"fp8 activation_scheme {config.get('activation_scheme')!r} (only dynamic)")
    if not block:
        raise _refuse(model_dir, "fp8 without weight_block_size (per-tensor fp8 in transformers' own layout)")
    return QuantSpec(
        source="fp8",
        activations="group",
        block=_block_shape(block, model_dir),
        scale_name="weight_scale_inv",
        ignore=("lm_head", *_ignored(config, "modules_to_not_convert")),
    )


def _fbgemm_fp8(config: dict[str, Any], model_dir: str) -> QuantSpec:
    upper = config.get("activation_scale_ub")
    return QuantSpec(
        source="fbgemm_fp8",
        activations="token",
        activation_scale_ub=None if upper is None else float(upper),
        ignore=("lm_head", *_ignored(config, "modules_to_not_convert")),
    )


def _compressed_tensors(config: dict[str, Any], model_dir: str) -> QuantSpec:
    fmt = config.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(model_dir, f"compressed-tensors format {fmt!r}")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse(model_dir, f"compressed-tensors with {len(groups)} config groups (one is supported)")
    group = groups[0]
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if group.get("output_activations"):
        raise _refuse(model_dir, "compressed-tensors output activation quantization")
    _check_fp8_args(weights, "weights", model_dir)
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block") or weights.get("dynamic"):
        raise _refuse(model_dir, f"compressed-tensors weight strategy {strategy!r}")
    block = _block_shape(weights.get("block_structure"), model_dir) if strategy == "block" else None
    if inputs is None:
        raise _refuse(model_dir, "compressed-tensors FP8 weights without FP8 activations (W8A16)")
    _check_fp8_args(inputs, "input activations", model_dir)
    act = inputs.get("strategy")
    dynamic = bool(inputs.get("dynamic"))
    if act == "tensor":
        activations = "tensor" if dynamic else "static"
    elif act == "token" and dynamic:
        activations = "token"
    elif act == "group" and dynamic and block is not None and inputs.get("group_size") == block[1]:
        activations = "group"
    else:
        raise _refuse(
            model_dir,
            f"compressed-tensors activation strategy {act!r} (dynamic={dynamic}, group_size="
            f"{inputs.get('group_size')}) with {strategy} weights",
        )
    if config.get("kv_cache_scheme"):
        raise _refuse(model_dir, "a compressed-tensors kv_cache_scheme (FP8 KV scales in the checkpoint)")
    return QuantSpec(
        source="compressed-tensors",
        activations=activations,
        block=block,
        ignore=_ignored(config, "ignore"),
        targets=tuple(str(t) for t in group.get("targets") or ("Linear",)),
    )


def _check_fp8_args(args: dict[str, Any], what: str, model_dir: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise _refuse(model_dir, f"compressed-tensors {what} of type {args.get('type')!r}, {args.get('num_bits')} bits")
    if args.get("symmetric") is False:
        raise _refuse(model_dir, f"asymmetric compressed-tensors {what}")


def _block_shape(block: Any, model_dir: str) -> tuple[int, int]:
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse(model_dir, f"weight block {block!r}")
    return int(block[0]), int(block[1])
