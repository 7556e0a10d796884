"""Varlen causal attention over the paged KV cache in Triton, for prefill chunks and mixed batches.

Each program takes a tile of consecutive query tokens of one sequence times every query head that
shares one KV head (GQA rows packed as token-major, head-minor), and streams that sequence's context
through the block table in tiles with an online softmax. The cache already holds this step's K/V, so
earlier chunks and the new tokens are read the same way.

Programs find their sequence on the device (no host sync on `cu_query_lens`): program `p` of
sequence `b` is numbered `cu_query_lens[b] // BLOCK_Q + b + i`, an upper bound on the query tiles
before it, so a grid of `T // BLOCK_Q + B` programs covers every tile and the few spare ones exit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchjob.engine.native.triton_decode import LOG2E, check_tile, dot_precision, kv_tile


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_query_lens_ptr,
    num_seqs,
    scale_log2,
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
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_P2: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    offs_b = tl.arange(0, SEQS_P2)
    starts = tl.load(cu_query_lens_ptr + offs_b, mask=offs_b < num_seqs, other=0)
    first_tile = tl.where(offs_b < num_seqs, starts // BLOCK_Q + offs_b, 2147483647)
    seq = tl.sum((first_tile <= pid).to(tl.int32), 0) - 1
    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    q0 = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q0 >= q_len:
        return

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
    # The tile's last query sees positions up to its own; nothing later is read.
    kv_end = tl.minimum(seq_len, context_before + q0 + BLOCK_Q)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + (block * stride_kb + in_block * stride_ks + kv_head * stride_kh)[:, None] + offs_d[None, :],
            mask=mask_n[:, None],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        # Position 0 is visible to every row (padding rows included), so no row is ever all -inf.
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
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

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_rows * stride_ot + q_heads * stride_oh)[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None],
    )


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape: `block_m` packed (token, head) rows per program, `block_n` KV tokens per tile
    (scripts/bench_attention.py --sweep compares them on a GPU)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

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
) -> torch.Tensor:
    """Causal varlen attention of `q` [T, Hq, D] over the paged cache; writes `out` [T, Hq, D] and returns it.

    Query token j of sequence b sits at position `seq_lens[b] - q_len_b + j` and sees cache positions
    [0, that position]. Any mix of query lengths (decodes included) and context lengths is allowed.
    """
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_q = max(1, config.block_m // group_p2)
    grid = (q.shape[0] // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        cu_query_lens,
        num_seqs,
        scale * LOG2E,
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
        GROUP=group,
        GROUP_P2=group_p2,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_p2,
        BLOCK_N=kv_tile(config.block_n, head_dim, q.element_size()),
        SEQS_P2=triton.next_power_of_2(num_seqs),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
