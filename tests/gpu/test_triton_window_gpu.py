"""Sliding windows and soft-capping in the compiled Triton attention kernels: bf16 and fp32 against a float64
reference at real sizes, and a windowed decode at long context costing what its window reads, not its length.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu -q -s   (-s shows the measured decode times)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Importing the kernels here, uninterpreted, would leave them unusable for the CPU interpreter tests.
    pytest.skip("needs CUDA", allow_module_level=True)

from attention_cases import forget_outside_windows, random_paged_step, reference_attention  # noqa: E402

from batchjob.engine.native.layers.attention import make_metadata  # noqa: E402
from batchjob.engine.native.layers.triton_attention import TritonPagedAttention  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)
GEMMA_LIKE = dict(num_heads=8, num_kv_heads=4, head_dim=256)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("window", "softcap", "shape"),
    [(1, 0.0, LLAMA_8B), (300, 0.0, LLAMA_8B), (4096, 0.0, LLAMA_8B), (0, 5.0, GEMMA_LIKE), (512, 5.0, GEMMA_LIKE)],
)
def test_sliding_window_and_soft_cap_match_reference(dtype, window, softcap, shape):
    # Prompts longer than the window, a chunk crossing its edge, decodes far past it and one inside it;
    # everything out of every window is NaN, as it may be once its blocks are freed.
    mixed = random_paged_step(
        [1, 1, 37, 513, 1000, 1, 250], [1, 777, 37, 1300, 1000, 2049, 251], 16, dtype=dtype, device=DEVICE, **shape
    )
    decode = random_paged_step([1] * 6, [1, 300, 301, 1025, 5000, 333], 16, dtype=dtype, device=DEVICE, seed=1, **shape)
    # A scale of 1/4 puts raw scores at about +-4 (head_dim 256), so a cap of 5 bends them.
    scale = 0.25 if softcap else shape["head_dim"] ** -0.5
    for q, k, v, k_cache, v_cache, meta in (mixed, decode):
        forget_outside_windows(k_cache, v_cache, meta, window)
        out = TritonPagedAttention().forward(q, k, v, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
        expected = reference_attention(q, k, v, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
        else:
            assert relative_error(out, expected) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_seqs", [40, 80], ids=["table read ahead", "default tiles"])
def test_head_dim_256_decode_in_one_split_matches_reference(dtype, num_seqs):
    # 160 or 320 programs of 4 KV heads: one split, below and above two programs a multiprocessor, with the
    # largest tiles' shared memory (head_dim 256) and soft-capping on, as a Gemma layer without a window.
    assert TritonPagedAttention().decode_splits(num_seqs, 4, DEVICE) == 1
    lens = [1 + (97 * i) % 1500 for i in range(num_seqs)]
    q, k, v, k_cache, v_cache, meta = random_paged_step(
        [1] * num_seqs, lens, 16, dtype=dtype, device=DEVICE, seed=2, **GEMMA_LIKE
    )
    out = TritonPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.25, softcap=5.0)
    expected = reference_attention(q, k, v, k_cache, v_cache, meta, 0.25, softcap=5.0)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    else:
        assert relative_error(out, expected) < 1e-2


@pytest.fixture
def graph_ms(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from bench_lib.hardware import graph_ms

    return graph_ms


def test_windowed_decode_at_8k_context_costs_its_window_not_its_length(graph_ms):
    # 32 sequences of 8,192 tokens at the Llama-8B head layout: full attention reads 1.07 GB of KV per step, a
    # 1,024-token window an eighth of it. The splits cover only the in-window tiles, so the time follows.
    num_seqs, context, window, block_size = 32, 8192, 1024, 16
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq + 1
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, 8, 128, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, 8, 128, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
    tables = order.view(num_seqs, blocks_per_seq).tolist()
    meta = make_metadata([1] * num_seqs, [context] * num_seqs, tables, block_size, device=DEVICE)
    q = torch.randn(num_seqs, 32, 128, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    k = torch.randn(num_seqs, 8, 128, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    v = torch.randn(num_seqs, 8, 128, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    backend, scale = TritonPagedAttention(), 128**-0.5

    full_ms = graph_ms(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale))
    window_ms = graph_ms(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale, window=window))
    kv_gb = 2 * num_seqs * context * 8 * 128 * 2 / 1e9
    print(
        f"\ndecode, {num_seqs} x {context} tokens, bf16: full attention {full_ms * 1e3:.1f} us "
        f"({kv_gb / full_ms:.2f} TB/s), window {window} {window_ms * 1e3:.1f} us, {full_ms / window_ms:.1f}x faster"
    )

    # An eighth of the bytes; launch and reduce costs are fixed, so ask for half of the ideal 8x.
    assert full_ms > 4 * window_ms
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window=window)
    expected = reference_attention(q, k, v, k_cache, v_cache, meta, scale, window=window)
    assert relative_error(out, expected) < 1e-2
