"""`python -m batchjob.status`: per-shard progress and the exactly-once check, on real output directories."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.io.inputs import InputSpec
from batchjob.io.job_status import job_status
from batchjob.io.lock import DEFAULT_TIMEOUT_S, LockHolder
from batchjob.io.output import OutputDataset
from batchjob.status import main

RECORD = {"rows": {"count": 8, "id_column": None}}
REPO = Path(__file__).resolve().parents[2]
# Opens shard 1 of 2 (taking its lock), says so, then waits to be killed.
HOLD_SHARD_1 = f"""
import sys, time
from batchjob.io.output import OutputDataset
OutputDataset(sys.argv[1], 1, 2).open({RECORD!r})
print("locked", flush=True)
time.sleep(600)
"""


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


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
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'typo'} holds no batchjob output (no _job.json in {tmp_path / 'typo.batchjob'}): set "
        "output.dir to the one the job ran with\n"
    )


def test_the_bookkeeping_folder_given_as_output_dir_is_pointed_at_the_output(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    commit(out, 0, [0, 1, 2, 3], success=True)
    assert main([f"output.dir={out}.batchjob"]) == 2
    assert capsys.readouterr().err == (
        f"error: {out}.batchjob is the folder where batchjob keeps a job's record, manifests and locks: set output.dir "
        f"to the job's output itself, {out}\n"
    )


def test_a_bare_directory_is_read_as_output_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    commit(tmp_path, 0, [0, 1, 2, 3], success=True)
    commit(tmp_path, 1, [4, 5, 6, 7], success=True)
    assert main([str(tmp_path), "--verify"]) == 0
    assert "every row exactly once" in capsys.readouterr().out


def test_a_data_limit_that_is_not_a_number_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([f"output.dir={tmp_path}", f"data.path={tmp_path}/in.parquet", "data.limit=ten"]) == 2
    assert capsys.readouterr().err == "error: data.limit='ten': must be an integer (the job's data.limit)\n"


def test_verify_checks_every_committed_part(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    commit(out, 0, [0, 1, 2, 3], success=True)
    commit(out, 1, [4, 5, 6, 7], success=True)
    assert main([f"output.dir={out}", "--verify"]) == 0
    assert "every committed part matches its manifest (size and sha256)" in capsys.readouterr().out
    part = out / "part-s00001-000000.parquet"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    assert main([f"output.dir={out}", "--verify"]) == 1
    printed = capsys.readouterr().out
    assert "shard 1: damaged part part-s00001-000000.parquet: " in printed and "(sha256)" in printed
    assert "rerun their shards to recompute their rows" in printed


def test_an_output_dir_of_the_older_layout_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "_job.json").write_text("{}")
    assert main([f"output.dir={tmp_path}"]) == 2
    assert "written by an older batchjob" in capsys.readouterr().err


def test_a_part_that_does_not_read_is_listed_even_without_verify(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    commit(out, 0, [0, 1, 2, 3], success=True)
    commit(out, 1, [4, 5, 6, 7], success=True)
    part = out / "part-s00000-000000.parquet"
    part.write_bytes(part.read_bytes()[:-20])
    assert main([f"output.dir={out}"]) == 1
    printed = capsys.readouterr().out
    assert "shard 0: damaged part part-s00000-000000.parquet: does not read as Parquet" in printed
    assert "4 row ids missing: 0, 1, 2, 3" in printed


def test_a_string_id_held_by_two_rows_is_reported(tmp_path: Path, capsys) -> None:
    record = {"rows": {"count": 4, "id_column": "custom_id", "string_ids": True}}
    for shard, row_ids, ids in ((0, [0, 1], ["a", "b"]), (1, [2, 3], ["c", "a"])):
        dataset = OutputDataset(str(tmp_path / "out"), shard, 2)
        dataset.open(record)
        dataset.commit(pa.table({"row_id": pa.array(row_ids, pa.int64()), "custom_id": ids}))
        dataset.mark_success()
        dataset.close()
    status = job_status(str(tmp_path / "out"))
    assert status.validation.ids_checked  # string ids keep row_id the position: 0..3 are checked too
    assert status.validation.repeated_ids == ("a",)
    assert not status.complete
    assert main([f"output.dir={tmp_path / 'out'}"]) == 1
    assert "custom_id values in more than one row: 'a'" in capsys.readouterr().out


def test_a_killed_shard_reads_stale_with_its_pid_and_host(tmp_path: Path) -> None:
    commit(tmp_path, 0, [0, 1, 2, 3], success=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_SHARD_1, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()  # SIGKILL: the lock file stays behind
    holder.wait()
    shard = job_status(str(tmp_path)).shards[1]
    assert shard.locked and not shard.complete
    assert shard.state.startswith(f"stale (pid {holder.pid} on {socket.gethostname()}")
    assert "no longer running" in shard.state


def test_a_shard_being_written_reads_running(tmp_path: Path) -> None:
    commit(tmp_path, 0, [0, 1, 2, 3], success=True)
    dataset = OutputDataset(str(tmp_path), 1, 2)
    dataset.open(RECORD)
    try:
        state = job_status(str(tmp_path)).shards[1].state
    finally:
        dataset.close()
    assert state.startswith(f"running (pid {os.getpid()} on {socket.gethostname()}")


def test_help_prints_the_usage_and_exits_0() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "batchjob.status", "--help"], capture_output=True, text=True, env=child_env()
    )
    assert shown.returncode == 0
    assert shown.stdout.startswith("usage: python -m batchjob.status output.dir=DIR")
    assert "stale" in shown.stdout
    assert shown.stderr == ""


def test_a_lock_from_another_host_not_refreshed_for_the_timeout_reads_stale(tmp_path: Path) -> None:
    commit(tmp_path, 0, [0, 1, 2, 3], success=True)
    lock = tmp_path.with_name(tmp_path.name + ".batchjob") / "locks" / "s00001.json"
    lost = dataclasses.replace(LockHolder.this_process(), host="node-17")
    lock.write_text(json.dumps(dataclasses.asdict(lost)))
    then = time.time() - 2 * DEFAULT_TIMEOUT_S
    os.utime(lock, (then, then))
    state = job_status(str(tmp_path)).shards[1].state
    assert state.startswith(f"stale (pid {lost.pid} on node-17: not refreshed for ")
