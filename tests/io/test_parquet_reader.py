"""Parquet input: which rows, which columns, which ids, and errors that say how to fix the config."""

from __future__ import annotations

import shutil
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


def test_files_with_different_columns_are_refused_naming_the_difference(prompts_dir: Path) -> None:
    pq.write_table(pa.table({"id": [1], "prompt": ["x"]}), prompts_dir / "d.parquet")
    with pytest.raises(InputError, match="d.parquet lacks 'topic' beside the columns of .*a.parquet: all Parquet"):
        open_input(InputSpec(str(prompts_dir)))


def test_files_with_the_same_columns_in_another_order_are_one_input(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["a"], "n": [1]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"n": [2], "prompt": ["b"]}), tmp_path / "b.parquet")
    source = open_input(InputSpec(str(tmp_path)))
    assert source.columns == ["prompt", "n"]
    assert read_all(InputSpec(str(tmp_path)), ["prompt", "n"]).to_pydict() == {
        "row_id": [0, 1],
        "prompt": ["a", "b"],
        "n": [1, 2],
    }


def test_a_column_stored_with_other_types_in_other_files_reads_as_one_widened_type(tmp_path: Path) -> None:
    first = {"prompt": pa.array(["a"]).dictionary_encode(), "n": pa.array([1], pa.int32())}
    pq.write_table(pa.table(first), tmp_path / "a.parquet")
    pq.write_table(pa.table({"prompt": pa.array(["b"], pa.large_string()), "n": [2**40]}), tmp_path / "b.parquet")
    source = open_input(InputSpec(str(tmp_path)))
    expected = pa.schema([("prompt", pa.large_string()), ("n", pa.int64())])
    assert source.column_types(["prompt", "n"]) == expected
    batches = list(source.iter_batches(["prompt", "n"]))
    assert [b.schema for b in batches] == [pa.schema([("row_id", pa.int64()), *expected])] * 2
    assert pa.Table.from_batches(batches).column("n").to_pylist() == [1, 2**40]


def test_a_column_of_types_no_cast_reconciles_is_refused_naming_both_files(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["a"], "n": [1]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"prompt": ["b"], "n": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(InputError, match="column 'n' is int64 in .*a.parquet but string in .*b.parquet: write it"):
        open_input(InputSpec(str(tmp_path)))


def test_a_file_with_two_columns_of_one_name_is_refused_naming_the_name(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["prompt", "prompt"]), path)
    with pytest.raises(InputError, match="p.parquet has more than one column named 'prompt'.*rename them"):
        open_input(InputSpec(str(path)))


@pytest.mark.parametrize("writer", ["pandas", "polars", "duckdb"])
def test_hive_partition_directories_are_columns_of_their_files_rows(tmp_path: Path, writer: str) -> None:
    import pandas as pd

    frame = pd.DataFrame({"prompt": ["p0", "p1", "p2", "p3"], "lang": ["en", "fr", "en", "de"], "year": [1, 1, 2, 2]})
    root = tmp_path / "partitioned"
    if writer == "pandas":
        frame.to_parquet(root, partition_cols=["lang", "year"])
    elif writer == "polars":
        import polars as pl

        pl.from_pandas(frame).write_parquet(root, partition_by=["lang", "year"])
    else:
        import duckdb

        duckdb.sql(f"COPY (SELECT * FROM frame) TO '{root}' (FORMAT PARQUET, PARTITION_BY (lang, year))")
    source = open_input(InputSpec(str(root)))
    assert sorted(source.columns) == ["lang", "prompt", "year"]
    table = pa.Table.from_batches(list(source.iter_batches(["prompt", "lang", "year"])))
    # Rows in sorted path order: lang=de, then lang=en/year=1, lang=en/year=2, then lang=fr.
    assert table.select(["row_id", "prompt", "lang", "year"]).to_pylist() == [
        {"row_id": 0, "prompt": "p3", "lang": "de", "year": 2},
        {"row_id": 1, "prompt": "p0", "lang": "en", "year": 1},
        {"row_id": 2, "prompt": "p2", "lang": "en", "year": 2},
        {"row_id": 3, "prompt": "p1", "lang": "fr", "year": 1},
    ]
    assert source.column_types(["year"]) == pa.schema([("year", pa.int64())])  # integer names are integers


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


