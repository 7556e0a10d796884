"""The sampler's exact top-k/top-p filter on CUDA: a per-row threshold found by search, never a sort.

The sampler's usual path (sampling_race) checks the filter at the race's winner and needs no threshold; it comes
here for the rows that check leaves open (few; `rows_to_search` marks them and every other row exits at once).

`filter_thresholds` finds, per row, the value `x` such that the kept tokens are exactly those with a scaled
logit `l > x` (a sort of the vocabulary cost 2.4 ms of a 4.1 ms sampler step at 256 x 128k on an H200).
A filter is a monotone test "the weight of the tokens strictly above v is at most B": top-k counts tokens
(weight 1, B = k - 1), top-p sums exp(l - max) over the top-k survivors (B = top_p times their total); `x`
is the largest token value failing it. One program per row:

1. a pass for the row's largest and smallest value;
2. pivot passes: each tests P values at once and narrows the bracket (lo, hi] holding `x` to one of its
   P + 1 pieces, keeping the count of tokens above lo and above hi and the weight above hi;
3. once at most WIDE tokens lie in the bracket, one pass copies them to scratch and the pivot passes go on
   over that copy alone, a small fraction of the row;
4. once at most NARROW remain, they are copied again and the test is evaluated exactly at each of them.

Ties are never split: every token with the same value as a kept one is kept (the sort kept an arbitrary part
of a tie at the boundary). A bracket whose tokens all share one value ends the search at once (they all pass).
Min-p needs no search (keep exp(l - max) >= min_p) and is applied in the draw.

The launch depends only on the row count and vocabulary; the per-row parameter pointers into the packed slot
buffer are not specialised on alignment, so every step size runs the same compiled kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PIVOTS = 8  # values tested per pass: each pass narrows the bracket about nine-fold
WIDE = 16384  # tokens in the bracket when the search moves from the row to a copy of them
NARROW = 512  # tokens in the bracket when each is tested exactly
_BLOCK = 1024
_MAX_PASSES = 48  # a bracket of distinct float32 values closes well before; a guard against NaN rows


@triton.jit
def _load_scaled(src_ptr, start, length, temperature, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    return tl.load(src_ptr + cols, mask=cols < length, other=float("-inf")) / temperature


@triton.jit
def _weights(v, row_max, floor, WEIGHTED: tl.constexpr):
    w = tl.exp(v - row_max) if WEIGHTED else tl.full(v.shape, 1.0, tl.float32)
    return tl.where(v > floor, w, 0.0)


@triton.jit
def _pivots(lo, hi, low_value, P: tl.constexpr):
    # Open below (lo = -inf): the lowest pivot is the row's smallest value itself, so no bracket straddles it.
    # Otherwise lo is already known to fail and the P pivots split (lo, hi) evenly.
    j = tl.arange(0, P).to(tl.float32)
    open_below = lo == float("-inf")
    base = tl.where(open_below, low_value, lo)
    return base + (hi - base) * tl.where(open_below, j / P, (j + 1.0) / (P + 1.0))


@triton.jit
def _pick(values, index, P: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, P) == index, values, 0), axis=0)


@triton.jit
def _pivot_pass(
    src_ptr, length, temperature, row_max, floor, lo, hi, low_value, bound, n_lo, n_hi, w_hi, w_outside,
    WEIGHTED: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One pass over `src` narrowing (lo, hi]; `w_outside` is the weight above every token of `src` that lies
    elsewhere (0 for the whole row). Returns the new (lo, hi, n_lo, n_hi, w_hi), counts being of `src`, and
    whether the search is over (the bracket's tokens share one value)."""
    pivots = _pivots(lo, hi, low_value, P)
    weight_above = tl.zeros((P,), dtype=tl.float32)
    count_above = tl.zeros((P,), dtype=tl.int32)
    inside_min = float("inf")
    inside_max = float("-inf")
    for start in range(0, length, BLOCK):
        v = _load_scaled(src_ptr, start, length, temperature, BLOCK)
        w = _weights(v, row_max, floor, WEIGHTED)
        above = v[:, None] > pivots[None, :]
        weight_above += tl.sum(tl.where(above, w[:, None], 0.0), axis=0)
        count_above += tl.sum(above.to(tl.int32), axis=0)
        inside = (v > lo) & (v <= hi)
        inside_min = tl.minimum(inside_min, tl.min(tl.where(inside, v, float("inf")), axis=0))
        inside_max = tl.maximum(inside_max, tl.max(tl.where(inside, v, float("-inf")), axis=0))
    # Pivots ascend and their weights above descend: the first `fails` fail the test.
    fails = tl.sum((w_outside + weight_above > bound).to(tl.int32), axis=0)
    new_lo = lo
    new_hi = hi
    if fails > 0:
        new_lo = _pick(pivots, fails - 1, P)
        n_lo = _pick(count_above, fails - 1, P)
    if fails < P:
        new_hi = _pick(pivots, fails, P)
        n_hi = _pick(count_above, fails, P)
        w_hi = w_outside + _pick(weight_above, fails, P)
    # No token lies between the bracket's largest and hi: hi comes down to it (same counts and weights), so the
    # next pivots span only values that occur.
    if inside_max > new_lo:
        new_hi = tl.minimum(new_hi, inside_max)
    # One value in the bracket: its weight above is w_hi, within the bound, so all its tokens pass. (No float
    # strictly inside the bracket any more means the same.)
    done = (inside_min == inside_max) | ((new_lo == lo) & (new_hi == hi))
    return new_lo, new_hi, n_lo, n_hi, w_hi, done


