"""Suite-wide: the tests share two CPU cores, where torch's default of one OpenMP thread per core makes
small models many times slower. Set before torch is imported here, and inherited by every job the tests
start (subprocesses, Slurm tasks)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels can only run interpreted here. Triton 3.6 reads this when it is first imported, and
    # transformers imports it early (through torch._dynamo), so it has to be set before any test module loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")
