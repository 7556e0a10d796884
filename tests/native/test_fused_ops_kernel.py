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

from batchjob.engine.native.kernels import fused_ops  # noqa: E402
from batchjob.engine.native.layers.elementwise import RMSNorm  # noqa: E402
from batchjob.engine.native.layers.rope import RopeSpec, RotaryEmbedding, apply_rotary  # noqa: E402

if not isinstance(fused_ops._rms_norm_kernel, InterpretedFunction):
    fused_ops = importlib.reload(fused_ops)  # imported compiled by another module: CPU needs interpreted


@pytest.mark.parametrize("style", [{}, {"weight_fp32": True}, {"unit_offset": True}], ids=["llama", "olmo2", "gemma"])
def test_fused_norm_with_residual_equals_the_torch_norm(style):
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    norm = RMSNorm(48, 1e-5, **style)
    norm.weight.data.normal_(generator=gen)
    want_h, want_sum = norm(x, residual.clone())

    fused_residual = residual.clone()
    got_h, got_sum = fused_ops.rms_norm(x, norm.weight, 1e-5, fused_residual, norm.weight_fp32, norm.offset)

    torch.testing.assert_close(got_sum, want_sum)
    torch.testing.assert_close(fused_residual, want_sum)  # the sum is written back in place
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 4])
def test_fused_norm_adds_up_split_k_partial_sums_as_the_matmul_would(splits):
    # A bf16 matmul's float32 partial sums over slices of K: the norm adds them up, rounds the total to bf16
    # (as the plain matmul's output is rounded), then adds the residual. Small integers keep every sum exact in
    # bf16: the interpreter rounds float32 to bf16 its own way, and the GPU test checks the rounding.
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (6, 32), generator=gen).bfloat16()
    weight = torch.randint(-2, 3, (48, 32), generator=gen).bfloat16()
    residual = torch.randint(-8, 9, (6, 48), generator=gen).bfloat16()
    norm = RMSNorm(48, 1e-5).bfloat16()
    norm.weight.data.normal_(generator=gen)
    parts = torch.stack([x[:, s::splits].float() @ weight[:, s::splits].float().T for s in range(splits)])
    want_h, want_sum = norm(x @ weight.T, residual.clone())

    fused_residual = residual.clone()
    got_h, got_sum = fused_ops.rms_norm(parts, norm.weight, 1e-5, fused_residual)

    assert got_h.dtype == torch.bfloat16
    torch.testing.assert_close(got_sum, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(fused_residual, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(got_h, want_h, atol=2**-6, rtol=2**-7)
    # The CPU path of the norm takes the same partial sums.
    cpu_h, cpu_sum = norm(parts, residual.clone())
    torch.testing.assert_close(cpu_sum, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(cpu_h, want_h, atol=0, rtol=0)


def test_fused_rotary_turns_only_the_leading_channels_of_each_head():
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), rotary_dim=12, max_positions=64)
    positions = torch.tensor([0, 5, 63])
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(1))
    cos, sin = rotary(positions)
    want = torch.cat((apply_rotary(x[..., :12], cos, sin), x[..., 12:]), dim=-1)

    got = x.clone()
    fused_ops.rotary_(got[..., :12], positions, rotary.cos_sin)

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("style", [{}, {"unit_offset": True}], ids=["qwen3", "gemma"])
def test_fused_head_norms_and_rotary_on_q_and_k_equal_the_torch_path(style):
    # q and k as the decoder has them: strided views into one fused qkv projection, 4 query and 2 key heads.
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3
    positions = torch.tensor([0, 1, 7, 30, 63])
    rotary = RotaryEmbedding(RopeSpec(theta=500000.0), rotary_dim=dim, max_positions=64)
    q_norm, k_norm = RMSNorm(dim, 1e-6, **style), RMSNorm(dim, 1e-6, **style)
    q_norm.weight.data.normal_(generator=gen)
    k_norm.weight.data.normal_(generator=gen)

    def views(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = flat.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)

    cos, sin = rotary(positions)
    q, k, _ = views(qkv)
    want_q, want_k = apply_rotary(q_norm(q), cos, sin), apply_rotary(k_norm(k), cos, sin)

    fused = qkv.clone()
    got_q, got_k, got_v = views(fused)
    norms = (q_norm.weight, k_norm.weight, 1e-6, q_norm.weight_fp32, q_norm.offset)
    fused_ops.rotary_qk_(got_q, got_k, positions, rotary.cos_sin, norms)

    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_v, views(qkv)[2])  # v, beside them in the same rows, untouched


