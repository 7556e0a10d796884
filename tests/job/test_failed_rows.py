"""Failed rows are visible and judged: the end line and the report count them by reason with a first example, and
a shard that completes with more failed rows than `job.max_error_fraction` exits 3, after committing everything:
on its first run, on a resumed run (counting the rows earlier runs committed) and on every rerun."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow as pa
from jobtools import REPO, bookkeeping, cli_command, cli_env, read_output, read_report, run_cli, tree_bytes, write_table

from batchjob.errors import EXIT_TOO_MANY_FAILED
from batchjob.io.crash_points import ENV as CRASH_AT
from batchjob.io.crash_points import EXIT_STATUS as CRASHED

LONG_PROMPT = " ".join(f"word{i}" for i in range(1500))  # far more tokens than the tiny model's 1024 context
LONGER_PROMPT = " ".join(f"word{i}" for i in range(2000))
TOO_LONG = "prompt has N tokens, the model context is N"  # engine=hf's message, its numbers masked


def job_over(tmp_path: Path, prompts: list[str | None]) -> tuple[str, str]:
    """`data.path` of a Parquet file of `prompts`, and an `output.dir` beside it."""
    path = write_table(tmp_path / "prompts.parquet", {"prompt": pa.array(prompts, pa.string())})
    return f"data.path={path}", f"output.dir={tmp_path / 'out'}"


def test_a_job_whose_every_row_failed_exits_3_with_every_row_committed(tmp_path: Path) -> None:
    done = run_cli(*job_over(tmp_path, [None, None, None]))
    assert done.returncode == EXIT_TOO_MANY_FAILED == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert "error: 3 of the shard's 3 rows failed (100%), more than job.max_error_fraction=0.5" in done.stderr
    assert 'most often 3 x "prompt is null" (first: row 0)' in done.stderr
    assert read_output(tmp_path / "out").column("error").to_pylist() == ["prompt is null"] * 3
    assert (bookkeeping(tmp_path / "out") / "_SUCCESS").exists()


def test_the_end_line_and_the_report_count_failed_rows_by_reason_with_the_first_example(tmp_path: Path) -> None:
    prompts = ["Fine prompt", None, LONG_PROMPT, None, "Another fine prompt", LONGER_PROMPT]
    done = run_cli(*job_over(tmp_path, prompts), "job.max_error_fraction=1")
    assert done.returncode == 0, done.stderr
    errors = read_output(tmp_path / "out").column("error").to_pylist()
    failed = read_report(tmp_path / "out")["failed_rows"]
    assert (failed["rows"], failed["of_rows"], failed["fraction"]) == (4, 6, 4 / 6)
    assert failed["by_reason"] == [
        {"reason": TOO_LONG, "rows": 2, "example_row_id": 2, "example_error": errors[2]},
        {"reason": "prompt is null", "rows": 2, "example_row_id": 1, "example_error": "prompt is null"},
    ]
    assert errors[2] != errors[5] and errors[2].startswith("prompt has ")  # two messages, one reason
    log = done.stdout + done.stderr
    end = next(line for line in log.splitlines() if "done: 6 rows (2 ok, 4 errors, 0 skipped)" in line)
    assert "; failed 4 of the shard's 6 rows: " in end
    assert f'2 x "{TOO_LONG}" (first: row 2: {errors[2]!r})' in end
    assert '2 x "prompt is null" (first: row 1)' in end


def test_skipped_rows_are_failed_rows(tmp_path: Path) -> None:
    done = run_cli(*job_over(tmp_path, [None, "Fine prompt", None, None]), "on_error=skip")
    assert done.returncode == 3, done.stderr
    assert "3 of the shard's 4 rows failed (75%)" in done.stderr
    assert read_output(tmp_path / "out").column("row_id").to_pylist() == [1]
    failed = read_report(tmp_path / "out")["failed_rows"]
    assert (failed["rows"], failed["of_rows"]) == (3, 4)


def test_a_rerun_of_the_complete_shard_gives_its_verdict_again_and_recomputes_nothing(tmp_path: Path) -> None:
    args = job_over(tmp_path, [None, None, "Fine prompt"])
    first = run_cli(*args)
    assert first.returncode == 3, first.stderr
    out, meta = tmp_path / "out", bookkeeping(tmp_path / "out")
    written = (tree_bytes(out), tree_bytes(meta / "manifests"), (meta / "_report.json").read_bytes())
    again = run_cli(*args)
    assert again.returncode == 3, again.stderr
    assert "already complete: nothing to generate" in again.stdout + again.stderr
    assert "2 of the shard's 3 rows failed (67%)" in again.stderr
    accepted = run_cli(*args, "job.max_error_fraction=1")
    assert accepted.returncode == 0, accepted.stderr
    assert (tree_bytes(out), tree_bytes(meta / "manifests"), (meta / "_report.json").read_bytes()) == written


def test_the_limit_is_a_share_a_shard_may_reach_and_0_allows_no_failed_row(tmp_path: Path) -> None:
    args = job_over(tmp_path, [None, "Fine prompt"])
    at_limit = run_cli(*args)
    assert at_limit.returncode == 0, at_limit.stderr  # 1 of 2 is not more than 0.5
    strict = run_cli(*args, "job.max_error_fraction=0")
    assert strict.returncode == 3, strict.stderr
    assert "1 of the shard's 2 rows failed (50%), more than job.max_error_fraction=0;" in strict.stderr


def test_a_resumed_job_counts_the_failed_rows_an_earlier_run_committed(tmp_path: Path) -> None:
    # Bad rows first: they are finished as they are read, so the part the first run commits before it is killed
    # holds them, and the resumed run generates mostly good rows. Only counting both runs gives 5 of 8.
    prompts = [None] * 5 + ["Fine prompt", "Another fine prompt", "A third fine prompt"]
    data, out = job_over(tmp_path, prompts)
    settings = (data, "output.commit_every_rows=2", "pipeline.tokenize_batch_rows=2")
    killed = subprocess.run(
        cli_command(*settings, out),
        cwd=REPO,
        env={**cli_env(), CRASH_AT: "manifest-synced"},  # killed as by kill -9, right after its first commit
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == CRASHED, killed.stderr
    earlier = read_output(tmp_path / "out")
    assert 0 < earlier.num_rows < len(prompts) and earlier.column("error").null_count < earlier.num_rows
    resumed = run_cli(*settings, out)
    assert resumed.returncode == 3, resumed.stderr
    assert "5 of the shard's 8 rows failed (62%)" in resumed.stderr
    report = read_report(tmp_path / "out")
    assert report["rows_committed_before_this_run"] == earlier.num_rows
    assert report["errors"] / report["rows"] <= 0.5  # this run's own rows alone would pass
    uninterrupted = run_cli(*settings, f"output.dir={tmp_path / 'whole'}")
    assert uninterrupted.returncode == 3, uninterrupted.stderr
    assert report["failed_rows"] == read_report(tmp_path / "whole")["failed_rows"]


def test_data_parallel_exits_with_a_childs_too_many_failed_rows_status(tmp_path: Path) -> None:
    # Two children, rows 0-2 and 3-5: the second child's rows all fail, the first child's none.
    data, out = job_over(tmp_path, ["One", "Two", "Three", None, None, None])
    env = {k: v for k, v in cli_env().items() if not k.startswith("SLURM_") and k != "CUDA_VISIBLE_DEVICES"}
    command = cli_command(data, out, "engine.data_parallel=2")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 3, done.stderr
    assert "data_parallel: shard 1/2 on GPU 1 exited 3" in done.stderr
    assert (bookkeeping(tmp_path / "out") / "_SUCCESS-s00000").exists()
    assert (bookkeeping(tmp_path / "out") / "_SUCCESS-s00001").exists()
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 3, again.stderr


def test_help_shows_max_error_fraction_and_its_exit_status() -> None:
    shown = run_cli(flags=("--help",))
    assert shown.returncode == 0, shown.stderr
    line = next(line for line in shown.stdout.splitlines() if "job.max_error_fraction=" in line)
    assert line.split()[0] == "job.max_error_fraction=0.5"
    assert "exits 3" in line and "1 = no check" in line
