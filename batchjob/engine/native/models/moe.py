"""A mixture-of-experts MLP: a linear router picks each token's top-k experts from a softmax, and the token's
output is the routing-weighted sum of those experts' SwiGLU MLPs.

Expert weights are stacked the way the fused kernel (`fused_moe.fused_moe`) reads them: `gate_up_proj`
[E, 2 * I, H] (each expert's gate rows, then its up rows) and `down_proj` [E, H, I]; the loader fills them
from per-expert checkpoint tensors. On CUDA the fused Triton kernel runs (inside CUDA graphs too); the plain
torch path below loops over the experts the step hit, which asks the host which ones they are: it is the CPU
path, and on CUDA only a fallback for eager steps when the kernel module is absent.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from batchjob.engine.native.kernels import fp8
from batchjob.engine.native.kernels.fp8 import FP8
from batchjob.engine.native.layers import batch_invariant
from batchjob.engine.native.layers.batch_invariant import InvariantLinear
from batchjob.engine.native.layers.fp8_linear import dequantize
from batchjob.engine.native.models.spec import ModelSpec

if TYPE_CHECKING:
    from batchjob.engine.native.kernels.moe_configs import MoEConfig

# engine.deterministic: the token count whose fused-kernel tiles every step uses.
INVARIANT_MOE_TOKENS = 256
FUSED_MOE_MODULE = "batchjob.engine.native.kernels.fused_moe"


@functools.cache
def fused_moe_kernel() -> Callable | None:
    """`fused_moe.fused_moe`, or None where that module is not part of this installation. An error inside
    the module is not hidden: only its absence selects the torch path."""
    try:
        return importlib.import_module(FUSED_MOE_MODULE).fused_moe
    except ModuleNotFoundError as err:
        if err.name != FUSED_MOE_MODULE:
            raise
        return None


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.batch_invariant = False  # engine.deterministic (layers/batch_invariant.py)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H], weights float32 [T, K], ids int64 [T, K]."""
        if x.is_cuda:
            kernel = fused_moe_kernel()
            if kernel is not None:
                config = self._fixed_config(x, expert_ids.shape[1])
                return kernel(x, self.gate_up_proj, self.down_proj, weights, expert_ids, config=config)
        return self._torch_forward(x, weights, expert_ids)

    def _torch_forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # Experts in ascending order, each adding its tokens' weighted outputs: transformers' order of additions.
        for expert in expert_ids.unique().tolist():
            tokens, slot = torch.where(expert_ids == expert)
            gate, up = self._linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            hidden = self._linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, (hidden * weights[tokens, slot, None]).to(out.dtype))
        return out

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return batch_invariant.matmul(x, weight) if self.batch_invariant else F.linear(x, weight)

    def _fixed_config(self, x: torch.Tensor, top_k: int) -> MoEConfig | None:
        """engine.deterministic: the fused kernel's tiles for a fixed token count, not this step's (a token's
        products then do not depend on how many others the step holds); None: the step's own."""
        if not self.batch_invariant:
            return None
        from batchjob.engine.native.kernels.moe_configs import moe_config

        experts, two_i, hidden = self.gate_up_proj.shape
        return moe_config(INVARIANT_MOE_TOKENS, experts, two_i // 2, hidden, top_k, x.dtype, x.device)


class Fp8Experts(Experts):
    """Experts with e4m3 weights (`gate_up_proj`, `down_proj`) and float32 scales (`gate_up_proj_scale`,
    `down_proj_scale`: [E, rows, 1] per row, or per block of `block` = (rows, columns)); each projection's input is
    quantized per token, or per token and group of `block[1]` channels (`group`). On CUDA the fused kernel runs
    them in FP8; on CPU the same arithmetic runs in float32 on the dequantized operands."""

    keeps_dtypes = True  # see Fp8Linear

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        block: tuple[int, int] | None,
        group: bool,
        activation_upper: float | None,
    ) -> None:
        nn.Module.__init__(self)
        self.batch_invariant = False
        self.block, self.group, self.activation_upper = block, block[1] if group else None, activation_upper
        for name, rows, cols in (("gate_up_proj", 2 * intermediate_size, hidden_size),
                                 ("down_proj", hidden_size, intermediate_size)):  # fmt: skip
            scales = (rows, 1) if block is None else (-(-rows // block[0]), -(-cols // block[1]))
            weight = nn.Parameter(torch.empty(num_experts, rows, cols, dtype=FP8), requires_grad=False)
            setattr(self, name, weight)
            setattr(self, name + "_scale", nn.Parameter(torch.empty(num_experts, *scales), requires_grad=False))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and fused_moe_kernel() is not None:
            from batchjob.engine.native.kernels.fused_moe import Fp8ExpertWeights

            scheme = Fp8ExpertWeights(
                self.gate_up_proj_scale, self.down_proj_scale, self.block, self.group, self.activation_upper
            )
            return fused_moe_kernel()(
                x, self.gate_up_proj, self.down_proj, weights, expert_ids, fp8_experts=scheme,
                config=self._fixed_config(x, expert_ids.shape[1]),
            )  # fmt: skip
        return self._torch_forward(x, weights, expert_ids)

    def _torch_forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        inputs = self._quantized(x)
        for expert in expert_ids.unique().tolist():
            tokens, slot = torch.where(expert_ids == expert)
            w13 = dequantize(self.gate_up_proj[expert], self.gate_up_proj_scale[expert], self.block)
            gate, up = self._linear(inputs[tokens], w13).to(x.dtype).chunk(2, dim=-1)
            w2 = dequantize(self.down_proj[expert], self.down_proj_scale[expert], self.block)
            hidden = self._linear(self._quantized(F.silu(gate) * up), w2)
            out.index_add_(0, tokens, (hidden * weights[tokens, slot, None]).to(out.dtype))
        return out

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        """x quantized as the kernel quantizes a GEMM's input, back in float32."""
        q, scales = fp8.plain_quantize(x, self.group, self.activation_upper)
        return dequantize(q, scales, (1, self.group or x.shape[1]))


class SparseMoE(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int = 0) -> None:
        super().__init__()
        moe = spec.moe
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        router = InvariantLinear if spec.batch_invariant else nn.Linear
        self.gate = router(spec.hidden_size, moe.num_experts, bias=False)
        shape = (moe.num_experts, spec.hidden_size, moe.intermediate_size)
        q = spec.quantization
        if spec.quantized(f"model.layers.{layer}.mlp.experts.0.gate_proj"):
            self.experts = Fp8Experts(*shape, q.block, q.activations == "group", q.activation_scale_ub)
        else:
            self.experts = Experts(*shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, weights, expert_ids)
