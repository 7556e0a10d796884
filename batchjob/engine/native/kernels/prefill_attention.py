"""Varlen causal attention over the paged KV cache in Triton, for prefill chunks and mixed batches.

Each program takes a tile of consecutive query tokens of one sequence times every query head that
shares one KV head (GQA rows packed as token-major, head-minor), and streams that sequence's context
through the block table in tiles with an online softmax. The cache already holds this step's K/V, so
earlier chunks and the new tokens are read the same way. With a sliding window a program starts at the
first tile its earliest query can see, so a sliding layer's cost is bounded by the window.

Programs find their sequence on the device (no host sync on `cu_query_lens`): program `p` of
sequence `b` is numbered `cu_query_lens[b] // BLOCK_Q + b + i`, an upper bound on the query tiles
before it, so a grid of `T // BLOCK_Q + B` programs covers every tile and the few spare ones exit.
The search reads `cu_query_lens` in fixed-width chunks, so the batch size is a runtime value: like the
block-table stride and the window, it never selects a compiled variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchjob.engine.native.kernels.attention_tile import (
    attend_kv_tile,
    check_tile,
    dot_precision,
    kv_tile,
    score_scales,
)

# Sequences whose query starts one search step reads; a default batch (256 sequences) takes one step.
SEQ_CHUNK = 256


@triton.jit(
    do_not_specialize=["num_seqs", "window", "stride_bt", "skip_single", "ordered"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "cu_query_lens_ptr", "order_ptr"],
)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_query_lens_ptr,
    order_ptr,
    num_seqs,
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
    stride_ot,
    stride_oh,
    stride_bt,
    skip_single,
    ordered,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQ_CHUNK: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASK_EVERY_TILE: tl.constexpr,
    ROW_SUM_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    if ordered != 0:
        # A step of one-token sequences: program pid takes the pid-th sequence `order` lists.
        seq = tl.load(order_ptr + tl.minimum(pid, num_seqs - 1))
    else:
        # This program's sequence: the last one whose first tile number is <= pid.
        found = 0
        for b0 in range(0, num_seqs, SEQ_CHUNK):
            offs_b = b0 + tl.arange(0, SEQ_CHUNK)
            mask_b = offs_b < num_seqs
            starts = tl.load(cu_query_lens_ptr + offs_b, mask=mask_b, other=0)
            found += tl.sum((mask_b & (starts // BLOCK_Q + offs_b <= pid)).to(tl.int32), 0)
        seq = found - 1
    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    q0 = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if ordered != 0:
        q0 = tl.where(pid < num_seqs, 0, q_len)  # the spare programs take none
    if q0 >= q_len:
        return
    if skip_single != 0 and q_len == 1:
        return  # the decode kernel's

    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - q_len
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q0 + offs_m // GROUP_P2
    head = offs_m % GROUP_P2
    mask_m = (tok < q_len) & (head < GROUP)
    q_pos = context_before + tok
    q_rows = (q_start + tok).to(tl.int64)
    q_heads = kv_head * GROUP + head
    q = tl.load(
        q_ptr + (q_rows * stride_qt + q_heads * stride_qh)[:, None] + offs_d[None, :],
        mask=mask_m[:, None],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The tile's last query sees positions up to its own, its first no further back than the window:
    # nothing outside [kv_start, kv_end) is read. Key tiles that every row sees whole, [full_start, full_end),
    # need no mask (most of a long prompt's work); the few tiles on either side are masked per key and row.
    first_pos = context_before + q0
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    kv_start = 0
    full_start = 0
    if SLIDING:
        kv_start = tl.maximum(first_pos - window + 1, 0)
        full_start = tl.cdiv(tl.maximum(first_pos + BLOCK_Q - window, 0), BLOCK_N) * BLOCK_N
        for n0 in range(kv_start // BLOCK_N * BLOCK_N, tl.minimum(full_start, kv_end), BLOCK_N):
            m_i, l_i, acc = attend_kv_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                n0, kv_start, kv_end, q_pos, window, score_scale, softcap_log2,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, SLIDING, SOFTCAP, DOT_PRECISION, True, ROW_SUM_DOT,
            )  # fmt: skip
    full_end = tl.maximum((first_pos + 1) // BLOCK_N * BLOCK_N, full_start)
    if MASK_EVERY_TILE:
        full_end = full_start
    for n0 in range(full_start, full_end, BLOCK_N):
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            n0, kv_start, kv_end, q_pos, window, score_scale, softcap_log2,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, SLIDING, SOFTCAP, DOT_PRECISION, False, ROW_SUM_DOT,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            n0, kv_start, kv_end, q_pos, window, score_scale, softcap_log2,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, SLIDING, SOFTCAP, DOT_PRECISION, True, ROW_SUM_DOT,
        )  # fmt: skip

    if SLIDING:
        # Every real row sees at least its own key; a padding row past the sequence's end may see none.
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_rows * stride_ot + q_heads * stride_oh)[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None],
    )


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape: `block_m` packed (token, head) rows per program, `block_n` KV tokens per tile
    (docs/history/benchmarks-2026.md compares them); `row_sum_dot`: the softmax's row sums on the tensor cores
    (`attend_kv_blocks`), so that launches of other `block_m` add them alike."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    row_sum_dot: bool = False

    def __post_init__(self) -> None:
        check_tile("block_m", self.block_m)
        check_tile("block_n", self.block_n)


DEFAULT_PREFILL_CONFIG = PrefillConfig()


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    config: PrefillConfig = DEFAULT_PREFILL_CONFIG,
    window: int = 0,
    softcap: float = 0.0,
    skip_single: bool = False,
    mask_every_tile: bool = False,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of `q` [T, Hq, D] over the paged cache; writes `out` [T, Hq, D] and returns it.

    Query token j of sequence b sits at position `seq_lens[b] - q_len_b + j` and sees cache positions
    [0, that position], or with `window` > 0 only the last `window` of them; `softcap` > 0 caps scores with
    a tanh. Any mix of query lengths (decodes included) and context lengths is allowed; `skip_single` leaves
    the rows of one-token sequences unwritten (the decode kernel reads their context faster).

    `mask_every_tile` (engine.deterministic) runs every key tile through the one masked path: a token's sums then
    take the same steps whether it is a decode, a prompt's first token or one in the middle of a chunk (the
    unmasked path, for tiles a whole query tile sees, may round differently: another compiled expression).
    Key tiles always start at multiples of the tile from position 0, so their order is the token's own.

    `order` [B] (int32; a step of one-token sequences only, which it does not check): programs take the sequences in
    that order, e.g. `AttentionMetadata.decode_order`, the longest context first, so that the launch does not end
    on a long sequence started last. A token's sums are unchanged: only which program takes it moves.
    """
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_q = max(1, config.block_m // group_p2)
    score_scale, softcap_log2 = score_scales(scale, softcap)
    grid = (q.shape[0] // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        cu_query_lens,
        cu_query_lens if order is None else order,
        num_seqs,
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
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        int(skip_single),
        int(order is not None),
        GROUP=group,
        GROUP_P2=group_p2,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_p2,
        BLOCK_N=kv_tile(config.block_n, head_dim, q.element_size()),
        SEQ_CHUNK=SEQ_CHUNK,
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        DOT_PRECISION=dot_precision(q.dtype),
        MASK_EVERY_TILE=mask_every_tile,
        ROW_SUM_DOT=config.row_sum_dot,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
