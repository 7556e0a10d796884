"""The job record refuses to mix outputs of different configurations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from batchjob.io import JobRecordMismatch, LockError, OutputDataset

JOB = {"model": "tiny-llama", "sampling": {"temperature": 0.0, "max_new_tokens": 8}, "input": {"rows": 10}}


def commit_rows(directory: Path, ids: list[int], record: dict = JOB, **kwargs: int) -> None:
    with OutputDataset(str(directory), **kwargs) as out:
        out.open(record)
        out.commit(pa.table({"row_id": np.array(ids, dtype=np.int64)}))
        out.mark_success()


def test_first_open_writes_the_record(tmp_path: Path) -> None:
    commit_rows(tmp_path, [0])
    assert json.loads((tmp_path / "_job.json").read_text()) == {**JOB, "shard_count": 1}


def test_same_record_resumes(tmp_path: Path) -> None:
    commit_rows(tmp_path, [0])
    with OutputDataset(str(tmp_path)) as out:
        out.open({**JOB, "sampling": {"max_new_tokens": 8, "temperature": 0.0}})
        assert out.committed_row_ids().tolist() == [0]


def test_different_record_is_refused_naming_each_changed_key(tmp_path: Path) -> None:
    commit_rows(tmp_path, [0])
    changed = {**JOB, "model": "tiny-qwen3", "sampling": {"temperature": 0.7, "max_new_tokens": 8}}
    with pytest.raises(JobRecordMismatch) as refused:
        OutputDataset(str(tmp_path)).open(changed)
    message = str(refused.value)
    assert "model: 'tiny-llama' -> 'tiny-qwen3'" in message
    assert "sampling.temperature: 0.0 -> 0.7" in message
    assert "max_new_tokens" not in message
    assert "rerun with resume=false" in message


def test_refusal_releases_the_lock(tmp_path: Path) -> None:
    commit_rows(tmp_path, [0])
    with pytest.raises(JobRecordMismatch):
        OutputDataset(str(tmp_path)).open({**JOB, "model": "other"})
    assert not (tmp_path / "_lock-s00000").exists()


def test_changing_the_shard_count_is_refused(tmp_path: Path) -> None:
    commit_rows(tmp_path, [0], shard_index=0, shard_count=2)
    with pytest.raises(JobRecordMismatch, match="shard_count: 2 -> 3"):
        OutputDataset(str(tmp_path), shard_index=0, shard_count=3).open(JOB)


def test_resume_false_starts_this_shard_over_with_the_new_record(tmp_path: Path) -> None:
    commit_rows(tmp_path, [0, 1])
    changed = {**JOB, "model": "tiny-qwen3"}
    with OutputDataset(str(tmp_path)) as out:
        out.open(changed, resume=False)
        assert out.committed_row_ids().tolist() == []
        assert not out.is_success()
        assert not list(tmp_path.glob("part-*"))
    assert json.loads((tmp_path / "_job.json").read_text())["model"] == "tiny-qwen3"


def test_resume_false_leaves_other_shards_alone(tmp_path: Path) -> None:
    commit_rows(tmp_path, [0], shard_index=0, shard_count=2)
    commit_rows(tmp_path, [5], shard_index=1, shard_count=2)
    with OutputDataset(str(tmp_path), shard_index=1, shard_count=2) as out:
        out.open(JOB, resume=False)
    with OutputDataset(str(tmp_path), shard_index=0, shard_count=2) as out:
        out.open(JOB)
        assert out.committed_row_ids().tolist() == [0]
        assert out.is_success()


def two_finished_shards(directory: Path) -> None:
    commit_rows(directory, [0], shard_index=0, shard_count=2)
    commit_rows(directory, [5], shard_index=1, shard_count=2)


def test_resume_false_with_a_new_record_is_refused_while_another_shard_holds_rows(tmp_path: Path) -> None:
    two_finished_shards(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(JobRecordMismatch) as refused:
        OutputDataset(str(tmp_path), shard_index=0, shard_count=2).open({**JOB, "model": "other"}, resume=False)
    message = str(refused.value)
    assert "model: 'tiny-llama' -> 'other'" in message
    assert "shard 1 (1 committed rows)" in message
    assert "new output.dir" in message and "output.overwrite=true" in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_overwrite_deletes_every_shard_and_writes_the_new_record(tmp_path: Path) -> None:
    two_finished_shards(tmp_path)
    changed = {**JOB, "model": "other"}
    with OutputDataset(str(tmp_path), shard_index=0, shard_count=2) as out:
        out.open(changed, overwrite=True)
        assert out.committed_row_ids().tolist() == []
    assert not list(tmp_path.glob("part-*")) and not list(tmp_path.glob("_SUCCESS*"))
    assert json.loads((tmp_path / "_job.json").read_text())["model"] == "other"
    with OutputDataset(str(tmp_path), shard_index=1, shard_count=2) as out:
        out.open(changed, overwrite=True)  # the same record now: the other shard starts normally
        assert out.committed_row_ids().tolist() == []


def test_overwrite_with_the_same_record_resumes(tmp_path: Path) -> None:
    two_finished_shards(tmp_path)
    with OutputDataset(str(tmp_path), shard_index=1, shard_count=2) as out:
        out.open(JOB, overwrite=True)
        assert out.committed_row_ids().tolist() == [5]


def test_overwrite_is_refused_while_another_shard_is_being_written(tmp_path: Path) -> None:
    two_finished_shards(tmp_path)
    with OutputDataset(str(tmp_path), shard_index=1, shard_count=2) as writer:
        writer.open(JOB)
        with pytest.raises(LockError, match="_lock-s00001"):
            OutputDataset(str(tmp_path), shard_index=0, shard_count=2).open({**JOB, "model": "other"}, overwrite=True)
        assert writer.committed_row_ids().tolist() == [5]
    assert json.loads((tmp_path / "_job.json").read_text())["model"] == "tiny-llama"


def test_a_record_without_committed_rows_is_replaced(tmp_path: Path) -> None:
    with OutputDataset(str(tmp_path)) as out:
        out.open(JOB)  # a start that failed before committing anything
    with OutputDataset(str(tmp_path)) as out:
        out.open({**JOB, "model": "fixed"})
    assert json.loads((tmp_path / "_job.json").read_text())["model"] == "fixed"
