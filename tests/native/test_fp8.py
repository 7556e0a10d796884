"""FP8 models on the native engine (CPU): every checkpoint format it reads, quantized by the formats' own tools
where one exists (compressed-tensors) and written tensor by tensor otherwise, computes what a float64 reference
of the same format computes; `engine.quantization=fp8` quantizes an unquantized checkpoint; formats it cannot run
are refused before a weight is read; the FP8 kernels compute what their plain-torch arithmetic does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from fp8_models import compressed_tensors_checkpoint, handwritten_checkpoint, reference_logits
from safetensors.torch import load_file

from batchjob.engine import Request, SamplingParams, choose_backend, create_engine
from batchjob.engine.native.kernels import fp8
from batchjob.engine.native.layers.attention import TorchPagedAttention, make_metadata
from batchjob.engine.native.layers.fp8_linear import Fp8Linear, dequantize, quantize_weight
from batchjob.engine.native.loading.model_loader import load_model, read_model_spec
from batchjob.engine.native.models.moe import Fp8Experts
from batchjob.engine.native.models.spec import UnsupportedModelError
from batchjob.job.tiny_model import make_tiny_model

FORMATS = {
    "compressed-tensors FP8_DYNAMIC (per-channel weights, per-token activations)": ("FP8_DYNAMIC", None),
    "compressed-tensors FP8 (per-tensor weights, static activations)": ("FP8", None),
    "compressed-tensors FP8_BLOCK (32 x 32 weight blocks, per-group activations)": ("FP8_BLOCK", (32, 32)),
    "fp8 with weight_block_size (DeepSeek / Qwen3 layout, 16 x 32 blocks)": ("fp8", (16, 32)),
    "fbgemm_fp8 (per-channel weights, capped per-token activations)": ("fbgemm_fp8", None),
}
PROMPT = [(5 * i) % 480 + 7 for i in range(40)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fp8") / "llama", arch="llama")


@pytest.fixture(scope="module", params=FORMATS, ids=[v[0] for v in FORMATS.values()])
def checkpoint(request, source, tmp_path_factory):
    name, block = FORMATS[request.param]
    out = tmp_path_factory.mktemp("fp8") / name
    if name.startswith("FP8"):
        return compressed_tensors_checkpoint(source, out, name, block)
    return handwritten_checkpoint(source, out, name, block)


def our_logits(model_dir, ids: list[int], quantization: str = "auto") -> torch.Tensor:
    model, _ = load_model(model_dir, "float32", "cpu", TorchPagedAttention(), quantization=quantization)
    return logits_of(model, ids)


@torch.no_grad()
def logits_of(model, ids: list[int]) -> torch.Tensor:
    spec = model.spec
    n, block_size = len(ids), 16
    blocks = -(-n // block_size)
    shape = (blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    meta = make_metadata([n], [n], [list(range(1, blocks + 1))], block_size)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, caches)).double()


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def greedy(model_dir, prompts: list[list[int]], **options) -> dict[int, tuple[int, ...]]:
    sampling = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    requests = [Request(id=i, prompt_ids=p, sampling=sampling) for i, p in enumerate(prompts)]
    engine = create_engine("native", str(model_dir), {"dtype": "float32", "device": "cpu", **options})
    try:
        return {c.id: c.token_ids for c in engine.generate(requests)}
    finally:
        engine.close()


@pytest.mark.parametrize(("rows", "padded"), [(1, 128), (128, 128), (224, 256), (300, 384)])
def test_quantized_activations_lie_in_buffers_of_whole_128_row_blocks_the_fp8_gemm_may_read_whole(rows, padded):
    q, scales = fp8.row_buffers(rows, 96, 1, torch.device("cpu"))
    assert q.shape == (rows, 96) and q.dtype == fp8.FP8 and scales.shape == (rows, 1)
    whole = fp8.padded_rows(q)
    assert whole.shape == (padded, 96) and whole.data_ptr() == q.data_ptr()
    assert fp8.padded_rows(scales).shape == (padded, 1)
    # a tensor without the room (or not the start of its buffer) is taken as it is
    assert (fp8.padded_rows(torch.zeros(rows, 96)) is None) == (rows != padded)
    assert fp8.padded_rows(fp8.row_buffers(rows + 1, 96, 1, torch.device("cpu"))[0][1:]) is None


def test_each_checkpoint_format_computes_the_float64_reference_of_its_fp8_arithmetic(source, checkpoint):
    ours = our_logits(checkpoint, PROMPT)
    reference = reference_logits(source, checkpoint, PROMPT)
    # float32 against float64 rounding moves an activation across an e4m3 boundary now and then: 1e-2 allows a few
    # such flips (a scale put on the wrong rows or blocks is an error of order one)
    assert relative_error(ours, reference) < 1e-2
    unquantized = our_logits(source, PROMPT)
    assert relative_error(ours, unquantized) > 10 * relative_error(ours, reference)  # FP8 is in effect


def test_each_checkpoint_format_generates_the_references_greedy_tokens(source, checkpoint):
    prompts = [PROMPT[: 8 + 5 * i] for i in range(3)]
    ours = greedy(checkpoint, prompts)
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        for _ in range(10):
            ids.append(int(reference_logits(source, checkpoint, ids)[-1].argmax()))
        assert ours[i] == tuple(ids[len(prompt) :])


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_per_channel_as_it_loads(source):
    model, spec = load_model(source, "float32", "cpu", TorchPagedAttention(), quantization="fp8")
    layer = model.layers[0]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(p, Fp8Linear) and p.weight.dtype == torch.float8_e4m3fn for p in projections)
    head = model.embed_tokens if model.lm_head is None else model.lm_head  # the lm_head stays in the model's dtype
    assert head.weight.dtype == torch.float32
    plain, _ = load_model(source, "float32", "cpu", TorchPagedAttention())
    q, scales = quantize_weight(plain.layers[0].self_attn.qkv_proj.weight)
    assert torch.equal(layer.self_attn.qkv_proj.weight.float(), q.float())
    assert torch.equal(layer.self_attn.qkv_proj.weight_scale, scales)
    assert spec.quantization.source == "engine"
    error = relative_error(our_logits(source, PROMPT, "fp8"), our_logits(source, PROMPT))
    assert 1e-3 < error < 0.2


def test_an_fp8_checkpoint_with_quantization_fp8_runs_as_the_checkpoint_says(checkpoint):
    assert torch.equal(our_logits(checkpoint, PROMPT, "fp8"), our_logits(checkpoint, PROMPT))


def test_dummy_weights_of_an_fp8_config_are_the_bf16_dummy_weights_quantized(source, tmp_path):
    checkpoint = handwritten_checkpoint(source, tmp_path / "block", "fp8", (16, 32))
    fp8_model, _ = load_model(checkpoint, "float32", "cpu", TorchPagedAttention(), load_format="dummy")
    plain, _ = load_model(source, "float32", "cpu", TorchPagedAttention(), load_format="dummy")
    projection = fp8_model.layers[1].mlp.down_proj
    q, scales = quantize_weight(plain.layers[1].mlp.down_proj.weight, (16, 32))
    assert torch.equal(projection.weight.float(), q.float()) and torch.equal(projection.weight_scale, scales)
    prompts = [PROMPT[:12], PROMPT[:20]]
    assert greedy(checkpoint, prompts, load_format="dummy") == greedy(checkpoint, prompts, load_format="dummy")


def _with_quantization(source, out, quantization: dict, **config_keys):
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config.update(quantization_config=quantization, **config_keys)
    (out / "config.json").write_text(json.dumps(config))
    return out


FP8_DYNAMIC_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
}


def _compressed(**changes) -> dict:
    group = json.loads(json.dumps(FP8_DYNAMIC_GROUP))
    for path, value in changes.items():
        section, _, key = path.partition("__")
        if key:
            group[section][key] = value
        else:
            group[section] = value
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": group},
            "ignore": ["lm_head"]}  # fmt: skip


REFUSED = {
    "awq": ({"quant_method": "awq", "bits": 4}, "quantization method 'awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq'"),
    "int8 weights": (_compressed(weights__type="int"), "weights of type 'int'"),
    "weight-only FP8": (_compressed(input_activations=None), "W8A16"),
    "asymmetric": (_compressed(weights__symmetric=False), "asymmetric"),
    "per-group weights": (_compressed(weights__strategy="group"), "weight strategy 'group'"),
    "fp8 without blocks": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    "packed format": ({**_compressed(), "format": "pack-quantized"}, "format 'pack-quantized'"),
    "FP8 KV scales": ({**_compressed(), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    "quantized lm_head": ({**_compressed(), "ignore": []}, "quantized lm_head"),  # of an untied model (below)
    "blocks not tiling q/k/v": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [24, 32]},
        "blocks of 24 rows",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_quantization_the_engine_cannot_run_is_refused_from_config_json_naming_the_supported_ones(
    case, source, tmp_path
):
    config, expected = REFUSED[case]
    model_dir = _with_quantization(source, tmp_path / "model", config, tie_word_embeddings=False)
    with pytest.raises(UnsupportedModelError) as refused:
        read_model_spec(model_dir)
    message = str(refused.value)
    assert expected in message and "compressed-tensors FP8" in message and "engine=hf" in message


@pytest.mark.parametrize(("name", "block"), [("fbgemm_fp8", None), ("fp8", (16, 16))])
def test_an_fp8_mixture_of_experts_runs_its_experts_in_fp8_and_its_router_in_the_model_dtype(name, block, tmp_path):
    moe = make_tiny_model(tmp_path / "moe", arch="qwen3_moe")
    checkpoint = handwritten_checkpoint(moe, tmp_path / name, name, block)
    model, _ = load_model(checkpoint, "float32", "cpu", TorchPagedAttention())
    sparse = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts"))
    assert isinstance(sparse.experts, Fp8Experts) and sparse.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert isinstance(sparse.gate, torch.nn.Linear) and sparse.gate.weight.dtype == torch.float32
    # Every expert holds its checkpoint tensors' values: gate rows, then up rows, scales beside them.
    tensors = load_file(checkpoint / "model.safetensors")
    layer = next(i for i, layer in enumerate(model.layers) if layer.mlp is sparse)
    scale_name = "weight_scale_inv" if name == "fp8" else "weight_scale"
    for e in (0, 5):
        stored = {}
        for which in ("gate", "up", "down"):
            key = f"model.layers.{layer}.mlp.experts.{e}.{which}_proj"
            stored[which] = dequantize(tensors[f"{key}.weight"], tensors[f"{key}.{scale_name}"], block)
        gate_up = dequantize(sparse.experts.gate_up_proj[e], sparse.experts.gate_up_proj_scale[e], block)
        assert torch.equal(gate_up, torch.cat([stored["gate"], stored["up"]]))
        down = dequantize(sparse.experts.down_proj[e], sparse.experts.down_proj_scale[e], block)
        assert torch.equal(down, stored["down"])
    # FP8's own error, routing flips included (a misplaced scale would be an error of order one)
    assert 1e-3 < relative_error(our_logits(checkpoint, PROMPT), our_logits(moe, PROMPT)) < 0.5
    prompts = [PROMPT[: 6 + 7 * i] for i in range(3)]
    if block is not None:
        assert greedy(checkpoint, prompts, tensor_parallel=2) == greedy(checkpoint, prompts)


@pytest.mark.parametrize(("group", "block"), [(None, None), (16, (16, 16))])
def test_fp8_experts_compute_the_float64_arithmetic_of_their_format(group, block):
    torch.manual_seed(3)
    experts = Fp8Experts(6, 64, 32, block, group is not None, None)
    reference = {}
    for name, rows, cols in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):
        q, scales = zip(*(quantize_weight(torch.randn(rows, cols) / cols**0.5, block) for _ in range(6)), strict=True)
        getattr(experts, name).data = torch.stack([w.view(torch.uint8) for w in q]).view(torch.float8_e4m3fn)
        getattr(experts, name + "_scale").data = torch.stack(scales)
        reference[name] = [(w.double() * _expand(s, block, rows, cols)) for w, s in zip(q, scales, strict=True)]
    x = torch.randn(9, 64)
    ids = torch.randint(0, 6, (9, 2))
    weights = torch.rand(9, 2)
    ours = experts(x, weights, ids)
    expected = torch.zeros(9, 64, dtype=torch.float64)
    for t in range(9):
        for k in range(2):
            e = int(ids[t, k])
            gate, up = (_fake_quant(x[t : t + 1], group) @ reference["gate_up_proj"][e].t()).float().chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
            expected[t] += float(weights[t, k]) * (_fake_quant(act, group) @ reference["down_proj"][e].t())[0]
    assert relative_error(ours.double(), expected) < 1e-5


def _expand(scales: torch.Tensor, block, rows: int, cols: int) -> torch.Tensor:
    if block is None:
        return scales.double()
    return scales.double().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def _fake_quant(x: torch.Tensor, group: int | None) -> torch.Tensor:
    q, scales = fp8.plain_quantize(x, group)
    return q.double() * scales.double().repeat_interleave(group or x.shape[1], 1)[:, : x.shape[1]]


def test_a_mixtral_fp8_checkpoint_naming_its_router_in_mixtral_terms_runs_its_experts_in_fp8(tmp_path):
    mixtral = make_tiny_model(tmp_path / "mixtral", arch="mixtral")
    checkpoint = handwritten_checkpoint(mixtral, tmp_path / "fp8", "fp8", (16, 16))
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "block_sparse_moe.gate"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    model, _ = load_model(checkpoint, "float32", "cpu", TorchPagedAttention())
    sparse = model.layers[0].mlp
    assert isinstance(sparse.experts, Fp8Experts) and isinstance(sparse.gate, torch.nn.Linear)
    assert 1e-3 < relative_error(our_logits(checkpoint, PROMPT), our_logits(mixtral, PROMPT)) < 0.5


def test_quantization_fp8_leaves_a_mixtures_experts_and_router_in_the_model_dtype(tmp_path):
    moe = make_tiny_model(tmp_path / "moe", arch="qwen3_moe")
    model, _ = load_model(moe, "float32", "cpu", TorchPagedAttention(), quantization="fp8")
    sparse = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts"))
    assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert sparse.experts.gate_up_proj.dtype == torch.float32 and isinstance(sparse.gate, torch.nn.Linear)
    assert greedy(moe, [PROMPT[:16]], quantization="fp8")[0]


def test_a_checkpoint_whose_fp8_tensors_its_config_does_not_declare_is_refused(source, tmp_path):
    checkpoint = handwritten_checkpoint(source, tmp_path / "fbgemm", "fbgemm_fp8")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "o_proj"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="o_proj.weight is FP8, but config.json's quantization_config"):
        load_model(checkpoint, "float32", "cpu", TorchPagedAttention())


def test_the_cli_runs_an_fp8_checkpoint_and_quantization_fp8_and_refuses_a_resume_under_another(
    source, checkpoint, tmp_path
):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def job(model, out, *extra):
        return subprocess.run(
            [sys.executable, "-m", "batchjob", f"model.path={model}", f"output.dir={out}", "engine=native",
             "data.limit=6", "sampling.max_new_tokens=4", *extra],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip

    assert job(checkpoint, tmp_path / "ckpt").returncode == 0
    done = job(source, tmp_path / "otf", "engine.quantization=fp8")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "otf.batchjob" / "_job.json").read_text())
    assert record["engine"]["quantization"] == "fp8"
    other = job(source, tmp_path / "otf", "engine.quantization=auto")
    assert other.returncode == 2 and "quantization" in other.stderr
    typo = job(source, tmp_path / "typo", "engine.quantization=fp4")
    assert typo.returncode == 2 and "engine.quantization='fp4'" in typo.stderr and "Traceback" not in typo.stderr


def test_tensor_parallel_2_generates_what_one_device_does_from_a_block_fp8_checkpoint(source, tmp_path):
    checkpoint = handwritten_checkpoint(source, tmp_path / "fp8", "fp8", (16, 32))
    prompts = [PROMPT[: 6 + 7 * i] for i in range(4)]
    assert greedy(checkpoint, prompts, tensor_parallel=2) == greedy(checkpoint, prompts)


def test_tensor_parallel_2_quantizes_each_ranks_part_of_a_row_parallel_input_per_token(source, tmp_path):
    """The ranks of o_proj and down_proj each hold half of a token's input and quantize it with its own scale (as
    vLLM's ranks do): the reference of two ranks, not one device's."""
    checkpoint = handwritten_checkpoint(source, tmp_path / "fbgemm", "fbgemm_fp8")
    prompts = [PROMPT[: 6 + 7 * i] for i in range(3)]
    ours = greedy(checkpoint, prompts, tensor_parallel=2)
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        for _ in range(10):
            ids.append(int(reference_logits(source, checkpoint, ids, ranks=2)[-1].argmax()))
        assert ours[i] == tuple(ids[len(prompt) :])


def test_block_fp8_that_a_rank_would_hold_in_partial_blocks_is_refused_before_loading(source, tmp_path):
    checkpoint = handwritten_checkpoint(source, tmp_path / "fp8", "fp8", (32, 32))
    with pytest.raises(ValueError, match="key/value heads a rank holds \\(16\\) in whole FP8 weight blocks of 32 x 32"):
        choose_backend("native", str(checkpoint), {"dtype": "float32", "device": "cpu", "tensor_parallel": 2})


@pytest.mark.parametrize("group", [None, 32])
def test_the_quantize_kernel_computes_the_plain_arithmetic(group):
    x = torch.randn(7, 96) * torch.logspace(-3, 2, 7)[:, None]
    q, scales = fp8.quantize(x, group)
    expected_q, expected_scales = fp8.plain_quantize(x, group)
    assert torch.equal(scales, expected_scales)
    ours, theirs = q.float(), expected_q.float()
    # Triton's interpreter rounds to e4m3 without carrying a mantissa overflow into the exponent (124.3 -> 64, not
    # 128); compiled kernels round correctly, which tests/gpu checks bit for bit. Anything else must match.
    interpreter_carry = (theirs.abs() == 2 ** theirs.abs().log2().round()) & (ours == theirs / 2)
    assert torch.all((ours == theirs) | interpreter_carry)


@pytest.mark.parametrize(
    ("group", "block"), [(None, None), (32, (32, 32)), (32, (16, 32)), (None, (16, 96)), (64, None)]
)
def test_the_scaled_matmul_kernel_computes_the_dequantized_product(group, block):
    torch.manual_seed(0)
    x, w, bias = torch.randn(19, 96), torch.randn(80, 96), torch.randn(80)
    a, a_scales = fp8.plain_quantize(x, group)
    b, b_scales = quantize_weight(w, block)
    out = fp8.scaled_matmul(a, a_scales, b, b_scales, block or (1, 96), torch.float32, bias)
    layer = Fp8Linear(96, 80, True, "group" if group else "token", block, dtype=torch.float32)
    layer.weight.data, layer.weight_scale.data, layer.bias.data = b, b_scales, bias
    reference = layer._plain(a, a_scales)
    assert relative_error(out.double(), reference.double()) < 1e-6


@pytest.mark.parametrize(("rows", "tile"), [(1, None), (5, (32, 4, 3)), (16, None), (33, (64, 4, 2)), (64, None)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_few_rows_kernel_computes_the_dequantized_product(rows, tile, bias):
    """A decode step's projection: every row, whatever the others, each output channel in a tile or past the last
    whole one (80 channels: two tiles of 32 and a partial one)."""
    from batchjob.engine.native.kernels import fp8_few_rows

    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 256, generator=gen), torch.randn(80, 256, generator=gen)
    a, a_scales = fp8.plain_quantize(x)
    b, b_scales = quantize_weight(w)
    b_bias = torch.randn(80, generator=gen) if bias else None
    assert fp8_few_rows.suits(rows, 256, a_scales)
    out = fp8_few_rows.matmul(a, a_scales, b, b_scales, b_bias, torch.float32, tile)
    layer = Fp8Linear(256, 80, bias, "token", dtype=torch.float32)
    layer.weight.data, layer.weight_scale.data = b, b_scales
    if bias:
        layer.bias.data = b_bias
    assert relative_error(out.double(), layer._plain(a, a_scales).double()) < 1e-6
    others = a.clone()
    others[:-1] = fp8.plain_quantize(torch.randn(rows - 1, 256, generator=gen))[0]
    beside = fp8_few_rows.matmul(others, a_scales, b, b_scales, b_bias, torch.float32, tile)
    assert torch.equal(beside[-1], out[-1]), "a row's result does not depend on the rows beside it"


def test_the_few_rows_kernel_takes_only_what_it_computes():
    from batchjob.engine.native.kernels import fp8_few_rows

    one_scale_a_row, grouped = torch.ones(64, 1), torch.ones(64, 2)
    assert fp8_few_rows.suits(64, 4096, one_scale_a_row)
    assert not fp8_few_rows.suits(65, 4096, one_scale_a_row), "more rows: cuBLASLt's large tiles"
    assert not fp8_few_rows.suits(0, 4096, one_scale_a_row)
    assert not fp8_few_rows.suits(64, 4000, one_scale_a_row), "a depth the K tile does not divide"
    assert not fp8_few_rows.suits(64, 4096, grouped), "activation scales per group of channels"


@pytest.mark.parametrize("upper", [None, 0.5])
@pytest.mark.parametrize("case", ["alone", "with residual", "split-K partial sums", "gemma"])
def test_the_norm_writes_its_output_quantized_as_the_quantize_kernel_would(case, upper):
    from batchjob.engine.native.kernels import fused_ops

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 96, generator=gen).bfloat16()
    residual = torch.randn(9, 96, generator=gen).bfloat16() if case != "alone" else None
    weight = torch.randn(96, generator=gen).bfloat16()
    style = {"weight_fp32": True, "offset": 1.0} if case == "gemma" else {}
    if case == "split-K partial sums":
        x = torch.stack([x.float() * 0.25, x.float() * 0.75])
    normed = fused_ops.rms_norm(x, weight, 1e-5, None if residual is None else residual.clone(), **style)
    want_q, want_scales = fp8.quantize(normed if residual is None else normed[0], None, upper)

    kept = None if residual is None else residual.clone()
    (q, scales), summed = fused_ops.rms_norm_fp8(x, weight, 1e-5, kept, upper=upper, **style)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if residual is not None:
        assert torch.equal(summed, normed[1])  # the residual sum is still written back


@pytest.mark.parametrize("upper", [None, 0.5])
# the row in one block (up to 16,384 columns), and wider rows in blocks of 2,048
@pytest.mark.parametrize("width", [96, 2100, 16400])
def test_silu_and_mul_writes_its_output_quantized_as_the_quantize_kernel_would(width, upper):
    from batchjob.engine.native.kernels import fused_ops

    gate_up = (torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    want_q, want_scales = fp8.quantize(fused_ops.silu_and_mul(gate_up), None, upper)
    q, scales = fused_ops.silu_and_mul_fp8(gate_up, upper)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("name", ["FP8_DYNAMIC", "fbgemm_fp8", "FP8"])
def test_per_token_fp8_projections_take_their_input_quantized_by_the_kernel_before_them(name, source, tmp_path):
    from batchjob.engine.native.layers.fp8_linear import Fp8Rows

    if name.startswith("FP8"):
        model_dir = compressed_tensors_checkpoint(source, tmp_path / name, name, None)
    else:
        model_dir = handwritten_checkpoint(source, tmp_path / name, name, None)
    model, _ = load_model(model_dir, "float32", "cpu", TorchPagedAttention())
    layer = model.layers[0]
    sources = [layer.input_layernorm, layer.pre_feedforward_layernorm, layer.mlp]
    if name == "FP8":  # static activation scales: the projection quantizes by its checkpoint's scale
        assert all(s.fp8_out is None for s in sources)
        return
    upper = layer.self_attn.qkv_proj.activation_upper
    assert [s.fp8_out.upper for s in sources] == [upper] * 3
    assert (upper is not None) == (name == "fbgemm_fp8")
    rows = layer.input_layernorm(torch.randn(3, layer.self_attn.qkv_proj.in_features))
    assert isinstance(rows, Fp8Rows) and rows.scales.shape == (3, 1)

    ids = [(7 * i) % 480 + 3 for i in range(20)]
    fused = our_logits(model_dir, ids)
    for module in model.modules():  # the same model with every projection quantizing its own input
        if hasattr(module, "fp8_out"):
            module.fp8_out = None
    assert torch.equal(fused, logits_of(model, ids))
