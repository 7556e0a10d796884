"""Fused mixture-of-experts MLP in Triton, safe to capture in a CUDA graph.

Organised as the well-known fused-MoE kernels are (vLLM's, SGLang's): the T*K (token, expert) pairs are
sorted by expert and each expert's run is padded to whole blocks of BLOCK_M rows (`moe_align_block_size`), so
that one grouped-GEMM launch serves every expert at once: a program takes one block, whose rows are all routed
to the same expert, and one tile of output columns, and reads that expert's weight tile once for the block.
Two launches: the gate/up projection with SiLU-and-mul fused into its epilogue (the [T*K, 2I] activations are
never written), then the down projection with the routing weight multiplied in; a sum over each token's K
choices ends it.

Graph safety: the alignment is plain torch ops with no host synchronisation, every buffer and grid is sized
from T, K, E and BLOCK_M alone (at most T*K + min(E, T*K) * (BLOCK_M - 1) padded rows), and blocks past the
routed rows' padded end exit at once. The launch config is chosen from the token count only, so a graph
captured for a batch bucket replays identically with any routing.

Rounding follows the dense MLP (triton_ops.silu_and_mul): gate and up rounded to the model dtype, SiLU
rounded before the multiply; the routing weight is applied in fp32 to the down projection's accumulator and the
K partial outputs are summed in fp32 and rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchjob.engine.native.triton_decode import dot_precision


@dataclass(frozen=True)
class MoEConfig:
    """Tile shape of both grouped GEMMs. `block_m` is also the alignment of each expert's rows."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Chosen by the average number of rows each expert gets (T*K/E), which for one model depends on T alone:
# a decode batch gives most experts a handful of rows (a 16-row block wastes the least padding and the step is
# bound by reading the experts' weights), a prefill gives each expert hundreds (wider tiles reuse each weight
# tile over more rows). Each (stage, tile) of the gate/up GEMM holds two weight tiles (gate and up).
_DECODE = MoEConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
_MEDIUM = MoEConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)
_PREFILL = MoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=4)


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 24:
        return _DECODE
    if rows_per_expert <= 96:
        return _MEDIUM
    return _PREFILL


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, choice) pairs of `topk_ids` [T, K] by expert, each expert's run padded to a multiple of
    `block_m`. Returns `sorted_pairs` (int32 [max_rows]: a flat pair index t*K + k, or T*K for padding),
    `block_experts` (int32 [max_rows / block_m]: the expert of each block) and `padded_rows` (int32 [1]: where
    the padded runs end; later blocks are unused). Within an expert the pairs keep their order."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    max_blocks = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank_in_expert = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    destination = (padded_end - padded)[expert_of_sorted] + rank_in_expert
    sorted_pairs = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, destination, order.to(torch.int32))
    block_starts = torch.arange(max_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


# The row and block counts vary with every eager batch size: not specialising on them keeps one compiled
# variant per config instead of one per divisibility class met mid-run.
@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    routing_weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_rows_ptr,
    n_cols,
    k_dim,
    num_pairs,
    num_m_blocks,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROW_DIVISOR: tl.constexpr,
    GATED: tl.constexpr,
    ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[pair, cols] = A[pair // A_ROW_DIVISOR] @ B[expert, cols]^T for the pairs of one block. GATED: B holds
    [gate; up] rows (2 * n_cols) and C = silu(gate) * up. ROUTED_WEIGHT: C *= the pair's routing weight."""
    pid = tl.program_id(0)
    # Blocks vary fastest: neighbouring programs are mostly the same expert's blocks for the same column tile,
    # so one expert's weight tile is read from HBM once and from L2 for its other blocks.
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    if pid_m * BLOCK_M >= tl.load(padded_rows_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIVISOR).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = ks < k_dim - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + n_cols * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = c_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    if ROUTED_WEIGHT:
        acc = acc * tl.load(routing_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    routing_weights: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    n_cols: int,
    a_row_divisor: int,
    gated: bool,
    config: MoEConfig,
) -> None:
    sorted_pairs, block_experts, padded_rows = alignment
    num_m_blocks = block_experts.numel()
    grid = (num_m_blocks * triton.cdiv(n_cols, config.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, out, routing_weights, sorted_pairs, block_experts, padded_rows,
        n_cols, a.shape[1], out.shape[0], num_m_blocks,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        A_ROW_DIVISOR=a_row_divisor, GATED=gated, ROUTED_WEIGHT=not gated,
        DOT_PRECISION=dot_precision(a.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        # fp32 tiles are twice as wide: two stages keep the gate/up GEMM's three tiles in shared memory.
        num_stages=config.num_stages if a.element_size() <= 2 else min(config.num_stages, 2),
    )  # fmt: skip


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """Per token t: sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)) with
    e = topk_ids[t, k]. `hidden` [T, H]; `w13` [E, 2I, H]; `w2` [E, H, I]; `topk_weights` float32 [T, K];
    `topk_ids` int64 [T, K]. Returns [T, H] in hidden's dtype. `config` overrides the tile shape `moe_config`
    picks from the token count."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    config = config or moe_config(num_tokens, top_k, num_experts)
    alignment = moe_align_block_size(topk_ids, num_experts, config.block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    pairs = num_tokens * top_k
    gated = torch.empty((pairs, inter), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gated, weights, alignment, inter, top_k, True, config)
    down = torch.empty((pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(gated, w2, down, weights, alignment, hidden_size, 1, False, config)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
