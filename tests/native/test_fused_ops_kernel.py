"""The fused norm and rotary kernels (CUDA path) in the styles the families need, against the torch path,
checked on CPU through the Triton interpreter: OLMo 2's and Gemma's norm rounding, Gemma's `1 + weight`, and
partial rotary dimensions whose half is no power of two (Phi-4-mini: 96 of 128)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_native_gpu.py checks the compiled kernels", allow_module_level=True)

os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from batchjob.engine.native import triton_ops  # noqa: E402
from batchjob.engine.native.layers import RMSNorm  # noqa: E402
from batchjob.engine.native.rope import RopeSpec, RotaryEmbedding, apply_rotary  # noqa: E402

if not isinstance(triton_ops._rms_norm_kernel, InterpretedFunction):
    triton_ops = importlib.reload(triton_ops)  # imported compiled by another module: CPU needs interpreted


@pytest.mark.parametrize("style", [{}, {"weight_fp32": True}, {"unit_offset": True}], ids=["llama", "olmo2", "gemma"])
def test_fused_norm_with_residual_equals_the_torch_norm(style):
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    norm = RMSNorm(48, 1e-5, **style)
    norm.weight.data.normal_(generator=gen)
    want_h, want_sum = norm(x, residual.clone())

    fused_residual = residual.clone()
    got_h, got_sum = triton_ops.rms_norm(x, norm.weight, 1e-5, fused_residual, norm.weight_fp32, norm.offset)

    torch.testing.assert_close(got_sum, want_sum)
    torch.testing.assert_close(fused_residual, want_sum)  # the sum is written back in place
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)


def test_fused_rotary_turns_only_the_leading_channels_of_each_head():
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), rotary_dim=12, max_positions=64)
    positions = torch.tensor([0, 5, 63])
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(1))
    cos, sin = rotary(positions)
    want = torch.cat((apply_rotary(x[..., :12], cos, sin), x[..., 12:]), dim=-1)

    got = x.clone()
    triton_ops.rotary_(got[..., :12], positions, rotary.cos_sin)

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
