"""`engine.load_format=dummy`: seeded random weights made on the device from config.json alone.

For benchmarking models whose weights would not fit the disk (or cannot be downloaded): throughput does not
depend on the values, only on the shapes. Matrices and embeddings are drawn from N(0, 0.02) (the families'
own initialiser scale, which keeps bf16 activations finite through every layer), biases are zero and norms
the identity (weight 1, or 0 where the norm scales by 1 + weight). Each parameter has its own generator,
seeded from its name, so the weights are the same in every run and do not depend on the order parameters are
visited; under tensor parallelism each rank takes its slices of the same full parameters, so the model is
the same for every `tensor_parallel`.

An FP8 projection (`Fp8Linear`) gets the same weight, drawn in the model's dtype and quantized into its layout
(per row or per block); a static activation scale is `DUMMY_INPUT_SCALE`.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from batchjob.engine.native.layers.elementwise import RMSNorm
from batchjob.engine.native.layers.fp8_linear import Fp8Linear, quantize_weight
from batchjob.engine.native.loading.sharding import ParamShard
from batchjob.engine.native.models.moe import Fp8Experts

DUMMY_SEED = 1234
STD = 0.02
# Activations of a few units quantize without clipping (a static scale is only a benchmark's here).
DUMMY_INPUT_SCALE = 8.0 / 448.0


def parameter_seed(name: str) -> int:
    return (DUMMY_SEED << 32) | zlib.crc32(name.encode())


def dummy_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, norm_value: float | None):
    """The full (unsharded) parameter `name`: `norm_value` everywhere for a norm weight, zeros for a bias, else
    seeded N(0, STD)."""
    if norm_value is not None:
        return torch.full(shape, norm_value, dtype=dtype, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(parameter_seed(name))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, STD, generator=generator)


def norm_values(model: nn.Module) -> dict[str, float]:
    """Parameter name -> the value that makes its norm the identity (0 for a `1 + weight` norm, else 1)."""
    return {
        f"{prefix}.weight" if prefix else "weight": 1.0 - module.offset
        for prefix, module in model.named_modules()
        if isinstance(module, RMSNorm)
    }


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, shards: dict[str, ParamShard | None]) -> None:
    """Fill every parameter; a sharded one (tensor parallelism) gets its slices of the full parameter, so a
    rank holds exactly what it would hold of a checkpoint of these weights."""
    norms = norm_values(model)
    fp8 = {f"{prefix}.": module for prefix, module in model.named_modules() if isinstance(module, Fp8Linear)}
    experts = {f"{prefix}.": module for prefix, module in model.named_modules() if isinstance(module, Fp8Experts)}
    for name, param in model.named_parameters():
        owner = name[: name.rfind(".") + 1]
        if owner in fp8 and not name.endswith(".bias"):
            if name.endswith(".weight"):
                _fill_fp8(param, fp8[owner].weight_scale, name, shards, fp8[owner].block, fp8[owner].out_dtype)
            elif name.endswith(".input_scale"):
                param.fill_(DUMMY_INPUT_SCALE)
            continue
        if owner in experts:
            if not name.endswith("_scale"):
                scales = getattr(experts[owner], name[len(owner) :] + "_scale")
                _fill_fp8(param, scales, name, shards, experts[owner].block, model.spec.dtype)
            continue
        shard = shards.get(name)
        if shard is None:
            param.copy_(dummy_tensor(name, tuple(param.shape), param.dtype, param.device, norms.get(name)))
        elif shard.first_rank_only:
            param.zero_()  # a bias, zero anyway
        else:
            param.zero_()  # vocabulary padding rows stay zero
            full = dummy_tensor(name, shard.full_shape(tuple(param.shape)), param.dtype, param.device, norms.get(name))
            shard.copy_(param, full, 0, shard.full_size)


def _fill_fp8(
    weight: torch.Tensor,
    scales: torch.Tensor,
    name: str,
    shards: dict[str, ParamShard | None],
    block: tuple[int, int] | None,
    dtype: torch.dtype,
) -> None:
    """An FP8 weight `name` (a projection's [N, K], or stacked experts' [E, N, K]) and its scales: the dummy weight
    of its full shape in the model's `dtype`, quantized, and this rank's part of it and of its scales."""
    shard = shards.get(name)
    shape = tuple(weight.shape) if shard is None else shard.full_shape(tuple(weight.shape))
    drawn = dummy_tensor(name, shape, dtype, weight.device, None)
    parts = [quantize_weight(matrix, block) for matrix in drawn.view(-1, *shape[-2:])]
    full = torch.stack([q.view(torch.uint8) for q, _ in parts]).view(weight.dtype).view(shape)  # no e4m3 stack
    full_scales = torch.stack([s for _, s in parts]).view(*shape[:-2], *parts[0][1].shape)
    for param, source, part in ((weight, full, shard), (scales, full_scales, shards.get(name + "_scale"))):
        if part is None:
            param.copy_(source)
        else:
            part.copy_(param, source, 0, part.full_size)
