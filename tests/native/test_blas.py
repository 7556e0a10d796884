"""On CPU the BLAS choice does nothing: torch's preference stays as it was for every step size (a CPU build of
torch refuses cuBLASLt outright, so a choice made here would raise). tests/gpu/test_blas_gpu.py checks CUDA."""

from __future__ import annotations

import pytest
import torch

from batchjob.engine.native.runtime import blas


@pytest.mark.parametrize("rows", [1, 17, 32, 64, 65])
def test_cpu_steps_leave_the_blas_preference_alone(rows):
    before = torch.backends.cuda.preferred_blas_library()
    with blas.for_rows(rows, torch.device("cpu"), torch.bfloat16):
        assert torch.backends.cuda.preferred_blas_library() == before
    assert torch.backends.cuda.preferred_blas_library() == before
