"""`engine.deterministic=true` on a GPU: the batch-invariant matmul computes every row the same bits at every row
count, and an 8B-shaped model (dummy weights) generates the same tokens and log-probabilities, greedy and sampled,
whatever the batch: one sequence at a time or 64 (other graph buckets), small prefill chunks (mixed steps),
eager steps, and the synchronous loop; a tiny mixture of experts likewise.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu -q
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from batchjob.engine import Request, SamplingParams, create_engine  # noqa: E402
from batchjob.engine.native.kernels import invariant_matmul  # noqa: E402
from batchjob.job.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (2048, 8192)])
def test_every_row_of_the_invariant_matmul_is_the_same_bits_at_every_row_count(shape, monkeypatch):
    n, k = shape
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) / k**0.5
    x = torch.randn(2304, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    whole = invariant_matmul.matmul(x, weight)  # a prefill chunk's rows: each program adds its tile's parts itself
    assert invariant_matmul.num_parts(weight) == 1 or invariant_matmul.serial(len(x), weight)
    for rows in (1, 7, 32, 64, 129, 256, 300, 384, 513, 1025, 2049):  # split across programs below `serial`'s rows
        assert torch.equal(invariant_matmul.matmul(x[:rows], weight), whole[:rows]), rows
    parts = invariant_matmul.partial_products(x[:33], weight)
    assert torch.equal(parts, invariant_matmul.partial_products(x, weight)[:, :33])
    split = invariant_matmul.reduce_parts(invariant_matmul.partial_products(x, weight), None, x.dtype)
    assert torch.equal(split, whole)  # the same rows split across programs: the same bits
    # Where a launch cannot take descriptors (an unaligned input), its tiles are loaded by address: the same bits.
    monkeypatch.setattr(invariant_matmul, "TMA_LOADS", False)
    assert torch.equal(invariant_matmul.matmul(x, weight), whole)
    for rows in (1, 64, 513):
        assert torch.equal(invariant_matmul.matmul(x[:rows], weight), whole[:rows]), rows
    expected = x.float() @ weight.float().t()
    assert ((whole.float() - expected).norm() / expected.norm()).item() < 1e-2


def test_the_matmul_profiler_times_the_engine_beside_cublas_and_the_variants_asked_for():
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "matmul_shapes.py"
    args = ["--only", "o,down", "--rows", "32,8192", "--serial-waves", "1", "--parts", "2", "--group-m", "1"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("o ", "down "))]
    assert [(r[0], r[4]) for r in rows] == [("o", "32"), ("o", "8192"), ("down", "32"), ("down", "8192")]
    for row in rows:
        # floor, cuBLAS, engine, waves=1, parts=2, group=1: milliseconds, ! where a variant's bits moved with the rows
        floor, *times = (float(cell.rstrip("!")) for cell in row[5:11])
        assert all(t >= 0.5 * floor for t in times), row  # nothing beats the roofline by 2x
        assert not any(cell.endswith("!") for cell in row[7:11]), row  # each keeps a row's bits
    assert "cuBLAS / each: engine " in done.stdout


def _requests(vocab: int, count: int = 24) -> list[Request]:
    rng = random.Random(5)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(20, 300))]
        temperature = 0.0 if i % 2 else 0.8  # greedy and sampled rows side by side
        sampling = SamplingParams(
            max_new_tokens=24, temperature=temperature, top_p=0.95 if temperature else 1.0, seed=i,
            ignore_eos=True, logprobs=0,
        )  # fmt: skip
        requests.append(Request(id=i, prompt_ids=prompt, sampling=sampling))
    return requests


def _generate(model_dir, requests, **options) -> dict:
    engine = create_engine("native", str(model_dir), {"deterministic": True, "detokenize": False, **options})
    try:
        return {c.id: (c.token_ids, c.samples[0].logprobs) for c in engine.generate(requests)}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
        from bench_lib.models import config_model_dir

        return config_model_dir("llama-3.1-8b", tmp_path_factory.mktemp("8b"))


@pytest.fixture(scope="module")
def reference_8b(llama_8b):
    return _generate(llama_8b, _requests(128256), load_format="dummy", max_num_seqs=64)


@pytest.mark.parametrize(
    "layout",
    [
        {"max_num_seqs": 1},
        {"max_num_seqs": 7, "max_num_batched_tokens": 128},  # prompts cut into chunks beside decodes
        {"max_num_seqs": 64, "cuda_graphs": False},
        {"max_num_seqs": 64, "async_loop": False},
    ],
    ids=["one sequence", "small chunks", "eager steps", "synchronous loop"],
)
def test_an_8b_model_generates_the_same_bits_whatever_the_batch(llama_8b, reference_8b, layout):
    got = _generate(llama_8b, _requests(128256), load_format="dummy", **layout)
    differing = [i for i in reference_8b if got[i] != reference_8b[i]]
    assert not differing, f"rows {differing} differ"


def test_a_mixture_of_experts_generates_the_same_bits_whatever_the_batch(tmp_path):
    moe = make_tiny_model(tmp_path / "moe", arch="qwen3_moe")
    requests = _requests(480, count=16)
    assert _generate(moe, requests, max_num_seqs=1, dtype="bfloat16") == _generate(
        moe, requests, max_num_seqs=64, dtype="bfloat16", max_num_batched_tokens=64
    )
