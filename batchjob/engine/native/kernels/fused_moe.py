"""Fused mixture-of-experts MLP in Triton, safe to capture in a CUDA graph.

Organised as the well-known fused-MoE kernels are (vLLM's, SGLang's): the T*K (token, expert) pairs are
sorted by expert and each expert's run is padded to whole blocks of BLOCK_M rows (`moe_align_block_size`), so
that one grouped-GEMM launch serves every expert at once: a program takes one block, whose rows are all routed
to the same expert, and one tile of output columns, and reads that expert's weight tile once for the block.
Four launches: the alignment (moe_align), the gate/up projection with SiLU-and-mul fused into its
epilogue (the [T*K, 2I] activations are never written), the down projection with the routing weight multiplied
in, and a sum over each token's K choices.

Graph safety: the alignment has no host synchronisation, every buffer and grid is sized from T, K, E and
BLOCK_M alone (at most T*K + min(E, T*K) * (BLOCK_M - 1) padded rows), and blocks past the routed rows' padded
end exit at once. The launch config (moe_configs) is chosen from the token count and the expert shape only, so a
graph captured for a batch bucket replays identically with any routing.

Rounding follows the dense MLP (fused_ops.silu_and_mul): gate and up rounded to the model dtype, SiLU
rounded before the multiply; the routing weight is applied in fp32 to the down projection's accumulator and the
K partial outputs are summed in fp32 and rounded once.

FP8 experts (e4m3 weights with float32 scales per row or per block, `models.moe.Fp8Experts`): each GEMM's input
is quantized first (`fp8.quantize`, per token or per group of channels: the tokens' hidden states before gate/up,
the gated activations before down), and each K tile's product is multiplied by its rows' activation scales and its
columns' weight scales as it is added up, as `fp8.scaled_matmul` does for a dense projection.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from batchjob.engine.native.kernels import fp8
from batchjob.engine.native.kernels.decode_attention import dot_precision
from batchjob.engine.native.kernels.launch_fit import launch_in_stages_that_fit
from batchjob.engine.native.kernels.moe_align import moe_align_block_size
from batchjob.engine.native.kernels.moe_configs import GemmTile, MoEConfig, moe_config


# The row and block counts vary with every eager batch size: not specialising on them keeps one compiled
# variant per config instead of one per divisibility class met mid-run.
@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    routing_weights_ptr,
    a_scale_ptr,
    b_scale_ptr,
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
    a_groups,
    a_group,
    b_block_n,
    b_block_k,
    stride_se,
    stride_sn,
    A_ROW_DIVISOR: tl.constexpr,
    GATED: tl.constexpr,
    ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8: tl.constexpr,
    FP8_NARROW: tl.constexpr,
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
    # Padding rows read row 0 and columns past the end wrap around (their results are never stored), so the
    # weight and activation loads of the main loop need no masks when the depth divides into whole tiles: the
    # loop is a plain stream of the expert's weights.
    a_rows = tl.where(row_ok, pairs // A_ROW_DIVISOR, 0).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + expert * stride_be + (cols % n_cols)[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # FP8: the scales of each tile's rows (activations) and columns (the expert's weight rows, gate then up)
    a_scales = a_scale_ptr + a_rows * a_groups
    b_scales = b_scale_ptr + expert * stride_se + ((cols % n_cols) // b_block_n).to(tl.int64) * stride_sn
    b_up_scales = b_scale_ptr + expert * stride_se + ((cols % n_cols + n_cols) // b_block_n).to(tl.int64) * stride_sn
    for k0 in range(0, k_dim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = ks < k_dim - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if FP8_NARROW:  # groups narrower than the FP8 dot's depth: each element scaled, multiplied in float32
            k_in = (ks < k_dim - k0)[None, :]
            a_s = tl.load(a_scales[:, None] + (k0 + ks)[None, :] // a_group, mask=k_in, other=0.0)
            a32 = a.to(tl.float32) * a_s
            b_s = tl.load(b_scales[None, :] + (k0 + ks)[:, None] // b_block_k, mask=tl.trans(k_in), other=0.0)
            acc = tl.dot(a32, b.to(tl.float32) * b_s, acc, input_precision="ieee")
        elif FP8:
            a_s = tl.load(a_scales + k0 // a_group)[:, None]
            acc += tl.dot(a, b) * a_s * tl.load(b_scales + k0 // b_block_k)[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(b_ptrs + n_cols * stride_bn)
            else:
                b_up = tl.load(b_ptrs + n_cols * stride_bn, mask=k_ok[:, None], other=0.0)
            if FP8_NARROW:
                b_s = tl.load(b_up_scales[None, :] + (k0 + ks)[:, None] // b_block_k, mask=tl.trans(k_in), other=0.0)
                acc_up = tl.dot(a32, b_up.to(tl.float32) * b_s, acc_up, input_precision="ieee")
            elif FP8:
                acc_up += tl.dot(a, b_up) * a_s * tl.load(b_up_scales + k0 // b_block_k)[None, :]
            else:
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


@dataclasses.dataclass(frozen=True)
class Fp8ExpertWeights:
    """What the FP8 grouped GEMMs need besides e4m3 weights: their float32 scales ([E, rows, 1] per row, or
    [E, rows / block rows, K / block columns] per block) and how the inputs are quantized."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block: tuple[int, int] | None = None  # weight block (rows, columns); None: a scale per row
    group: int | None = None  # channels per activation scale; None: a scale per token
    activation_upper: float | None = None  # caps a token's amax (fbgemm_fp8)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    routing_weights: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    gated: bool,
    top_k: int,
    block_m: int,
    tile: GemmTile,
    scales: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None,
) -> None:
    """One projection over the aligned pairs. gated: `a` is the tokens' hidden states [T, H], `b` the experts'
    [gate; up] weights [E, 2I, H], `out` [T*K, I] gets silu(gate) * up. Otherwise `a` is that [T*K, I], `b`
    the down weights [E, H, I] and `out` [T*K, H] the routing-weighted expert outputs. `alignment` comes from
    `moe_align_block_size` with this `block_m`. `scales`: FP8 operands' (a's [rows, groups], b's, b's block)."""
    sorted_pairs, block_experts, padded_rows = alignment
    n_cols = b.shape[1] // 2 if gated else b.shape[1]
    k_dim = a.shape[1]
    num_m_blocks = block_experts.numel()
    grid = (num_m_blocks * triton.cdiv(n_cols, tile.block_n),)
    narrow = False
    if scales is None:
        a_scales = b_scales = routing_weights  # not read
        a_group, b_block = k_dim, (1, k_dim)
    else:
        a_scales, b_scales, b_block = scales
        a_group = k_dim if a_scales.shape[1] == 1 else k_dim // a_scales.shape[1]
        # A depth tile must lie inside one activation group and one weight block, or (narrower groups than the FP8
        # dot's depth: tiny test models) scale each element and multiply in float32.
        widths = [width for width in (a_group, b_block[1]) if width < k_dim]
        block_k = math.gcd(tile.block_k, *widths)
        narrow = block_k < fp8.FP8_DOT_DEPTH
        tile = dataclasses.replace(tile, block_k=fp8.FP8_DOT_DEPTH if narrow else block_k)

    def launch(stages: int) -> None:
        _grouped_gemm_kernel[grid](
            a, b, out, routing_weights, a_scales, b_scales, sorted_pairs, block_experts, padded_rows,
            n_cols, k_dim, out.shape[0], num_m_blocks,
            a.stride(0), b.stride(0), b.stride(1), out.stride(0),
            a_scales.shape[1] if scales else 1, a_group, b_block[0], b_block[1],
            b_scales.stride(0) if scales else 0, b_scales.stride(1) if scales else 0,
            A_ROW_DIVISOR=top_k if gated else 1, GATED=gated, ROUTED_WEIGHT=not gated,
            EVEN_K=k_dim % tile.block_k == 0, FP8=scales is not None, FP8_NARROW=narrow,
            DOT_PRECISION=dot_precision(a.dtype),
            BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            num_warps=tile.num_warps, num_stages=stages,
        )  # fmt: skip

    # fp32 tiles are twice as wide: two stages keep the gate/up GEMM's three tiles in shared memory.
    stages = tile.num_stages if a.element_size() <= 2 else min(tile.num_stages, 2)
    # The tables' and the default tiles are sized for a Hopper block's 227 KB of shared memory; a GPU of about 100 KB
    # holds fewer of the gate/up GEMM's stages of three tiles.
    launch_in_stages_that_fit(launch, (a.device, a.dtype, b.dtype, gated, narrow, block_m, tile), stages)


