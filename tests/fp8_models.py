"""FP8 checkpoints of a tiny model in the formats the native engine reads, and the float64 reference they are
compared with.

- compressed-tensors checkpoints are written by the compressed-tensors library itself (its presets FP8_DYNAMIC,
  FP8, FP8_BLOCK; weight scales from each channel's / tensor's / block's range and a static activation scale from
  a calibration batch, as llm-compressor's min-max observers take them), so the real format is what loads.
- block FP8 in the `quant_method: fp8` layout (DeepSeek-V3, Qwen3-FP8: `weight_scale_inv` per 128 x 128 block,
  here smaller blocks for a tiny model) and Meta's `fbgemm_fp8` (per-row scales) are written tensor by tensor as
  those checkpoints hold them.

`reference_logits` runs transformers' model in float64 with each quantized projection's weight dequantized and its
input quantized and dequantized as the format says: the arithmetic an FP8 engine must reproduce, up to float32
rounding (which can move a value across an e4m3 rounding boundary now and then).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CALIBRATION_IDS = [[(7 * i + 3 * j) % 500 + 3 for j in range(24)] for i in range(2)]


def compressed_tensors_checkpoint(source: Path, out: Path, preset: str, block: tuple[int, int] | None = None) -> Path:
    """`source` (an unquantized model directory) quantized with compressed-tensors' `preset`, saved to `out`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if block is not None:
        scheme.weights.block_structure = list(block)
        scheme.input_activations.group_size = block[1]
    amax = _input_amax(model)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        args, weight = module.quantization_scheme.weights, module.weight.data
        if args.strategy == "channel":
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        elif args.strategy == "tensor":
            low, high = weight.amin().view(1), weight.amax().view(1)
        else:
            rows, cols = args.block_structure
            blocks = weight.view(weight.shape[0] // rows, rows, weight.shape[1] // cols, cols)
            low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
        module.weight_scale.data = calculate_qparams(low, high, args)[0].to(module.weight_scale.dtype)
        inputs = module.quantization_scheme.input_activations
        if inputs is not None and not inputs.dynamic:
            peak = torch.tensor([amax[name]])
            scale = calculate_qparams(-peak, peak, inputs)[0]
            module.input_scale.data = scale.to(module.input_scale.dtype).view(module.input_scale.shape)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    compressor.update_config(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def _input_amax(model) -> dict[str, float]:
    """Each Linear's largest input magnitude over the calibration batch."""
    amax: dict[str, float] = {}

    def record(name):
        def hook(module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())

        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.tensor(CALIBRATION_IDS))
    for hook in hooks:
        hook.remove()
    return amax


def handwritten_checkpoint(source: Path, out: Path, method: str, block: tuple[int, int] | None = None) -> Path:
    """`source` with its attention and MLP projections in FP8 as a `method` checkpoint holds them: `fp8` (block
    scales, `weight_scale_inv`) or `fbgemm_fp8` (per-row scales)."""
    shutil.copytree(source, out, dirs_exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    for key in [k for k in tensors if k.endswith("_proj.weight") or re.search(r"\.experts\.\d+\.w[123]\.weight$", k)]:
        weight = tensors[key].float()
        if method == "fp8":
            q, scales = _block_quantize(weight, block)
            tensors[key], tensors[key + "_scale_inv"] = q, scales
        else:
            scales = (weight.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            tensors[key], tensors[key + "_scale"] = (weight / scales).to(FP8), scales
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    if method == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            # a mixture's routers, as Qwen3's FP8 MoEs list them; Mixtral's
            "modules_to_not_convert": ["lm_head", "mlp.gate", "block_sparse_moe.gate"],
        }
    else:
        config["quantization_config"] = {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ["lm_head", "mlp.gate", "block_sparse_moe.gate"],
        }
    (out / "config.json").write_text(json.dumps(config))
    return out


def _block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = block
    blocks = weight.view(weight.shape[0] // rows, rows, weight.shape[1] // cols, cols)
    scales = (blocks.abs().amax((1, 3)) / FP8_MAX).clamp(min=1e-12)
    return (blocks / scales[:, None, :, None]).to(FP8).view(weight.shape), scales


@torch.no_grad()
def reference_logits(source: Path, checkpoint: Path, ids: list[int], ranks: int = 1) -> torch.Tensor:
    """float64 logits [len(ids), vocab] of the FP8 `checkpoint` (of the model in `source`): each FP8 projection's
    weight dequantized, its input quantized to e4m3 by the checkpoint's activation scheme and dequantized. `ranks`:
    as tensor parallelism over that many ranks runs it, where each rank quantizes its own part of the inputs of the
    row-parallel projections (o_proj, down_proj) per token."""
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64).eval()
    tensors = load_file(checkpoint / "model.safetensors")
    acts = _activation_scheme(json.loads((checkpoint / "config.json").read_text())["quantization_config"])
    for name, module in hf.named_modules():
        weight = tensors.get(name + ".weight")
        if weight is None or weight.dtype != FP8:
            continue
        scales = next(tensors[name + s] for s in (".weight_scale", ".weight_scale_inv") if name + s in tensors)
        scales = scales.double()
        if scales.numel() > 1 and scales.shape[1] > 1:  # blocks
            rows, cols = -(-weight.shape[0] // scales.shape[0]), -(-weight.shape[1] // scales.shape[1])
            scales = scales.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        module.weight.data = (
            weight.double() * scales.reshape(-1, 1) if scales.shape[-1] == 1 else weight.double() * scales
        )
        parts = ranks if name.endswith(("o_proj", "down_proj")) and acts["strategy"] == "token" else 1
        module.register_forward_pre_hook(_fake_quant_hook(acts, tensors.get(name + ".input_scale"), parts))
    return hf(torch.tensor([ids])).logits[0]


def _activation_scheme(config: dict) -> dict:
    if config["quant_method"] == "compressed-tensors":
        return config["config_groups"]["group_0"]["input_activations"]
    if config["quant_method"] == "fp8":
        return {"strategy": "group", "dynamic": True, "group_size": config["weight_block_size"][1]}
    return {"strategy": "token", "dynamic": True, "upper": config.get("activation_scale_ub")}


def _fake_quant_hook(acts: dict, input_scale: torch.Tensor | None, parts: int = 1):
    def hook(module, args):
        return (torch.cat([fake_quant(part) for part in args[0].chunk(parts, dim=-1)], dim=-1),)

    def fake_quant(x: torch.Tensor) -> torch.Tensor:
        if acts["strategy"] == "group":
            groups = x.unflatten(-1, (-1, acts["group_size"]))
            scale = (groups.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            return (_round(groups / scale) * scale).flatten(-2)
        if acts["strategy"] == "token":
            peak = x.abs().amax(-1, keepdim=True)
            if acts.get("upper") is not None:
                peak = peak.clamp(max=acts["upper"])
            scale = (peak / FP8_MAX).clamp(min=1e-12)
        elif acts["dynamic"]:
            scale = (x.abs().amax() / FP8_MAX).clamp(min=1e-12)
        else:
            scale = input_scale.double()
        return _round(x / scale) * scale

    return hook


def _round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 (saturating), back in float64."""
    return x.clamp(-FP8_MAX, FP8_MAX).float().to(FP8).double()
