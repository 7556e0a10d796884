"""The projections that feed a residual add (o_proj, down_proj): split-K matmuls whose partial sums the next
RMSNorm adds up, or matmuls that add their product into the residual themselves.

A decode step's o_proj and down_proj have few rows and a long K. BLAS either splits K across thread blocks and
then runs a second kernel that adds the partial sums (`splitKreduce_kernel`, about 2 us, up to two a layer), or
picks a tile that leaves much of the GPU idle. Here the split is explicit instead: one batched matmul writes
the float32 partial sums [parts, rows, N], and the fused residual add + RMSNorm that follows
(`fused_ops.rms_norm`) adds them up as it loads them. The rounding is a plain matmul's: the float32 sum,
rounded once to the model dtype, then added to the residual.

Which projections split, into how many parts and at which step sizes is measured, per weight shape, as whole
graphed decode steps (with the engine's BLAS picks; docs/history/benchmarks-2026.md). On an H200:

| Llama-3.1-8B step, rows | 8 | 16 | 32 | 64 | 96 | 128 | 256 |
|---|---|---|---|---|---|---|---|
| plain, ms | 4.920 | 5.208 | 5.239 | 5.953 | 7.199 | 7.827 | 12.284 |
| o and down in 2 parts, ms | 4.788 | 5.044 | 5.240 | 6.047 | 6.974 | 7.719 | 12.141 |

| Llama-3.2-1B step, rows | 32 | 64 | 128 | 256 | 512 |
|---|---|---|---|---|---|
| plain, ms | 1.299 | 1.500 | 2.031 | 2.900 | 5.122 |
| o in 2 parts, down in 4, ms | 1.265 | 1.471 | 1.967 | 2.881 | 5.229 |

Between 17 and 64 rows the 8B's plain matmuls go to cuBLASLt (blas.py), whose kernels for those shapes need no
reduce; the split does not pay there. Shapes not in the table are not split. Only bf16/fp16 models split:
float32 ones are compared with transformers, whose matmuls sum in cuBLAS's order.

Where a bf16/fp16 projection is not split, its matmul adds the residual in its epilogue (`addmm_` into the
residual): the residual add + RMSNorm that followed read the product and the residual and wrote the sum and the
normed rows, 4 x hidden x 2 bytes a row; the norm alone now reads the sum and writes the normed rows, half that,
while the matmul reads the residual once more. The sum is rounded once (transformers rounds the product, then the
sum); float32 models keep transformers' order.
"""

from __future__ import annotations

from collections.abc import Container

import torch
from torch import nn

from batchjob.engine.native.layers import batch_invariant
from batchjob.engine.native.layers.batch_invariant import InvariantLinear

_UP_TO_256 = range(1, 257)
_OUTSIDE_CUBLASLT = frozenset(range(1, 17)) | frozenset(range(65, 257))
# (N, K) of a weight -> (parts, the step sizes in rows that split it).
SPLITS: dict[tuple[int, int], tuple[int, Container[int]]] = {
    (2048, 2048): (2, _UP_TO_256),  # Llama-3.2-1B o_proj
    (2048, 8192): (4, _UP_TO_256),  # Llama-3.2-1B down_proj
    (4096, 4096): (2, _OUTSIDE_CUBLASLT),  # Llama-3.1-8B o_proj
    (4096, 14336): (2, _OUTSIDE_CUBLASLT),  # Llama-3.1-8B down_proj
}


def splits_for(weight: torch.Tensor, rows: int) -> int:
    """Parts to split a [rows, K] x [N, K]^T matmul into (1: do not split)."""
    if not weight.is_cuda or weight.dtype not in (torch.bfloat16, torch.float16):
        return 1
    parts, row_counts = SPLITS.get(tuple(weight.shape), (1, ()))
    return parts if rows in row_counts else 1


def partial_products(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """float32 [parts, rows, N]: part s is `x[:, Ks] @ weight[:, Ks]^T` over the s-th of `parts` equal slices
    of K. Both operands are read in place (strided views, no copies)."""
    rows, k = x.shape
    n = weight.shape[0]
    part = k // parts
    a = x.view(rows, parts, part).transpose(0, 1)
    b = weight.view(n, parts, part).permute(1, 2, 0)
    return torch.bmm(a, b, out_dtype=torch.float32)


def adds_into_residual(weight: torch.Tensor) -> bool:
    """Whether a projection feeding a residual add writes its product straight into the residual (bf16/fp16:
    see `linear`). float32 models keep transformers' order: the product rounded, then added."""
    return weight.dtype in (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`layer(x)`, for a projection whose output the next step adds to `residual` (None: it does not, or the
    caller adds it itself). Then, where a split pays, its float32 partial sums [parts, rows, N]; otherwise, for a
    bf16/fp16 projection without bias, `residual` itself with the product added in place: the matmul's epilogue
    reads the residual and writes the sum, one rounding, and the norm that follows reads only the sum (half the
    bytes of an add fused into the norm). The caller's next step must be `rms_norm` with that residual, which
    adds partial sums up and takes `residual` itself as already added."""
    if residual is None:
        return layer(x)
    if isinstance(layer, InvariantLinear):  # engine.deterministic: K split by the weight's shape alone
        return layer(x) if layer.bias is not None else batch_invariant.partial_products(x, layer.weight)
    parts = splits_for(layer.weight, x.shape[0])
    if parts > 1:
        return partial_products(x, layer.weight, parts)
    if layer.bias is None and adds_into_residual(layer.weight):
        return residual.addmm_(x, layer.weight.t())
    return layer(x)
