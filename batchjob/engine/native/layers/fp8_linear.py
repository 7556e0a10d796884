"""A projection with FP8 (e4m3) weights and activations: `Fp8Linear`, the drop-in for `nn.Linear` where a model
is quantized (models/quantization.py says which formats and which projections).

Weights are stored as e4m3 [N, K] with float32 scales, per output row ([N, 1]) or per block ([N / rows, K / cols]);
a weight element is `weight * its scale`. Each step quantizes the activations: per token (dynamic), per token and
group of channels (dynamic, with block weights), over the whole step (dynamic per tensor) or by the checkpoint's
`input_scale` (static). Then:

- per-row weights on CUDA, a decode step's few rows: the Triton kernel of `kernels/fp8_few_rows.py`, which reads
  the weights at a larger share of the copy rate than cuBLASLt's tiles for large M;
- per-row weights on CUDA, more rows: `torch._scaled_mm` (cuBLASLt's FP8 GEMM, row-wise scales), bf16 out, its
  rows padded to a multiple of 128 in the buffers the quantizing kernels allocate (`blas_matmul`);
- block weights, or another output dtype, on CUDA: the Triton matmul of `kernels/fp8.py`;
- on CPU: the same arithmetic in float32 on the dequantized operands (quantized activations included), which
  is also what the tests take as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchjob.engine.native.kernels import fp8, fp8_few_rows
from batchjob.engine.native.kernels.fp8 import FP8, FP8_MAX, INV_FP8_MAX, MIN_SCALE
from batchjob.engine.native.layers import batch_invariant


@dataclass(frozen=True)
class Fp8Rows:
    """Activations [M, K] already quantized for an `Fp8Linear` by the kernel that computed them: e4m3 `q` and
    float32 `scales` [M, 1], what the projection's own per-token quantizer would have made of them."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass(frozen=True)
class RowQuantizer:
    """How the kernel before an `Fp8Linear` with per-token activations quantizes its output for it (the RMSNorm
    before q/k/v or gate/up, the SiLU-and-mul before down): one scale a row, its amax capped at `upper`. That saves
    the projection's own quantizing kernel, one launch and one read of the activations."""

    upper: float | None

    @classmethod
    def feeding(cls, layer: nn.Module) -> RowQuantizer | None:
        """The quantizer for `layer`'s input, or None where `layer` takes its input unquantized."""
        if isinstance(layer, Fp8Linear) and layer.activations == "token":
            return cls(layer.activation_upper)
        return None

    def __call__(self, x: torch.Tensor) -> Fp8Rows:
        """`x` [M, K] quantized: for the kernels that cannot quantize what they write (and on CPU)."""
        return Fp8Rows(*(fp8.quantize if x.is_cuda else fp8.plain_quantize)(x, None, self.upper))


