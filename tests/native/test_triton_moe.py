"""The fused MoE kernel computes what a float64 per-expert loop says, on CPU through the Triton interpreter:
one token, an odd count and more tokens than a block, with experts that get no token and tokens that pick the
same expert twice; and the expert alignment it rests on."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_moe_gpu.py runs these checks compiled", allow_module_level=True)

# Kernels are built as interpreted or compiled when their module is imported, so this must come first.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from batchjob.engine.native import triton_moe  # noqa: E402

if not isinstance(triton_moe._grouped_gemm_kernel, InterpretedFunction):
    triton_moe = importlib.reload(triton_moe)  # imported compiled by another module: CPU needs interpreted

E, K, H, INTER = 8, 2, 64, 32


def reference_moe(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """float64, one token and one choice at a time."""
    x, w13, w2 = hidden.double(), w13.double(), w2.double()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = w13[e] @ x[t]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, k]) * (w2[e] @ act)
    return out


def routing(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts drawn from 0..E-3 only (the last two get no token); every third token picks one expert twice."""
    ids = torch.randint(0, E - 2, (num_tokens, K), generator=gen)
    ids[::3, 1] = ids[::3, 0]
    weights = torch.rand(num_tokens, K, generator=gen)
    return weights / weights.sum(dim=1, keepdim=True), ids


def random_moe(num_tokens: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=gen) / INTER**0.5).to(dtype)
    return (hidden, w13, w2, *routing(num_tokens, gen))


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_fused_moe_equals_the_float64_reference(num_tokens):
    args = random_moe(num_tokens)
    got = triton_moe.fused_moe(*args)
    assert got.shape == args[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference_moe(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [triton_moe._MEDIUM, triton_moe._PREFILL], ids=["medium", "prefill"])
def test_every_tile_config_gives_the_same_result(config):
    # Tiles wider than the expert (64-row blocks of 3-row experts, 128 columns of 32) exercise the masks.
    args = random_moe(33)
    got = triton_moe.fused_moe(*args, config=config)
    torch.testing.assert_close(got.double(), reference_moe(*args), rtol=1e-5, atol=1e-5)


def test_half_precision_gives_outputs_in_its_dtype_within_its_rounding():
    # bf16 is checked on the GPU only: the interpreter's tl.dot multiplies bf16 bit patterns as integers.
    args = random_moe(5, torch.float16)
    got = triton_moe.fused_moe(*args)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), reference_moe(*args), rtol=1e-2, atol=1e-2)


def test_alignment_groups_pairs_by_expert_in_whole_blocks():
    gen = torch.Generator().manual_seed(0)
    _, ids = routing(33, gen)
    block_m = 16
    sorted_pairs, block_experts, padded_rows = triton_moe.moe_align_block_size(ids, E, block_m)
    pairs = ids.numel()
    counts = torch.bincount(ids.flatten(), minlength=E)
    end = int(padded_rows)
    assert end == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_pairs.numel() >= end and sorted_pairs.numel() % block_m == 0
    # Every pair exactly once, only padding after the used blocks, each block one expert's.
    real = sorted_pairs[sorted_pairs < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    assert (sorted_pairs[end:] == pairs).all()
    for block in range(end // block_m):
        rows = sorted_pairs[block * block_m : (block + 1) * block_m]
        rows = rows[rows < pairs].long()
        assert len(rows) > 0 and (ids.flatten()[rows] == block_experts[block]).all()
        assert rows.tolist() == sorted(rows.tolist())
