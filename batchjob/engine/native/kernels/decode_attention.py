"""Paged decode attention in Triton, safe to capture in a CUDA graph: the launch rules, and the kernel of a batch
that gives every multiprocessor a program with one split.

One query token per sequence (sequences with another count are skipped: a mixed step runs these kernels for
its one-token sequences beside the varlen kernel for the rest). Each program takes a (sequence, KV head) and
reads its context through the block table once for every query head sharing that KV head (GQA grouping, so
each KV byte leaves HBM once). Once the batch gives every SM a program (17 sequences or more for 8 KV heads on
132 SMs) one program streams the whole context and writes the output itself (`_decode_one_split_kernel`);
smaller batches, and layers with a sliding window, split the context and combine the parts
(`split_decode_attention.py`; on an H200 that combine was 5% of an 8B decode step at 256 sequences).

Below two programs an SM each program's stream of tiles is the whole of the SM's work, so a tile's key and
value loads should not wait behind the block-table read that gives their addresses: `FEW_PROGRAMS_DECODE_CONFIG`
reads the next tile's blocks a tile ahead. On an H200 (docs/history/benchmarks-2026.md, 32
sequences of 8 KV heads over 32 layers of distinct caches) that is 25.0 / 40.1 us a layer at 640 / 1,152 tokens
of context against 25.3 / 40.6 for the best launch without it; at 64 sequences it loses (82.2 against 66.2 us in
the same tiles), so it is off there. Most of the gain over the earlier kernel, which ran one split as a variant of
the split kernel, is this kernel's leaner body: timed in whole graphed decode steps of 32 sequences, the same
machine, 26.5 / 42.1 us a layer before, 24.6 / 39.7 after.

A one-split launch's programs take the sequences in the order `order` lists them (the engine passes
`AttentionMetadata.decode_order`, longest context first): the GPU starts programs in grid order, so in batch order
a long sequence near the end of the batch started in the last wave and the layer ended on it alone. On an H200
(docs/history/benchmarks-2026.md, Llama-3.1-8B's
attention, contexts drawn uniformly from 128-3,072 tokens) a layer took 749.4 against 777.9 us at 512 sequences,
386.2 against 411.1 us at 256; W5 ran 1.012x as fast.

The launch depends only on the batch size, never on the context lengths: a captured graph replays with other
`seq_lens`. Nothing that changes between steps is a compile-time specialisation but whether there is one
split: the block-table stride is a plain runtime integer and the metadata pointers (views into a packed buffer
at step-dependent offsets) are not specialised on alignment. Two variants of this kernel (with and without the
read ahead) and the split kernel's serve a whole run; the start-up warm-up's batch sizes meet each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchjob.engine.native.kernels.attention_tile import (
    attend_kv_blocks,
    attend_kv_tile,
    check_tile,
    dot_precision,
    kv_tile,
    score_scales,
    tile_blocks,
)
from batchjob.engine.native.kernels.split_decode_attention import MAX_SPLITS, split_decode_attention


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of stage 1 (docs/history/benchmarks-2026.md compares them).

    `block_n` tokens per tile; splits are whole tiles, so the reduce recomputes which splits ran.
    """

    block_n: int = 64
    num_warps: int = 4
    # Measured on an H200 (docs/history/benchmarks-2026.md, bf16, 32 x 1152 and 64 x 1024 contexts): 3-4
    # stages beat 2 by ~20%. Tiles wider than 2 bytes per element fall back to 2 stages to fit shared memory.
    num_stages: int = 4
    # One split only: read the next tile's cache blocks from the block table a tile ahead (a hand-made stage
    # for the one load whose address the key and value loads need).
    prefetch_table: bool = False
    # One split only: a fixed grid of this many programs taking the (sequence, KV head) pairs in turn, so the
    # kernel leaves the other multiprocessors free (0: a program per pair).
    programs: int = 0
    # One split only: the grid's first dimension the KV heads, so that a sequence's heads run side by side and
    # read the same cache blocks together (a block holds every head's keys of its tokens) rather than each head
    # of every sequence in turn. On an H200 (docs/history/benchmarks-2026.md, Llama-3.1-8B's shape, a layer)
    # 740.7 against 749.5 us at 512 x 1,500 tokens of context, 386.1 against 392.5 at 256 x 1,500, 354.1 against
    # 358.6 at 512 x 700; W5 ran 1.007x as fast with it.
    heads_first: bool = False

    def __post_init__(self) -> None:
        check_tile("block_n", self.block_n)
        if self.programs < 0:
            raise ValueError(f"programs must be >= 0, got {self.programs}")


DEFAULT_DECODE_CONFIG = DecodeConfig(heads_first=True)
# One split over a batch of between one and two programs a multiprocessor: each program streams a whole context,
# so its tiles' loads should not wait behind their block-table reads (the module's docstring has the figures).
FEW_PROGRAMS_DECODE_CONFIG = DecodeConfig(block_n=64, num_warps=4, num_stages=3, prefetch_table=True)


