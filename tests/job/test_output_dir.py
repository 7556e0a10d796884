"""Where a job may write, through the real CLI: into an output.dir that is a mount point (a container volume, a
bind mount) every row is committed, a killed run resumes exactly; a folder holding anything but batchjob's
parts, or inside another job's output, is refused in one line before the model loads, and nothing is written.
And what users do to an output between runs: a part deleted, or put back after its rows were recomputed, a file
added; the rerun ends with every row exactly once, or names what to delete."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from jobtools import (
    REPO,
    bookkeeping,
    cli_command,
    cli_env,
    read_output,
    run_cli,
    tree_bytes,
    unloadable_copy,
    write_prompts,
    write_table,
)
from output_readers import every_reader_reads, row_ids_by_reader

from batchjob.io.crash_points import ENV, EXIT_STATUS

ROWS = 12


def job_args(tmp_path: Path, out: Path | str) -> tuple[str, ...]:
    return (
        f"data.path={write_prompts(tmp_path / 'p.parquet', ROWS)}",
        f"output.dir={out}",
        "output.commit_every_rows=4",
    )


def test_a_job_into_a_mounted_output_dir_commits_every_row(mounted_output: Path, tmp_path: Path) -> None:
    done = run_cli(*job_args(tmp_path, mounted_output))
    assert done.returncode == 0, done.stderr
    assert every_reader_reads(mounted_output, list(range(ROWS))), row_ids_by_reader(mounted_output)
    assert all(name.startswith("part-") for name in os.listdir(mounted_output))
    assert (bookkeeping(mounted_output) / "_SUCCESS").exists()


def test_a_job_killed_mid_commit_into_a_mounted_output_dir_resumes_exactly_once(
    mounted_output: Path, tmp_path: Path
) -> None:
    args = job_args(tmp_path, mounted_output)
    killed = subprocess.run(
        cli_command(*args),
        cwd=REPO,
        env={**cli_env(), ENV: "part-written:2"},  # the second part written, not yet linked into output.dir
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == EXIT_STATUS, killed.stderr
    assert every_reader_reads(mounted_output, read_output(mounted_output).column("row_id").to_pylist())
    assert len(read_output(mounted_output)) == 4, "exactly the first part's rows"
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 4 rows already committed, 8 to go" in resumed.stderr
    assert every_reader_reads(mounted_output, list(range(ROWS))), row_ids_by_reader(mounted_output)


def strangers_folder(tmp_path: Path) -> Path:
    out = tmp_path / "shared" / "results"
    (out / "sub").mkdir(parents=True)
    (out / "important.txt").write_text("keep me")
    return out


def assert_refused(done: subprocess.CompletedProcess, out: Path) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: output.dir={out} holds files batchjob did not write (important.txt, sub/); every reader of the "
        "output reads the whole folder, so batchjob writes only into its own output: set output.dir to an empty "
        "or new folder"
    ]


def test_a_folder_holding_other_files_is_refused_before_the_model_loads(tmp_path: Path, model_dir: str) -> None:
    out = strangers_folder(tmp_path)
    before = tree_bytes(out.parent)
    # Weights that fail as they load: any other error than the folder's would mean the model was loaded.
    unloadable = unloadable_copy(model_dir, tmp_path / "unloadable-model")
    done = run_cli(*job_args(tmp_path, out), f"model.path={unloadable}")
    assert_refused(done, out)
    assert tree_bytes(out.parent) == before and sorted(os.listdir(out.parent)) == ["results"]


def test_overwrite_does_not_make_a_folder_holding_other_files_writable(tmp_path: Path) -> None:
    out = strangers_folder(tmp_path)
    done = run_cli(*job_args(tmp_path, out), "output.overwrite=true", "resume=false")
    assert_refused(done, out)
    assert (out / "important.txt").read_text() == "keep me"


def test_a_folder_holding_other_files_is_refused_before_the_id_scan(tmp_path: Path) -> None:
    """A first run with an id column scans the ids beside the engine, and opens the output only then; the folder
    is checked with the checks before the engine, so it is what a run with duplicate ids is refused for."""
    out = strangers_folder(tmp_path)
    prompts = write_table(tmp_path / "dup.parquet", {"id": [7, 7, 8], "prompt": ["a", "b", "c"]})
    done = run_cli(f"data.path={prompts}", "data.id_column=id", f"output.dir={out}")
    assert_refused(done, out)


def test_parts_whose_job_record_was_lost_are_refused_not_adopted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = job_args(tmp_path, out)
    assert run_cli(*args, "sampling.max_new_tokens=3").returncode == 0
    parts = sorted(os.listdir(out))
    # The folder beside output.dir is gone (it lived on a container's own filesystem, or only the parts were
    # copied): a job with other settings must not take those rows as its own.
    subprocess.run(["rm", "-r", str(bookkeeping(out))], check=True)
    refused = run_cli(*args, "sampling.max_new_tokens=5")
    assert refused.returncode == 2, refused.stderr
    assert "no job record" in refused.stderr and "output.overwrite=true" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert sorted(os.listdir(out)) == parts
    fresh = run_cli(*args, "sampling.max_new_tokens=5", "output.overwrite=true")
    assert fresh.returncode == 0, fresh.stderr
    assert sorted(read_output(out).column("row_id").to_pylist()) == list(range(ROWS))


def test_a_rerun_into_a_folder_inside_the_first_output_is_refused_and_every_reader_still_reads_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    assert run_cli(*job_args(tmp_path, out)).returncode == 0
    before = tree_bytes(tmp_path)
    refused = run_cli(*job_args(tmp_path, out / "retry"), "sampling.max_new_tokens=3")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: output.dir={out / 'retry'} is inside {out}, another job's output.dir; every reader of that folder "
        "reads all of it, so this job's files would show up there as extra or duplicate rows: set output.dir to a "
        f"folder outside {out}"
    )
    assert tree_bytes(tmp_path) == before
    assert every_reader_reads(out, list(range(ROWS))), row_ids_by_reader(out)


def test_an_output_dir_spelled_with_a_trailing_dot_keeps_its_logs_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_cli(*job_args(tmp_path, f"{out}/."))  # a str: pathlib drops the dot
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == [
        "part-s00000-000000.parquet",
        "part-s00000-000001.parquet",
        "part-s00000-000002.parquet",
    ]
    assert (bookkeeping(out) / "_hydra" / "shard-0-of-1" / "batchjob.log").is_file()
    assert every_reader_reads(out, list(range(ROWS))), row_ids_by_reader(out)
    again = run_cli(*job_args(tmp_path, out))
    assert again.returncode == 0 and "already complete" in again.stderr, again.stderr


def test_a_part_deleted_from_a_finished_job_is_recomputed_by_the_rerun(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli(*job_args(tmp_path, out)).returncode == 0
    (out / "part-s00000-000001.parquet").unlink()
    again = run_cli(*job_args(tmp_path, out))
    assert again.returncode == 0, again.stderr
    assert "part-s00000-000001.parquet is missing: its rows are recomputed" in again.stderr
    assert every_reader_reads(out, list(range(ROWS))), row_ids_by_reader(out)


def test_a_part_put_back_after_its_rows_were_recomputed_is_not_read_twice(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli(*job_args(tmp_path, out)).returncode == 0
    moved = tmp_path / "looking-at.parquet"
    (out / "part-s00000-000001.parquet").rename(moved)
    assert run_cli(*job_args(tmp_path, out)).returncode == 0
    moved.rename(out / "part-s00000-000001.parquet")
    again = run_cli(*job_args(tmp_path, out))
    assert again.returncode == 0, again.stderr
    assert "part-s00000-000001.parquet holds rows that other parts committed" in again.stderr
    assert every_reader_reads(out, list(range(ROWS))), row_ids_by_reader(out)


def test_a_file_added_to_an_unfinished_output_is_refused_naming_it_and_resumes_once_deleted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = job_args(tmp_path, out)
    killed = subprocess.run(
        cli_command(*args),
        cwd=REPO,
        env={**cli_env(), ENV: "manifest-synced:1"},  # ended as by kill -9 once the first part is committed
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == EXIT_STATUS, killed.stderr
    (out / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")  # the folder was opened in a file browser
    refused = run_cli(*args)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: output.dir={out} holds files batchjob did not write (.DS_Store); every reader of the output reads "
        "the whole folder, so batchjob writes only into its own output: delete them (or move them out) to resume "
        "this output, or set output.dir to a new folder"
    )
    (out / ".DS_Store").unlink()
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 4 rows already committed, 8 to go" in resumed.stderr
    assert every_reader_reads(out, list(range(ROWS))), row_ids_by_reader(out)


def test_an_output_dir_under_the_home_folder_keeps_its_logs_beside_it_not_in_a_tilde_folder(tmp_path: Path) -> None:
    from batchjob.caches import cache_root

    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir()
    here.mkdir()
    env = {**cli_env(), "HOME": str(home), "BATCHJOB_CACHE": str(cache_root())}
    args = job_args(tmp_path, '"~/run1"')  # quoted for Hydra, as its message asks
    done = subprocess.run(cli_command(*args), cwd=here, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert os.listdir(here) == [], "no folder named ~ in the working directory"
    assert (home / "run1.batchjob" / "_hydra" / "shard-0-of-1" / "batchjob.log").is_file()
    assert every_reader_reads(home / "run1", list(range(ROWS))), row_ids_by_reader(home / "run1")