def test_one_rotary_call_turns_q_and_k_of_different_head_counts():
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), rotary_dim=12, max_positions=64)
    positions = torch.tensor([3, 9])
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 6, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    cos, sin = rotary(positions)

    got_q, got_k = q.clone(), k.clone()
    fused_ops.rotary_qk_(got_q[..., :12], got_k[..., :12], positions, rotary.cos_sin)

    for got, x in ((got_q, q), (got_k, k)):
        want = torch.cat((apply_rotary(x[..., :12], cos, sin), x[..., 12:]), dim=-1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_norms", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_rotary_kernel_stores_rotated_keys_and_values_where_store_kv_would(with_norms, block_size):
    # The decoder's views of one qkv row (6 query, 2 key heads), slots in shuffled blocks, one slot -1 (no entry).
    gen = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, dim = 6, 6, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([0, 3, 4, 17, 40, 63])
    slots = torch.tensor([5, 2 * block_size + 1, -1, 3 * block_size - 1, 0, block_size + 2])
    rotary = RotaryEmbedding(RopeSpec(theta=500000.0), rotary_dim=dim, max_positions=64)
    norms = None
    if with_norms:
        q_norm, k_norm = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
        q_norm.weight.data.normal_(generator=gen)
        k_norm.weight.data.normal_(generator=gen)
        norms = (q_norm.weight, k_norm.weight, 1e-6, False, 0.0)

    def views(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = flat.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        k_cache = torch.full((2, 4, block_size, kv_heads, dim), float("nan"))  # both halves of one tensor
        return k_cache[0], k_cache[1]

    want_flat = qkv.clone()
    want_q, want_k, want_v = views(want_flat)
    fused_ops.rotary_qk_(want_q, want_k, positions, rotary.cos_sin, norms)
    want_kc, want_vc = caches()
    keep = slots >= 0
    want_kc.view(-1, kv_heads, dim)[slots[keep]] = want_k[keep]
    want_vc.view(-1, kv_heads, dim)[slots[keep]] = want_v[keep]

    got_flat = qkv.clone()
    got_q, got_k, got_v = views(got_flat)
    got_kc, got_vc = caches()
    fused_ops.rotary_qk_(got_q, got_k, positions, rotary.cos_sin, norms, (got_v, got_kc, got_vc, slots))

    assert torch.equal(got_flat, want_flat)  # q and k rotated in place as without the store, v untouched
    torch.testing.assert_close(got_kc, want_kc, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(got_vc, want_vc, equal_nan=True, atol=0, rtol=0)


def test_rope_step_stores_only_when_it_turns_whole_heads():
    # Phi-4-mini's partial rotary leaves channels the kernel never sees: the attention then stores k and v itself.
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), rotary_dim=12, max_positions=64)
    step = rotary.prepare(torch.tensor([1, 2]))
    step.cos = step.sin = None  # the CUDA path's step (tables gathered in the kernel)
    q, k, v = torch.randn(2, 2, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    k_cache, v_cache = torch.zeros(2, 4, 4, 1, 16)
    _, _, stored = step.apply(q, k, None, (v, k_cache, v_cache, torch.tensor([0, 1])))
    assert not stored and not k_cache.any() and not v_cache.any()
