"""How `python -m batchjob` picks its shard: Slurm's variables by default, and `engine.data_parallel=N`
splitting this process's shard over N child processes (on CPU here: each child just gets no GPU)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from jobtools import REPO, bookkeeping, cli_command, cli_env, read_output, write_prompts

from batchjob.io.job_status import job_status


def run_with_env(*overrides: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in cli_env().items() if not k.startswith("SLURM_") and k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run(
        cli_command(*overrides), cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=180
    )


def array_task(task: int, lowest: int, highest: int) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "900",
        "SLURM_ARRAY_JOB_ID": "900",
        "SLURM_ARRAY_TASK_ID": str(task),
        "SLURM_ARRAY_TASK_MIN": str(lowest),
        "SLURM_ARRAY_TASK_MAX": str(highest),
        "SLURM_ARRAY_TASK_COUNT": str(highest - lowest + 1),
    }


def test_an_array_task_runs_its_own_shard_by_default(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_with_env(f"output.dir={out}", "data.limit=6", env=array_task(1, 0, 1))
    assert done.returncode == 0, done.stderr
    assert read_output(out).column("row_id").to_pylist() == [3, 4, 5]
    assert (bookkeeping(out) / "_SUCCESS-s00001").exists()
    assert [(s.index, s.complete) for s in job_status(str(out)).shards] == [(0, False), (1, True)]


def test_an_array_not_numbered_from_zero_needs_an_explicit_shard_count(tmp_path: Path) -> None:
    failed = run_with_env(f"output.dir={tmp_path / 'out'}", env=array_task(2, 2, 2))
    assert failed.returncode == 2
    assert "shard.count: this Slurm array has 1 task(s) with ids 2..2" in failed.stderr
    assert "Traceback" not in failed.stderr
    # A refused run writes nothing, not even Hydra's files.
    assert not (tmp_path / "out").exists() and not bookkeeping(tmp_path / "out").exists()


def test_data_parallel_children_write_every_row_of_the_shard_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    prompts = write_prompts(tmp_path / "prompts.parquet", 6)
    done = run_with_env(f"output.dir={out}", f"data.path={prompts}", "engine.data_parallel=2", env={})
    assert done.returncode == 0, done.stderr
    assert read_output(out).column("row_id").to_pylist() == list(range(6))
    status = job_status(str(out))
    assert [s.index for s in status.shards] == [0, 1]
    assert status.complete


def test_bad_data_parallel_fails_fast_naming_the_key(tmp_path: Path) -> None:
    failed = run_with_env(f"output.dir={tmp_path / 'out'}", "engine.data_parallel=0", env={})
    assert failed.returncode == 2
    assert "engine.data_parallel=0: must be an integer >= 1" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert not os.path.exists(bookkeeping(tmp_path / "out") / "_job.json")


def test_data_parallel_parent_and_children_keep_separate_hydra_folders(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_with_env(f"output.dir={out}", "data.limit=2", "engine.data_parallel=2", env={})
    assert done.returncode == 0, done.stderr
    folders = sorted(p.name for p in (bookkeeping(out) / "_hydra").iterdir())
    assert folders == ["shard-0-of-1", "shard-0-of-2", "shard-1-of-2"]
    parent = (bookkeeping(out) / "_hydra" / "shard-0-of-1" / ".hydra" / "overrides.yaml").read_text()
    child = (bookkeeping(out) / "_hydra" / "shard-0-of-2" / ".hydra" / "overrides.yaml").read_text()
    assert "engine.data_parallel=2" in parent
    assert "shard.count=2" in child and "engine.data_parallel=2" not in child
