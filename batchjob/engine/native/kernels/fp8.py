"""FP8 (float8_e4m3fn) kernels: activations quantized per token or per token and group of channels, and a
matmul of FP8 operands whose scales change along K (block-quantized weights: DeepSeek-style 128 x 128).

Quantizing: a row's (or group's) scale is its largest magnitude times float32(1 / 448) (448: the largest finite
e4m3 value; a product, not a quotient, because torch's CUDA division by a scalar multiplies by its reciprocal, and
every path must compute the same scale), at least `MIN_SCALE`, and each element is divided by it (IEEE division)
and rounded to e4m3: one read of the activations, one write of a
byte each plus a float32 scale per group. `plain_quantize` is the same arithmetic in torch: the CPU path, and the
reference the kernel is tested against.

The matmul: C[m, n] = sum over K tiles of (A_q[m, tile] . B_q[n, tile]) * a_scale[m, group] * b_scale[n-block,
k-block], summed in float32 and rounded once to C's dtype. A tile of BLOCK_K channels lies inside one activation
group and one weight block, so each scale is loaded once a tile. Per-channel weights are blocks of one row and all
of K; per-token activations one group of all of K.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = 1.0 / FP8_MAX  # taken as float32 by every path (torch's float32 tensors, Triton's constants)
# A row of zeros still gets a finite scale (the quantized zeros are then exact).
MIN_SCALE = 1e-12
# The K depth of an FP8 tensor-core dot (Triton refuses less on Hopper).
FP8_DOT_DEPTH = 32
# Quantized activations are the first rows of buffers of a multiple of this many rows (`row_buffers`): torch's FP8
# GEMM runs another row count far slower than the multiple above it, so `fp8_linear.blas_matmul` hands it the whole
# buffer (`padded_rows`) and drops the extra rows' results.
BUFFER_ROWS = 128


@triton.jit
def row_scale(amax, upper, HAS_UPPER: tl.constexpr):
    """The float32 scale of a row (or group) whose largest magnitude is `amax`: `_quantize_kernel`'s, for the
    kernels that quantize the row they just computed (`fused_ops`: RMSNorm, SiLU-and-mul)."""
    if HAS_UPPER:
        amax = tl.minimum(amax, upper)
    return tl.maximum(amax * 0.002232142857142857, 1e-12)  # INV_FP8_MAX, MIN_SCALE


@triton.jit
def to_fp8(x, scale, q_ptr):
    """`x` (float32) over `scale` in `q_ptr`'s e4m3: IEEE division and clamp, as `_quantize_kernel`."""
    return tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0).to(q_ptr.dtype.element_ty)


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    x_stride,
    q_stride,
    n_cols,
    group_size,
    groups,
    upper,
    HAS_UPPER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (row, group): the group's amax, then its elements over the scale."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * group_size
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, group_size, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        mask = (cols < n_cols) & (offset + tl.arange(0, BLOCK) < group_size)
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, axis=0), upper, HAS_UPPER)
    # IEEE division (Triton's `/` may round differently): the quantized values are those of `plain_quantize`
    tl.store(scale_ptr + row * groups + group, scale)
    for offset in range(0, group_size, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        mask = (cols < n_cols) & (offset + tl.arange(0, BLOCK) < group_size)
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * q_stride + cols, to_fp8(x, scale, q_ptr), mask=mask)


