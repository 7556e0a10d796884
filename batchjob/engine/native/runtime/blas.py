"""Which BLAS library runs a step's matmuls: cuBLASLt for decode steps of 17 to 64 rows, cuBLAS otherwise.

torch sends a bf16 matmul to cuBLAS or to cuBLASLt by a process-wide preference, read at each call (a captured
graph keeps the kernels chosen while it was recorded). On an H200 the two pick different kernels for a decode
step's few rows (docs/history/benchmarks-2026.md, Llama-3.1-8B's projections, microseconds a call from a graph):

| rows | o_proj | down_proj | gate_up_proj | a step's matmuls, 32 layers and the lm_head |
|---|---|---|---|---|
| 8 | 13.1 / 13.1 | 31.7 / 34.6 | 55.6 / 55.6 | 3.953 / 4.044 ms |
| 32 | 13.6 / 11.4 | 33.0 / 30.6 | 57.0 / 57.0 | 4.089 / 3.938 ms |
| 64 | 11.7 / 11.5 | 36.0 / 31.3 | 61.1 / 58.2 | 4.270 / 4.024 ms |
| 128 | 13.9 / 13.9 | 37.3 / 38.9 | 65.6 / 66.1 | 4.537 / 4.604 ms |

(cuBLAS / cuBLASLt; Llama-3.2-1B's steps differ by 2.2% or less either way.) W1, whose decode steps have 32 rows,
ran 2.8% faster with cuBLASLt for every matmul (5,540 -> 5,696 tok/s). The preference is set around the
steps of those sizes only and put back after.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

LT_ROWS = range(17, 65)

_quieted = False


@contextmanager
def for_rows(rows: int, device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Inside, the matmuls of a step of `rows` rows of a `dtype` model on `device` go to the library chosen for
    that size. float32 models stay on cuBLAS: their greedy output is compared with transformers', which uses it."""
    if device.type != "cuda" or rows not in LT_ROWS or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    previous = _set("cublaslt")
    try:
        yield
    finally:
        _set(previous)


def _set(backend):
    """Set torch's preferred BLAS library and return the one before. The first setting prints torch's note that
    the preference is experimental to the process's stderr (not through Python's warnings): that once, stderr is
    sent to /dev/null, so a job's log does not carry it."""
    global _quieted
    previous = torch.backends.cuda.preferred_blas_library()
    with nullcontext() if _quieted else _stderr_to_devnull():
        torch.backends.cuda.preferred_blas_library(backend)
    _quieted = True
    return previous


@contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to quiet (closed by whoever started the process)
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