@triton.jit
def _sum_choices_kernel(partial_ptr, out_ptr, hidden_size, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden_size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(partial_ptr + (token * TOP_K + k) * hidden_size + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden_size + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_choices(partial: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T*K, H] routing-weighted expert outputs -> [T, H]: each token's K summed in fp32, rounded once."""
    pairs, hidden_size = partial.shape
    out = torch.empty((pairs // top_k, hidden_size), dtype=partial.dtype, device=partial.device)
    block = min(1024, triton.next_power_of_2(hidden_size))
    _sum_choices_kernel[(pairs // top_k, triton.cdiv(hidden_size, block))](
        partial, out, hidden_size, TOP_K=top_k, BLOCK=block, num_warps=4
    )
    return out


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: MoEConfig | None = None,
    fp8_experts: Fp8ExpertWeights | None = None,
) -> torch.Tensor:
    """Per token t: sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)) with
    e = topk_ids[t, k]. `hidden` [T, H]; `w13` [E, 2I, H]; `w2` [E, H, I]; `topk_weights` float32 [T, K];
    `topk_ids` int64 [T, K]. Returns [T, H] in hidden's dtype. `config` overrides the one `moe_config` picks
    for this token count, expert shape and device. `fp8_experts`: w13 and w2 are e4m3, with these scales."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    if config is None:
        config = moe_config(num_tokens, num_experts, inter, hidden_size, top_k, hidden.dtype, hidden.device)
    alignment = moe_align_block_size(topk_ids, num_experts, config.block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    pairs = num_tokens * top_k
    gated = torch.empty((pairs, inter), dtype=hidden.dtype, device=hidden.device)
    a, scales = _inputs(hidden, fp8_experts, fp8_experts and fp8_experts.w13_scale)
    grouped_gemm(
        a, w13, gated, weights, alignment, gated=True, top_k=top_k, block_m=config.block_m, tile=config.gate_up,
        scales=scales,
    )  # fmt: skip
    down = torch.empty((pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    a, scales = _inputs(gated, fp8_experts, fp8_experts and fp8_experts.w2_scale)
    grouped_gemm(
        a, w2, down, weights, alignment, gated=False, top_k=top_k, block_m=config.block_m, tile=config.down,
        scales=scales,
    )  # fmt: skip
    return sum_choices(down, top_k)


def _inputs(x: torch.Tensor, experts: Fp8ExpertWeights | None, weight_scales: torch.Tensor | None):
    """A GEMM's input as the kernel takes it: x itself, or x quantized with the FP8 experts' scheme and the
    (activation scales, weight scales, weight block) to go with it."""
    if experts is None:
        return x, None
    q, scales = fp8.quantize(x, experts.group, experts.activation_upper)
    return q, (scales, weight_scales, experts.block or (1, x.shape[1]))