@triton.jit
def _decode_one(
    seq,
    kv_head,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_query_lens_ptr,
    out_ptr,
    score_scale,
    softcap_log2,
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
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr,
):
    """One (sequence, KV head) over the whole context, no window: the output written directly. With
    PREFETCH_TABLE each iteration reads the next tile's cache blocks from the block table, so a tile's key and
    value loads need not wait behind that read. A sequence of another query count is skipped."""
    # Three independent reads, issued together before the branch.
    q_row = tl.load(cu_query_lens_ptr + seq)
    q_end = tl.load(cu_query_lens_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_end - q_row == 1:  # else a mixed step's chunk: the varlen kernel's
        row = q_row.to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        mask_h = offs_h < GROUP
        q_heads = kv_head * GROUP + offs_h
        q = tl.load(
            q_ptr + row * stride_qt + q_heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None],
            other=0.0,
        )
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        table_row = block_tables_ptr + tl.cast(seq, tl.int64) * stride_bt
        num_tiles = tl.cdiv(seq_len, BLOCK_N)
        if PREFETCH_TABLE:
            block = tile_blocks(table_row, 0, 0, seq_len, BLOCK_SIZE, BLOCK_N, False)
            for tile in range(0, num_tiles):
                n0 = tile * BLOCK_N
                this_block = block
                block = tile_blocks(table_row, n0 + BLOCK_N, 0, seq_len, BLOCK_SIZE, BLOCK_N, False)
                m_i, l_i, acc = attend_kv_blocks(
                    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, this_block, kv_head,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    n0, 0, seq_len, 0, 0, score_scale, softcap_log2,
                    HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False, SOFTCAP, DOT_PRECISION,
                )  # fmt: skip
        else:
            for tile in range(0, num_tiles):
                m_i, l_i, acc = attend_kv_tile(
                    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    tile * BLOCK_N, 0, seq_len, 0, 0, score_scale, softcap_log2,
                    HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False, SOFTCAP, DOT_PRECISION,
                )  # fmt: skip
        # An empty sequence (a padding slot in a graph bucket) read no tile: zeros, as the reduce writes, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = out_ptr + row * stride_ot + q_heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])


@triton.jit
def _nth_sequence(order_ptr, nth, ORDERED: tl.constexpr):
    """The sequence a kernel's `nth` program (or item) takes: the nth of the order given, else the nth."""
    if ORDERED:
        return tl.load(order_ptr + nth)
    return nth


@triton.jit(
    do_not_specialize=["stride_bt", "num_items"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "cu_query_lens_ptr", "order_ptr"],
)
def _decode_one_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_query_lens_ptr,
    order_ptr,
    out_ptr,
    score_scale,
    softcap_log2,
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
    num_items,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr,
    PERSISTENT: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """One split per (sequence, KV head): a program each, or with PERSISTENT a fixed grid whose programs take
    the `num_items` (sequence, KV head) pairs in turn, so the kernel holds only as many multiprocessors as it
    has programs. With ORDERED the programs take the sequences in the order `order_ptr` lists them."""
    if PERSISTENT:
        for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
            _decode_one(
                _nth_sequence(order_ptr, item // NUM_KV_HEADS, ORDERED), item % NUM_KV_HEADS, q_ptr, k_cache_ptr,
                v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_query_lens_ptr, out_ptr, score_scale, softcap_log2,
                stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, stride_bt, GROUP, BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N, SOFTCAP, DOT_PRECISION,
                PREFETCH_TABLE,
            )  # fmt: skip
    else:
        nth, kv_head = (tl.program_id(1), tl.program_id(0)) if HEADS_FIRST else (tl.program_id(0), tl.program_id(1))
        _decode_one(
            _nth_sequence(order_ptr, nth, ORDERED), kv_head, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
            seq_lens_ptr, cu_query_lens_ptr, out_ptr, score_scale, softcap_log2, stride_qt, stride_qh,
            stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
            GROUP, BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N, SOFTCAP, DOT_PRECISION, PREFETCH_TABLE,
        )  # fmt: skip


def default_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence, whatever the lengths: none once the batch gives every multiprocessor a program
    (docs/history/benchmarks-2026.md on an H200, 32 sequences of 8 KV heads, 256 programs on 132
    multiprocessors: one split was the fastest at every context from 256 to 1,152 tokens, each further split
    slower, the reduce included); below that, enough to fill the GPU about two programs deep."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * num_sms, programs)))


def default_config(num_seqs: int, num_kv_heads: int, num_sms: int) -> DecodeConfig:
    """The launch shape for a batch: `FEW_PROGRAMS_DECODE_CONFIG` for one split of fewer than two programs a
    multiprocessor, `DEFAULT_DECODE_CONFIG` otherwise."""
    programs = num_seqs * num_kv_heads
    return FEW_PROGRAMS_DECODE_CONFIG if num_sms <= programs < 2 * num_sms else DEFAULT_DECODE_CONFIG


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
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over the paged cache; writes `out` [B, Hq, D] and returns it. Sequences of
    another query count (a mixed step's chunks) are skipped: their rows of `out` are left as they were.
    `order` (int32 [B], a permutation of the sequences) is the order a one-split launch's programs take them in
    (`AttentionMetadata.decode_order`: the longest context first).

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
    num_stages = config.num_stages if q.element_size() <= 2 else min(config.num_stages, 2)
    launch = dict(
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        SOFTCAP=softcap > 0, DOT_PRECISION=dot_precision(q.dtype), num_warps=config.num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits == 1 and window == 0:
        items = num_seqs * num_kv_heads
        grid = (num_kv_heads, num_seqs) if config.heads_first else (num_seqs, num_kv_heads)
        grid = (config.programs,) if config.programs else grid
        _decode_one_split_kernel[grid](
            q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, seq_lens if order is None else order, out,
            score_scale, softcap_log2, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3],
            *v_cache.stride()[:3], block_tables.stride(0), items, NUM_KV_HEADS=num_kv_heads, **launch,
            BLOCK_N=block_n, PREFETCH_TABLE=config.prefetch_table, PERSISTENT=config.programs > 0,
            HEADS_FIRST=config.heads_first, ORDERED=order is not None,
        )  # fmt: skip
        return out
    split_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, out, score_scale, softcap_log2, window,
        num_splits, block_n, launch,
    )  # fmt: skip
    return out