def _buffer_rows(rows: int) -> int:
    return -(-rows // BUFFER_ROWS) * BUFFER_ROWS


def row_buffers(rows: int, cols: int, groups: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised e4m3 [rows, cols] and float32 [rows, groups] tensors for quantized activations and their
    scales, each the first rows of a buffer of `BUFFER_ROWS`-row multiples."""
    padded = _buffer_rows(rows)
    q = torch.empty((padded, cols), dtype=FP8, device=device)[:rows]
    return q, torch.empty((padded, groups), dtype=torch.float32, device=device)[:rows]


def padded_rows(t: torch.Tensor) -> torch.Tensor | None:
    """`t` [M, C] (the first rows of its storage, contiguous) with its rows up to the next multiple of
    `BUFFER_ROWS`, where its storage holds them (`row_buffers`); else None. The extra rows hold what was there."""
    rows, cols = t.shape
    padded = _buffer_rows(rows)
    if t.storage_offset() or not t.is_contiguous() or t.untyped_storage().nbytes() < padded * cols * t.element_size():
        return None
    return t.as_strided((padded, cols), (cols, 1))


def quantize(x: torch.Tensor, group_size: int | None = None, upper: float | None = None):
    """(x in e4m3 [M, K], float32 scales [M, K / group_size]) for activations x [M, K]; `group_size` None: one
    scale per row. `upper` caps each group's amax (fbgemm_fp8's activation_scale_ub)."""
    rows, cols = x.shape
    group = cols if group_size is None else group_size
    groups = triton.cdiv(cols, group)
    q, scales = row_buffers(rows, cols, groups, x.device)
    if rows:
        block = min(triton.next_power_of_2(group), 1024)
        _quantize_kernel[(rows, groups)](
            x, q, scales, x.stride(0), q.stride(0), cols, group, groups,
            0.0 if upper is None else upper, HAS_UPPER=upper is not None, BLOCK=block,
        )  # fmt: skip
    return q, scales


def plain_quantize(x: torch.Tensor, group_size: int | None = None, upper: float | None = None):
    """`quantize` in plain torch (the same arithmetic: float32 amax, scale, division, clamp, round to e4m3)."""
    rows, cols = x.shape
    group = cols if group_size is None else group_size
    groups = -(-cols // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    peak = padded.abs().amax(-1)
    if upper is not None:
        peak = peak.clamp(max=upper)
    scales = (peak * INV_FP8_MAX).clamp(min=MIN_SCALE)
    q = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, groups * group)[:, :cols]
    return q, scales


# The row count varies with every step: not specialising on it keeps one compiled variant per weight shape.
@triton.jit(do_not_specialize=["m"])
def _scaled_matmul_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    bias_ptr,
    c_ptr,
    m,
    n,
    k,
    stride_am,
    stride_bn,
    stride_cm,
    a_groups,
    a_group,
    b_block_n,
    b_block_k,
    b_scale_stride,
    HAS_BIAS: tl.constexpr,
    NARROW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :], row_mask[:, None] & k_mask[None, :], other=0.0
        )
        b = tl.load(
            b_ptr + cols[None, :].to(tl.int64) * stride_bn + ks[:, None], col_mask[None, :] & k_mask[:, None], other=0.0
        )
        if NARROW:  # groups narrower than the FP8 dot's depth: each element scaled, multiplied in float32
            a_mask, b_mask = row_mask[:, None] & k_mask[None, :], col_mask[None, :] & k_mask[:, None]
            a_scale = tl.load(a_scale_ptr + rows[:, None] * a_groups + ks[None, :] // a_group, a_mask, other=0.0)
            b_scales = b_scale_ptr + (cols[None, :] // b_block_n) * b_scale_stride
            b_scale = tl.load(b_scales + ks[:, None] // b_block_k, b_mask, other=0.0)
            acc = tl.dot(a.to(tl.float32) * a_scale, b.to(tl.float32) * b_scale, acc, input_precision="ieee")
        else:
            a_scale = tl.load(a_scale_ptr + rows * a_groups + k0 // a_group, mask=row_mask, other=0.0)
            b_scale = tl.load(
                b_scale_ptr + (cols // b_block_n) * b_scale_stride + k0 // b_block_k, mask=col_mask, other=0.0
            )
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], c, row_mask[:, None] & col_mask[None, :])


def scaled_matmul(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    b_block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """C [M, N] = dequant(a) @ dequant(b)^T for e4m3 a [M, K] with float32 `a_scales` [M, groups] (a group:
    K / groups channels) and e4m3 b [N, K] with float32 `b_scales` [N / rows, K / cols] for `b_block` = (rows,
    cols). A depth tile lies inside one activation group and one weight block; groups or blocks narrower than the
    FP8 dot's 32 (tiny test models, no real checkpoint) scale each element and multiply in float32 instead."""
    m, k = a.shape
    n = b.shape[0]
    a_group = k if a_scales.shape[1] == 1 else k // a_scales.shape[1]
    widths = [width for width in (a_group, b_block[1]) if width < k]
    block_k = math.gcd(64, *widths)  # a power of two that divides them
    if block_k < 8:
        raise ValueError(f"FP8 matmul: activation groups of {a_group} and weight blocks {b_block} need tiles of 8")
    narrow = block_k < FP8_DOT_DEPTH
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    block_m = 64
    block_n = 128 if n >= 128 else triton.next_power_of_2(n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scaled_matmul_kernel[grid](
        a, a_scales, b, b_scales, a if bias is None else bias, c, m, n, k,
        a.stride(0), b.stride(0), c.stride(0), a_scales.shape[1], a_group, b_block[0], b_block[1],
        b_scales.stride(0), HAS_BIAS=bias is not None, NARROW=narrow, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=FP8_DOT_DEPTH if narrow else block_k,
    )  # fmt: skip
    return c
