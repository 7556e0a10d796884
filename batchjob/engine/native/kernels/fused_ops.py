"""Fused elementwise kernels for the CUDA path: residual-add + RMSNorm, rotary embedding on q and k in place
(with the per-head q/k norms of the families that have them, and the paged KV cache's store), and SiLU-and-mul.
In plain torch each is 3-12 kernels; at batch 32 of an 8B model those launches cost more GPU time than the math,
so each is one kernel here. (The sampler's kernels are in sampling_draw.py.)

Rounding follows transformers (fp32 statistics, a round to the model dtype before the weight multiply, SiLU
rounded before the multiply), so bf16 results stay within bf16 tolerance of theirs and fp32 results agree
to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob.engine.native.kernels import fp8
from batchjob.engine.native.kernels.attention_tile import cache_value


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    x_stride,
    split_stride,
    res_stride,
    out_stride,
    n_cols,
    eps,
    offset,
    upper,
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,
    SPLITS: tl.constexpr,
    FP8_OUT: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """With SPLITS > 1, x is that many float32 partial sums of a split-K matmul (`split_k.py`): added up and
    rounded to the model dtype here, they are the matmul's output. With FP8_OUT the normed row, rounded to the
    model dtype, is quantized as `fp8.quantize` would quantize it, one scale per row: `out_ptr` is e4m3 and
    `scale_ptr` float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # Every load first: the weight's does not wait for the reduction (one memory round trip fewer).
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        x += tl.load(x_ptr + s * split_stride + row * x_stride + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
    dtype = res_ptr.dtype.element_ty if SPLITS > 1 else x_ptr.dtype.element_ty
    x = x.to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the model dtype, as a plain `x + residual` would be.
        x = (x + r).to(dtype).to(tl.float32)
        tl.store(res_ptr + row * res_stride + cols, x.to(dtype), mask=mask)
    variance = tl.sum(x * x, axis=0) / n_cols
    h = x * tl.rsqrt(variance + eps)
    if not WEIGHT_FP32:
        h = h.to(dtype).to(tl.float32)
    y = (h * w).to(dtype)
    if FP8_OUT:
        y = y.to(tl.float32)
        scale = fp8.row_scale(tl.max(tl.abs(y), axis=0), upper, HAS_UPPER)
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * out_stride + cols, fp8.to_fp8(y, scale, out_ptr), mask=mask)
    else:
        tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_fp32: bool = False,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of 2-D `x`, scaled by `offset + weight` (rounded to the dtype before the
    multiply unless `weight_fp32`: see `layers.RMSNorm`). With `residual`: `residual += x` (in place), then
    the norm of it; returns (normed, residual). A 3-D float32 `x` [splits, rows, cols] is a split-K matmul's
    partial sums (`split_k.py`), added up first; the output then takes the residual's dtype."""
    splits = x.shape[0] if x.dim() == 3 else 1
    dtype = x.dtype if splits == 1 else residual.dtype
    out = torch.empty(x.shape[-2:], dtype=dtype, device=x.device)
    _launch_norm(x, weight, eps, residual, weight_fp32, offset, out, None, None)
    return out if residual is None else (out, residual)


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_fp32: bool = False,
    offset: float = 0.0,
    upper: float | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """`rms_norm`, its output quantized per row for an FP8 projection, in the same kernel: ((e4m3 [rows, cols],
    float32 scales [rows, 1]), residual): `fp8.quantize(rms_norm(...), None, upper)`'s arithmetic on the normed
    rows, which this kernel's compiled variant may round one bf16 step apart from `rms_norm`'s in a rare element
    (tests/gpu/test_fp8_gpu.py bounds it)."""
    rows, cols = x.shape[-2:]
    q, scales = fp8.row_buffers(rows, cols, 1, x.device)
    _launch_norm(x, weight, eps, residual, weight_fp32, offset, q, scales, upper)
    return (q, scales), residual


def _launch_norm(x, weight, eps, residual, weight_fp32, offset, out, scales, upper) -> None:
    splits = x.shape[0] if x.dim() == 3 else 1
    rows, cols = x.shape[-2:]
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, out if scales is None else scales, x.stride(-2), x.stride(0), res.stride(0),
        out.stride(0), cols, eps, offset, 0.0 if upper is None else upper, HAS_RESIDUAL=residual is not None,
        WEIGHT_FP32=weight_fp32, SPLITS=splits, FP8_OUT=scales is not None, HAS_UPPER=upper is not None,
        BLOCK=triton.next_power_of_2(cols), num_warps=4 if cols <= 4096 else 8,
    )  # fmt: skip


