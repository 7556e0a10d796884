"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Randomness comes from a counter-based hash of (seed, output position, vocabulary id), not from a global
generator, so a request's samples depend only on its own seed and logits: the same whatever else is in the
batch, and graph-capturable (no generator state). A token is drawn by the exponential race
`argmax(p_i / E_i)` with `E_i = -log(u_i)`, which picks token i with probability p_i.

Stages: the structured-outputs mask (token_mask.py: -inf over the tokens a constrained row's grammar forbids,
before anything else looks at the logits), the draw (the race among the tokens the row's top-k/top-p/min-p
filter keeps, or the argmax for greedy rows), then the log-probabilities (of the unmasked logits). The draw
does not renormalise the kept probabilities: the race's winner among the kept tokens is the same either way.
On CUDA the draw is sampling_race's kernels, which check the filter at the race's winner instead of searching
the row for it; elsewhere it is the torch path here, with the filter read off the sorted row (`draw`,
`sorted_row_filter`), the reference the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.engine.native.sampling.token_mask import TokenMask

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, all [S] on the logits' device."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32; 1 = off
    min_p: torch.Tensor  # float32; 0 = off
    seeds: torch.Tensor  # int64
    positions: torch.Tensor  # int64: index of the token being sampled within its sequence's output

    def rows(self, n: int) -> SamplingTensors:
        return SamplingTensors(*(getattr(self, f)[:n] for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class SamplerMode:
    """What a step needs, fixed per captured graph: any sampled (non-greedy) row, any row with a top-k/top-p/
    min-p filter, and how many top log-probabilities to return (None: none at all, 0: the sampled token's)."""

    sampling: bool = False
    filtering: bool = False
    logprobs: int | None = None


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor | None = None  # float32 [S]
    top_ids: torch.Tensor | None = None  # int64 [S, K]
    top_logprobs: torch.Tensor | None = None  # float32 [S, K]


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 (Wellons): values stay in [0, 2^32) inside int64; products wrap, and only their low 32 bits
    # are kept, which two's-complement wrap-around preserves.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One hash key per row, in [0, 2^32): the row's (seed, output position)."""
    return _hash32((seeds & _MASK32) ^ _hash32((positions * 0x9E3779B1 + (seeds >> 32)) & _MASK32))


def torch_exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """E[s, v] ~ Exp(1), a pure function of (keys[s], v); the CUDA draw computes the same bits in registers."""
    vocab = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _hash32((keys[:, None] * 0x85EBCA6B + vocab[None, :]) & _MASK32)
    # 24 random bits give a float32 exactly in (0, 1): log never sees 0 or 1.
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


@dataclass
class RowFilter:
    """Which tokens a row may draw, over its scaled logits l = logits / temperature: those with
    l > threshold (top-k and top-p) and exp(l - row_max) >= min_p. All [S] float32."""

    threshold: torch.Tensor
    row_max: torch.Tensor
    min_p: torch.Tensor

    def keep(self, scaled: torch.Tensor) -> torch.Tensor:
        return (scaled > self.threshold[:, None]) & ((scaled - self.row_max[:, None]).exp() >= self.min_p[:, None])


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / temperature, greedy rows (temperature 0) left as they are."""
    return logits / torch.where(temperature > 0, temperature, 1.0)[:, None]


def sorted_row_filter(scaled: torch.Tensor, params: SamplingTensors) -> RowFilter:
    """The filter read off the sorted row. Top-k keeps the k largest values and every token tied with the k-th;
    top-p then keeps, among those, each token whose probability mass strictly above it is at most top_p; min-p
    keeps tokens at least min_p times as probable as the most probable. A tie is never split."""
    values = scaled.sort(dim=-1, descending=True).values
    vocab = values.shape[-1]
    row_max = values[:, 0].contiguous()  # the kernels read per-row tensors as contiguous
    neg_inf = torch.tensor(float("-inf"), device=scaled.device)
    kth = values.gather(1, (params.top_k.clamp(1, vocab) - 1)[:, None])
    top_k_threshold = torch.where(values < kth, values, neg_inf).max(dim=-1).values
    top_k_threshold = torch.where((params.top_k > 0) & (params.top_k < vocab), top_k_threshold, neg_inf)
    weights = (values - row_max[:, None]).exp() * (values > top_k_threshold[:, None])
    bound = params.top_p * weights.sum(dim=-1)
    # The mass before a position is the mass strictly above its value at the first of a run of equal values.
    mass_above = weights.cumsum(dim=-1) - weights
    first_of_run = torch.ones_like(values, dtype=torch.bool)
    first_of_run[:, 1:] = values[:, 1:] < values[:, :-1]
    failing = (mass_above > bound[:, None]) & first_of_run
    top_p_threshold = torch.where(failing, values, neg_inf).max(dim=-1).values
    top_p_threshold = torch.where(params.top_p < 1, top_p_threshold, neg_inf)
    return RowFilter(torch.maximum(top_k_threshold, top_p_threshold), row_max, params.min_p)


def draw(logits: torch.Tensor, params: SamplingTensors, keep: RowFilter | None) -> torch.Tensor:
    """One token per row, in torch: the exponential race among the tokens `keep` allows, or the argmax where
    temperature is 0."""
    keys = noise_keys(params.seeds, params.positions)
    scaled = scaled_logits(logits, params.temperature)
    # argmax(p / E) = argmax(log p - log E); the softmax normaliser is the same for the whole row.
    score = scaled - torch_exponential_noise(keys, logits.shape[-1]).log()
    if keep is not None:
        score = score.masked_fill(~keep.keep(scaled), float("-inf"))
    return torch.where(params.temperature > 0, score.argmax(dim=-1), logits.argmax(dim=-1))


def sampled_tokens(logits: torch.Tensor, params: SamplingTensors, filtering: bool) -> torch.Tensor:
    """The race's token of each row (the argmax for greedy rows), among the tokens each row's filter keeps
    when `filtering`; without it the filters are ignored. CUDA and the torch path agree up to float rounding."""
    if logits.is_cuda:
        from batchjob.engine.native.kernels import sampling_race

        filters = (params.top_k, params.top_p, params.min_p) if filtering else None
        keys = noise_keys(params.seeds, params.positions)
        return sampling_race.sample_tokens(logits, params.temperature, keys, filters)
    keep = sorted_row_filter(scaled_logits(logits, params.temperature), params) if filtering else None
    return draw(logits, params, keep)


def greedy_tokens(logits: torch.Tensor, mask: TokenMask | None = None) -> torch.Tensor:
    """The argmax of each row (the first of equal maxima), of logits in any float dtype; with `mask`, among the
    tokens each constrained row allows. On CUDA the mask is read beside the logits (sampling_race); elsewhere it
    writes -inf over the forbidden logits first, in place."""
    if logits.is_cuda:
        from batchjob.engine.native.kernels import sampling_race

        return sampling_race.greedy_tokens(logits, None if mask is None else (mask.bitmask, mask.rows))
    if mask is not None:
        logits = mask.apply_(logits)
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor, params: SamplingTensors, mode: SamplerMode, mask: TokenMask | None = None
) -> SamplerOutput:
    """Sample one token per row of float32 `logits` [S, V] (a greedy mode without log-probabilities also takes
    the model's bf16/fp16 logits). With `mask` (structured outputs), tokens a row's constraint forbids are never
    chosen, and -inf may be written over them in `logits` unless log-probabilities are asked for: those stay the
    model's own distribution's."""
    raw = logits
    if mode.sampling:
        if mask is not None:
            logits = mask.apply_(logits.clone() if mode.logprobs is not None else logits)
        tokens = sampled_tokens(logits, params, mode.filtering)
    else:
        # Off CUDA the mask is written over the logits: over a copy where the log-probabilities need them raw.
        copy = mask is not None and not logits.is_cuda and mode.logprobs is not None
        tokens = greedy_tokens(logits.clone() if copy else logits, mask)
    out = SamplerOutput(tokens=tokens)
    if mode.logprobs is not None:
        logprobs = raw.log_softmax(dim=-1)
        out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
        if mode.logprobs > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(mode.logprobs, dim=-1)
    return out
