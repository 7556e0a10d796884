"""FP8 on a GPU: the compiled kernels compute their plain-torch arithmetic (the quantizer bit for bit), the
row-scaled projections through cuBLASLt agree with the CPU's float32 arithmetic within bf16 rounding, an FP8
model's greedy output equals the float64 reference of its format, and CUDA graphs, the asynchronous loop and the
synchronous one give the same tokens.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from fp8_models import handwritten_checkpoint, reference_logits  # noqa: E402

from batchjob.engine import Request, SamplingParams, create_engine  # noqa: E402
from batchjob.engine.native.kernels import fp8  # noqa: E402
from batchjob.engine.native.layers.fp8_linear import Fp8Linear, blas_matmul, quantize_weight  # noqa: E402
from batchjob.job.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu
PROMPTS = [[(5 * i + 11 * j) % 480 + 7 for i in range(6 + 9 * j)] for j in range(5)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fp8") / "llama", arch="llama")


@pytest.fixture(scope="module", params=["fbgemm_fp8", "fp8"])
def checkpoint(request, source, tmp_path_factory):
    block = (16, 32) if request.param == "fp8" else None
    return handwritten_checkpoint(source, tmp_path_factory.mktemp("fp8") / request.param, request.param, block)


def _greedy(model_dir, **options) -> dict[int, tuple[int, ...]]:
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [Request(id=i, prompt_ids=p, sampling=sampling) for i, p in enumerate(PROMPTS)]
    engine = create_engine("native", str(model_dir), {"max_num_seqs": 8, **options})
    try:
        return {c.id: c.token_ids for c in engine.generate(requests)}
    finally:
        engine.close()


@pytest.mark.parametrize("group", [None, 128])
def test_the_compiled_quantizer_is_the_plain_arithmetic_bit_for_bit(group):
    x = torch.randn(33, 1024, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 2, 33, device="cuda")[:, None]
    q, scales = fp8.quantize(x, group)
    expected_q, expected_scales = fp8.plain_quantize(x, group)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))


def _assert_quantized_alike(q, scales, want_q, want_scales):
    """The fused kernels' e4m3 rows against the quantizer's of the unfused output: the same scales, and the same
    bits but where the fused norm's bf16 output differs from the unfused norm's by rounding (its compiled variant
    may sum the squares in another order), which can move an element one e4m3 step. On an H200 the 700-row case
    met such elements, the 32-row and one-row cases none; more than one in 10,000 would be a fault, not rounding."""
    assert torch.equal(scales, want_scales)
    ours, theirs = q.float(), want_q.float()
    differ = ours != theirs
    # One e4m3 step is at most an eighth of the value (3 mantissa bits), and 2**-9 among the subnormals.
    step = theirs.abs().clamp(min=2**-6) / 8
    assert torch.all((ours - theirs).abs()[differ] <= step[differ]), "an element beyond one e4m3 step"
    assert differ.float().mean().item() <= 1e-4, f"{int(differ.sum())} of {differ.numel()} elements differ"


@pytest.mark.parametrize("upper", [None, 1.5])
@pytest.mark.parametrize("rows", [1, 32, 700])
def test_the_norm_and_the_activation_quantize_what_they_write_as_the_quantizer_would(rows, upper):
    from batchjob.engine.native.kernels import fused_ops

    bf16 = torch.bfloat16
    x, residual = torch.randn(rows, 4096, device="cuda", dtype=bf16), torch.randn(rows, 4096, device="cuda", dtype=bf16)
    weight = torch.randn(4096, device="cuda", dtype=bf16)
    parts = torch.randn(2, rows, 4096, device="cuda")
    for norm_input, kept in ((x, None), (x, residual), (parts, residual)):
        copy = (lambda: None) if kept is None else kept.clone
        normed = fused_ops.rms_norm(norm_input, weight, 1e-5, copy())
        want_q, want_scales = fp8.quantize(normed if kept is None else normed[0], None, upper)
        (q, scales), summed = fused_ops.rms_norm_fp8(norm_input, weight, 1e-5, copy(), upper=upper)
        _assert_quantized_alike(q, scales, want_q, want_scales)
        if kept is not None:
            assert torch.equal(summed, normed[1])  # the residual sum, written back, is the same bits
    for width in (14336, 28672):  # an 8B's row in one block, a 70B's in blocks
        gate_up = torch.randn(rows, 2 * width, device="cuda", dtype=bf16) * 4
        want_q, want_scales = fp8.quantize(fused_ops.silu_and_mul(gate_up), None, upper)
        q, scales = fused_ops.silu_and_mul_fp8(gate_up, upper)
        _assert_quantized_alike(q, scales, want_q, want_scales)


@pytest.mark.parametrize(("rows", "block"), [(1, (128, 128)), (32, (128, 128)), (300, (128, 128)), (32, None)])
def test_the_compiled_scaled_matmul_is_the_dequantized_product(rows, block):
    x = torch.randn(rows, 512, device="cuda")
    w = torch.randn(384, 512, device="cuda")
    a, a_scales = fp8.quantize(x, 128 if block else None)
    b, b_scales = quantize_weight(w, block)
    out = fp8.scaled_matmul(a, a_scales, b, b_scales, block or (1, 512), torch.float32)
    layer = Fp8Linear(512, 384, False, "group" if block else "token", block, dtype=torch.float32).cuda()
    layer.weight.data, layer.weight_scale.data = b, b_scales
    reference = layer._plain(a, a_scales)
    # Hopper's FP8 tensor cores add up a tile's products in less than float32's precision (measured 7.5e-5 on an
    # H100 with 64-deep tiles); a misplaced scale is an error of order one
    assert ((out - reference).norm() / reference.norm()).item() < 5e-4


@pytest.mark.parametrize("rows", [1, 7, 16, 32, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_the_few_rows_kernel_is_the_dequantized_product_at_an_8b_models_shapes(rows, n, k):
    from batchjob.engine.native.kernels import fp8_few_rows

    gen = torch.Generator(device="cuda").manual_seed(rows)
    a, a_scales = fp8.quantize(torch.randn(rows, k, device="cuda", generator=gen))
    b, b_scales = quantize_weight(torch.randn(n, k, device="cuda", generator=gen))
    out = fp8_few_rows.matmul(a, a_scales, b, b_scales, None, torch.float32)
    layer = Fp8Linear(k, n, False, "token", dtype=torch.float32).cuda()
    layer.weight.data, layer.weight_scale.data = b, b_scales
    reference = layer._plain(a, a_scales)
    assert ((out - reference).norm() / reference.norm()).item() < 5e-4
    others = a.clone()
    others[:-1] = fp8.quantize(torch.randn(rows - 1, k, device="cuda", generator=gen))[0]
    beside = fp8_few_rows.matmul(others, a_scales, b, b_scales, None, torch.float32)
    assert torch.equal(beside[-1], out[-1]), "a row's result does not depend on the rows beside it"


@pytest.mark.parametrize("rows", [1, 40, 64, 65, 300])
def test_row_scaled_projections_agree_with_the_float32_arithmetic(rows):
    """Up to 64 rows through the few-rows kernel, more through cuBLASLt (`torch._scaled_mm`)."""
    linear = torch.nn.Linear(1024, 768, bias=True).cuda().to(torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    q, scales = layer.quantize_input(x)
    reference = layer._plain(q, scales).float()
    assert out.dtype == torch.bfloat16
    assert ((out.float() - reference).norm() / reference.norm()).item() < 1e-2


@pytest.mark.parametrize("rows", [65, 224, 256, 300])
def test_the_fp8_gemm_reads_its_rows_up_to_a_multiple_of_128_and_gives_back_the_rows_asked_for(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    weight, weight_scale = quantize_weight(torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16, generator=gen))
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, scales = fp8.quantize(torch.randn(rows, 1024, device="cuda", generator=gen) * 3)
    assert fp8.padded_rows(q) is not None, "the quantizer leaves the GEMM the rows up to a multiple of 128"
    out = blas_matmul(q, scales, weight, weight_scale, bias)
    unpadded = blas_matmul(q.clone(), scales.clone(), weight, weight_scale, bias)  # no room: the rows asked for
    padded = -(-rows // fp8.BUFFER_ROWS) * fp8.BUFFER_ROWS
    whole = torch.zeros(padded, 1024, device="cuda").to(fp8.FP8)
    whole[:rows] = q
    whole_scales = torch.ones(padded, 1, device="cuda")
    whole_scales[:rows] = scales
    expected = torch._scaled_mm(
        whole, weight.t(), scale_a=whole_scales, scale_b=weight_scale.view(1, -1), bias=bias, out_dtype=torch.bfloat16
    )
    assert out.shape == (rows, 768) and out.is_contiguous() and out.dtype == torch.bfloat16
    assert torch.equal(out, expected[:rows])
    assert unpadded.shape == out.shape
    assert ((unpadded.float() - out.float()).norm() / out.float().norm()).item() < 1e-2


def test_fp8_greedy_output_is_the_float64_references_choice_but_where_an_fp8_rounding_flips(source, checkpoint):
    # The GPU's FP8 tensor cores add up in less than float32's precision, and an activation a hair from an e4m3
    # rounding boundary can round the other way there than in the reference: one step of e4m3 is 6 to 12% of a
    # value, enough to move a tiny random model's logits by a few percent. So most chosen tokens must be the
    # reference's best, and every one within 5% of it (relative to the logits' scale); a wrong matmul or scale
    # picks tokens far from the best (on an H100, 2 of 36 positions were off the best, by 0.3% and 2.3%).
    ours = _greedy(checkpoint, dtype="float32")
    gaps = []
    for i, prompt in enumerate(PROMPTS[:3]):
        logits = reference_logits(source, checkpoint, list(prompt) + list(ours[i]))[len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(ours[i])[:, None])[:, 0]
        gaps += ((logits.max(1).values - chosen) / logits.abs().max(1).values).tolist()
    assert max(gaps) < 5e-2, gaps
    assert sum(gap < 1e-3 for gap in gaps) >= 0.9 * len(gaps), gaps


# The engine comparisons run float32 models: their FP8 projections take the Triton matmul, whose tiles do not
# depend on a step's row count, so a graph's padded bucket computes each row as an eager step does (cuBLASLt's FP8
# kernels, which bf16 models use, are chosen by row count: a near tie can then go either way).
@pytest.mark.parametrize("options", [{"cuda_graphs": False}, {"async_loop": False}])
def test_fp8_graphs_and_the_asynchronous_loop_generate_what_eager_and_sync_steps_do(checkpoint, options):
    assert _greedy(checkpoint, dtype="float32") == _greedy(checkpoint, dtype="float32", **options)


def test_quantization_fp8_runs_a_model_with_graphs_as_without(source):
    graphed = _greedy(source, dtype="float32", quantization="fp8")
    assert graphed == _greedy(source, dtype="float32", quantization="fp8", cuda_graphs=False)
    assert graphed != _greedy(source, dtype="float32")
    assert _greedy(source, dtype="bfloat16", quantization="fp8")  # the cuBLASLt path, graphed


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"), [([1] * 6, [3, 40, 200, 700, 31, 1024]), ([9, 1, 40], [9, 70, 300])]
)
def test_compiled_kernels_store_and_read_an_fp8_cache_as_the_values_it_rounds_to(query_lens, seq_lens):
    from attention_cases import random_paged_step, reference_attention

    from batchjob.engine.native.layers.triton_attention import TritonPagedAttention

    step = random_paged_step(query_lens, seq_lens, 16, 32, 8, 128, torch.bfloat16, torch.device("cuda"))
    q, k, v, k_cache, v_cache, meta = step
    k8, v8 = (c.float().clamp(-448, 448).to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
    out = TritonPagedAttention().forward(q, k, v, k8, v8, meta, 0.088)
    rounded = [x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float() for x in (k, v, k8, v8)]
    expected = reference_attention(q.float(), *rounded, meta, 0.088)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2  # bf16 queries and output
    written = k8.view(torch.uint8).view(-1, 8, 128)[meta.slot_mapping].view(torch.float8_e4m3fn).float()
    assert torch.equal(written, k.float().clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_an_fp8_kv_cache_with_graphs_generates_what_eager_steps_do(source):
    graphed = _greedy(source, dtype="float32", kv_cache_dtype="fp8_e4m3")
    assert graphed == _greedy(source, dtype="float32", kv_cache_dtype="fp8_e4m3", cuda_graphs=False)
    assert graphed == _greedy(source, dtype="float32", kv_cache_dtype="fp8_e4m3", async_loop=False)


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_the_compiled_fp8_experts_kernel_computes_their_float32_arithmetic(block):
    from batchjob.engine.native.models.moe import Fp8Experts

    experts, hidden, inter, tokens = 16, 1024, 768, 300
    module = Fp8Experts(experts, hidden, inter, block, block is not None, None).cuda()
    for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        parts = [quantize_weight(torch.randn(rows, cols, device="cuda") / cols**0.5, block) for _ in range(experts)]
        getattr(module, name).data = torch.stack([q.view(torch.uint8) for q, _ in parts]).view(torch.float8_e4m3fn)
        getattr(module, name + "_scale").data = torch.stack([s for _, s in parts])
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = (
        torch.rand(tokens, 4, device="cuda").softmax(-1),
        torch.randint(0, experts, (tokens, 4), device="cuda"),
    )
    got = module(x, weights, ids).float()
    expected = module._torch_forward(x, weights, ids).float()
    assert ((got - expected).norm() / expected.norm()).item() < 2e-2  # bf16 intermediate rounding


def test_an_fp8_mixture_of_experts_with_graphs_generates_what_eager_steps_do(tmp_path):
    moe = make_tiny_model(tmp_path / "moe", arch="qwen3_moe")
    checkpoint = handwritten_checkpoint(moe, tmp_path / "moe-fp8", "fp8", (16, 16))
    graphed = _greedy(checkpoint, dtype="float32")
    assert graphed == _greedy(checkpoint, dtype="float32", cuda_graphs=False)


def test_the_fp8_shapes_profiler_times_cublaslt_beside_the_few_rows_kernel_and_its_tiles():
    """The profiler's tiles, and above the few-rows kernel the engine's padded call and the transposed product,
    each within FP8's tolerance of cuBLASLt (a best tile marked ! would not be)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "fp8_shapes.py"
    args = ["--rows", "1,32,224", "--block-n", "32,64", "--stages", "3"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("qkv ", "o ", "gate_up ", "down "))]
    counts = ("1", "32", "224")
    assert [(r[0], r[4]) for r in rows] == [(name, n) for name in ("qkv", "o", "gate_up", "down") for n in counts]
    # above the few-rows kernel: the engine's padded rows beside the product transposed
    assert done.stdout.count("every tile: padded ") == 4 and done.stdout.count(", transposed ") == 4
    for row in rows:
        floor, blas, engine, best = (float(cell) for cell in row[5:9])
        assert min(blas, engine, best) >= 0.5 * floor, row  # nothing beats the roofline by 2x
        assert not row[9].endswith("!"), row  # the best tile computes what cuBLASLt does, within FP8's tolerance
    assert "cuBLASLt / engine " in done.stdout
