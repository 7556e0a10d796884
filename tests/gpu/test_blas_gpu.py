"""The BLAS library a step's matmuls go to (blas.py): cuBLASLt inside decode steps of 17 to 64 rows of a bf16 or
fp16 model, cuBLAS everywhere else and after; and the one note torch prints when the preference is first set
never reaches a job's stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from batchjob.engine.native.runtime import blas  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
CUBLAS, CUBLASLT = torch._C._BlasBackend.Cublas, torch._C._BlasBackend.Cublaslt


@pytest.mark.parametrize(
    ("rows", "dtype", "inside"),
    [
        (16, torch.bfloat16, CUBLAS),
        (17, torch.bfloat16, CUBLASLT),
        (32, torch.float16, CUBLASLT),
        (64, torch.bfloat16, CUBLASLT),
        (65, torch.bfloat16, CUBLAS),
        (32, torch.float32, CUBLAS),
    ],
)
def test_decode_steps_of_17_to_64_rows_of_half_precision_models_use_cublaslt(rows, dtype, inside):
    assert torch.backends.cuda.preferred_blas_library() == CUBLAS
    with blas.for_rows(rows, DEVICE, dtype):
        assert torch.backends.cuda.preferred_blas_library() == inside
        x = torch.randn(rows, 256, device=DEVICE, dtype=dtype)
        w = torch.randn(512, 256, device=DEVICE, dtype=dtype)
        out = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, atol=0.5, rtol=2e-2)
    assert torch.backends.cuda.preferred_blas_library() == CUBLAS


def test_the_preference_leaves_no_note_on_stderr():
    code = (
        "import torch; from batchjob.engine.native.runtime import blas\n"
        "with blas.for_rows(32, torch.device('cuda'), torch.bfloat16):\n"
        "    assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt\n"
        "print('done')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "done"
    assert "experimental" not in run.stderr, run.stderr
