"""What the decode and prefill attention kernels share: one KV tile of online softmax over the paged cache,
and the host-side rules both launches follow (tile sizes, dot precision, score scaling).

Scores live in the log2 domain (`exp2` is the fast exponential), so the softmax scale arrives premultiplied
by log2(e). With soft-capping the score is `softcap * tanh(scale * qk / softcap)` in natural units; the tanh
is written with `exp2`, which the Triton interpreter also runs (its libdevice has no tanh).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def check_tile(name: str, size: int) -> None:
    """tl.dot needs every tile side to be a power of two of at least 16."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {size}")


def kv_tile(block_n: int, head_dim: int, element_size: int) -> int:
    """KV tokens per tile, capped so one K tile stays within 32 KB: K and V tiles, double-buffered, must fit
    in shared memory even for fp32 with head_dim 256."""
    return max(16, min(block_n, 32768 // (head_dim * element_size)))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to TF32: the fp32 engine is compared exactly with transformers."""
    return "ieee" if dtype == torch.float32 else "tf32"


def score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """The two multipliers `attend_kv_tile` takes: what q.k is multiplied by, and (soft-capping only) what the
    tanh is multiplied by, so that the result is the score in log2 units."""
    if softcap > 0:
        return 2 * LOG2E * scale / softcap, softcap * LOG2E
    return scale * LOG2E, 1.0


@triton.jit
def attend_kv_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table_row,
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    n0,
    kv_start,
    kv_end,
    q_pos,
    window,
    score_scale,
    softcap_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EDGE: tl.constexpr = True,
    ROW_SUM_DOT: tl.constexpr = False,
):
    """Fold keys [n0, n0 + BLOCK_N) below `kv_end` into the running softmax of the query rows `q`
    [M, HEAD_DIM]: max `m_i` and sum `l_i` [M] (log2 domain) and unnormalised output `acc` [M, HEAD_DIM].

    CAUSAL masks keys after each row's position `q_pos` [M]. SLIDING never reads keys before `kv_start`
    (blocks that far back may already be freed and hold anything, NaN included), and with CAUSAL also masks,
    per row, keys at or before `q_pos - window`. Without SLIDING, `kv_start` and `window` are ignored.
    Without EDGE the caller knows every row sees every key of the tile: nothing is masked (a causal prefill's
    tiles before its first query, most of its work). ROW_SUM_DOT: see `attend_kv_blocks`.
    """
    block = tile_blocks(table_row, n0, kv_start, kv_end, BLOCK_SIZE, BLOCK_N, SLIDING, EDGE)
    return attend_kv_blocks(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block, kv_head,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        n0, kv_start, kv_end, q_pos, window, score_scale, softcap_log2,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, CAUSAL, SLIDING, SOFTCAP, DOT_PRECISION, EDGE, ROW_SUM_DOT,
    )  # fmt: skip


@triton.jit
def tile_blocks(
    table_row,
    n0,
    kv_start,
    kv_end,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    EDGE: tl.constexpr = True,
):
    """The cache block of each key of the tile [n0, n0 + BLOCK_N), read from the sequence's block-table row
    (0 for keys outside [kv_start, kv_end); `kv_start` only with SLIDING; without EDGE every key is inside)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if not EDGE:
        return tl.load(table_row + offs_n // BLOCK_SIZE)
    mask_n = offs_n < kv_end
    if SLIDING:
        mask_n = mask_n & (offs_n >= kv_start)
    return tl.load(table_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0)


@triton.jit
def cache_value(x, cache_ptr):
    """`x` in the KV cache's dtype; into an e4m3 cache (`engine.kv_cache_dtype=fp8_e4m3`, a scale of 1) it saturates
    at +-448 instead of overflowing to NaN."""
    dtype = cache_ptr.dtype.element_ty
    if dtype == tl.float8e4nv:
        return tl.clamp(x.to(tl.float32), -448.0, 448.0).to(dtype)
    return x.to(dtype)


@triton.jit
def attend_kv_blocks(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block,
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    n0,
    kv_start,
    kv_end,
    q_pos,
    window,
    score_scale,
    softcap_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EDGE: tl.constexpr = True,
    ROW_SUM_DOT: tl.constexpr = False,
):
    """`attend_kv_tile` with the tile's cache blocks already read (`tile_blocks`): a kernel can then read the
    next tile's blocks while this one's keys load.

    ROW_SUM_DOT adds each row's probabilities on the tensor cores (a dot with ones, the probabilities rounded as
    the value dot takes them) rather than with `tl.sum`, whose order of additions follows the tile's layout across
    threads and warps: a 16-row and a 64-row program then add a row's sum alike."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_n = offs_n < kv_end
    if SLIDING:
        mask_n = mask_n & (offs_n >= kv_start)
    block = block.to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    k_rows = k_cache_ptr + (block * stride_kb + in_block * stride_ks + kv_head * stride_kh)[:, None] + offs_d[None, :]
    v_rows = v_cache_ptr + (block * stride_vb + in_block * stride_vs + kv_head * stride_vh)[:, None] + offs_d[None, :]
    # An FP8 cache's keys and values are widened to the queries' dtype for the dots (a no-op otherwise).
    k = (tl.load(k_rows, mask=mask_n[:, None], other=0.0) if EDGE else tl.load(k_rows)).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * score_scale
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (e^(2x) + 1): exact at both ends (e^(2x) overflowing to inf gives 1), no NaN.
        s = (1.0 - 2.0 / (tl.math.exp2(s) + 1.0)) * softcap_log2
    if EDGE:
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
            if SLIDING:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if CAUSAL and SLIDING:
        # A row can meet a tile wholly before its window while m is still -inf; measuring from 0 then keeps
        # its p and alpha at 0 rather than NaN (-inf minus -inf). Without a window, key 0 is in every row's
        # first tile; without per-row masks, every tile read has a visible key.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    if ROW_SUM_DOT:
        # Every column of the dot is the row's sum (the probabilities in the dtype the value dot takes them in);
        # the max picks one of them exactly.
        ones = tl.full([BLOCK_N, 16], 1.0, dtype=q.dtype)
        l_i = l_i * alpha + tl.max(tl.dot(p.to(q.dtype), ones, input_precision=DOT_PRECISION), 1)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    v = (tl.load(v_rows, mask=mask_n[:, None], other=0.0) if EDGE else tl.load(v_rows)).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
