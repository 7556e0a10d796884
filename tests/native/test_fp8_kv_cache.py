"""engine.kv_cache_dtype=fp8_e4m3 on CPU: K and V are stored in e4m3 (a scale of 1, saturating at +-448), every
attention path reads them as the values they round to (the plain-torch backend exactly; the Triton decode, split
decode and prefill kernels, through the interpreter, within float32 rounding), the cache holds twice the tokens of
a bf16 one in the same memory, and a job records the choice so that a resume cannot change it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_fp8_gpu.py runs these checks compiled", allow_module_level=True)

from attention_cases import reference_attention  # noqa: E402
from interpreted_attention import TritonPagedAttention, random_step  # noqa: E402

from batchjob.engine import Request, SamplingParams, create_engine  # noqa: E402
from batchjob.engine.native.layers.attention import TorchPagedAttention, store_kv  # noqa: E402
from batchjob.engine.native.loading.model_loader import read_model_spec  # noqa: E402
from batchjob.job.tiny_model import make_tiny_model  # noqa: E402

FP8 = torch.float8_e4m3fn


def as_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(FP8)


def fp8_step(step):
    """The step with its cached K/V in e4m3 caches, and the same step in float32 holding the values they round
    to (its new K/V rounded too)."""
    q, k, v, k_cache, v_cache, meta = step
    k8, v8 = as_fp8(k_cache), as_fp8(v_cache)
    rounded = (q, as_fp8(k).float(), as_fp8(v).float(), k8.float(), v8.float(), meta)
    return (q, k, v, k8, v8, meta), rounded


@pytest.mark.parametrize("window", [0, 5])
def test_the_torch_backend_reads_an_fp8_cache_as_the_values_it_rounds_to(window):
    step = random_step([3, 1, 9, 1], [3, 12, 30, 41], block_size=4, group=2)
    (q, k, v, k8, v8, meta), (_, kr, vr, kc, vc, _) = fp8_step(step)
    ours = TorchPagedAttention().forward(q, k, v, k8, v8, meta, 0.3, window=window)
    expected = TorchPagedAttention().forward(q, kr, vr, kc, vc, meta, 0.3, window=window)
    assert torch.equal(ours, expected)
    assert torch.equal(k8.float().nan_to_num(), kc.nan_to_num())  # the step's keys were stored rounded


def test_stored_keys_and_values_saturate_at_448_instead_of_overflowing():
    k_cache = torch.zeros(2, 4, 1, 16, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k = torch.full((2, 1, 16), 1000.0)
    store_kv(k, -k, k_cache, v_cache, torch.tensor([4, 5]))
    assert torch.equal(k_cache[1, :2].float(), torch.full((2, 1, 16), 448.0))
    assert torch.equal(v_cache[1, :2].float(), torch.full((2, 1, 16), -448.0))


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "splits"),
    [([1, 1, 1], [7, 40, 93], 1), ([1, 1, 1], [7, 40, 93], 2), ([5, 1, 20], [5, 30, 60], 1)],
    ids=["decode", "split decode", "prefill and decode"],
)
def test_the_triton_kernels_read_an_fp8_cache_as_the_values_it_rounds_to(query_lens, seq_lens, splits):
    # The step's own K/V are stored by torch (kv_stored): the interpreter's e4m3 rounding does not carry a
    # mantissa overflow into the exponent (1.97 -> 1.0), which compiled kernels do right (tests/gpu checks them).
    fp8, rounded = fp8_step(random_step(query_lens, seq_lens, block_size=16, group=2))
    q, k, v, k8, v8, meta = fp8
    store_kv(k, v, k8, v8, meta.slot_mapping)
    out = TritonPagedAttention(num_decode_splits=splits).forward(q, k, v, k8, v8, meta, 0.25, kv_stored=True)
    expected = reference_attention(*rounded, 0.25)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-5


def test_an_fp8_cache_holds_twice_the_tokens_of_a_bf16_one(tmp_path):
    model = make_tiny_model(tmp_path / "llama", arch="llama")
    bf16 = read_model_spec(model, "bfloat16")
    fp8 = read_model_spec(model, "bfloat16", kv_cache_dtype="fp8_e4m3")
    assert bf16.kv_bytes_per_token == 2 * fp8.kv_bytes_per_token
    options = {"dtype": "float32", "device": "cpu", "kv_cache_gb": 0.01}
    blocks = {}
    for kv in ("auto", "fp8_e4m3"):
        engine = create_engine("native", str(model), {**options, "kv_cache_dtype": kv})
        blocks[kv] = engine.blocks.num_blocks
        assert engine.kv_caches[0][0].dtype == (FP8 if kv == "fp8_e4m3" else torch.float32)
        engine.close()
    assert blocks["fp8_e4m3"] // 4 == blocks["auto"]  # float32 on CPU: 4 bytes a value against 1


def test_an_fp8_cache_generates_alike_with_the_asynchronous_and_the_synchronous_loop(tmp_path):
    model = make_tiny_model(tmp_path / "qwen3", arch="qwen3")
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [Request(id=i, prompt_ids=list(range(5 + i, 30 + 3 * i)), sampling=sampling) for i in range(4)]
    outputs = []
    for engine_name in ("native", "native_sync"):
        options = {"dtype": "float32", "device": "cpu", "kv_cache_dtype": "fp8_e4m3"}
        engine = create_engine(engine_name, str(model), options)
        outputs.append({c.id: c.token_ids for c in engine.generate(requests)})
        engine.close()
    assert outputs[0] == outputs[1]


def test_a_job_records_the_kv_cache_dtype_and_a_resume_cannot_change_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def job(*extra):
        return subprocess.run(
            [sys.executable, "-m", "batchjob", f"output.dir={tmp_path / 'out'}", "engine=native", "data.limit=4",
             "sampling.max_new_tokens=4", *extra],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip

    assert job("engine.kv_cache_dtype=fp8_e4m3").returncode == 0
    record = json.loads((tmp_path / "out.batchjob" / "_job.json").read_text())
    assert record["engine"]["kv_cache_dtype"] == "fp8_e4m3"
    changed = job()
    assert changed.returncode == 2 and "kv_cache_dtype" in changed.stderr
    typo = job("engine.kv_cache_dtype=fp8")
    assert typo.returncode == 2 and "engine.kv_cache_dtype='fp8'" in typo.stderr and "Traceback" not in typo.stderr
