"""Split-K paged decode attention (flash-decoding) in Triton, safe to capture in a CUDA graph.

One query token per sequence. Stage 1 runs one program per (sequence, KV head, split): it reads its
slice of the sequence's context through the block table once for every query head sharing that KV
head (GQA grouping, so each KV byte leaves HBM once) and writes a partial output with its log-sum-exp.
Stage 2 combines the partials of each (sequence, query head).

The launch (grid, split count, workspace shapes) depends only on the batch size, never on the context
lengths: a captured graph replays with other `seq_lens`, and splits that fall past a sequence's end
exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of stage 1 (scripts/bench_attention.py --sweep compares them on a GPU).

    `block_n` tokens per tile; splits are whole tiles, so the reduce recomputes which splits ran.
    """

    block_n: int = 64
    num_warps: int = 4
    # Measured on an H200 (scripts/bench_attention.py --sweep, bf16, 32 x 1152 and 64 x 1024 contexts): 3-4
    # stages beat 2 by ~20%. Tiles wider than 2 bytes per element fall back to 2 stages to fit shared memory.
    num_stages: int = 4

    def __post_init__(self) -> None:
        check_tile("block_n", self.block_n)


def check_tile(name: str, size: int) -> None:
    """tl.dot needs every tile side to be a power of two of at least 16."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {size}")


DEFAULT_DECODE_CONFIG = DecodeConfig()


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_query_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    if tile_start >= tile_end:
        return

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_h = offs_h < GROUP
    q_heads = kv_head * GROUP + offs_h
    q_row = tl.load(cu_query_lens_ptr + seq).to(tl.int64)
    q = tl.load(
        q_ptr + q_row * stride_qt + q_heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_start, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + (block * stride_kb + in_block * stride_ks + kv_head * stride_kh)[:, None] + offs_d[None, :],
            mask=mask_n[:, None],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + (block * stride_vb + in_block * stride_vs + kv_head * stride_vh)[:, None] + offs_d[None, :],
            mask=mask_n[:, None],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Partials are laid out [seq, q_head, split, (dim)], so the reduce reads each head's splits contiguously.
    part_row = (seq * GROUP * tl.num_programs(1) + q_heads).to(tl.int64) * num_splits + split
    tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=mask_h[:, None])
    tl.store(part_lse_ptr + part_row, m_i + tl.math.log2(l_i), mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    cu_query_lens_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)

    # Recompute which splits ran, with stage 1's arithmetic; the others left their partials unwritten.
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), 1)
    num_valid = tl.cdiv(num_tiles, tiles_per_split)

    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < num_valid
    part_row = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part_row, mask=mask_s, other=float("-inf"))
    # An empty sequence (a padding slot in a graph bucket) has no valid split: its output is zeros, not NaN.
    m = tl.where(num_valid > 0, tl.max(lse, 0), 0.0)
    w = tl.where(mask_s, tl.math.exp2(lse - m), 0.0)
    parts = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    out_row = tl.load(cu_query_lens_ptr + seq).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + out_row + offs_d, out.to(out_ptr.dtype.element_ty))


def default_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence so stage 1 fills the GPU about two programs deep, whatever the lengths (the sweep's
    best on an H200: deeper splitting costs more in the reduce than it gains in occupancy)."""
    target_programs = 2 * num_sms
    return max(1, min(MAX_SPLITS, triton.cdiv(target_programs, num_seqs * num_kv_heads)))


def kv_tile(block_n: int, head_dim: int, element_size: int) -> int:
    """KV tokens per tile, capped so one K tile stays within 32 KB: K and V tiles, double-buffered, must fit
    in shared memory even for fp32 with head_dim 256."""
    return max(16, min(block_n, 32768 // (head_dim * element_size)))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to TF32: the fp32 engine is compared exactly with transformers."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor,
    config: DecodeConfig = DEFAULT_DECODE_CONFIG,
) -> torch.Tensor:
    """One query token per sequence over the paged cache; writes `out` [B, Hq, D] and returns it.

    `q` is [B, Hq, D] (row `cu_query_lens[b]` belongs to sequence b); caches are
    [num_blocks, block_size, Hkv, D]. Nothing here reads a length on the host.
    """
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    block_n = kv_tile(config.block_n, head_dim, q.element_size())
    part_out = torch.empty(num_seqs, q.shape[1], num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, q.shape[1], num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_query_lens,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        num_splits,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages if q.element_size() <= 2 else min(config.num_stages, 2),
    )
    _decode_reduce_kernel[(num_seqs, q.shape[1])](
        part_out,
        part_lse,
        seq_lens,
        cu_query_lens,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        SPLITS_P2=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
    return out
