"""The compiled fused MoE kernel at Qwen3-30B-A3B's expert shape (128 experts, 8 active, hidden 2048,
intermediate 768): bf16 within bf16 rounding and fp32 tight against a float64 reference for decode- and
prefill-sized batches, a captured CUDA graph that replays with new routing, and the decode step's time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Importing the kernels here, uninterpreted, would leave them unusable for the CPU interpreter tests.
    pytest.skip("needs CUDA", allow_module_level=True)

from batchjob.engine.native.kernels.fused_moe import fused_moe  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
E, K, H, INTER = 128, 8, 2048, 768
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def experts():
    gen = torch.Generator(DEVICE).manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device=DEVICE, generator=gen) / H**0.5
    w2 = torch.randn(E, H, INTER, device=DEVICE, generator=gen) / INTER**0.5
    return w13, w2


def routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing of random router logits, renormalised (Qwen3-MoE's norm_topk_prob)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    logits = torch.randn(num_tokens, E, device=DEVICE, generator=gen)
    weights, ids = logits.softmax(dim=-1).topk(K, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def reference(hidden, w13, w2, weights, ids) -> torch.Tensor:
    """float64, one expert at a time over the tokens routed to it."""
    x = hidden.double()
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, choice = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[token] @ w13[e].double().T).chunk(2, dim=-1)
        down = (torch.nn.functional.silu(gate) * up) @ w2[e].double().T
        out.index_add_(0, token, down * weights[token, choice].double()[:, None])
    return out


@pytest.mark.parametrize("num_tokens", [1, 64, 512, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_moe_equals_the_float64_reference(experts, num_tokens, dtype):
    w13, w2 = (w.to(dtype) for w in experts)
    hidden = torch.randn(num_tokens, H, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1)).to(dtype)
    weights, ids = routing(num_tokens, seed=num_tokens)
    got = fused_moe(hidden, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == hidden.shape
    # bf16: the inputs are the same bf16 values; the gate, up, SiLU, partial outputs and sum are rounded to it.
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.double(), reference(hidden, w13, w2, weights, ids), **tol)


def test_captured_graph_replays_with_new_routing(experts):
    w13, w2 = (w.to(torch.bfloat16) for w in experts)
    num_tokens = 64
    hidden = torch.randn(num_tokens, H, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, seed=0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_moe(hidden, w13, w2, weights, ids)  # compile outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fused_moe(hidden, w13, w2, weights, ids)
    for seed in (1, 2, 3):
        new_weights, new_ids = routing(num_tokens, seed)
        # Seed 3 sends every token to the same 8 experts: one expert's run spans several blocks.
        if seed == 3:
            new_ids = torch.arange(K, device=DEVICE).repeat(num_tokens, 1)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        hidden.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = reference(hidden, w13, w2, weights, ids)
        torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_decode_batch_time_and_weight_bandwidth(experts, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from bench_lib.hardware import graph_ms

    w13, w2 = (w.to(torch.bfloat16) for w in experts)
    num_tokens = 256
    hidden = torch.randn(num_tokens, H, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, seed=0)
    ms = graph_ms(lambda: fused_moe(hidden, w13, w2, weights, ids), reps=50)
    touched = ids.unique().numel()
    weight_bytes = touched * (w13[0].numel() + w2[0].numel()) * w13.element_size()
    print(
        f"\nfused MoE, {num_tokens} tokens x top-{K} of {E} experts (H={H}, I={INTER}), bf16: {ms:.3f} ms, "
        f"{touched} experts' weights ({weight_bytes / 1e9:.2f} GB) at {weight_bytes / ms / 1e6:.0f} GB/s"
    )
    assert ms > 0


def test_alignment_equals_the_torch_stable_sort(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from bench_lib.moe_timing import torch_alignment

    from batchjob.engine.native.kernels.moe_align import moe_align_block_size

    for num_tokens, block_m in [(1, 16), (256, 16), (256, 32), (3000, 64), (8192, 128)]:
        _, ids = routing(num_tokens, seed=num_tokens)
        ours, theirs = moe_align_block_size(ids, E, block_m), torch_alignment(ids, E, block_m)
        end = int(theirs[2])
        assert int(ours[2]) == end
        assert torch.equal(ours[0][:end], theirs[0][:end])
        assert torch.equal(ours[1][: end // block_m], theirs[1][: end // block_m])


def test_every_tuned_config_for_this_gpu_computes_the_reference(experts):
    from batchjob.engine.native.kernels.moe_configs import device_name, package_table, shape_key

    key = shape_key(E, INTER, H, K, torch.bfloat16)
    tuned = package_table().entries.get(device_name(DEVICE), {}).get(key, {})
    if not tuned:
        pytest.skip(f"no tuned configs for {key} on {device_name(DEVICE)}")
    w13, w2 = (w.to(torch.bfloat16) for w in experts)
    for num_tokens, config in sorted(tuned.items()):
        hidden = torch.randn(num_tokens, H, device=DEVICE, dtype=torch.bfloat16)
        weights, ids = routing(num_tokens, seed=num_tokens)
        got = fused_moe(hidden, w13, w2, weights, ids, config=config)
        torch.testing.assert_close(got.double(), reference(hidden, w13, w2, weights, ids), rtol=2e-2, atol=2e-2)
