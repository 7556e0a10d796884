"""Real Parquet inputs and outputs in tmp_path for the IO layer's tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mounted_dirs import mounted_output  # noqa: F401  (a fixture)
from s3_server import s3_endpoint, s3_output_dir  # noqa: F401  (fixtures)
from small_tmpfs import small_tmpfs  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[2]
PROCS = Path(__file__).with_name("procs.py")


def prompts_table(start: int, stop: int) -> pa.Table:
    """Rows numbered `start..stop-1` in input order; `id` is deliberately not the position."""
    index = np.arange(start, stop)
    return pa.table(
        {
            "id": pa.array(10_000 + 3 * index, type=pa.int64()),
            "prompt": pa.array([f"prompt {i}" for i in index]),
            "topic": pa.array([f"topic {i % 7}" for i in index]),
        }
    )


def write_prompts(path: Path, start: int, stop: int, row_group_rows: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(prompts_table(start, stop), path, row_group_size=row_group_rows)
    return path


@pytest.fixture
def prompts_dir(tmp_path: Path) -> Path:
    """100 rows over three files (sorted names give the input order) with 7-row row groups."""
    directory = tmp_path / "prompts"
    write_prompts(directory / "b.parquet", 30, 70, row_group_rows=7)
    write_prompts(directory / "a.parquet", 0, 30, row_group_rows=7)
    write_prompts(directory / "c.parquet", 70, 100, row_group_rows=7)
    return directory


def run_proc(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run tests/io/procs.py in a fresh interpreter (a real second process)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(PROCS), *args], env=env, capture_output=True, text=True, timeout=timeout)


def start_proc(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(PROCS), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def bookkeeping(out: Path) -> Path:
    """The folder beside an output directory that holds its job record, manifests, locks and reports."""
    return out.with_name(out.name + ".batchjob")
