"""Fixtures for job tests; the helpers they use live in jobtools.py."""

from __future__ import annotations

import pytest
from mounted_dirs import mounted_output  # noqa: F401  (a fixture)
from s3_server import s3_endpoint, s3_output_dir  # noqa: F401  (fixtures)
from small_tmpfs import small_tmpfs  # noqa: F401  (a fixture)

from batchjob.job.tiny_model import default_tiny_model


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> None:
    """Tests share two cores with other work; spinning OpenMP threads there are ten times slower."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(default_tiny_model())
