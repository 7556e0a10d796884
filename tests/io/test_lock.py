"""One writer per shard, and a crashed writer's lock does not block the rerun."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import run_proc, start_proc

from batchjob.io import LockError, OutputDataset
from batchjob.io.lock import LockHolder

JOB = {"model": "tiny", "sampling": {"max_new_tokens": 4}}  # the record procs.py opens with


def test_second_process_on_the_same_shard_is_refused(tmp_path: Path) -> None:
    holder = start_proc("hold-lock", str(tmp_path))
    try:
        assert holder.stdout.readline() == "locked\n", holder.stderr.read()
        refused = run_proc("try-open", str(tmp_path))
        assert refused.returncode == 3, refused.stderr
        assert f"held by pid {holder.pid} on host {os.uname().nodename} since" in refused.stdout
    finally:
        holder.kill()
        holder.wait()


def test_second_writer_in_the_same_process_is_refused(tmp_path: Path) -> None:
    with OutputDataset(str(tmp_path)) as first:
        first.open(JOB)
        with pytest.raises(LockError, match=f"held by pid {os.getpid()}"):
            OutputDataset(str(tmp_path)).open(JOB)


def test_other_shards_are_not_blocked(tmp_path: Path) -> None:
    with OutputDataset(str(tmp_path), 0, 2) as first, OutputDataset(str(tmp_path), 1, 2) as second:
        first.open(JOB)
        second.open(JOB)
        first.commit(pa.table({"row_id": pa.array([0], pa.int64())}))
        second.commit(pa.table({"row_id": pa.array([1], pa.int64())}))
        assert first.committed_row_ids().tolist() == [0]
        assert second.committed_row_ids().tolist() == [1]


def test_lock_of_a_killed_process_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = start_proc("hold-lock", str(tmp_path))
    assert holder.stdout.readline() == "locked\n", holder.stderr.read()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (tmp_path / "_lock-s00000").exists()
    with caplog.at_level(logging.WARNING), OutputDataset(str(tmp_path)) as out:
        out.open(JOB)
    assert f"taking over stale lock {tmp_path / '_lock-s00000'}: pid {holder.pid}" in caplog.text


def test_close_releases_the_lock(tmp_path: Path) -> None:
    out = OutputDataset(str(tmp_path))
    out.open(JOB)
    out.close()
    assert not (tmp_path / "_lock-s00000").exists()
    with OutputDataset(str(tmp_path)) as again:
        again.open(JOB)


def test_lock_of_an_earlier_run_of_a_requeued_slurm_job_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The earlier run may sit on another node where its pid cannot be checked; the requeue proves it over.
    earlier = start_proc("hold-lock", str(tmp_path), env={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"})
    try:
        assert earlier.stdout.readline() == "locked\n", earlier.stderr.read()
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        with caplog.at_level(logging.WARNING), OutputDataset(str(tmp_path)) as out:
            out.open(JOB)
        assert "Slurm requeued job 77 (restart 1)" in caplog.text
    finally:
        earlier.kill()
        earlier.wait()


def test_lock_held_on_another_host_is_refused_with_how_to_clear_it(tmp_path: Path) -> None:
    other = dataclasses.replace(LockHolder.this_process(), host="node-17")
    (tmp_path / "_lock-s00000").write_text(json.dumps(dataclasses.asdict(other)))
    with pytest.raises(LockError, match=r"on host node-17 since .* delete .*_lock-s00000 and rerun"):
        OutputDataset(str(tmp_path)).open(JOB)
