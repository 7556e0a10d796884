"""Split-K paged decode attention (flash-decoding) in Triton, for batches too small to give every multiprocessor
a program with one split, and for layers with a sliding window.

Stage 1 runs one program per (sequence, KV head, split): it reads its slice of the sequence's context through
the block table once for every query head sharing that KV head (GQA grouping, so each KV byte leaves HBM once)
and writes a partial output with its log-sum-exp. Stage 2 combines the partials of each (sequence, query head).

The launch (grid, split count, workspace shapes) depends only on the batch size, never on the context
lengths: a captured graph replays with other `seq_lens`, and splits that fall past a sequence's end
exit at once. With a sliding window only the in-window tiles are dealt out to the splits, so a sliding
layer reads at most `window` keys (plus one partial tile) per sequence, whatever its length. The split
count, the window and the block-table stride are plain runtime integers, and the metadata pointers (views
into a packed buffer at step-dependent offsets) are not specialised on alignment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob.engine.native.kernels.attention_tile import attend_kv_tile

MAX_SPLITS = 64
# Splits the reduce combines per iteration: a fixed width, so the split count never picks a variant.
SPLIT_CHUNK = 16


@triton.jit
def _split_plan(seq_len, window, num_splits, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """The keys a decode query sees, [kv_start, seq_len), as whole tiles from `first_tile` dealt out to the
    splits `tiles_per_split` at a time. Stage 1 and the reduce both derive which splits ran from this."""
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(seq_len - window, 0)
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), 1)
    return kv_start, first_tile, num_tiles, tiles_per_split


@triton.jit(
    do_not_specialize=["window", "stride_bt", "num_splits"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "cu_query_lens_ptr"],
)
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_query_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    score_scale,
    softcap_log2,
    window,
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
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # In a mixed step this kernel takes the one-token sequences and the varlen kernel the rest. (Checked first
    # and alone: folded into the later exit, it raised the sliding variant from 122 to 154 registers a thread.)
    if tl.load(cu_query_lens_ptr + seq + 1) - tl.load(cu_query_lens_ptr + seq) != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start, first_tile, num_tiles, tiles_per_split = _split_plan(seq_len, window, num_splits, BLOCK_N, SLIDING)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, first_tile + num_tiles)
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
    # One query at the last position: every key below seq_len is causally visible and the window starts
    # exactly at kv_start, so no per-row mask is needed. Only the first in-window tile can start before
    # kv_start: it runs apart with the window mask, which keeps the mask out of the pipelined loop (122
    # registers instead of 148 for bf16, head_dim 128, compiled for sm_90: one more program per SM).
    loop_start = tile_start
    if SLIDING:  # noqa: SIM102 - a compile-time branch around a run-time one
        if tile_start == first_tile:
            m_i, l_i, acc = attend_kv_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                tile_start * BLOCK_N, kv_start, seq_len, 0, 0, score_scale, softcap_log2,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, True, SOFTCAP, DOT_PRECISION,
            )  # fmt: skip
            loop_start += 1
    for tile in range(loop_start, tile_end):
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            tile * BLOCK_N, 0, seq_len, 0, 0, score_scale, softcap_log2,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False, SOFTCAP, DOT_PRECISION,
        )  # fmt: skip

    # Partials are laid out [seq, q_head, split, (dim)], so the reduce reads each head's splits contiguously.
    part_row = (seq * GROUP * tl.num_programs(1) + q_heads).to(tl.int64) * num_splits + split
    tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=mask_h[:, None])
    tl.store(part_lse_ptr + part_row, m_i + tl.math.log2(l_i), mask=mask_h)


@triton.jit(
    do_not_specialize=["window", "num_splits"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "cu_query_lens_ptr"],
)
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    cu_query_lens_ptr,
    out_ptr,
    window,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)

    q_row = tl.load(cu_query_lens_ptr + seq).to(tl.int64)
    if tl.load(cu_query_lens_ptr + seq + 1) - q_row != 1:
        return  # not a one-token sequence: the varlen kernel's
    # Recompute which splits ran, with stage 1's arithmetic; the others left their partials unwritten.
    seq_len = tl.load(seq_lens_ptr + seq)
    _, _, num_tiles, tiles_per_split = _split_plan(seq_len, window, num_splits, BLOCK_N, SLIDING)
    num_valid = tl.cdiv(num_tiles, tiles_per_split)

    part_row = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    offs_s = tl.arange(0, MAX_SPLITS)
    lse = tl.load(part_lse_ptr + part_row + offs_s, mask=offs_s < num_valid, other=float("-inf"))
    # An empty sequence (a padding slot in a graph bucket) has no valid split: its output is zeros, not NaN.
    m = tl.where(num_valid > 0, tl.max(lse, 0), 0.0)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    denom = tl.zeros([SPLIT_CHUNK], dtype=tl.float32)
    for s0 in range(0, num_valid, SPLIT_CHUNK):
        offs_c = s0 + tl.arange(0, SPLIT_CHUNK)
        mask_c = offs_c < num_valid
        w = tl.where(mask_c, tl.math.exp2(tl.load(part_lse_ptr + part_row + offs_c, mask=mask_c, other=0.0) - m), 0.0)
        parts = tl.load(
            part_out_ptr + (part_row + offs_c)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_c[:, None], other=0.0
        )
        acc += tl.sum(parts * w[:, None], 0)
        denom += w
    total = tl.sum(denom, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    out_row = q_row * stride_ot + head * stride_oh
    tl.store(out_ptr + out_row + offs_d, out.to(out_ptr.dtype.element_ty))


def split_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    out: torch.Tensor,
    score_scale: float,
    softcap_log2: float,
    window: int,
    num_splits: int,
    block_n: int,
    launch: dict,
) -> torch.Tensor:
    """Both stages over the batch, into `out`; `launch` holds the kernel's shape constants (GROUP, BLOCK_H,
    HEAD_DIM, BLOCK_SIZE, SOFTCAP, DOT_PRECISION) and its num_warps and num_stages."""
    num_seqs = seq_lens.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
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
        score_scale,
        softcap_log2,
        window,
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
        **launch,
        BLOCK_N=block_n,
        SLIDING=window > 0,
    )
    _decode_reduce_kernel[(num_seqs, q.shape[1])](
        part_out,
        part_lse,
        seq_lens,
        cu_query_lens,
        out,
        window,
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        MAX_SPLITS=MAX_SPLITS,
        SPLIT_CHUNK=SPLIT_CHUNK,
        SLIDING=window > 0,
        num_warps=4,
    )
    return out
