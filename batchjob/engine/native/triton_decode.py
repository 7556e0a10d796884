"""Split-K paged decode attention (flash-decoding) in Triton, safe to capture in a CUDA graph.

One query token per sequence (sequences with another count are skipped: a mixed step runs this kernel for
its one-token sequences beside the varlen kernel for the rest). Stage 1 runs one program per (sequence, KV
head, split): it reads its slice of the sequence's context through the block table once for every query
head sharing that KV head (GQA grouping, so each KV byte leaves HBM once) and writes a partial output with
its log-sum-exp. Stage 2 combines the partials of each (sequence, query head). With one split (a batch that
gives every SM a program: 17 sequences or more for 8 KV heads on 132 SMs) stage 1 writes the output itself and
stage 2 is not launched; on an H200 the reduce was 5% of an 8B decode step at 256 sequences. That is a compiled
variant of its own (`DIRECT`, layers without a sliding window): as a runtime branch, the output's addresses
raised the kernel from 96 to 150 registers a thread (sm_90), and an 8B decode step of 32 sequences (two splits)
at about 1,100 tokens of context took 6.6 ms against 6.2 ms. Below two programs an SM it reads tiles of 128
tokens (`WIDE_DECODE_CONFIG`), a third variant.

The launch (grid, split count, workspace shapes) depends only on the batch size, never on the context
lengths: a captured graph replays with other `seq_lens`, and splits that fall past a sequence's end
exit at once. With a sliding window only the in-window tiles are dealt out to the splits, so a sliding
layer reads at most `window` keys (plus one partial tile) per sequence, whatever its length.

Nothing that changes between steps is a compile-time specialisation but whether there is one split: the split
count, the window and the block-table stride are plain runtime integers, and the metadata pointers (views into
a packed buffer at step-dependent offsets) are not specialised on alignment. Three compiled variants (several
splits; one split in 64- or 128-token tiles) serve a whole run; the start-up warm-up's batch sizes meet each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchjob.engine.native.triton_attention_tile import (
    attend_kv_tile,
    check_tile,
    dot_precision,
    kv_tile,
    score_scales,
)

MAX_SPLITS = 64
# Splits the reduce combines per iteration: a fixed width, so the split count never picks a variant.
SPLIT_CHUNK = 16


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


DEFAULT_DECODE_CONFIG = DecodeConfig()
# One split over a batch of between one and two programs a multiprocessor: each program streams a whole context,
# and tiles of 128 tokens keep more of it in flight (H200, 32 sequences, 8 KV heads: 9.8 / 27.1 / 42.8 us at
# 256 / 640 / 1,152 tokens of context against 14.7 / 31.4 / 46.5 us for two splits of 64-token tiles; at 64
# sequences, four programs a multiprocessor, 64-token tiles stay faster: 66.8 against 71.8 us).
WIDE_DECODE_CONFIG = DecodeConfig(block_n=128, num_warps=4, num_stages=2)


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
    out_ptr,
    score_scale,
    softcap_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
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
    DIRECT: tl.constexpr,
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
        if DIRECT:
            # An empty sequence (a padding slot in a graph bucket): zeros, as the reduce writes, not NaN.
            offs_h = tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, HEAD_DIM)
            q_row = tl.load(cu_query_lens_ptr + seq).to(tl.int64)
            out_rows = out_ptr + q_row * stride_ot + (kv_head * GROUP + offs_h)[:, None] * stride_oh + offs_d[None, :]
            zeros = tl.zeros([BLOCK_H, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
            tl.store(out_rows, zeros, mask=(offs_h < GROUP)[:, None])
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

    if DIRECT:
        out_rows = out_ptr + q_row * stride_ot + q_heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
        return
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


def default_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence, whatever the lengths: none once the batch gives every multiprocessor a program
    (`scripts/bench_attention.py --sweep` on an H200, 32 sequences of 8 KV heads, 256 programs on 132
    multiprocessors: one split was the fastest at every context from 256 to 1,152 tokens, each further split
    slower, the reduce included); below that, enough to fill the GPU about two programs deep."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * num_sms, programs)))


def default_config(num_seqs: int, num_kv_heads: int, num_sms: int) -> DecodeConfig:
    """The launch shape for a batch: `WIDE_DECODE_CONFIG` for one split of fewer than two programs a
    multiprocessor, `DEFAULT_DECODE_CONFIG` otherwise."""
    programs = num_seqs * num_kv_heads
    return WIDE_DECODE_CONFIG if num_sms <= programs < 2 * num_sms else DEFAULT_DECODE_CONFIG


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
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence over the paged cache; writes `out` [B, Hq, D] and returns it. Sequences of
    another query count (a mixed step's chunks) are skipped: their rows of `out` are left as they were.

    `q` is [B, Hq, D] (row `cu_query_lens[b]` belongs to sequence b); caches are
    [num_blocks, block_size, Hkv, D]. `window` > 0 limits each query to its last `window` keys and
    `softcap` > 0 caps scores at ±softcap with a tanh (`PagedAttentionBackend.forward`). Nothing here reads
    a length on the host.
    """
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    block_n = kv_tile(config.block_n, head_dim, q.element_size())
    score_scale, softcap_log2 = score_scales(scale, softcap)
    # Sliding layers keep the reduce: writing the output from stage 1 raised their variant from 122 to 154
    # registers a thread (sm_90), one program fewer per SM.
    direct = num_splits == 1 and window == 0
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
        out,
        score_scale,
        softcap_log2,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
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
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        DOT_PRECISION=dot_precision(q.dtype),
        DIRECT=direct,
        num_warps=config.num_warps,
        num_stages=config.num_stages if q.element_size() <= 2 else min(config.num_stages, 2),
    )
    if direct:
        return out
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
