"""The sampler's draw on CUDA: one pass over each row of logits.

Per row: the temperature, the filter (triton_filter's threshold, and min-p), the counter-based exponential
noise (the bits of sampler.torch_exponential_noise, computed in registers instead of a [rows, vocab] tensor)
and the race argmax(l - log E); greedy rows take the argmax of the raw logits. Plain temperature sampling
therefore reads the logits once, as greedy does.

The launch depends only on the row count and vocabulary; the per-row pointers into the packed slot buffer are
not specialised on alignment, so every step size runs the same compiled kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _hash32(x):
    # The sampler's lowbias32 in uint32 lanes, whose products wrap exactly as the torch path's `& 0xFFFFFFFF`.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "keys_ptr", "threshold_ptr", "row_max_ptr", "min_p_ptr"])
def _draw_kernel(
    logits_ptr, stride, temperature_ptr, keys_ptr, threshold_ptr, row_max_ptr, min_p_ptr, tokens_ptr, vocab,
    FILTERED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    temperature = tl.load(temperature_ptr + row)
    best = float("-inf")
    token = 0
    if temperature > 0:
        key = tl.load(keys_ptr + row).to(tl.uint32)
        if FILTERED:
            threshold = tl.load(threshold_ptr + row)
            row_max = tl.load(row_max_ptr + row)
            min_p = tl.load(min_p_ptr + row)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")) / temperature
            bits = _hash32(key * 0x85EBCA6B + cols.to(tl.uint32))
            # 24 random bits give a float32 exactly in (0, 1), as in sampler.torch_exponential_noise.
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = v - tl.log(-tl.log(u))
            if FILTERED:
                score = tl.where((v > threshold) & (tl.exp(v - row_max) >= min_p), score, float("-inf"))
            block_best = tl.max(score, axis=0)
            if block_best > best:
                best = block_best
                token = start + tl.argmax(score, axis=0)
    else:
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
            block_best = tl.max(x, axis=0)
            if block_best > best:
                best = block_best
                token = start + tl.argmax(x, axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64))


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One token per row of float32 `logits` [S, V]: the exponential race over `logits / temperature` with the
    noise of the rows' hash `keys`, restricted by `filters` = (threshold, row max, min_p) when given; the argmax
    where temperature is 0. Returns int64 [S]."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    threshold, row_max, min_p = filters if filters is not None else (temperature, temperature, temperature)
    if rows:
        _draw_kernel[(rows,)](
            logits, logits.stride(0), temperature, keys, threshold, row_max, min_p, tokens, vocab,
            FILTERED=filters is not None, BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
    return tokens
