"""`python -m batchjob.status`: per-shard progress and the exactly-once check, on real output directories."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.io.inputs import InputSpec
from batchjob.io.output import OutputDataset
from batchjob.status import job_status, main

RECORD = {"rows": {"count": 8, "id_column": None}}


def commit(out: Path, shard: int, row_ids: list[int], *, success: bool, record: dict = RECORD) -> None:
    dataset = OutputDataset(str(out), shard, 2)
    dataset.open(record)
    dataset.commit(pa.table({"row_id": pa.array(row_ids, pa.int64()), "completion_tokens": [3] * len(row_ids)}))
    if success:
        dataset.mark_success()
    dataset.close()


def test_complete_job_has_every_row_exactly_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    commit(tmp_path, 0, [0, 1, 2, 3], success=True)
    commit(tmp_path, 1, [4, 5, 6, 7], success=True)
    status = job_status(str(tmp_path))
    assert status.complete
    assert [(s.rows_done, s.rows_total, s.completion_tokens) for s in status.shards] == [(4, 4, 12), (4, 4, 12)]
    assert main([f"output.dir={tmp_path}"]) == 0
    assert "every row exactly once" in capsys.readouterr().out


def test_unfinished_shard_lists_its_missing_rows(tmp_path: Path) -> None:
    commit(tmp_path, 0, [0, 1, 2, 3], success=True)
    commit(tmp_path, 1, [4, 5], success=False)
    status = job_status(str(tmp_path))
    assert not status.complete
    assert status.validation.missing.first == (6, 7)
    assert main([f"output.dir={tmp_path}"]) == 1


def test_a_row_committed_by_two_shards_is_reported_as_duplicate(tmp_path: Path) -> None:
    commit(tmp_path, 0, [0, 1, 2, 3, 4], success=True)
    commit(tmp_path, 1, [4, 5, 6, 7], success=True)
    validation = job_status(str(tmp_path)).validation
    assert (validation.duplicates.count, validation.duplicates.first) == (1, (4,))
    assert not validation.exactly_once


def test_validation_against_the_input_uses_its_id_column(tmp_path: Path) -> None:
    pq.write_table(
        pa.table({"id": pa.array([10, 11, 12, 13], pa.int64()), "prompt": ["a"] * 4}), tmp_path / "in.parquet"
    )
    out = tmp_path / "out"
    commit(out, 0, [10, 11], success=True)
    commit(out, 1, [12, 99], success=True)
    validation = job_status(str(out), InputSpec(path=str(tmp_path / "in.parquet"), id_column="id")).validation
    assert (validation.missing.first, validation.unexpected.first) == ((13,), (99,))


def test_ids_from_an_id_column_are_not_checked_against_positions(tmp_path: Path, capsys) -> None:
    record = {"rows": {"count": 4, "id_column": "id"}}
    commit(tmp_path, 0, [10, 11], success=True, record=record)
    commit(tmp_path, 1, [12, 13], success=True, record=record)
    status = job_status(str(tmp_path))
    assert status.complete
    assert (status.validation.rows_expected, status.validation.ids_checked) == (4, False)
    assert main([f"output.dir={tmp_path}"]) == 0
    assert "pass the job's data.* keys to check the row ids" in capsys.readouterr().out


def test_bad_arguments_print_usage(capsys: pytest.CaptureFixture) -> None:
    assert main(["data.path=x"]) == 2
    assert "usage: python -m batchjob.status output.dir=DIR" in capsys.readouterr().err


def test_a_directory_without_a_job_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([f"output.dir={tmp_path / 'typo'}"]) == 2
    assert "holds no batchjob output (no _job.json)" in capsys.readouterr().err


def test_a_string_id_held_by_two_rows_is_reported(tmp_path: Path, capsys) -> None:
    record = {"rows": {"count": 4, "id_column": "custom_id", "string_ids": True}}
    for shard, row_ids, ids in ((0, [0, 1], ["a", "b"]), (1, [2, 3], ["c", "a"])):
        dataset = OutputDataset(str(tmp_path), shard, 2)
        dataset.open(record)
        dataset.commit(pa.table({"row_id": pa.array(row_ids, pa.int64()), "custom_id": ids}))
        dataset.mark_success()
        dataset.close()
    status = job_status(str(tmp_path))
    assert status.validation.ids_checked  # string ids keep row_id the position: 0..3 are checked too
    assert status.validation.repeated_ids == ("a",)
    assert not status.complete
    assert main([f"output.dir={tmp_path}"]) == 1
    assert "custom_id values in more than one row: 'a'" in capsys.readouterr().out
