"""One writer per shard, a crashed or lost writer's lock does not block the rerun, and two live writers never
share a shard."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import bookkeeping, run_proc, start_proc

from batchjob.io import LockError, OutputDataset
from batchjob.io.lock import LockHolder

JOB = {"model": "tiny", "sampling": {"max_new_tokens": 4}}  # the record procs.py opens with


def lock_file(out: Path) -> Path:
    return bookkeeping(out) / "locks" / "s00000.json"


def write_foreign_lock(out: Path, age_s: float) -> None:
    """A lock left by a process on another host, last refreshed `age_s` seconds ago."""
    other = dataclasses.replace(LockHolder.this_process(), host="node-17")
    lock_file(out).parent.mkdir(parents=True)
    lock_file(out).write_text(json.dumps(dataclasses.asdict(other)))
    then = time.time() - age_s
    os.utime(lock_file(out), (then, then))


def output_dir(storage: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return str(tmp_path / "out") if storage == "local" else request.getfixturevalue("s3_output_dir")


def test_second_process_on_the_same_shard_is_refused(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    holder = start_proc("hold-lock", out)
    try:
        assert holder.stdout.readline() == "locked\n", holder.stderr.read()
        refused = run_proc("try-open", out)
        assert refused.returncode == 3, refused.stderr
        assert f"held by pid {holder.pid} on host {os.uname().nodename} since" in refused.stdout
    finally:
        holder.kill()
        holder.wait()


def test_second_writer_in_the_same_process_is_refused(tmp_path: Path) -> None:
    with OutputDataset(str(tmp_path / "out")) as first:
        first.open(JOB)
        with pytest.raises(LockError, match=f"held by pid {os.getpid()}"):
            OutputDataset(str(tmp_path / "out")).open(JOB)


def test_other_shards_are_not_blocked(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    with OutputDataset(out, 0, 2) as first, OutputDataset(out, 1, 2) as second:
        first.open(JOB)
        second.open(JOB)
        first.commit(pa.table({"row_id": pa.array([0], pa.int64())}))
        second.commit(pa.table({"row_id": pa.array([1], pa.int64())}))
        assert first.committed_row_ids().tolist() == [0]
        assert second.committed_row_ids().tolist() == [1]


def test_lock_of_a_killed_process_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    holder = start_proc("hold-lock", str(out))
    assert holder.stdout.readline() == "locked\n", holder.stderr.read()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert lock_file(out).exists()
    with caplog.at_level(logging.WARNING), OutputDataset(str(out)) as dataset:
        dataset.open(JOB)
    assert f"taking over stale lock {lock_file(out)}: pid {holder.pid}" in caplog.text


def test_close_releases_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "out"
    dataset = OutputDataset(str(out))
    dataset.open(JOB)
    dataset.close()
    assert not lock_file(out).exists()
    with OutputDataset(str(out)) as again:
        again.open(JOB)


def test_lock_of_an_earlier_run_of_a_requeued_slurm_job_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The earlier run may sit on another node where its pid cannot be checked; the requeue proves it over.
    out = str(tmp_path / "out")
    earlier = start_proc("hold-lock", out, env={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"})
    try:
        assert earlier.stdout.readline() == "locked\n", earlier.stderr.read()
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        with caplog.at_level(logging.WARNING), OutputDataset(out) as dataset:
            dataset.open(JOB)
        assert "Slurm requeued job 77 (restart 1)" in caplog.text
    finally:
        earlier.kill()
        earlier.wait()


def test_live_lock_held_on_another_host_is_refused_with_how_to_clear_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_foreign_lock(out, age_s=5)
    with pytest.raises(LockError, match=r"on host node-17 since .*\(refreshed [56] s ago\).*lock_timeout_s=300 s"):
        OutputDataset(str(out)).open(JOB)


def test_lock_not_refreshed_for_the_timeout_is_taken_over_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    write_foreign_lock(out, age_s=400)  # its node was lost 400 s ago
    with caplog.at_level(logging.WARNING), OutputDataset(str(out), lock_timeout_s=300) as dataset:
        dataset.open(JOB)
        assert json.loads(lock_file(out).read_text())["pid"] == os.getpid()
    assert "on node-17" in caplog.text and "not refreshed for 400 s (output.lock_timeout_s=300)" in caplog.text


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_a_live_holder_keeps_its_lock_past_the_timeout_by_refreshing_it(storage: str, tmp_path: Path, request) -> None:
    out = output_dir(storage, tmp_path, request)
    holder = start_proc("hold-lock", out, "2")
    try:
        assert holder.stdout.readline() == "locked\n", holder.stderr.read()
        time.sleep(4)  # twice the timeout: only its refreshes keep it live
        refused = run_proc("try-open", out, "2")
        assert refused.returncode == 3, refused.stderr
        assert holder.poll() is None, holder.stdout.read()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_a_stalled_holder_is_taken_over_and_never_commits_again(storage: str, tmp_path: Path, request) -> None:
    out = output_dir(storage, tmp_path, request)
    holder = start_proc("hold-lock", out, "2")
    try:
        assert holder.stdout.readline() == "locked\n", holder.stderr.read()
        os.kill(holder.pid, signal.SIGSTOP)  # a stall: alive, on this host, but refreshing nothing
        time.sleep(3)
        taker = OutputDataset(out, lock_timeout_s=2)
        taker.open(JOB)
        committed = taker.committed_row_ids().tolist()
        os.kill(holder.pid, signal.SIGCONT)
        stdout, _ = holder.communicate(timeout=30)
        assert holder.returncode == 4, stdout
        assert "lost its lock" in stdout and "nothing more is committed here" in stdout
        taker.close()
        with OutputDataset(out) as again:
            again.open(JOB)
            assert again.committed_row_ids().tolist() == committed
    finally:
        holder.kill()
        holder.wait()
