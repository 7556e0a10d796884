"""The structured-outputs mask kernel for the CUDA path (see token_mask.py for the layout).

It stores -inf over forbidden tokens and loads no logits: a step's cost is its bitmask (V / 8 bytes per
constrained row) plus the stores, and an unconstrained row's programs return after one load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, mask_rows_ptr, vocab, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    mask_row = tl.load(mask_rows_ptr + row)
    if mask_row >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        words = tl.load(bitmask_ptr + mask_row * bitmask_stride + cols // 32, mask=inside, other=-1)
        forbidden = ((words >> (cols % 32)) & 1) == 0
        tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=inside & forbidden)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor) -> None:
    rows, vocab = logits.shape
    if rows:
        block = 1024
        grid = (rows, triton.cdiv(vocab, block))
        _apply_token_bitmask_kernel[grid](
            logits, logits.stride(0), bitmask, bitmask.stride(0), mask_rows, vocab, BLOCK=block
        )
