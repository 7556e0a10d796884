"""Reading a Parquet input takes memory bounded by a row group, not by the row count."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import run_proc

ROW_GROUP_ROWS = 10_000


def write_large_input(path: Path, rows: int) -> Path:
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string())])
    filler = "x" * 40  # with the row number, prompts are ~50 bytes
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, ROW_GROUP_ROWS):
            ids = range(start, start + ROW_GROUP_ROWS)
            writer.write_table(pa.table({"id": list(ids), "prompt": [f"{i:010d}{filler}" for i in ids]}, schema))
    return path


def peak_mib(path: Path) -> float:
    result = run_proc("peak-rss", str(path), "1024")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["rows"] == pq.ParquetFile(path).metadata.num_rows
    return report["peak_mib"]


def test_peak_memory_does_not_grow_with_input_rows(tmp_path: Path) -> None:
    small = peak_mib(write_large_input(tmp_path / "small.parquet", 200_000))
    large = peak_mib(write_large_input(tmp_path / "large.parquet", 1_000_000))
    assert large < small + 40, f"peak RSS {large:.0f} MiB for 1M rows vs {small:.0f} MiB for 200k rows"
