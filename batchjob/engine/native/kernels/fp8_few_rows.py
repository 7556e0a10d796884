"""An FP8 projection of a few rows (a decode step's): e4m3 activations [M, K] with a float32 scale a row, times e4m3
weights [N, K] with a float32 scale an output channel, out in bf16 (or the activations' dtype).

With M at most `MAX_ROWS` the step is bound by reading the weights once; a GEMM tiled for large M pads the few rows
to its tile and leaves the weight reads short of the copy rate. Here the weights are the MMA's wide operand: each
program holds `BLOCK_N` weight rows against every activation row (C^T = W A^T), reads its weight rows once, K-tile
by K-tile (each tile's products added to a float32 sum), and scales its sums by the channel's and the row's scales
at the end (per-channel weights and per-token activations keep one scale each along K). The tile widths come from
`config`, measured per shape by `scripts/dev/fp8_shapes.py`. The reduction runs in K order in float32: a row's
result does not depend on the values of the rows beside it (their count picks the tile, which may move its last
bits; so does cuBLASLt).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows above this go to cuBLASLt, whose large-M tiles then keep the tensor cores busy.
MAX_ROWS = 64
# The depth of one load of weight rows: a multiple of the FP8 dot's 32 that every real hidden size divides.
BLOCK_K = 128


@triton.jit(do_not_specialize=["m"])
def _few_rows_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    c_ptr,
    m,
    n,
    k,
    stride_a,
    stride_w,
    stride_c,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per `BLOCK_N` output channels, for all (at most `BLOCK_M`) rows."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_mask, row_mask = cols < n, rows < m
    depth = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w + depth[None, :]
    a_ptrs = a_ptr + rows[None, :].to(tl.int64) * stride_a + depth[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(0, k, BLOCK_K):
        w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
        a = tl.load(a_ptrs, mask=row_mask[None, :], other=0.0)
        # A tile's products summed apart, then added in float32: Hopper's FP8 MMA accumulates in less than float32's
        # precision, and Triton lets it carry the whole K in its accumulator when given `acc` (an 8B's gate/up at
        # 64-wide tiles missed the float32 product by more than FP8's tolerance).
        acc += tl.dot(w, a)
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    w_scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    a_scale = tl.load(a_scale_ptr + rows, mask=row_mask, other=0.0)
    acc = acc * w_scale[:, None] * a_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    out = c_ptr + rows[None, :].to(tl.int64) * stride_c + cols[:, None]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=col_mask[:, None] & row_mask[None, :])


def suits(m: int, k: int, a_scales: torch.Tensor) -> bool:
    """Whether this kernel takes `m` rows of depth `k` quantized with `a_scales` (it needs one scale a row; the
    weights' scales must be one a channel)."""
    return 0 < m <= MAX_ROWS and k % BLOCK_K == 0 and a_scales.shape[1] == 1


def config(n: int, block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). Measured on an H100 at an 8B's projections (scripts/dev/fp8_shapes.py, 1 to 64
    rows): 64-wide tiles six stages deep for q/k/v, o and down (10-30% faster than 32- or 128-wide ones); for the
    wide gate/up (28,672 channels) three stages, 64 wide at 64 rows, 32 wide below (every tile within 10% there)."""
    if n >= 16384:
        return (64 if block_m >= 64 else 32), 4, 3
    return 64, 4, 6


def matmul(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """C [M, N] = (a * a_scales) @ (w * w_scales)^T (+ bias) for `suits` shapes; `tile` overrides `config`."""
    m, k = a.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    block_n, warps, stages = tile or config(n, block_m)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    _few_rows_kernel[(triton.cdiv(n, block_n),)](
        a, a_scales, w, w_scales, a if bias is None else bias, c, m, n, k, a.stride(0), w.stride(0), c.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=BLOCK_K, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return c
