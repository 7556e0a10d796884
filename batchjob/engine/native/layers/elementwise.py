"""Building blocks of the decoder: RMSNorm (in the rounding styles of the families) and the gated MLP
activations (SwiGLU, GELU-tanh).

Everything here is shape-static and free of host syncs so that decode steps can be captured in CUDA graphs.
Numerics follow transformers (norm statistics in float32) so that our logits match theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchjob.engine.native.layers.fp8_linear import Fp8Rows, RowQuantizer

ACTIVATIONS = ("silu", "gelu_tanh")


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`. Llama-style norms round the normalised x to the model dtype before the weight
    multiply; `weight_fp32` multiplies in float32 and rounds once (OLMo 2, Gemma), and `unit_offset` scales by
    `1 + weight` (Gemma, whose checkpoints store the offset from one)."""

    def __init__(self, size: int, eps: float, weight_fp32: bool = False, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.weight_fp32 = weight_fp32 or unit_offset
        self.offset = 1.0 if unit_offset else 0.0
        # Set where an FP8 projection takes this norm's output (`decoder.quantize_at_source`): 2-D rows out, quantized.
        self.fp8_out: RowQuantizer | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Fp8Rows | tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum also written into `residual`
        on CUDA (one fused kernel there). With a residual, x may also be a split-K matmul's float32 partial
        sums [splits, tokens, size] (split_k.py), added up first. With `fp8_out`, the normed rows come quantized
        (`Fp8Rows`), by the norm's own kernel on CUDA."""
        if x.is_cuda:
            from batchjob.engine.native.kernels import fused_ops

            if self.fp8_out is not None:
                (q, scales), residual = fused_ops.rms_norm_fp8(
                    x, self.weight, self.eps, residual, self.weight_fp32, self.offset, self.fp8_out.upper
                )
                return Fp8Rows(q, scales) if residual is None else (Fp8Rows(q, scales), residual)
            if residual is not None:
                return fused_ops.rms_norm(x, self.weight, self.eps, residual, self.weight_fp32, self.offset)
            shape = x.shape
            out = fused_ops.rms_norm(
                x.reshape(-1, shape[-1]), self.weight, self.eps, None, self.weight_fp32, self.offset
            )
            return out.reshape(shape)
        if residual is not None:
            if x.dim() == residual.dim() + 1:
                x = x.sum(0).to(residual.dtype)
            x = residual = x + residual
        # float32 statistics: bf16 squares of large activations lose too much precision.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (h * (self.offset + self.weight.float())).to(x.dtype) if self.weight_fp32 else self.weight * h.to(x.dtype)
        if self.fp8_out is not None:
            h = self.fp8_out(h)
        return h if residual is None else (h, residual)


def act_and_mul(gate_up: torch.Tensor, activation: str, fp8_out: RowQuantizer | None = None) -> torch.Tensor | Fp8Rows:
    """`act(gate) * up` on a fused [.., 2 * intermediate] gate/up projection (gate first): SwiGLU for
    `silu`, GeGLU with the tanh approximation for `gelu_tanh` (Gemma). With `fp8_out`, quantized for the FP8
    projection that takes it (`Fp8Rows`), in the same kernel for SwiGLU on CUDA."""
    if activation == "silu" and gate_up.is_cuda:
        from batchjob.engine.native.kernels import fused_ops

        if fp8_out is not None:
            return Fp8Rows(*fused_ops.silu_and_mul_fp8(gate_up, fp8_out.upper))
        return fused_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up if activation == "silu" else F.gelu(gate, approximate="tanh") * up
    return h if fp8_out is None else fp8_out(h)
