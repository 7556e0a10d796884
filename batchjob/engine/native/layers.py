"""Building blocks of the Llama family: RMSNorm, rotary embedding (with rope scaling), SiLU-and-mul.

Everything here is shape-static and free of host syncs so that decode steps can be captured in CUDA graphs.
Numerics follow transformers (norm in float32, rope tables computed in float32 then cast to the model dtype)
so that our logits match theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum also written into `residual`
        on CUDA (one fused kernel there)."""
        if x.is_cuda:
            from batchjob.engine.native import triton_ops

            shape = x.shape
            out = triton_ops.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps, residual)
            return out.reshape(shape) if residual is None else out
        if residual is not None:
            x = residual = x + residual
        # float32 statistics: bf16 squares of large activations lose too much precision.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return h if residual is None else (h, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [.., 2 * intermediate] gate/up projection."""
    if gate_up.is_cuda:
        from batchjob.engine.native import triton_ops

        return triton_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
    attention_factor: float | None = None  # yarn; None: derived from factor (and mscale, mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the scale applied to cos/sin, as transformers
    computes them for each rope type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq)
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


def _yarn_inv_freq(rope: RopeSpec, head_dim: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = inv_freq / rope.factor
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position below `max_positions`, computed once; `forward` only gathers.

    Positions must lie in [0, max_positions): callers pad CUDA-graph batches with position 0.
    """

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(max_positions, 2 * head_dim), persistent=False)
        self.reset_table()

    @torch.no_grad()
    def reset_table(self) -> None:
        """(Re)compute the table in float32 into the buffer, whatever its device and dtype: the loader builds
        modules on the `meta` device, so the table has to be filled after materialisation."""
        if self.cos_sin.is_meta:
            return
        inv_freq, scale = rope_inv_freq(self.rope, self.head_dim)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        table = torch.cat((emb.cos() * scale, emb.sin() * scale), dim=-1)
        self.cos_sin.copy_(table)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for `positions` [T], broadcastable over heads."""
        cos, sin = self.cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def prepare(self, positions: torch.Tensor) -> RopeStep:
        """What every layer of one step needs to rotate its q and k."""
        if positions.is_cuda:
            return RopeStep(positions, self.cos_sin, None, None)
        cos, sin = self(positions)
        return RopeStep(positions, self.cos_sin, cos, sin)


@dataclass
class RopeStep:
    positions: torch.Tensor
    table: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [T, H, D] rotated (in place, by one kernel each, on CUDA)."""
        if self.cos is None:
            from batchjob.engine.native import triton_ops

            triton_ops.rotary_(q, self.positions, self.table)
            triton_ops.rotary_(k, self.positions, self.table)
            return q, k
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (half-split layout, as Llama checkpoints in HF format expect)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