# The slot mapping is a view at a step-dependent offset in a packed buffer (see `_store_kv_kernel`).
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _qk_rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    table_ptr,
    q_norm_ptr,
    k_norm_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    eps,
    offset,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program (token, 0) rotates every query head of one token, (token, 1) every key head; with NORM each
    head is first RMS-normalised over its 2 * HALF channels, rounded as `_rms_norm_kernel` rounds. With STORE
    the key program also writes the rotated keys and the values into the paged caches at the token's slot
    (a negative slot: none), which saves the attention's own store kernel."""
    token = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 1:
        x_ptr, w_ptr, stride_t, stride_h, num_heads = k_ptr, k_norm_ptr, stride_kt, stride_kh, K_HEADS
    else:
        x_ptr, w_ptr, stride_t, stride_h, num_heads = q_ptr, q_norm_ptr, stride_qt, stride_qh, Q_HEADS
    pos = tl.load(pos_ptr + token)
    offs = tl.arange(0, BLOCK)
    heads = tl.arange(0, HEADS)
    # A partial rotary dim (Phi-4-mini: 96 of 128) makes HALF no power of two.
    mask_c = offs < HALF
    mask = (heads[:, None] < num_heads) & mask_c[None, :]
    # The table row is [cos | sin], each of the rotated dim with its two halves equal (transformers' layout).
    cos = tl.load(table_ptr + pos * 4 * HALF + offs, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(table_ptr + pos * 4 * HALF + 2 * HALF + offs, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    base = x_ptr + token * stride_t + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        inv = tl.rsqrt(variance + eps)[:, None]
        h1, h2 = x1 * inv, x2 * inv
        if not WEIGHT_FP32:
            h1, h2 = h1.to(dtype).to(tl.float32), h2.to(dtype).to(tl.float32)
        w1 = tl.load(w_ptr + offs, mask=mask_c, other=0.0).to(tl.float32)[None, :] + offset
        w2 = tl.load(w_ptr + HALF + offs, mask=mask_c, other=0.0).to(tl.float32)[None, :] + offset
        # The normed head is rounded to the model dtype, as the norm kernel's output would be, before rotating.
        x1, x2 = (h1 * w1).to(dtype).to(tl.float32), (h2 * w2).to(dtype).to(tl.float32)
    y1, y2 = (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)
    tl.store(base, y1, mask=mask)
    tl.store(base + HALF, y2, mask=mask)
    if STORE and tl.program_id(1) == 1:
        slot = tl.load(slot_ptr + token)
        keep = mask & ((heads[:, None] * 0 + slot) >= 0)  # a tensor compare: the scalar one is no mask dtype
        slot = tl.maximum(slot, 0)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads[:, None] * stride_ch
        dst += offs[None, :]
        tl.store(k_cache_ptr + dst, cache_value(y1, k_cache_ptr), mask=keep)
        tl.store(k_cache_ptr + dst + HALF, cache_value(y2, k_cache_ptr), mask=keep)
        v_base = v_ptr + token * stride_vt + heads[:, None] * stride_vh + offs[None, :]
        tl.store(v_cache_ptr + dst, cache_value(tl.load(v_base, mask=keep), v_cache_ptr), mask=keep)
        tl.store(v_cache_ptr + dst + HALF, cache_value(tl.load(v_base + HALF, mask=keep), v_cache_ptr), mask=keep)


def rotary_qk_(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    table: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float, bool, float] | None = None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotate `q` [T, Hq, D] and `k` [T, Hk, D] in place (any strides with a contiguous last dim; `k` may be
    None) by the cos/sin `table` rows of `positions` (each 2 * D wide), in one kernel.

    `norms` = (q weight, k weight, eps, weight_fp32, offset): first RMS-normalise each head over its D
    channels as `rms_norm` would (Qwen 3's and Gemma's per-head q/k norms), which needs the whole head rotated.
    `store` = (v, k_cache, v_cache, slot_mapping): also write the rotated keys and `v` [T, Hk, D] into the
    caches [num_blocks, block_size, Hk, D] at the flat slots [T], as `store_kv` would (whole heads only).
    """
    tokens, q_heads, dim = q.shape
    if tokens == 0:
        return
    k_heads = 0 if k is None else k.shape[1]
    half = dim // 2
    heads = triton.next_power_of_2(max(q_heads, k_heads))
    block = triton.next_power_of_2(half)
    q_weight, k_weight, eps, weight_fp32, offset = norms if norms is not None else (q, q, 0.0, False, 0.0)
    if store is not None:
        v, k_cache, v_cache, slots = store
        if k is None or v.shape != k.shape or k_cache.shape[-1] != dim or k_cache.stride() != v_cache.stride():
            raise ValueError("storing keys and values needs k and v of one shape, whole heads, and alike caches")
        block_size = k_cache.shape[1]
    else:
        v, k_cache, v_cache, slots, block_size = q, q, q, positions, 1
    k = q if k is None else k
    _qk_rope_kernel[(tokens, 1 if k is q else 2)](
        q, k, positions, table, q_weight, k_weight, v, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2) if store is not None else 0, eps, offset,
        Q_HEADS=q_heads, K_HEADS=k_heads, HEADS=heads, HALF=half, BLOCK=block, NORM=norms is not None,
        WEIGHT_FP32=weight_fp32, STORE=store is not None, BLOCK_SIZE=block_size,
        num_warps=4 if heads * block <= 2048 else 8,
    )  # fmt: skip


def rotary_(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> None:
    """Rotate `x` [T, H, D] in place (any strides with a contiguous last dim), by the cos/sin `table` rows
    of `positions` (each 2 * D wide)."""
    rotary_qk_(x, None, positions, table)


@triton.jit
def _silu_mul(x_ptr, n_cols, cols, mask):
    """SiLU(gate) * up of one row's `cols`, in the model dtype (gate and up: the row's two halves at `x_ptr`)."""
    gate = tl.load(x_ptr + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(x_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    tl.store(out_ptr + row * out_stride + cols, _silu_mul(x_ptr + row * x_stride, n_cols, cols, mask), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    x_stride,
    q_stride,
    n_cols,
    upper,
    HAS_UPPER: tl.constexpr,
    BLOCK: tl.constexpr,
    WHOLE_ROW: tl.constexpr,
):
    """One program a row. `WHOLE_ROW` (BLOCK covers the row): the product once, in registers, then its largest
    magnitude and the quantized row; otherwise the largest magnitude block by block, then the row again, quantized
    (recomputing reads the input twice, as the unfused pair of kernels would read and write the product between)."""
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * x_stride
    if WHOLE_ROW:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _silu_mul(x_ptr, n_cols, cols, mask).to(tl.float32)
        scale = fp8.row_scale(tl.max(tl.abs(y), axis=0), upper, HAS_UPPER)
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * q_stride + cols, fp8.to_fp8(y, scale, q_ptr), mask=mask)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        amax = tl.maximum(amax, tl.abs(_silu_mul(x_ptr, n_cols, cols, mask).to(tl.float32)))
    scale = fp8.row_scale(tl.max(amax, axis=0), upper, HAS_UPPER)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _silu_mul(x_ptr, n_cols, cols, mask).to(tl.float32)
        tl.store(q_ptr + row * q_stride + cols, fp8.to_fp8(y, scale, q_ptr), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out


WHOLE_ROW_MAX = 16384


def silu_and_mul_fp8(gate_up: torch.Tensor, upper: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul` quantized per row for an FP8 projection, in one kernel: (e4m3 [rows, n], float32 scales
    [rows, 1]), with `fp8.quantize(silu_and_mul(gate_up), None, upper)`'s arithmetic."""
    rows, width = gate_up.shape
    n = width // 2
    q, scales = fp8.row_buffers(rows, n, 1, gate_up.device)
    if rows:
        # A row of up to WHOLE_ROW_MAX products fits one program's registers (16 warps: 32 floats a thread): one
        # read of the row, its loads all in flight at once (a decode step has a program for each of its few rows).
        whole = n <= WHOLE_ROW_MAX
        _silu_and_mul_fp8_kernel[(rows,)](
            gate_up, q, scales, gate_up.stride(0), q.stride(0), n, 0.0 if upper is None else upper,
            HAS_UPPER=upper is not None, BLOCK=triton.next_power_of_2(n) if whole else 2048, WHOLE_ROW=whole,
            num_warps=16 if whole else 8,
        )  # fmt: skip
    return q, scales
