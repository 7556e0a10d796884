"""The sampler on CUDA: the exponential race, split over many programs per row, and the filters checked on the
race's winner instead of searched for.

Reading a row of 128k logits with one program leaves most of the GPU idle, and a threshold search reads it many
times. Two facts avoid both. The filters are monotone in the scaled logit l (top-k: the count of tokens strictly
above l is at most k - 1; top-p: their weight exp(l - max) is at most top_p times the row's total; min-p:
exp(l - max) >= min_p), so the kept tokens are those above some value x. And the race's winner among the kept
tokens is the winner among all tokens when that one is kept: the filter only needs checking at one token.
When the candidate c fails, every token at or below l_c fails too, and the answer is the race among the tokens
above l_c, whose winner is the next candidate. So:

1. `_race_kernel` (rows x chunks): each program races its chunk of the row and keeps its best score, token,
   and (filtering) its max and sum of exp(l - chunk max);
2. `_pick_kernel` (rows): the row's candidate, row max and total weight; a candidate at the row max passes
   every filter, as does any candidate of a row without filters;
3. `ROUNDS` times: `_verify_kernel` (rows x chunks) counts and weighs, over the rows still open, the tokens
   above the candidate and races those that pass min-p; `_settle_kernel` (rows) accepts the candidate or
   moves to that race's winner;
4. rows still open, and rows with both top-k and top-p (top-p renormalises over the top-k survivors, whose
   mass needs top-k's threshold), take the exact per-row search (sampling_filter) and draw (sampling_draw).

The token is the one the race among the kept tokens picks, so it does not depend on the path a row took. At
top_p = 0.95 a candidate fails about one time in twenty and each further round about halves what is left, so
almost every row settles in the first round and the exact search almost never runs; its launches exit at once.
Every launch has a fixed grid and runs whatever the data: the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob.engine.native.kernels import sampling_draw, sampling_filter
from batchjob.engine.native.kernels.sampling_draw import race_score

CHUNK = 8192  # vocabulary entries per program: 16 programs per row of a 128k vocabulary
ROUNDS = 4  # candidate checks before a row takes the exact search
_BLOCK = 1024

# A row's state: its token is final; its candidate is not checked yet; it needs the exact search. Nonzero: not
# settled, as the exact search's `rows_to_search` reads it.
SETTLED = tl.constexpr(0)
OPEN = tl.constexpr(1)
EXACT = tl.constexpr(2)


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "keys_ptr", "mask_rows_ptr"])
def _race_kernel(
    logits_ptr, stride, temperature_ptr, keys_ptr, best_ptr, token_ptr, max_ptr, mass_ptr, vocab,
    bitmask_ptr, bitmask_stride, mask_rows_ptr,
    STATS: tl.constexpr, CHUNK_: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr = False,
    MASKED: tl.constexpr = False,
):  # fmt: skip
    """GREEDY: every row takes the argmax (no temperatures are read), of logits in any float dtype. MASKED (with
    GREEDY): a row whose `mask_rows` entry is a bitmask row takes the argmax among the tokens that row allows
    (token_mask.py's layout), read beside the logits instead of written over them first."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    part = row * tl.num_programs(1) + chunk
    row_ptr = logits_ptr + row * stride
    temperature = 0.0 if GREEDY else tl.load(temperature_ptr + row)
    first = chunk * CHUNK_
    best = float("-inf")
    token = first
    chunk_max = float("-inf")
    mass = 0.0
    if temperature > 0:
        key = tl.load(keys_ptr + row).to(tl.uint32)
        for start in range(first, first + CHUNK_, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")) / temperature
            score = race_score(v, key, cols)
            block_best = tl.max(score, axis=0)
            if block_best > best:
                best = block_best
                token = start + tl.argmax(score, axis=0)
            if STATS:
                # Online, as in flash attention: rescaled whenever the running max grows.
                new_max = tl.maximum(chunk_max, tl.max(v, axis=0))
                mass *= tl.where(chunk_max == float("-inf"), 0.0, tl.exp(chunk_max - new_max))
                mass += tl.sum(tl.where(v > float("-inf"), tl.exp(v - new_max), 0.0), axis=0)
                chunk_max = new_max
    else:
        mask_row = tl.load(mask_rows_ptr + row) if MASKED else -1
        for start in range(first, first + CHUNK_, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            if MASKED:  # noqa: SIM102 - a compile-time branch around a run-time one
                if mask_row >= 0:
                    words = tl.load(bitmask_ptr + mask_row * bitmask_stride + cols // 32, mask=cols < vocab, other=0)
                    x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
            block_best = tl.max(x, axis=0)
            if block_best > best:
                best = block_best
                token = start + tl.argmax(x, axis=0)
    tl.store(best_ptr + part, best)
    tl.store(token_ptr + part, token)
    if STATS:
        tl.store(max_ptr + part, chunk_max)
        tl.store(mass_ptr + part, mass)


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr"])
def _pick_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, best_ptr, token_ptr, max_ptr, mass_ptr,
    tokens_ptr, candidate_ptr, row_max_ptr, total_ptr, state_ptr, vocab, chunks,
    FILTERING: tl.constexpr, CHUNKS_P2: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    parts = row * chunks + tl.arange(0, CHUNKS_P2)
    valid = tl.arange(0, CHUNKS_P2) < chunks
    # The first chunk holding the best score: the row's first best token, as a single pass would find it.
    best = tl.argmax(tl.load(best_ptr + parts, mask=valid, other=float("-inf")), axis=0)
    token = tl.load(token_ptr + row * chunks + best)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    if FILTERING:
        temperature = tl.load(temperature_ptr + row)
        top_k = tl.load(top_k_ptr + row)
        use_k = (top_k > 0) & (top_k < vocab)
        use_p = tl.load(top_p_ptr + row) < 1.0
        maxes = tl.load(max_ptr + parts, mask=valid, other=float("-inf"))
        row_max = tl.max(maxes, axis=0)
        scale = tl.where(maxes > float("-inf"), tl.exp(maxes - row_max), 0.0)
        total = tl.sum(tl.load(mass_ptr + parts, mask=valid, other=0.0) * scale, axis=0)
        candidate = tl.load(logits_ptr + row * stride + token) / temperature
        filtered = (temperature > 0) & (use_k | use_p | (tl.load(min_p_ptr + row) > 0))
        state = tl.where(filtered & (candidate < row_max), tl.where(use_k & use_p, EXACT, OPEN), SETTLED)
        tl.store(candidate_ptr + row, candidate)
        tl.store(row_max_ptr + row, row_max)
        tl.store(total_ptr + row, total)
        tl.store(state_ptr + row, state)


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "keys_ptr", "min_p_ptr"])
def _verify_kernel(
    logits_ptr, stride, temperature_ptr, keys_ptr, min_p_ptr, candidate_ptr, row_max_ptr, state_ptr,
    best_ptr, token_ptr, count_ptr, weight_ptr, vocab, CHUNK_: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if tl.load(state_ptr + row) == OPEN:
        chunk = tl.program_id(1)
        part = row * tl.num_programs(1) + chunk
        row_ptr = logits_ptr + row * stride
        temperature = tl.load(temperature_ptr + row)
        key = tl.load(keys_ptr + row).to(tl.uint32)
        min_p = tl.load(min_p_ptr + row)
        candidate = tl.load(candidate_ptr + row)
        row_max = tl.load(row_max_ptr + row)
        first = chunk * CHUNK_
        best = float("-inf")
        token = first
        count = 0
        weight = 0.0
        for start in range(first, first + CHUNK_, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")) / temperature
            above = v > candidate
            w = tl.exp(v - row_max)
            count += tl.sum(above.to(tl.int32), axis=0)
            weight += tl.sum(tl.where(above, w, 0.0), axis=0)
            score = tl.where(above & (w >= min_p), race_score(v, key, cols), float("-inf"))
            block_best = tl.max(score, axis=0)
            if block_best > best:
                best = block_best
                token = start + tl.argmax(score, axis=0)
        tl.store(best_ptr + part, best)
        tl.store(token_ptr + part, token)
        tl.store(count_ptr + part, count)
        tl.store(weight_ptr + part, weight)


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr"])
def _settle_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, best_ptr, token_ptr, count_ptr,
    weight_ptr, tokens_ptr, candidate_ptr, row_max_ptr, total_ptr, state_ptr, vocab, chunks,
    CHUNKS_P2: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if tl.load(state_ptr + row) == OPEN:
        parts = row * chunks + tl.arange(0, CHUNKS_P2)
        valid = tl.arange(0, CHUNKS_P2) < chunks
        count = tl.sum(tl.load(count_ptr + parts, mask=valid, other=0), axis=0)
        # Summed in a fixed order: the same row always gets the same answer.
        weight = tl.sum(tl.load(weight_ptr + parts, mask=valid, other=0.0), axis=0)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        candidate = tl.load(candidate_ptr + row)
        row_max = tl.load(row_max_ptr + row)
        passes_k = (top_k <= 0) | (top_k >= vocab) | (count <= top_k - 1)
        passes_p = (top_p >= 1.0) | (weight <= top_p * tl.load(total_ptr + row))
        passes_min_p = tl.exp(candidate - row_max) >= tl.load(min_p_ptr + row)
        if passes_k & passes_p & passes_min_p:
            tl.store(state_ptr + row, SETTLED)
        else:
            # Every token at or below the candidate fails as well: the answer is the race above it.
            best = tl.argmax(tl.load(best_ptr + parts, mask=valid, other=float("-inf")), axis=0)
            token = tl.load(token_ptr + row * chunks + best)
            candidate = tl.load(logits_ptr + row * stride + token) / tl.load(temperature_ptr + row)
            tl.store(tokens_ptr + row, token.to(tl.int64))
            tl.store(candidate_ptr + row, candidate)
            if candidate >= row_max:
                tl.store(state_ptr + row, SETTLED)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    chunk: int = CHUNK,
    rounds: int = ROUNDS,
) -> torch.Tensor:
    """One token per row of float32 `logits` [S, V]: the exponential race over `logits / temperature` with the
    noise of the rows' hash `keys`, among the tokens that `filters` = (top_k, top_p, min_p) keep when given; the
    argmax where temperature is 0. `chunk` (a power of two) is the vocabulary each program reads, `rounds` the
    candidate checks before the exact search. Returns int64 [S]."""
    tokens, state = settle(logits, temperature, keys, filters, chunk, rounds)
    if filters is not None and len(tokens):
        top_k, top_p, min_p = filters
        threshold, row_max = sampling_filter.filter_thresholds(
            logits, temperature, top_k, top_p, min_p, rows_to_search=state
        )
        sampling_draw.draw(logits, temperature, keys, (threshold, row_max, min_p), rows_to_draw=state, out=tokens)
    return tokens


def greedy_tokens(
    logits: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor] | None = None, chunk: int = CHUNK
) -> torch.Tensor:
    """The argmax of each row of `logits` [S, V] (float32, bf16 or fp16: a model's own logits need no float32
    copy), the first of equal maxima as torch.argmax takes it; int64 [S]. Split over many programs per row, as
    the race is: torch's reduction reads a row with one block and leaves most of the GPU idle. `mask`: a step's
    (bitmask, mask_rows) (token_mask.py): a constrained row's argmax among the tokens it allows, as if the
    forbidden ones were -inf (a row that allows none takes its first token, as torch.argmax of all -inf)."""
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if len(tokens):
        _race_unfiltered(logits, None, None, chunk, tokens, mask)
    return tokens


def _race_unfiltered(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    keys: torch.Tensor | None,
    chunk: int,
    tokens: torch.Tensor,
    mask: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write each row's race winner without filters (the argmax where temperature is 0; every row's argmax
    when `temperature` is None, under `mask` when given) into `tokens`: the race over chunks, then the pick of
    each row's best chunk."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, chunk)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    token = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    greedy = temperature is None
    temperature = best if greedy else temperature
    bitmask, mask_rows = mask if mask is not None else (token, token)
    _race_kernel[(rows, chunks)](
        logits, logits.stride(0), temperature, best if greedy else keys, best, token, best, best, vocab,
        bitmask, bitmask.stride(0), mask_rows,
        STATS=False, CHUNK_=chunk, BLOCK=min(_BLOCK, chunk), GREEDY=greedy, MASKED=mask is not None, num_warps=4,
    )  # fmt: skip
    _pick_kernel[(rows,)](
        logits, logits.stride(0), temperature, temperature, temperature, temperature, best, token, best, best,
        tokens, best, best, best, token, vocab, chunks, FILTERING=False, CHUNKS_P2=triton.next_power_of_2(chunks),
        num_warps=1,
    )  # fmt: skip


def settle(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    chunk: int = CHUNK,
    rounds: int = ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` up to the exact search: (tokens int64 [S], state int32 [S]), the tokens final where the
    state is 0 (SETTLED), the rows' candidates elsewhere (1: still open after `rounds` checks, 2: top-k and
    top-p together)."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, chunk)
    chunks_p2 = triton.next_power_of_2(chunks)
    block = min(_BLOCK, chunk)
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    state = torch.zeros(rows, dtype=torch.int32, device=device)
    if not rows:
        return tokens, state
    if filters is None:
        _race_unfiltered(logits, temperature, keys, chunk, tokens)
        return tokens, state
    best = torch.empty((rows, chunks), dtype=torch.float32, device=device)
    token = torch.empty((rows, chunks), dtype=torch.int32, device=device)
    maxes, masses = torch.empty_like(best), torch.empty_like(best)
    _race_kernel[(rows, chunks)](
        logits, logits.stride(0), temperature, keys, best, token, maxes, masses, vocab, token, 0, token,
        STATS=True, CHUNK_=chunk, BLOCK=block, num_warps=4,
    )  # fmt: skip
    top_k, top_p, min_p = filters
    candidate, row_max, total = (torch.empty(rows, dtype=torch.float32, device=device) for _ in range(3))
    _pick_kernel[(rows,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, best, token, maxes, masses,
        tokens, candidate, row_max, total, state, vocab, chunks, FILTERING=True, CHUNKS_P2=chunks_p2, num_warps=1,
    )  # fmt: skip
    counts = torch.empty((rows, chunks), dtype=torch.int32, device=device)
    for _ in range(rounds):
        _verify_kernel[(rows, chunks)](
            logits, logits.stride(0), temperature, keys, min_p, candidate, row_max, state,
            best, token, counts, masses, vocab, CHUNK_=chunk, BLOCK=block, num_warps=4,
        )  # fmt: skip
        _settle_kernel[(rows,)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p, best, token, counts, masses,
            tokens, candidate, row_max, total, state, vocab, chunks, CHUNKS_P2=chunks_p2, num_warps=1,
        )  # fmt: skip
    return tokens, state
