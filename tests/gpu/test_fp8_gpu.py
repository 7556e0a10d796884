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
from batchjob.engine.native.layers.fp8_linear import Fp8Linear, quantize_weight  # noqa: E402
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
    assert ((out - reference).norm() / reference.norm()).item() < 1e-5


def test_row_scaled_projections_through_cublaslt_agree_with_the_float32_arithmetic():
    linear = torch.nn.Linear(1024, 768, bias=True).cuda().to(torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(40, 1024, device="cuda", dtype=torch.bfloat16)
    out = layer(x)  # torch._scaled_mm
    q, scales = layer.quantize_input(x)
    reference = layer._plain(q, scales).float()
    assert out.dtype == torch.bfloat16
    assert ((out.float() - reference).norm() / reference.norm()).item() < 1e-2


def test_fp8_greedy_output_equals_the_float64_reference_of_its_format(source, checkpoint):
    ours = _greedy(checkpoint, dtype="float32")
    for i, prompt in enumerate(PROMPTS[:3]):
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(reference_logits(source, checkpoint, ids)[-1].argmax()))
        assert ours[i] == tuple(ids[len(prompt) :])


@pytest.mark.parametrize("options", [{"cuda_graphs": False}, {"async_loop": False}])
def test_fp8_graphs_and_the_asynchronous_loop_generate_what_eager_and_sync_steps_do(checkpoint, options):
    assert _greedy(checkpoint, dtype="bfloat16") == _greedy(checkpoint, dtype="bfloat16", **options)


def test_quantization_fp8_runs_a_bf16_model_with_graphs_as_without(source):
    graphed = _greedy(source, dtype="bfloat16", quantization="fp8")
    assert graphed == _greedy(source, dtype="bfloat16", quantization="fp8", cuda_graphs=False)
    assert graphed != _greedy(source, dtype="bfloat16")
