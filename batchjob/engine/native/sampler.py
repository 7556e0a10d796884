"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Randomness comes from a counter-based hash of (seed, output position, vocabulary id), not from a global
generator, so a request's samples depend only on its own seed and logits: the same whatever else is in the
batch, and graph-capturable (no generator state). A token is drawn by the exponential race
`argmax(p_i / E_i)` with `E_i = -log(u_i)`, which picks token i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.engine.native.token_mask import TokenMask

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


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """E[s, v] ~ Exp(1), a pure function of (seeds[s], positions[s], v). On CUDA one fused kernel computes the
    same bits (batchjob.engine.native.triton_ops.exponential_noise); elsewhere `torch_exponential_noise`."""
    keys = noise_keys(seeds, positions)
    if seeds.is_cuda:
        from batchjob.engine.native import triton_ops

        return triton_ops.exponential_noise(keys, vocab_size)
    return torch_exponential_noise(keys, vocab_size)


def torch_exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    vocab = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _hash32((keys[:, None] * 0x85EBCA6B + vocab[None, :]) & _MASK32)
    # 24 random bits give a float32 exactly in (0, 1): log never sees 0 or 1.
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


def _filtered_probs(scaled: torch.Tensor, params: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities in descending order with top-k, top-p and min-p applied, and the token of each column."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(params.top_k > 0, params.top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Top-p keeps the smallest prefix whose mass reaches p: a token is dropped when the mass before it does.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before > params.top_p[:, None]
    drop |= probs < params.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0), order


def sample(
    logits: torch.Tensor, params: SamplingTensors, mode: SamplerMode, mask: TokenMask | None = None
) -> SamplerOutput:
    """Sample one token per row of float32 `logits` [S, V]. With `mask` (structured outputs), tokens a row's
    constraint forbids are never chosen; log-probabilities stay those of the model's own distribution."""
    raw = logits
    # ---- stage 0, structured outputs: forbidden tokens get -inf before greedy choice and any filtering ----
    if mask is not None:
        logits = mask.apply_(logits.clone() if mode.logprobs is not None else logits)
    # ---- end of stage 0 ----
    greedy_tokens = logits.argmax(dim=-1)
    tokens = greedy_tokens
    if mode.sampling:
        temperature = torch.where(params.temperature > 0, params.temperature, 1.0)[:, None]
        scaled = logits / temperature
        noise = exponential_noise(params.seeds, params.positions, logits.shape[-1])
        if mode.filtering:
            probs, order = _filtered_probs(scaled, params)
            choice = (probs / noise.gather(1, order)).argmax(dim=-1, keepdim=True)
            drawn = order.gather(1, choice).squeeze(1)
        else:
            # argmax(p / E) = argmax(log p - log E); the softmax normaliser is the same for the whole row.
            drawn = (scaled - noise.log()).argmax(dim=-1)
        tokens = torch.where(params.temperature > 0, drawn, greedy_tokens)
    out = SamplerOutput(tokens=tokens)
    if mode.logprobs is not None:
        logprobs = raw.log_softmax(dim=-1)
        out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
        if mode.logprobs > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(mode.logprobs, dim=-1)
    return out
