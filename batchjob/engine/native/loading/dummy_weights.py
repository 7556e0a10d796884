"""`engine.load_format=dummy`: seeded random weights made on the device from config.json alone.

For benchmarking models whose weights would not fit the disk (or cannot be downloaded): throughput does not
depend on the values, only on the shapes. Matrices and embeddings are drawn from N(0, 0.02) (the families'
own initialiser scale, which keeps bf16 activations finite through every layer), biases are zero and norms
the identity (weight 1, or 0 where the norm scales by 1 + weight). Each parameter has its own generator,
seeded from its name, so the weights are the same in every run and do not depend on the order parameters are
visited; under tensor parallelism each rank takes its slices of the same full parameters, so the model is
the same for every `tensor_parallel`.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from batchjob.engine.native.layers.elementwise import RMSNorm
from batchjob.engine.native.loading.sharding import ParamShard

DUMMY_SEED = 1234
STD = 0.02


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
    for name, param in model.named_parameters():
        shard = shards.get(name)
        if shard is None:
            param.copy_(dummy_tensor(name, tuple(param.shape), param.dtype, param.device, norms.get(name)))
        elif shard.first_rank_only:
            param.zero_()  # a bias, zero anyway
        else:
            param.zero_()  # vocabulary padding rows stay zero
            full = dummy_tensor(name, shard.full_shape(tuple(param.shape)), param.dtype, param.device, norms.get(name))
            shard.copy_(param, full, 0, shard.full_size)
