"""Split-K o/down projections whose float32 partial sums the next fused residual add + RMSNorm adds up
(split_k.py): the partial products read the weight in place, the norm adds them and rounds exactly as a plain
matmul's output is rounded, and a bf16 model that splits gives the logits of one that does not, within the
difference of summation order."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from batchjob.engine.native.kernels import fused_ops  # noqa: E402
from batchjob.engine.native.layers import split_k  # noqa: E402
from batchjob.job.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


@pytest.mark.parametrize("splits", [2, 4, 7])
def test_partial_products_are_the_matmul_split_along_k_read_in_place(splits):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(32, 14336, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(4096, 14336, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.01
    split_k.partial_products(x, weight, splits)  # the first call allocates cuBLAS's workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    parts = split_k.partial_products(x, weight, splits)
    torch.cuda.synchronize()
    # Only the output was allocated (a copy of the weight's strided slices would be 117 MB).
    assert torch.cuda.max_memory_allocated() - before <= parts.numel() * 4
    assert parts.shape == (splits, 32, 4096) and parts.dtype == torch.float32
    part = 14336 // splits
    for s in (0, splits - 1):
        want = x[:, s * part : (s + 1) * part].float() @ weight[:, s * part : (s + 1) * part].float().T
        torch.testing.assert_close(parts[s], want, atol=1e-3, rtol=1e-3)


def test_the_norm_adds_the_partial_sums_and_rounds_them_as_the_plain_matmul_is_rounded():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    parts = torch.randn(2, 48, 4096, device=DEVICE, generator=gen) * 4
    residual = torch.randn(48, 4096, device=DEVICE, generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(4096, device=DEVICE, generator=gen)).bfloat16()
    total = ((parts[0] + parts[1]).bfloat16().float() + residual.float()).bfloat16()
    h = total.float() * torch.rsqrt(total.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    want_h = weight * h.bfloat16()

    fused_residual = residual.clone()
    got_h, got_sum = fused_ops.rms_norm(parts, weight, 1e-5, fused_residual)

    torch.testing.assert_close(got_sum, total, atol=0, rtol=0)
    torch.testing.assert_close(fused_residual, total, atol=0, rtol=0)
    torch.testing.assert_close(got_h, want_h, atol=1e-2, rtol=1e-2)


def test_a_bf16_model_with_split_projections_gives_the_logits_of_one_without(tmp_path, monkeypatch):
    from batchjob.engine.native.layers.attention import make_metadata
    from batchjob.engine.native.layers.triton_attention import TritonPagedAttention
    from batchjob.engine.native.loading.model_loader import load_model
    from batchjob.engine.native.runtime.kv_cache import allocate_kv_cache

    model_dir = make_tiny_model(
        tmp_path / "mid", hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2
    )
    model, spec = load_model(model_dir, "bfloat16", "cuda", TritonPagedAttention())
    assert all(layer.self_attn.fused_add and layer.mlp.fused_add for layer in model.layers)
    calls = []
    products = split_k.partial_products
    monkeypatch.setattr(split_k, "partial_products", lambda *a: calls.append(a[2]) or products(*a))
    n = 48
    prompt = torch.randint(6, 500, (n,), generator=torch.Generator().manual_seed(0)).cuda()

    def logits(splits: dict) -> torch.Tensor:
        monkeypatch.setattr(split_k, "SPLITS", splits)
        caches = allocate_kv_cache(spec, 16, 16, DEVICE)
        meta = make_metadata([n], [n], [list(range(1, 5))], 16, device="cuda")
        with torch.no_grad():
            return model.compute_logits(model(prompt, torch.arange(n, device=DEVICE), meta, caches)).double()

    plain = logits({})
    assert calls == []
    split = logits({(512, 512): (2, range(1, 65)), (512, 1024): (4, range(1, 65))})
    assert calls == [2, 4] * spec.num_layers
    assert ((split - plain).norm() / plain.norm()).item() < 1e-2
    assert (split.argmax(-1) == plain.argmax(-1)).float().mean().item() > 0.9
