"""Sorting a step's (token, choice) pairs by expert into whole blocks, in one Triton launch.

The fused MoE GEMMs need the T*K pairs grouped by expert, each expert's run padded to a multiple of `block_m`
(one block, one expert). Done with torch ops this is a sort plus some twenty small kernels, a fixed cost per
layer that a decode step pays 48 times; here one program per expert does it: each counts every expert's pairs
(a histogram, so it knows where its run starts), then writes its own pairs' indices in their original order,
pads its run and labels its blocks. Every program reads the whole `topk_ids` (a few KB at decode, from L2).

Graph safety: buffer sizes depend on T, K, E and `block_m` only; the pair count is not specialised on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 2048  # pairs per step of each program's loops: a 256-token decode of top-8 routing in one step


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted buffer: every pair, plus at most block_m - 1 padding rows per expert that has any."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs", "max_rows"])
def _align_kernel(
    topk_ids_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_rows_ptr,
    num_pairs,
    max_rows,
    NUM_EXPERTS: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    expert = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    bins = tl.arange(0, BINS)
    # Pairs past the end count in bin NUM_EXPERTS (< BINS), which no expert owns.
    counts = tl.zeros((BINS,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(topk_ids_ptr + start + offs, mask=start + offs < num_pairs, other=NUM_EXPERTS)
        counts += tl.histogram(ids.to(tl.int32), BINS)
    padded = tl.where(bins < NUM_EXPERTS, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    run_start = tl.sum(tl.where(bins < expert, padded, 0))
    own_count = tl.sum(tl.where(bins == expert, counts, 0))
    own_padded = tl.sum(tl.where(bins == expert, padded, 0))

    cursor = run_start
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(topk_ids_ptr + start + offs, mask=start + offs < num_pairs, other=NUM_EXPERTS)
        mine = (ids == expert).to(tl.int32)
        destination = cursor + tl.cumsum(mine, 0) - 1
        tl.store(sorted_pairs_ptr + destination, (start + offs).to(tl.int32), mask=mine != 0)
        cursor += tl.sum(mine)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_pairs_ptr + cursor + pad, num_pairs, mask=pad < own_padded - own_count)
    first_block = run_start // BLOCK_M
    for block in range(0, own_padded // BLOCK_M, CHUNK):
        tl.store(block_experts_ptr + first_block + block + offs, expert, mask=block + offs < own_padded // BLOCK_M)

    if expert == 0:
        total = tl.sum(padded)
        tl.store(padded_rows_ptr, total)
        # The blocks past the used ones are skipped by the GEMMs; they are filled so no row reads garbage.
        for row in range(total, max_rows, CHUNK):
            tl.store(sorted_pairs_ptr + row + offs, num_pairs, mask=row + offs < max_rows)
        for block in range(total // BLOCK_M, max_rows // BLOCK_M, CHUNK):
            tl.store(block_experts_ptr + block + offs, 0, mask=block + offs < max_rows // BLOCK_M)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, choice) pairs of `topk_ids` [T, K] by expert, each expert's run padded to a multiple of
    `block_m`. Returns `sorted_pairs` (int32 [max_rows]: a flat pair index t*K + k, or T*K for padding),
    `block_experts` (int32 [max_rows / block_m]: the expert of each block; 0 past the used ones) and
    `padded_rows` (int32 [1]: where the padded runs end). Within an expert the pairs keep their order."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(max_rows // block_m, dtype=torch.int32, device=flat.device)
    padded_rows = torch.empty(1, dtype=torch.int32, device=flat.device)
    _align_kernel[(num_experts,)](
        flat, sorted_pairs, block_experts, padded_rows, num_pairs, max_rows,
        NUM_EXPERTS=num_experts, BINS=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m, CHUNK=_CHUNK,
        num_warps=8,
    )  # fmt: skip
    return sorted_pairs, block_experts, padded_rows