def test_a_delta_lake_table_is_refused_since_its_files_hold_earlier_versions(prompts_dir: Path) -> None:
    (prompts_dir / "_delta_log").mkdir()
    (prompts_dir / "_delta_log" / "00000000000000000000.json").write_text("{}\n")
    with pytest.raises(InputError, match="is a Delta Lake table .*write its current version to Parquet"):
        open_input(InputSpec(str(prompts_dir)))


def test_a_hudi_table_is_refused_like_a_delta_table(prompts_dir: Path) -> None:
    (prompts_dir / ".hoodie").mkdir()
    (prompts_dir / ".hoodie" / "hoodie.properties").write_text("hoodie.table.name=t\n")
    with pytest.raises(InputError, match="is an Apache Hudi table .*write its current version to Parquet"):
        open_input(InputSpec(str(prompts_dir)))


def test_an_iceberg_table_and_its_data_folder_are_refused(tmp_path: Path, prompts_dir: Path) -> None:
    table = tmp_path / "warehouse" / "db" / "prompts"
    (table / "metadata").mkdir(parents=True)
    shutil.copytree(prompts_dir, table / "data")
    assert read_all(InputSpec(str(table / "data")), ["prompt"]).num_rows  # no metadata yet: plain Parquet files
    (table / "metadata" / "00001-6a1f.metadata.json").write_text('{"format-version": 2}')
    for path, what in ((table, "an Apache Iceberg table"), (table / "data", "the data folder of an Apache Iceberg")):
        with pytest.raises(InputError, match=f"is {what}.*pyiceberg"):
            open_input(InputSpec(str(path)))


def spark_and_dask_sidecars(directory: Path) -> None:
    """What Spark (_SUCCESS, Hadoop's .crc checksums) and Dask (_metadata, _common_metadata) write beside parts."""
    (directory / "_SUCCESS").write_bytes(b"")
    (directory / ".a.parquet.crc").write_bytes(b"crc\x00")
    files = sorted(directory.glob("*.parquet"))
    collected: list = []
    for file in files:
        collected.append(pq.read_metadata(file))
        collected[-1].set_file_path(file.name)
    schema = pq.read_schema(files[0])
    pq.write_metadata(schema, directory / "_common_metadata")
    pq.write_metadata(schema, directory / "_metadata", metadata_collector=collected)


def test_a_glob_skips_underscore_and_dot_files_as_a_directory_does(prompts_dir: Path) -> None:
    spark_and_dask_sidecars(prompts_dir)
    table = read_all(InputSpec(str(prompts_dir / "*")), ["prompt"])
    assert table.column("row_id").to_pylist() == list(range(100))


def test_a_metadata_summary_file_named_by_a_glob_is_refused_as_no_data(prompts_dir: Path) -> None:
    spark_and_dask_sidecars(prompts_dir)
    with pytest.raises(InputError, match="_metadata is a summary of other Parquet files' row groups"):
        open_input(InputSpec(str(prompts_dir / "_meta*")))


@pytest.mark.parametrize("name", ["PROMPTS.PARQUET", "prompts.parq", "part-00000"])
def test_a_parquet_file_named_without_the_parquet_suffix_is_read_as_parquet(tmp_path: Path, name: str) -> None:
    path = write_prompts(tmp_path / name, 0, 5, row_group_rows=5)
    assert read_all(InputSpec(str(path)), ["prompt"]).column("row_id").to_pylist() == list(range(5))


def test_a_value_one_file_cannot_hold_in_the_common_type_is_named_with_its_file(tmp_path: Path) -> None:
    # Seconds in one file, nanoseconds in another: the common type is nanoseconds, which end in 2262.
    import datetime

    pq.write_table(pa.table({"prompt": ["a"], "t": pa.array([datetime.datetime(2020, 1, 1)], pa.timestamp("ns"))}),
                   tmp_path / "a.parquet")  # fmt: skip
    pq.write_table(pa.table({"prompt": ["b"], "t": pa.array([datetime.datetime(2900, 1, 1)], pa.timestamp("s"))}),
                   tmp_path / "b.parquet")  # fmt: skip
    source = open_input(InputSpec(str(tmp_path)))
    with pytest.raises(InputError, match=r"column 't' \(timestamp\[.s\] in .*b.parquet\) cannot be read as the other "):
        list(source.iter_batches(["prompt", "t"]))
