"""The sampler's race score, and the exact per-row draw: one program reads a whole row of logits.

Per row: the temperature, the filter (sampling_filter's threshold, and min-p), the counter-based exponential
noise (the bits of sampler.torch_exponential_noise, computed in registers instead of a [rows, vocab] tensor)
and the race argmax(l - log E); greedy rows take the argmax of the raw logits. The sampler's usual path
(sampling_race) splits the race over many programs per row and comes here only for the rows whose filter it
does not settle; it computes the same scores with `race_score`, so both paths pick the same token.

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


@triton.jit
def race_score(v, key, cols):
    """The race score log p - log E of scaled logits `v` at vocabulary ids `cols`, up to the row's constant."""
    bits = _hash32(key * 0x85EBCA6B + cols.to(tl.uint32))
    # 24 random bits give a float32 exactly in (0, 1), as in sampler.torch_exponential_noise.
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return v - tl.log(-tl.log(u))


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "keys_ptr", "threshold_ptr", "row_max_ptr", "min_p_ptr"])
def _draw_kernel(
    logits_ptr, stride, temperature_ptr, keys_ptr, threshold_ptr, row_max_ptr, min_p_ptr, pending_ptr, tokens_ptr,
    vocab, FILTERED: tl.constexpr, SOME_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    # A row not to draw reads nothing and keeps its token.
    todo = True
    length = vocab
    if SOME_ROWS:
        todo = tl.load(pending_ptr + row) != 0
        length = tl.where(todo, vocab, 0)
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
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")) / temperature
            score = race_score(v, key, cols)
            if FILTERED:
                score = tl.where((v > threshold) & (tl.exp(v - row_max) >= min_p), score, float("-inf"))
            block_best = tl.max(score, axis=0)
            if block_best > best:
                best = block_best
                token = start + tl.argmax(score, axis=0)
    else:
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
            block_best = tl.max(x, axis=0)
            if block_best > best:
                best = block_best
                token = start + tl.argmax(x, axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64), mask=todo)


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    rows_to_draw: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of float32 `logits` [S, V]: the exponential race over `logits / temperature` with the
    noise of the rows' hash `keys`, restricted by `filters` = (threshold, row max, min_p) when given; the argmax
    where temperature is 0. With `rows_to_draw` (int32 [S], nonzero: draw) only those rows are drawn, into
    `out`, whose other rows keep their tokens. Returns int64 [S] (`out` when given)."""
    rows, vocab = logits.shape
    tokens = out if out is not None else torch.empty(rows, dtype=torch.int64, device=logits.device)
    threshold, row_max, min_p = filters if filters is not None else (temperature, temperature, temperature)
    if rows:
        _draw_kernel[(rows,)](
            logits, logits.stride(0), temperature, keys, threshold, row_max, min_p,
            rows_to_draw if rows_to_draw is not None else tokens, tokens, vocab,
            FILTERED=filters is not None, SOME_ROWS=rows_to_draw is not None, BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
    return tokens
