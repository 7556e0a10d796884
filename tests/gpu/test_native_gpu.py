"""The native engine on a GPU: greedy output equals transformers' in fp32 with CUDA graphs and the async loop on
for every supported family (sliding windows, soft-capping, MoE routing through the fused kernel), async equals
sync, graph replay equals eager for every captured bucket, poisoned slots change nothing (the slot-race test),
and bf16 logits of every family agree with transformers' within bf16 tolerance.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine_cases import (  # noqa: E402
    CASES,
    assert_each_request_as_alone,
    hf_greedy,
    mixed_requests,
    open_ended,
    per_request_settings,
    with_stops,
)
from transformers import AutoModelForCausalLM  # noqa: E402

from batchjob.engine import Request, SamplingParams, create_engine  # noqa: E402
from batchjob.engine.native.runtime.step_layout import decode_buckets  # noqa: E402
from batchjob.job.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu


def _run(model_dir, requests, engine="native", **options) -> dict:
    # 64 sequences keep the number of captured graphs (and the suite's time) small.
    eng = create_engine(engine, str(model_dir), {"dtype": "float32", "max_num_seqs": 64, **options})
    try:
        return {c.id: c.token_ids for c in eng.generate(requests)}
    finally:
        eng.close()


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp("m") / request.param, arch=arch, **overrides)
    base = mixed_requests(80, seed=3, max_prompt=64, max_new=32)
    reqs, expected = with_stops(base, hf_greedy(model_dir, base, device="cuda"))
    return model_dir, reqs, expected


@pytest.mark.parametrize(
    "engine,options",
    [
        ("native", {}),
        ("native_sync", {}),
        ("native", {"cuda_graphs": False}),
        ("native", {"debug_poison_slots": True}),
        ("native", {"num_kv_blocks": 40, "block_size": 4, "max_model_len": 100, "max_num_batched_tokens": 32}),
    ],
    ids=["async+graphs", "sync+graphs", "async eager", "poisoned slots", "preemption+chunks"],
)
def test_greedy_equals_transformers_fp32(case, engine, options, monkeypatch):
    model_dir, reqs, expected = case
    if "num_kv_blocks" in options:
        open_ended(monkeypatch)  # rows the scheduler cannot see the ends of: the small cache preempts
    assert _run(model_dir, reqs, engine, **options) == expected


def test_graph_replay_equals_eager_for_every_bucket_greedy_and_sampling(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    max_seqs = 40
    # One engine each, reused for every bucket (a generate() leaves no state behind); a fixed KV size lets
    # both live on one GPU.
    options = {"dtype": "float32", "max_num_seqs": max_seqs, "num_kv_blocks": 512}
    graphed_engine = create_engine("native", str(model_dir), options)
    eager_engine = create_engine("native", str(model_dir), {**options, "cuda_graphs": False})
    try:
        assert graphed_engine.stats()["graph_modes"] == 3, graphed_engine.runner.graphs.errors
        for bucket in decode_buckets(max_seqs):
            # greedy, temperature only, and filtering: each graph mode against the eager step of the same mode
            for temperature, top_p in ((0.0, 1.0), (0.8, 1.0), (0.8, 0.95)):
                params = SamplingParams(
                    max_new_tokens=6, ignore_eos=True, temperature=temperature, top_p=top_p, seed=11
                )
                reqs = [Request(i, (10 + i, 20, 30 + i), params) for i in range(bucket)]
                graphed = {c.id: c.token_ids for c in graphed_engine.generate(reqs)}
                eager = {c.id: c.token_ids for c in eager_engine.generate(reqs)}
                assert graphed == eager, f"bucket {bucket}, temperature {temperature}, top_p {top_p}"
    finally:
        graphed_engine.close()
        eager_engine.close()


def test_sampled_output_is_the_same_async_and_sync(tmp_path):
    model_dir = make_tiny_model(tmp_path / "qwen3", arch="qwen3")
    reqs = [
        Request(
            i, tuple(range(5, 5 + i % 17 + 1)), SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=i)
        )
        for i in range(50)
    ]
    assert _run(model_dir, reqs, "native") == _run(model_dir, reqs, "native_sync")


# Mid-sized variants for the bf16 test: rounding differences grow with width. Phi-3's LongRoPE factors must
# cover its rotary dimension (half of 64).
MID = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
MID_OVERRIDES = {
    "phi3": dict(
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 16 for i in range(16)], "long_factor": [2.0] * 16}
    )
}


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3", "smollm3", "olmo2"])
def test_bf16_logits_match_transformers_within_bf16_tolerance(tmp_path, arch):
    from batchjob.engine.native.layers.attention import make_metadata
    from batchjob.engine.native.layers.triton_attention import TritonPagedAttention
    from batchjob.engine.native.loading.model_loader import load_model
    from batchjob.engine.native.runtime.kv_cache import allocate_kv_cache

    model_dir = make_tiny_model(tmp_path / "mid", arch=arch, **MID, **MID_OVERRIDES.get(arch, {}))
    ours, spec = load_model(model_dir, "bfloat16", "cuda", TritonPagedAttention())
    hf = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    )
    # transformers' grouped-GEMM experts take no float64; its plain per-expert loop does.
    plain_experts = {"experts_implementation": "eager"} if arch in ("qwen3_moe", "mixtral") else {}
    ref64 = (
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float64, attn_implementation="eager", **plain_experts
        )
        .cuda()
        .eval()
    )
    # 60 tokens: past the 8-token windows, short of Phi-3's LongRoPE switch at 64.
    n = 60
    prompt = torch.randint(6, 500, (n,), generator=torch.Generator().manual_seed(0))
    caches = allocate_kv_cache(spec, 16, 16, torch.device("cuda"))
    meta = make_metadata([n], [n], [list(range(1, 5))], 16, device="cuda")
    with torch.no_grad():
        ours_logits = ours.compute_logits(ours(prompt.cuda(), torch.arange(n, device="cuda"), meta, caches)).double()
        hf_logits = hf(prompt[None].cuda()).logits[0].double()
        exact = ref64(prompt[None].cuda()).logits[0]

    def rel(x):
        return ((x - exact).norm() / exact.norm()).item()

    # Our bf16 error against the float64 truth is of the same size as transformers' own bf16 error.
    assert rel(ours_logits) < max(2 * rel(hf_logits), 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_equal_the_torch_ops_they_replace(dtype):
    from batchjob.engine.native.kernels import fused_ops
    from batchjob.engine.native.layers.elementwise import RMSNorm
    from batchjob.engine.native.layers.rope import RopeSpec, RotaryEmbedding, apply_rotary

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    x = torch.randn(37, 4096, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    norm = RMSNorm(4096, 1e-5).to("cuda", dtype)
    norm.weight.data.normal_()
    cpu_norm = RMSNorm(4096, 1e-5).to(dtype)
    cpu_norm.weight.data.copy_(norm.weight.data.cpu())
    want_h, want_r = cpu_norm(x.cpu(), residual.cpu())
    got_h, got_r = norm(x, residual.clone())
    torch.testing.assert_close(got_r.cpu(), want_r, **tol)
    torch.testing.assert_close(got_h.cpu(), want_h, **tol)
    for style in (dict(weight_fp32=True), dict(unit_offset=True)):  # OLMo 2's and Gemma's norms
        styled = RMSNorm(4096, 1e-5, **style).to("cuda", dtype)
        styled.weight.data.copy_(norm.weight.data)
        cpu_styled = RMSNorm(4096, 1e-5, **style).to(dtype)
        cpu_styled.weight.data.copy_(norm.weight.data.cpu())
        torch.testing.assert_close(styled(x).cpu(), cpu_styled(x.cpu()), **tol)

    gate_up = torch.randn(37, 2 * 1000, device="cuda", dtype=dtype)
    gate, up = gate_up.cpu().chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up).cpu(), torch.nn.functional.silu(gate) * up, **tol)

    rope = RotaryEmbedding(RopeSpec(rope_type="default", theta=10000.0), 128, 512).to("cuda", dtype)
    qkv = torch.randn(37, 12 * 128, device="cuda", dtype=dtype)
    positions = torch.randint(0, 512, (37,), device="cuda")
    q = qkv[:, : 8 * 128].view(37, 8, 128)
    cos, sin = rope(positions)
    want = apply_rotary(q.clone().float(), cos.float(), sin.float())
    fused_ops.rotary_(q, positions, rope.cos_sin)
    torch.testing.assert_close(q.float(), want, **tol)

    partial = RotaryEmbedding(RopeSpec(rope_type="default", theta=10000.0), 96, 512).to("cuda", dtype)
    k = qkv[:, 8 * 128 : 10 * 128].view(37, 2, 128)
    cos, sin = partial(positions)
    want = torch.cat((apply_rotary(k[..., :96].float(), cos.float(), sin.float()), k[..., 96:].float()), dim=-1)
    partial.prepare(positions).apply(q, k)  # rotates the first 96 channels of each head (Phi-4-mini), in place
    torch.testing.assert_close(k.float(), want, **tol)

    # Per-head q/k norms fused into the rotation (Qwen 3, Gemma 3), against norm then rotate on the CPU.
    for style in ({}, {"unit_offset": True}):
        q_norm, k_norm = (RMSNorm(128, 1e-6, **style).to("cuda", dtype) for _ in range(2))
        for norm in (q_norm, k_norm):
            norm.weight.data.normal_()
        q, k = qkv[:, : 8 * 128].view(37, 8, 128), qkv[:, 8 * 128 : 10 * 128].view(37, 2, 128)
        cpu_norms = [RMSNorm(128, 1e-6, **style).to(dtype) for _ in range(2)]
        for cpu_norm, norm in zip(cpu_norms, (q_norm, k_norm), strict=True):
            cpu_norm.weight.data.copy_(norm.weight.data.cpu())
        cos, sin = (t.cpu() for t in rope(positions))
        want_q, want_k = (apply_rotary(n(x.cpu()), cos, sin) for n, x in zip(cpu_norms, (q, k), strict=True))
        rope.prepare(positions).apply(q, k, (q_norm, k_norm))
        torch.testing.assert_close(q.cpu(), want_q, **tol)
        torch.testing.assert_close(k.cpu(), want_k, **tol)

    # The rotation writing keys and values into the paged cache (a slot of -1: no entry), as store_kv would.
    q, k = qkv[:, : 8 * 128].view(37, 8, 128), qkv[:, 8 * 128 : 10 * 128].view(37, 2, 128)
    v = qkv[:, 10 * 128 :].view(37, 2, 128)
    slots = torch.randperm(8 * 16, device="cuda")[:37]
    slots[3] = -1
    want_q, want_k = q.clone(), k.clone()
    fused_ops.rotary_qk_(want_q, want_k, positions, rope.cos_sin)
    want_kc, want_vc = torch.zeros(2, 8, 16, 2, 128, device="cuda", dtype=dtype)
    keep = slots >= 0
    want_kc.view(-1, 2, 128)[slots[keep]], want_vc.view(-1, 2, 128)[slots[keep]] = want_k[keep], v[keep]
    got_kc, got_vc = torch.zeros(2, 8, 16, 2, 128, device="cuda", dtype=dtype)
    fused_ops.rotary_qk_(q, k, positions, rope.cos_sin, None, (v, got_kc, got_vc, slots))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(got_kc, want_kc) and torch.equal(got_vc, want_vc)


def test_stop_strings_and_n_samples_are_the_same_async_and_sync(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    probe = create_engine("native", str(model_dir), {"dtype": "float32", "max_num_seqs": 64})
    texts = {c.id: c.text for c in probe.generate(mixed_requests(40, seed=5, max_prompt=64, max_new=32))}
    probe.close()
    reqs = [
        Request(
            r.id,
            r.prompt_ids,
            SamplingParams(
                max_new_tokens=r.sampling.max_new_tokens,
                stop=(texts[r.id][3:6],) if len(texts[r.id]) > 8 else (),
                n=1 + r.id % 3,
                temperature=0.0 if r.id % 2 else 0.7,
                seed=r.id,
            ),
        )
        for r in mixed_requests(40, seed=5, max_prompt=64, max_new=32)
    ]

    def run(engine):
        eng = create_engine(engine, str(model_dir), {"dtype": "float32", "max_num_seqs": 64})
        try:
            return {c.id: [(s.token_ids, s.text, s.finish_reason) for s in c.samples] for c in eng.generate(reqs)}
        finally:
            eng.close()

    got = run("native")
    assert got == run("native_sync")
    for r in reqs:
        for _, text, _ in got[r.id]:
            assert not any(stop in text for stop in r.sampling.stop)


@pytest.mark.parametrize("engine", ["native", "native_sync"])
def test_each_request_generates_with_its_own_settings_under_graphs(tmp_path, engine):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    reqs = per_request_settings([tuple(range(30, 45)), tuple(range(50, 58)), (9, 8, 7)])
    eng = create_engine(engine, str(model_dir), {"dtype": "float32", "max_num_seqs": 64})
    try:
        together = {c.id: c for c in eng.generate(reqs)}
        alone = {r.id: next(iter(eng.generate([r]))) for r in reqs}
    finally:
        eng.close()
    assert_each_request_as_alone(together, alone, reqs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_read_in_many_chunks_onto_the_gpu_equal_the_checkpoint(tmp_path, monkeypatch, dtype):
    """Pinned buffers refilled while earlier copies out of them may still run: every chunk must land intact."""
    from safetensors.torch import load_file

    from batchjob.engine.native.layers.attention import TorchPagedAttention
    from batchjob.engine.native.loading import weight_stream
    from batchjob.engine.native.loading.model_loader import load_model

    model_dir = make_tiny_model(tmp_path / "m", arch="qwen3_moe")
    monkeypatch.setattr(weight_stream, "CHUNK_BYTES", 4096)
    model, _ = load_model(model_dir, dtype, "cuda", TorchPagedAttention())
    params = dict(model.named_parameters())
    torch.cuda.synchronize()
    for key, tensor in load_file(model_dir / "model.safetensors").items():
        name = key.removeprefix("model.")
        if name in params:
            assert torch.equal(params[name].cpu(), tensor.to(params[name].dtype)), key
    embed = load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(params["embed_tokens.weight"].cpu(), embed.to(params["embed_tokens.weight"].dtype))