@triton.jit
def _copy_bracket(src_ptr, length, temperature, lo, hi, dst_ptr, CAPACITY: tl.constexpr, BLOCK: tl.constexpr):
    """Copy the scaled values in (lo, hi] of `src` to `dst`, packed (the caller counted at most CAPACITY)."""
    tl.debug_barrier()  # `dst` may still be read by other threads for the previous search
    filled = 0
    for start in range(0, length, BLOCK):
        v = _load_scaled(src_ptr, start, length, temperature, BLOCK)
        inside = (v > lo) & (v <= hi)
        slot = filled + tl.cumsum(inside.to(tl.int32), axis=0) - 1
        tl.store(dst_ptr + slot, v, mask=inside & (slot < CAPACITY))
        filled += tl.sum(inside.to(tl.int32), axis=0)
    tl.debug_barrier()  # the copies are read back by other threads of this program


@triton.jit
def _largest_failing_of(
    vals_ptr, n, row_max, floor, w_hi, bound, answer, WEIGHTED: tl.constexpr, NARROW_: tl.constexpr
):  # fmt: skip
    """The exact test at each of the n <= NARROW_ values copied to `vals`: weight above = w_hi + the weights
    of the copied values above it."""
    idx = tl.arange(0, NARROW_)
    vals = tl.load(vals_ptr + idx, mask=idx < n, other=float("-inf"))
    w = tl.where(idx < n, _weights(vals, row_max, floor, WEIGHTED), 0.0)
    for first in range(0, NARROW_, 32):
        cand_idx = first + tl.arange(0, 32)
        cand = tl.load(vals_ptr + cand_idx, mask=cand_idx < n, other=float("-inf"))
        above = w_hi + tl.sum(tl.where(vals[None, :] > cand[:, None], w[None, :], 0.0), axis=1)
        failing = (above > bound) & (cand_idx < n)
        answer = tl.maximum(answer, tl.max(tl.where(failing, cand, float("-inf")), axis=0))
    return answer


