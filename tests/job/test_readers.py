"""Every common Parquet reader, given the plain output directory, reads exactly the committed rows: of a
finished job, and of a job killed with SIGKILL mid-run (before any rerun repaired anything)."""

from __future__ import annotations

import random
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from jobtools import run_cli, start_cli, wait_for, write_prompts

from batchjob.io import OutputDataset

ROWS = 30
SMALL_PARTS = ("output.commit_every_rows=3", "output.commit_every_s=1000", "engine.max_batch_size=1")


def pyarrow_dataset(directory: Path, _: Path) -> list[int]:
    return pads.dataset(str(directory), format="parquet").to_table().column("row_id").to_pylist()


def pandas_read_parquet(directory: Path, _: Path) -> list[int]:
    import pandas

    return pandas.read_parquet(directory)["row_id"].tolist()


def polars_read_parquet(directory: Path, _: Path) -> list[int]:
    import polars

    return polars.read_parquet(directory)["row_id"].to_list()


def polars_scan_parquet(directory: Path, _: Path) -> list[int]:
    import polars

    return polars.scan_parquet(directory).collect()["row_id"].to_list()


def duckdb_directory(directory: Path, _: Path) -> list[int]:
    import duckdb

    return [row[0] for row in duckdb.sql(f"SELECT row_id FROM read_parquet('{directory}')").fetchall()]


def duckdb_glob(directory: Path, _: Path) -> list[int]:
    import duckdb

    return [row[0] for row in duckdb.sql(f"SELECT row_id FROM read_parquet('{directory}/*.parquet')").fetchall()]


def polars_glob(directory: Path, _: Path) -> list[int]:
    import polars

    return polars.read_parquet(f"{directory}/*.parquet")["row_id"].to_list()


def duckdb_recursive_glob_hive(directory: Path, _: Path) -> list[int]:
    import duckdb

    query = f"SELECT row_id FROM read_parquet('{directory}/**/*.parquet', hive_partitioning=true)"
    return [row[0] for row in duckdb.sql(query).fetchall()]


def pyarrow_dataset_hive(directory: Path, _: Path) -> list[int]:
    dataset = pads.dataset(str(directory), format="parquet", partitioning="hive")
    return dataset.to_table().column("row_id").to_pylist()


def datasets_load_dataset(directory: Path, scratch: Path) -> list[int]:
    import datasets

    loaded = datasets.load_dataset("parquet", data_dir=str(directory), split="train", cache_dir=str(scratch))
    return loaded["row_id"]


READERS: dict[str, Callable[[Path, Path], list[int]]] = {
    f.__name__: f
    for f in (
        pyarrow_dataset,
        pandas_read_parquet,
        polars_read_parquet,
        polars_scan_parquet,
        polars_glob,
        duckdb_directory,
        duckdb_glob,
        duckdb_recursive_glob_hive,
        pyarrow_dataset_hive,
        datasets_load_dataset,
    )
}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.parquet", ROWS)


@pytest.fixture(scope="module")
def finished(prompts: Path, tmp_path_factory) -> tuple[Path, list[int]]:
    out = tmp_path_factory.mktemp("finished") / "out"
    done = run_cli(f"data.path={prompts}", f"output.dir={out}", *SMALL_PARTS)
    assert done.returncode == 0, done.stderr
    return out, list(range(ROWS))


@pytest.fixture(scope="module")
def killed(prompts: Path, tmp_path_factory) -> tuple[Path, list[int]]:
    """A copy of the output directory as SIGKILL left it, and the rows committed there (asked of the
    output layer, which recovers the shard first)."""
    base = tmp_path_factory.mktemp("killed")
    out = base / "out"
    job = start_cli(f"data.path={prompts}", f"output.dir={out}", *SMALL_PARTS)
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 3, job, "3 committed parts")
    time.sleep(random.Random(3).uniform(0.0, 0.05))
    job.send_signal(signal.SIGKILL)
    job.wait()
    as_left = base / "as-left"
    shutil.copytree(out, as_left)
    with OutputDataset(str(out)) as dataset:
        dataset.open(_job_record_of(out))
        committed = dataset.committed_row_ids().tolist()
    assert 0 < len(committed) < ROWS
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in as_left.iterdir()), "nothing to repair"
    return as_left, committed


def _job_record_of(out: Path) -> dict:
    import json

    record = json.loads((out.with_name(out.name + ".batchjob") / "_job.json").read_text())
    return record


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("job", ["finished", "killed"])
def test_reader_reads_exactly_the_committed_rows(reader: str, job: str, request, tmp_path: Path) -> None:
    directory, committed = request.getfixturevalue(job)
    assert sorted(READERS[reader](directory, tmp_path)) == committed
