"""An FP8 checkpoint's scales -> the `Fp8Linear` scales they fill.

Scales are small (a number per tensor, row or 128 x 128 block), so they are read whole through safetensors after
the weights, and placed with their weight's slot (`checkpoint_names.py`):

- a per-tensor weight scale fills every row of its weight: q, k and v (or gate and up) of different scales then
  share one fused projection exactly;
- per-row scales fill their weight's rows, block scales their blocks' rows (the weight's rows / block rows);
- a static activation scale (`input_scale`) of a fused projection is the largest of its parts', as the parts'
  inputs are one tensor: each part's values are then quantized at most as finely as its checkpoint asked.

Under tensor parallelism a rank keeps the part its `ParamShard` names (`sharding.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from batchjob.engine.native.loading.checkpoint_names import SCALE_SUFFIXES, checkpoint_slot
from batchjob.engine.native.loading.sharding import ParamShard
from batchjob.engine.native.models.spec import ModelSpec, UnsupportedModelError


@torch.no_grad()
def load_scales(
    files: list[Path], spec: ModelSpec, params: dict[str, torch.Tensor], shards: dict[str, ParamShard | None]
) -> dict[str, int]:
    """Fill the scale parameters of `params` from the checkpoint `files`; returns the elements written to each."""
    loaded: dict[str, int] = {}
    for name, param in params.items():
        if name.endswith(".input_scale"):
            param.zero_()  # the largest of the parts' scales is taken
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as checkpoint:
            for key in checkpoint.keys():  # noqa: SIM118 (safe_open is not a mapping)
                suffix = next((s for s in SCALE_SUFFIXES if key.endswith(s)), None)
                if suffix is None:
                    continue
                weight_key = key.removesuffix(suffix) + ".weight"
                slot = checkpoint_slot(weight_key, spec)
                if slot is None:
                    continue
                kind = "input_scale" if suffix == ".input_scale" else "weight_scale"
                name = (
                    slot.name + "_scale" if slot.expert is not None else f"{slot.name.removesuffix('.weight')}.{kind}"
                )
                if name not in params or (slot.expert is not None and kind == "input_scale"):
                    raise UnsupportedModelError(
                        f"{file}: {key} scales {weight_key}, which config.json's quantization_config leaves "
                        "unquantized; the config and weights do not match"
                    )
                scale = checkpoint.get_tensor(key).float()
                if kind == "input_scale":
                    params[name].copy_(torch.maximum(params[name], scale.reshape(1)))
                    loaded[name] = 1
                    continue
                rows = checkpoint.get_slice(weight_key).get_shape()[0]
                param, shard = params[name], shards[name]
                if slot.expert is not None:  # one expert's entry of the stacked scales
                    param, shard = param[slot.expert], shard and shard.entry()
                written = _place_weight_scale(param, shard, scale, rows, slot.row or 0, spec, file, key)
                loaded[name] = loaded.get(name, 0) + written
    return loaded


def _place_weight_scale(
    param: torch.Tensor,
    shard: ParamShard | None,
    scale: torch.Tensor,
    weight_rows: int,
    weight_row: int,
    spec: ModelSpec,
    file: Path,
    key: str,
) -> int:
    """Copy one checkpoint weight's scales into `param` (this rank's part of them); returns the elements written."""
    block = spec.quantization.block
    if block is None:
        if scale.numel() == 1:
            scale = scale.reshape(1, 1).expand(weight_rows, 1)
        expected, row = (weight_rows, 1), weight_row
    else:
        expected = (-(-weight_rows // block[0]), param.shape[1] if shard is None or shard.dim == 0 else shard.full_size)
        row = weight_row // block[0]
    scale = scale.reshape(expected[0], -1) if scale.numel() == expected[0] * expected[1] else scale
    if tuple(scale.shape) != expected:
        raise UnsupportedModelError(
            f"{file}: {key} has shape {tuple(scale.shape)}, but its weight and config.json's quantization_config "
            f"imply {expected}; the config and weights do not match"
        )
    if shard is None:
        param.narrow(0, row, expected[0]).copy_(scale)
        return scale.numel()
    if shard.dim == 0:
        return shard.copy_(param, scale, row, expected[0])
    return shard.copy_(param, scale, 0, expected[1])
