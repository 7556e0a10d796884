"""Duplicate ids are found before the run, in bounded memory, for every input that can be read up front."""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.io import InputError, InputSpec, open_input
from batchjob.io.unique_ids import check_unique_ids


def write_ids(path: Path, ids: list, row_group_rows: int = 7) -> Path:
    table = pa.table({"uid": ids, "prompt": [f"p{i}" for i in range(len(ids))]})
    pq.write_table(table, path, row_group_size=row_group_rows)
    return path


# 1 partition checks in memory; 30 rows in 4-row partitions go through the temporary partition files.
@pytest.mark.parametrize("partition_rows", [1_000_000, 4])
def test_repeated_integer_ids_are_named(tmp_path: Path, partition_rows: int) -> None:
    path = write_ids(tmp_path / "p.parquet", [*range(30)][:-2] + [3, 17])
    with pytest.raises(InputError, match=r"data.id_column='uid' repeats values \((3, 17|17, 3)\)"):
        check_unique_ids(open_input(InputSpec(str(path), id_column="uid")), partition_rows=partition_rows)


@pytest.mark.parametrize("partition_rows", [1_000_000, 4])
def test_unique_string_ids_pass(tmp_path: Path, partition_rows: int) -> None:
    path = write_ids(tmp_path / "p.parquet", [f"req-{i}" for i in range(30)])
    check_unique_ids(open_input(InputSpec(str(path), id_column="uid")), partition_rows=partition_rows)


def test_repeated_string_ids_are_named(tmp_path: Path) -> None:
    path = write_ids(tmp_path / "p.parquet", [f"req-{i % 20}" for i in range(22)])
    with pytest.raises(InputError, match=r"repeats values \('req-0', 'req-1'\)"):
        check_unique_ids(open_input(InputSpec(str(path), id_column="uid")), partition_rows=5)


def test_null_ids_are_refused(tmp_path: Path) -> None:
    path = write_ids(tmp_path / "p.parquet", ["a", None, "c"])
    with pytest.raises(InputError, match="1 null values"):
        check_unique_ids(open_input(InputSpec(str(path), id_column="uid")))


def test_rows_beyond_the_limit_are_not_the_jobs(tmp_path: Path) -> None:
    path = write_ids(tmp_path / "p.parquet", [0, 1, 2, 3, 0])
    check_unique_ids(open_input(InputSpec(str(path), id_column="uid", limit=4)))


def test_saved_dataset_duplicates_are_refused(tmp_path: Path) -> None:
    datasets.Dataset.from_dict({"uid": [5, 6, 5], "prompt": ["a", "b", "c"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(InputError, match=r"repeats values \(5\)"):
        check_unique_ids(open_input(InputSpec(str(tmp_path / "ds"), id_column="uid")))


def test_uint64_ids_beyond_int64_are_refused_before_the_run_and_while_reading(tmp_path: Path) -> None:
    # 64-bit hashes as uint64: the largest would wrap around to a negative row_id.
    path = write_ids(tmp_path / "p.parquet", pa.array([1, 2**63 + 1, 3], pa.uint64()))
    source = open_input(InputSpec(str(path), id_column="uid"))
    refused = r"data.id_column='uid' holds 9223372036854775809, larger than row_id \(int64\) can hold"
    with pytest.raises(InputError, match=refused):
        check_unique_ids(source)
    with pytest.raises(InputError, match=refused):  # a streaming reader, which has no scan, reads them too
        next(source.iter_batches(["prompt"]))


def test_uint64_ids_within_int64_are_row_ids(tmp_path: Path) -> None:
    path = write_ids(tmp_path / "p.parquet", pa.array([7, 2**63 - 1], pa.uint64()))
    source = open_input(InputSpec(str(path), id_column="uid"))
    check_unique_ids(source)
    assert next(source.iter_batches(["prompt"])).column("row_id").to_pylist() == [7, 2**63 - 1]


@pytest.mark.parametrize("values", [["b", "a", "b"], [9, 4, 9]], ids=["strings", "integers"])
def test_dictionary_encoded_ids_are_the_values_they_encode(tmp_path: Path, values: list) -> None:
    # pandas' category and polars' Categorical columns are dictionary-encoded in Parquet.
    path = write_ids(tmp_path / "p.parquet", pa.array(values[:2]).dictionary_encode())
    source = open_input(InputSpec(str(path), id_column="uid"))
    check_unique_ids(source)
    batch = next(source.iter_batches(["prompt"]))
    if isinstance(values[0], str):
        assert batch.column("uid").to_pylist() == ["b", "a"] and batch.column("uid").type == pa.string()
    else:
        assert batch.column("row_id").to_pylist() == [9, 4]
    repeated = write_ids(tmp_path / "r.parquet", pa.array(values).dictionary_encode())
    with pytest.raises(InputError, match="repeats values"):
        check_unique_ids(open_input(InputSpec(str(repeated), id_column="uid")))


def test_integer_decimal_ids_are_row_ids_and_one_beyond_int64_is_refused(tmp_path: Path) -> None:
    # Snowflake's NUMBER(38,0), Spark's DECIMAL(p, 0) and DuckDB's HUGEINT reach Parquet as decimals of scale 0.
    from decimal import Decimal

    path = write_ids(tmp_path / "p.parquet", pa.array([Decimal(12), Decimal(2**62)], pa.decimal128(38, 0)))
    source = open_input(InputSpec(str(path), id_column="uid"))
    check_unique_ids(source)
    batch = next(source.iter_batches(["prompt", "uid"]))
    assert batch.column("row_id").to_pylist() == [12, 2**62] and batch.column("uid").type == pa.int64()
    repeated = write_ids(tmp_path / "r.parquet", pa.array([Decimal(5), Decimal(5)], pa.decimal128(20, 0)))
    with pytest.raises(InputError, match=r"repeats values \(5\)"):
        check_unique_ids(open_input(InputSpec(str(repeated), id_column="uid")))
    huge = write_ids(tmp_path / "h.parquet", pa.array([Decimal(1), Decimal(2**70)], pa.decimal128(38, 0)))
    with pytest.raises(InputError, match=r"data.id_column='uid' \(decimal128\(38, 0\) in .*cannot hold .*as strings"):
        check_unique_ids(open_input(InputSpec(str(huge), id_column="uid")))
    fraction = write_ids(tmp_path / "f.parquet", pa.array([Decimal("1.5")], pa.decimal128(10, 1)))
    with pytest.raises(InputError, match=r"has type decimal128\(10, 1\), but ids must be integers or strings"):
        open_input(InputSpec(str(fraction), id_column="uid"))
