"""Rotary position embeddings: the parameters of every supported rope type, their cos/sin tables, and applying
them to q and k (in place by one Triton kernel for both on CUDA, with any per-head q/k norms, and there
optionally storing the keys and values into the paged KV cache).

Tables are computed once in float32, as transformers computes them, for every position the engine may use;
a step only gathers rows. Partial rotary embeddings (Phi-4-mini) rotate the first `rotary_dim` channels of
each head and pass the rest through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from batchjob.engine.native.layers.elementwise import RMSNorm

ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters, normalised from transformers' `rope_parameters` (or the older
    `rope_theta` + `rope_scaling` keys). Fields unused by `rope_type` keep their defaults."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn, longrope; None: derived from factor (and mscale, mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors below original_max_position_embeddings
    long_factor: tuple[float, ...] = ()  # longrope: ... and from there on


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeSpec, dim: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (float32) and the scale applied to cos/sin, as transformers computes
    them for each rope type (`dim`: the rotated channels of a head). `long`: longrope's long-context set."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type in ("default", "dynamic"):
        # Dynamic NTK scaling (transformers' "dynamic") raises theta only once a forward call's longest position
        # passes max_position_embeddings; below it the frequencies are the default ones, and the engine's
        # max_model_len never exceeds it (a longer one is refused).
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim, inv_freq)
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(rope, exponents, long)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}: supported are {', '.join(ROPE_TYPES)}")


def _llama3_inv_freq(rope: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeSpec, dim: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = inv_freq / rope.factor
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


def _longrope_inv_freq(rope: RopeSpec, exponents: torch.Tensor, long: bool) -> tuple[torch.Tensor, float]:
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = (
            1.0
            if rope.factor <= 1.0
            else math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
        )
    factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    return 1.0 / (factors * rope.theta**exponents), float(attention_factor)


def rope_table(rope: RopeSpec, dim: int, max_positions: int) -> torch.Tensor:
    """float32 [max_positions, 2 * dim]: each row is cos | sin of one position, each repeated over the two
    halves of the rotated channels (transformers' layout).

    Longrope switches to its long factors at position original_max_position_embeddings. transformers decides
    per forward call (long for every token once the call's longest position passes the original length), which
    for one-token decode steps is the same thing, and for a prompt longer than the original length differs only
    in the prompt positions below it."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    inv_freq, scale = rope_inv_freq(rope, dim)
    freqs = positions[:, None] * inv_freq[None, :]
    if rope.rope_type == "longrope":
        long_inv_freq, _ = rope_inv_freq(rope, dim, long=True)
        is_long = positions[:, None] >= rope.original_max_position_embeddings
        freqs = torch.where(is_long, positions[:, None] * long_inv_freq[None, :], freqs)
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.cat((emb.cos() * scale, emb.sin() * scale), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position below `max_positions`, computed once; `forward` only gathers.

    Positions must lie in [0, max_positions): callers pad CUDA-graph batches with position 0.
    """

    def __init__(self, rope: RopeSpec, rotary_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope = rope
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(max_positions, 2 * rotary_dim), persistent=False)
        self.reset_table()

    @torch.no_grad()
    def reset_table(self) -> None:
        """(Re)compute the table in float32 into the buffer, whatever its device and dtype: the loader builds
        modules on the `meta` device, so the table has to be filled after materialisation."""
        if self.cos_sin.is_meta:
            return
        self.cos_sin.copy_(rope_table(self.rope, self.rotary_dim, self.max_positions))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] for `positions` [T], broadcastable over heads."""
        cos, sin = self.cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def prepare(self, positions: torch.Tensor) -> RopeStep:
        """What every layer of one step that uses this embedding needs to rotate its q and k."""
        if positions.is_cuda:
            return RopeStep(self.rotary_dim, positions, self.cos_sin, None, None)
        cos, sin = self(positions)
        return RopeStep(self.rotary_dim, positions, self.cos_sin, cos, sin)


@dataclass
class RopeStep:
    rotary_dim: int
    positions: torch.Tensor
    table: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None

    def apply(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[RMSNorm, RMSNorm] | None = None,
        store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """q, k [T, H, D] rotated over their first `rotary_dim` channels, after `norms` (per-head q and k
        norms) where given. On CUDA in place, q and k in one kernel, the norms in it too when rope turns
        whole heads. `store` = (v, k_cache, v_cache, slot_mapping): the same kernel may also write the keys and
        values into the paged cache; the third value says whether it did (on CUDA, when rope turns whole heads)."""
        whole = self.rotary_dim == q.shape[-1]
        fuse = norms is not None and self.cos is None and whole
        if norms is not None and not fuse:
            q, k = norms[0](q), norms[1](k)
        if self.cos is None:
            from batchjob.engine.native.kernels import fused_ops

            fused = None
            if fuse:
                q_norm, k_norm = norms
                fused = (q_norm.weight, k_norm.weight, q_norm.eps, q_norm.weight_fp32, q_norm.offset)
            store = store if whole else None
            rotary = self.rotary_dim
            fused_ops.rotary_qk_(q[..., :rotary], k[..., :rotary], self.positions, self.table, fused, store)
            return q, k, store is not None
        return self._rotate(q), self._rotate(k), False

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:
            return apply_rotary(x, self.cos, self.sin)
        rotated = apply_rotary(x[..., : self.rotary_dim], self.cos, self.sin)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (half-split layout, as Llama checkpoints in HF format expect)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
