"""Projections for `engine.deterministic`: a row's product is a function of the row and the weight alone, never of
the rows it is batched with.

BLAS chooses its kernel by the row count (on CPU too: one row goes through a matrix-vector path whose sums differ
in their last bits from a matrix-matrix one's), so the same prompt could take another greedy tie or sampled token
in another batch. Here, on a GPU, `kernels/invariant_matmul.py` runs one launch shape for every row count; on CPU
each output element is an elementwise product summed over K by torch's reduction, whose order depends on K alone.
"""

from __future__ import annotations

import torch
from torch import nn

# CPU: rows per elementwise product, so the [rows, N, K] intermediate stays within about 16 MB.
_CPU_ELEMENTS = 1 << 22


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed alike for a row whatever the other rows of x ([..., K])."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if x.is_cuda:
        from batchjob.engine.native.kernels import invariant_matmul

        out = invariant_matmul.matmul(flat, weight, bias)
    else:
        out = _cpu_matmul(flat, weight, bias)
    return out.reshape(*shape[:-1], weight.shape[0])


def _cpu_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.new_empty((x.shape[0], weight.shape[0]))
    step = max(1, _CPU_ELEMENTS // weight.numel())
    for start in range(0, x.shape[0], step):
        out[start : start + step] = (x[start : start + step, None, :] * weight).sum(-1)
    return out if bias is None else out + bias


def partial_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """For a projection whose output the next RMSNorm adds to the residual: on a GPU, where K is split across
    programs, its float32 partial sums [parts, rows, N] (the norm adds them in order); otherwise the product itself
    (added up alike, in the matmul, where the step's rows fill the GPU: `invariant_matmul.serial`)."""
    if x.is_cuda:
        from batchjob.engine.native.kernels import invariant_matmul

        if invariant_matmul.num_parts(weight) > 1 and not invariant_matmul.serial(x.shape[0], weight):
            return invariant_matmul.partial_products(x, weight)
    return matmul(x, weight)


def apply(model: nn.Module) -> None:
    """Turn on the batch-invariant arithmetic of every module of `model` that has one (FP8 projections, experts);
    plain projections are built as `InvariantLinear`."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True


class InvariantLinear(nn.Linear):
    """`nn.Linear` whose rows are computed alike whatever the batch (`matmul`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)
