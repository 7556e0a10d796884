"""The fused exponential-noise kernel (CUDA path of the sampler) gives the torch path's bits, checked on CPU
through the Triton interpreter: same hash, same uniforms, the same Exp(1) values to float32 rounding."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_native_gpu.py checks the compiled kernel", allow_module_level=True)

os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from batchjob.engine.native import triton_ops  # noqa: E402
from batchjob.engine.native.sampler import noise_keys, torch_exponential_noise  # noqa: E402

if not isinstance(triton_ops._exponential_noise_kernel, InterpretedFunction):
    triton_ops = importlib.reload(triton_ops)  # imported compiled by another module: CPU needs interpreted


def test_fused_noise_equals_the_torch_noise_up_to_log_rounding():
    # Seeds over the whole int64 range (negative ones too) and large positions exercise every hash input bit;
    # 2,500 columns cover a partial last block.
    seeds = torch.tensor([0, 1, 2**63 - 1, -(2**63), -12345, 2**40 + 7], dtype=torch.int64)
    positions = torch.tensor([0, 1, 7, 4095, 10**6, 3], dtype=torch.int64)
    keys = noise_keys(seeds, positions)
    assert int(keys.min()) >= 0 and int(keys.max()) < 2**32
    want = torch_exponential_noise(keys, 2500)
    got = triton_ops.exponential_noise(keys, 2500)
    assert got.shape == want.shape and got.dtype == torch.float32
    # The hash scrambles every bit, so a wrong hash or constant would put nearly every element far off; the same
    # bits leave only the log's last-place rounding (the interpreter's numpy log vs torch's: ~1e-7 relative).
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    # Exp(1): mean 1, and never 0 or inf (u is strictly inside (0, 1)).
    assert torch.isfinite(got).all() and (got > 0).all()
    assert abs(got.mean().item() - 1.0) < 0.02


def test_no_rows_gives_an_empty_tensor():
    assert triton_ops.exponential_noise(torch.zeros(0, dtype=torch.int64), 10).shape == (0, 10)