@triton.jit
def _weight_above_floor(row_ptr, vocab, temperature, row_max, floor, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    total = 0.0
    count = 0
    for start in range(0, vocab, BLOCK):
        v = _load_scaled(row_ptr, start, vocab, temperature, BLOCK)
        total += tl.sum(_weights(v, row_max, floor, WEIGHTED), axis=0)
        count += tl.sum((v > floor).to(tl.int32), axis=0)
    return total, count


@triton.jit
def _largest_failing(
    row_ptr, wide_ptr, narrow_ptr, vocab, temperature, row_max, low_value, floor, total, n_lo, bound,
    WEIGHTED: tl.constexpr, P: tl.constexpr, WIDE_: tl.constexpr, NARROW_: tl.constexpr,
    MAX_PASSES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The largest token value v > floor whose weight strictly above exceeds `bound`, or `floor` if none.
    `total` and `n_lo`: the weight and the count of the tokens above floor."""
    lo = floor
    hi = row_max
    n_hi = 0
    w_hi = 0.0
    done = total <= bound  # everything above floor passes
    passes = 0
    while (n_lo - n_hi > WIDE_) & (done == 0) & (passes < MAX_PASSES):
        lo, hi, n_lo, n_hi, w_hi, done = _pivot_pass(
            row_ptr, vocab, temperature, row_max, floor, lo, hi, low_value, bound, n_lo, n_hi, w_hi, 0.0,
            WEIGHTED, P, BLOCK,
        )  # fmt: skip
        passes += 1
    # A search cut short (NaN logits) keeps everything above lo.
    answer = lo
    if (done == 0) & (n_lo - n_hi <= WIDE_):
        # Go on over a copy of the bracket's tokens: counts are now of the copy, the weight above it carries over.
        n = n_lo - n_hi
        w_outside = w_hi
        _copy_bracket(row_ptr, vocab, temperature, lo, hi, wide_ptr, WIDE_, BLOCK)
        n_lo = n
        n_hi = 0
        while (n_lo - n_hi > NARROW_) & (done == 0) & (passes < MAX_PASSES):
            lo, hi, n_lo, n_hi, w_hi, done = _pivot_pass(
                wide_ptr, n, 1.0, row_max, floor, lo, hi, low_value, bound, n_lo, n_hi, w_hi, w_outside,
                WEIGHTED, P, BLOCK,
            )  # fmt: skip
            passes += 1
        answer = lo
        if (done == 0) & (n_lo - n_hi <= NARROW_):
            _copy_bracket(wide_ptr, n, 1.0, lo, hi, narrow_ptr, NARROW_, BLOCK)
            answer = _largest_failing_of(narrow_ptr, n_lo - n_hi, row_max, floor, w_hi, bound, lo, WEIGHTED, NARROW_)
    return answer


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr"])
def _threshold_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, pending_ptr, threshold_ptr, row_max_ptr,
    wide_ptr, narrow_ptr, vocab, SOME_ROWS: tl.constexpr,
    P: tl.constexpr, WIDE_: tl.constexpr, NARROW_: tl.constexpr, MAX_PASSES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    wide_ptr += row * WIDE_
    narrow_ptr += row * NARROW_
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    threshold = float("-inf")
    row_max = 0.0
    todo = True
    if SOME_ROWS:
        todo = tl.load(pending_ptr + row) != 0
    if (temperature > 0) & (use_k | use_p | (tl.load(min_p_ptr + row) > 0)) & todo:
        # One pass for the row's range, its count of tokens and its softmax denominator (online, as in flash
        # attention: rescaled whenever the running max grows).
        row_max = float("-inf")
        low_value = float("inf")
        count = 0
        mass = 0.0
        for start in range(0, vocab, BLOCK):
            v = _load_scaled(row_ptr, start, vocab, temperature, BLOCK)
            finite = v > float("-inf")
            new_max = tl.maximum(row_max, tl.max(v, axis=0))
            mass *= tl.where(row_max == float("-inf"), 0.0, tl.exp(row_max - new_max))
            mass += tl.sum(tl.where(finite, tl.exp(v - new_max), 0.0), axis=0)
            row_max = new_max
            low_value = tl.minimum(low_value, tl.min(tl.where(finite, v, float("inf")), axis=0))
            count += tl.sum(finite.to(tl.int32), axis=0)
        if use_k:
            threshold = _largest_failing(
                row_ptr, wide_ptr, narrow_ptr, vocab, temperature, row_max, low_value, threshold,
                count.to(tl.float32), count, (top_k - 1).to(tl.float32), False, P, WIDE_, NARROW_, MAX_PASSES, BLOCK,
            )  # fmt: skip
        if use_p:
            if use_k:
                # Top-p renormalises over the top-k survivors: their mass takes one more pass.
                mass, count = _weight_above_floor(row_ptr, vocab, temperature, row_max, threshold, True, BLOCK)
            threshold = _largest_failing(
                row_ptr, wide_ptr, narrow_ptr, vocab, temperature, row_max, low_value, threshold,
                mass, count, top_p * mass, True, P, WIDE_, NARROW_, MAX_PASSES, BLOCK,
            )  # fmt: skip
    tl.store(threshold_ptr + row, threshold)
    tl.store(row_max_ptr + row, row_max)


def filter_thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    wide: int = WIDE,
    narrow: int = NARROW,
    rows_to_search: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of float32 `logits` [S, V]: (threshold, row max) of the scaled logits `logits / temperature`;
    the top-k/top-p survivors are the tokens above the threshold. Greedy rows and rows without a filter get
    threshold -inf (and row max 0 when they have no min-p either), as do rows `rows_to_search` (int32 [S])
    leaves at 0 when given. `wide` and `narrow` (powers of two, narrow >= 32) set when the search moves to a
    copy of the bracket and when it tests each token."""
    rows, vocab = logits.shape
    threshold = torch.empty(rows, dtype=torch.float32, device=logits.device)
    row_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
    wide_scratch = torch.empty((rows, wide), dtype=torch.float32, device=logits.device)
    narrow_scratch = torch.empty((rows, narrow), dtype=torch.float32, device=logits.device)
    if rows:
        _threshold_kernel[(rows,)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p,
            rows_to_search if rows_to_search is not None else top_k, threshold, row_max,
            wide_scratch, narrow_scratch, vocab, SOME_ROWS=rows_to_search is not None,
            P=PIVOTS, WIDE_=wide, NARROW_=narrow, MAX_PASSES=_MAX_PASSES, BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
    return threshold, row_max
