"""Shards: disjoint, and together the whole input exactly once, for every reader."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
from conftest import prompts_table, write_prompts

from batchjob.io import InputSpec, open_input

SHARD_COUNTS = (1, 2, 3, 7)


def shard_ids(spec_kwargs: dict, count: int) -> list[np.ndarray]:
    out = []
    for index in range(count):
        source = open_input(InputSpec(**spec_kwargs, shard_index=index, shard_count=count, batch_rows=4))
        batches = list(source.iter_batches(["prompt"]))
        ids = np.concatenate([b.column("row_id").to_numpy() for b in batches]) if batches else np.empty(0)
        assert source.num_rows() in (None, len(ids))
        out.append(ids)
    return out


def assert_partition(shards: list[np.ndarray], expected: np.ndarray) -> None:
    union = np.concatenate(shards)
    assert len(union) == len(expected), "a row is in two shards or in none"
    assert np.array_equal(np.sort(union), np.sort(expected))


@pytest.mark.parametrize("count", SHARD_COUNTS)
def test_parquet_shards_partition_the_input(prompts_dir: Path, count: int) -> None:
    assert_partition(shard_ids({"path": str(prompts_dir)}, count), np.arange(100))


@pytest.mark.parametrize("count", SHARD_COUNTS)
def test_parquet_shards_partition_when_shards_outnumber_row_groups(tmp_path: Path, count: int) -> None:
    path = write_prompts(tmp_path / "p.parquet", 0, 11, row_group_rows=6)  # 2 row groups
    assert_partition(shard_ids({"path": str(path)}, count), np.arange(11))


def test_parquet_shards_are_contiguous_ranges(prompts_dir: Path) -> None:
    shards = shard_ids({"path": str(prompts_dir)}, 3)
    assert [(s[0], s[-1]) for s in shards] == [(0, 32), (33, 65), (66, 99)]


@pytest.mark.parametrize("count", SHARD_COUNTS)
def test_parquet_shards_partition_the_limited_input(prompts_dir: Path, count: int) -> None:
    assert_partition(shard_ids({"path": str(prompts_dir), "limit": 45}, count), np.arange(45))


def test_every_shard_reports_the_whole_jobs_row_count_after_limit(prompts_dir: Path, saved_dataset: Path) -> None:
    for path, limit, expected in ((prompts_dir, 45, 45), (prompts_dir, None, 100), (saved_dataset, 500, 50)):
        sources = [open_input(InputSpec(str(path), limit=limit, shard_index=i, shard_count=3)) for i in range(3)]
        assert [s.job_rows() for s in sources] == [expected] * 3


def test_more_shards_than_rows_leaves_some_empty(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.parquet", 0, 3, row_group_rows=3)
    shards = shard_ids({"path": str(path)}, 7)
    assert sum(len(s) == 0 for s in shards) == 4
    assert_partition(shards, np.arange(3))


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "saved"
    datasets.Dataset(prompts_table(0, 50)).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("count", SHARD_COUNTS)
def test_saved_dataset_shards_partition_the_input(saved_dataset: Path, count: int) -> None:
    assert_partition(shard_ids({"path": str(saved_dataset)}, count), np.arange(50))


def test_saved_dataset_reads_like_parquet(saved_dataset: Path) -> None:
    source = open_input(InputSpec(str(saved_dataset), id_column="id"))
    assert source.columns == ["id", "prompt", "topic"]
    batch = next(source.iter_batches(["prompt"], skip_row_ids=np.array([10_000], dtype=np.int64)))
    assert batch.schema.names == ["row_id", "prompt"]
    assert batch.column("row_id").to_pylist()[:2] == [10_003, 10_006]
    assert batch.column("prompt").to_pylist()[:2] == ["prompt 1", "prompt 2"]


@pytest.fixture(scope="module")
def parquet_for_load_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_prompts(tmp_path_factory.mktemp("hub") / "p.parquet", 0, 40, row_group_rows=9))


@pytest.mark.parametrize("count", SHARD_COUNTS)
def test_streaming_shards_partition_the_input(parquet_for_load_dataset: str, count: int) -> None:
    spec = {"path": "parquet", "data_files": parquet_for_load_dataset, "streaming": True}
    assert_partition(shard_ids(spec, count), np.arange(40))


def test_streaming_parquet_files_have_known_counts_limit_and_id_column(parquet_for_load_dataset: str) -> None:
    spec = InputSpec("parquet", data_files=parquet_for_load_dataset, streaming=True, id_column="id", limit=5)
    source = open_input(spec)
    assert (source.num_rows(), source.job_rows()) == (5, 5)
    ids = [i for b in source.iter_batches(["prompt"]) for i in b.column("row_id").to_pylist()]
    assert ids == [10_000 + 3 * i for i in range(5)]


@pytest.fixture(scope="module")
def jsonl_files(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("jsonl")
    for part, (start, stop) in enumerate(((0, 17), (17, 40))):
        prompts_table(start, stop).to_pandas().to_json(directory / f"part{part}.jsonl", orient="records", lines=True)
    return str(directory / "*.jsonl")


@pytest.mark.parametrize("count", SHARD_COUNTS)
def test_streaming_non_parquet_files_shard_by_row_index(jsonl_files: str, count: int) -> None:
    spec = {"path": "json", "data_files": jsonl_files, "streaming": True}
    assert_partition(shard_ids(spec, count), np.arange(40))


def test_load_dataset_without_streaming_shards_by_range(parquet_for_load_dataset: str) -> None:
    spec = {"path": "parquet", "data_files": parquet_for_load_dataset}
    shards = shard_ids(spec, 3)
    assert_partition(shards, np.arange(40))
    assert shards[0].tolist() == list(range(13))
