"""Parquet input: which rows, which columns, which ids, and errors that say how to fix the config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_prompts

from batchjob.io import InputError, InputSpec, open_input


def read_all(spec: InputSpec, columns: list[str]) -> pa.Table:
    return pa.Table.from_batches(list(open_input(spec).iter_batches(columns)))


def test_single_file_yields_row_ids_in_file_order(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.parquet", 0, 25, row_group_rows=10)
    table = read_all(InputSpec(str(path), batch_rows=4), ["prompt"])
    assert table.column_names == ["row_id", "prompt"]
    assert table.column("row_id").type == pa.int64()
    assert table.column("row_id").to_pylist() == list(range(25))
    assert table.column("prompt").to_pylist() == [f"prompt {i}" for i in range(25)]


def test_batches_hold_at_most_batch_rows(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.parquet", 0, 25, row_group_rows=10)
    batches = list(open_input(InputSpec(str(path), batch_rows=4)).iter_batches(["prompt"]))
    assert max(b.num_rows for b in batches) <= 4


def test_directory_reads_files_in_sorted_path_order(prompts_dir: Path) -> None:
    table = read_all(InputSpec(str(prompts_dir)), ["prompt"])
    assert table.column("row_id").to_pylist() == list(range(100))
    assert table.column("prompt").to_pylist() == [f"prompt {i}" for i in range(100)]


def test_directory_ignores_underscore_and_dot_files(prompts_dir: Path) -> None:
    write_prompts(prompts_dir / "_tmp" / "z.parquet", 0, 5, row_group_rows=5)
    write_prompts(prompts_dir / ".hidden.parquet", 0, 5, row_group_rows=5)
    assert open_input(InputSpec(str(prompts_dir))).num_rows() == 100


def test_glob_selects_matching_files(prompts_dir: Path) -> None:
    table = read_all(InputSpec(str(prompts_dir / "[ab].parquet")), ["prompt"])
    assert table.column("prompt").to_pylist() == [f"prompt {i}" for i in range(70)]


def test_fsspec_uri_reads_like_a_local_path(prompts_dir: Path) -> None:
    table = read_all(InputSpec(f"file://{prompts_dir}"), ["prompt"])
    assert table.column("row_id").to_pylist() == list(range(100))


def test_only_requested_columns_are_returned(prompts_dir: Path) -> None:
    source = open_input(InputSpec(str(prompts_dir)))
    assert source.columns == ["id", "prompt", "topic"]
    batch = next(source.iter_batches(["topic"]))
    assert batch.schema.names == ["row_id", "topic"]


def test_id_column_gives_row_ids_without_being_returned(prompts_dir: Path) -> None:
    table = read_all(InputSpec(str(prompts_dir), id_column="id"), ["prompt"])
    assert table.column_names == ["row_id", "prompt"]
    assert table.column("row_id").to_pylist() == [10_000 + 3 * i for i in range(100)]


def test_limit_keeps_the_first_rows_of_the_whole_input(prompts_dir: Path) -> None:
    source = open_input(InputSpec(str(prompts_dir), limit=42))
    assert source.num_rows() == 42
    ids = pa.Table.from_batches(list(source.iter_batches([]))).column("row_id").to_pylist()
    assert ids == list(range(42))


def test_skip_row_ids_drops_exactly_those_rows(prompts_dir: Path) -> None:
    skip = np.array([0, 1, 2, 3, 4, 5, 6, 13, 50, 99], dtype=np.int64)  # 0..6 is a whole row group
    source = open_input(InputSpec(str(prompts_dir), batch_rows=5))
    ids = np.concatenate([b.column(0).to_numpy() for b in source.iter_batches(["prompt"], skip)])
    assert ids.tolist() == np.setdiff1d(np.arange(100), skip).tolist()


def test_skip_row_ids_applies_to_id_column_values(prompts_dir: Path) -> None:
    skip = np.array([10_000, 10_003, 10_297], dtype=np.int64)
    source = open_input(InputSpec(str(prompts_dir), id_column="id"))
    ids = np.concatenate([b.column(0).to_numpy() for b in source.iter_batches([], skip)])
    assert len(ids) == 97 and not np.isin(skip, ids).any()


def test_everything_skipped_yields_nothing(prompts_dir: Path) -> None:
    source = open_input(InputSpec(str(prompts_dir)))
    assert list(source.iter_batches(["prompt"], np.arange(100, dtype=np.int64))) == []


def test_missing_path_names_the_setting_to_fix(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"no such file or directory: .*nope.parquet; data.path must be"):
        open_input(InputSpec(str(tmp_path / "nope.parquet")))


def test_glob_matching_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no Parquet files matched"):
        open_input(InputSpec(str(tmp_path / "*.parquet")))


def test_missing_id_column_lists_the_columns(prompts_dir: Path) -> None:
    with pytest.raises(InputError, match=r"data.id_column='uid' is not a column .* columns are: id, prompt, topic"):
        open_input(InputSpec(str(prompts_dir), id_column="uid"))


def test_id_column_of_another_type_is_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"score": [0.5, 1.5], "prompt": ["a", "b"]}), tmp_path / "p.parquet")
    with pytest.raises(InputError, match="has type double, but ids must be integers or strings"):
        open_input(InputSpec(str(tmp_path / "p.parquet"), id_column="score"))


def test_string_id_column_rides_along_and_row_ids_stay_positions(prompts_dir: Path) -> None:
    source = open_input(InputSpec(str(prompts_dir), id_column="topic", shard_index=1, shard_count=2))
    assert source.ids_are_positions
    skip = np.arange(50, 57, dtype=np.int64)  # a whole row group of this shard, finished earlier
    table = pa.Table.from_batches(list(source.iter_batches(["prompt"], skip)))
    assert table.column_names == ["row_id", "prompt", "topic"]
    assert table.column("row_id").to_pylist() == list(range(57, 100))
    assert table.column("topic").to_pylist()[:2] == ["topic 1", "topic 2"]


def test_requesting_a_missing_column_lists_the_columns(prompts_dir: Path) -> None:
    source = open_input(InputSpec(str(prompts_dir)))
    with pytest.raises(InputError, match="column.s. messages not found .* columns are: id, prompt, topic"):
        next(source.iter_batches(["messages"]))


def test_files_with_different_columns_are_refused(prompts_dir: Path) -> None:
    pq.write_table(pa.table({"text": ["x"]}), prompts_dir / "d.parquet")
    with pytest.raises(InputError, match="must share their columns"):
        open_input(InputSpec(str(prompts_dir)))


def test_fingerprint_changes_when_a_file_changes(prompts_dir: Path) -> None:
    before = open_input(InputSpec(str(prompts_dir))).fingerprint()
    assert before == open_input(InputSpec(str(prompts_dir))).fingerprint()
    write_prompts(prompts_dir / "c.parquet", 70, 101, row_group_rows=7)
    assert open_input(InputSpec(str(prompts_dir))).fingerprint() != before


def test_memory_filesystem_uri_is_read_through_fsspec() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    with fs.open("/batchjob-input/p.parquet", "wb") as f:
        pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), f, row_group_size=2)
    source = open_input(InputSpec("memory://batchjob-input/p.parquet", shard_index=1, shard_count=2))
    batch = next(source.iter_batches(["prompt"]))
    assert batch.to_pydict() == {"row_id": [1, 2], "prompt": ["b", "c"]}
    assert source.fingerprint()["files"][0]["size"] > 0