def blas_matmul(
    q: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """bf16 [M, N] = (q [M, K] e4m3 * scales [M, 1]) @ (weight [N, K] e4m3 * weight_scale [N, 1]).T + bias, by
    `torch._scaled_mm` over the rows of q's buffer up to a multiple of `fp8.BUFFER_ROWS` where it has them (the
    quantizing kernels allocate so), the extra rows' results dropped. On an H100 (docs/benchmarks.md,
    Llama-3.1-70B's four projections of a layer, microseconds a call from a graph) the GEMM took 608 at 160 rows and
    504 at 224 against 441 at 256, 886 at 288 against 625 at 384; Llama-3.1-8B's 174 at 144 rows against 132 at
    256."""
    rows = q.shape[0]
    whole_q, whole_scales = fp8.padded_rows(q), fp8.padded_rows(scales)
    if whole_q is not None and whole_scales is not None:
        q, scales = whole_q, whole_scales
    out = torch._scaled_mm(
        q, weight.t(), scale_a=scales, scale_b=weight_scale.view(1, -1), bias=bias, out_dtype=torch.bfloat16
    )
    return out[:rows]


class Fp8Linear(nn.Module):
    # The loader materialises parameters in the model's dtype except these modules', whose dtypes are their own.
    keeps_dtypes = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        activations: str,
        block: tuple[int, int] | None = None,
        activation_upper: float | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activations, self.block, self.activation_upper = activations, block, activation_upper
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        scale_shape = (
            (out_features, 1) if block is None else (-(-out_features // block[0]), -(-in_features // block[1]))
        )
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.input_scale = (
            nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False) if activations == "static" else None
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.out_dtype = dtype
        # engine.deterministic: every row computed alike whatever the batch (the Triton matmul's fixed tiles on a
        # GPU, not cuBLASLt's kernels chosen by row count; `batch_invariant.matmul` on CPU)
        self.batch_invariant = False

    @property
    def weight_block(self) -> tuple[int, int]:
        """The weight's scale block (rows, columns): one row and all of K for per-row scales."""
        return self.block or (1, self.in_features)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """The projection of `x`, or of activations its producer quantized for it (`RowQuantizer`)."""
        shape = x.shape
        if isinstance(x, Fp8Rows):
            q, scales = x.q, x.scales
        else:
            q, scales = self.quantize_input(x.reshape(-1, self.in_features))
        per_row = self.block is None and not self.batch_invariant  # the batch-invariant path is the Triton matmul
        if not q.is_cuda:
            out = self._plain(q, scales)
        elif per_row and fp8_few_rows.suits(q.shape[0], q.shape[1], scales):
            out = fp8_few_rows.matmul(q, scales, self.weight, self.weight_scale, self.bias, self.out_dtype)
        elif per_row and self.out_dtype == torch.bfloat16:
            out = blas_matmul(q, scales, self.weight, self.weight_scale, self.bias)
        else:
            out = fp8.scaled_matmul(
                q, scales, self.weight, self.weight_scale, self.weight_block, self.out_dtype, self.bias
            )
        return out.view(*shape[:-1], self.out_features)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x in e4m3 [M, K], float32 scales [M, groups]) by this layer's activation scheme."""
        if self.activations in ("token", "group"):
            group = self.block[1] if self.activations == "group" else None
            quantize = fp8.quantize if x.is_cuda else fp8.plain_quantize
            return quantize(x, group, self.activation_upper)
        if self.activations == "static":
            scale = self.input_scale
        else:  # dynamic, one scale for the whole step
            scale = (x.abs().amax().float() * INV_FP8_MAX).clamp(min=MIN_SCALE).view(1)
        q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, scale.view(1, 1).expand(x.shape[0], 1).contiguous()

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in float32, as the scales say."""
        return dequantize(self.weight, self.weight_scale, self.block)

    def _plain(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = dequantize(q, scales, (1, -(-self.in_features // scales.shape[1])))
        weight = self.dequantized_weight()
        out = batch_invariant.matmul(x, weight) if self.batch_invariant else x @ weight.t()
        if self.bias is not None:
            out += self.bias.float()
        return out.to(self.out_dtype)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear` with its weight quantized a scale per row, dynamic per-token activations (`engine.quantization=
        fp8`); built on the weight's device."""
        weight = linear.weight
        has_bias = linear.bias is not None
        with torch.device(weight.device):
            layer = cls(linear.in_features, linear.out_features, has_bias, "token", dtype=weight.dtype)
        q, scales = quantize_weight(weight)
        layer.weight.copy_(q)
        layer.weight_scale.copy_(scales)
        if has_bias:
            layer.bias.copy_(linear.bias)
        return layer


class LinearToQuantize(nn.Linear):
    """A projection that loads in the model's dtype and becomes an `Fp8Linear` once its weights are in
    (`engine.quantization=fp8` on an unquantized checkpoint)."""


def dequantize(x: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """e4m3 `x` [N, K] in float32: times its `scales`, one per `block` = (rows, columns) (None: one per row)."""
    rows, cols = block or (1, x.shape[1])
    full = scales.repeat_interleave(rows, 0)[: x.shape[0]].repeat_interleave(cols, 1)[:, : x.shape[1]]
    return x.float() * full


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [N, K], float32 scales) of a float weight: a scale per row ([N, 1]), or per block of `block`
    = (rows, columns) ([N / rows, K / columns], partial blocks at the edges)."""
    n, k = weight.shape
    rows, cols = block or (1, k)
    nb, kb = -(-n // rows), -(-k // cols)
    padded = torch.nn.functional.pad(weight.float(), (0, kb * cols - k, 0, nb * rows - n))
    blocks = padded.view(nb, rows, kb, cols)
    scales = (blocks.abs().amax((1, 3)) * INV_FP8_MAX).clamp(min=MIN_SCALE)
    q = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * rows, kb * cols)[:n, :k].contiguous(), scales
