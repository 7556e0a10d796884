"""Real Slurm on localhost (scripts/slurm/local-cluster.sh): arrays, the submitit launcher, preemption, crashes.

Every run must leave each input row in the shared output exactly once, with the generations of an
uninterrupted single-process run (greedy decoding, one row per batch).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import (
    committed_parts,
    generations,
    job_env,
    lock_holder_pid,
    logs,
    sbatch,
    wait_gone,
    wait_until,
)

from batchjob.io.job_status import job_status

pytestmark = pytest.mark.slurm
# The requeue is tested on both engines, the default (native) one and the transformers one; the other
# interruptions (each minutes of CI on two cores) on the transformers one.
ON_BOTH_ENGINES = pytest.mark.parametrize("workload", ["native", "hf"], indirect=True)


def assert_exactly_once_as(out: Path, reference: Path) -> None:
    status = job_status(str(out))
    assert status.complete, status
    assert [s.index for s in status.shards] == [0, 1, 2, 3]
    assert generations(out) == generations(reference)


def test_array_of_four_tasks_writes_every_row_once(workload, reference, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = sbatch(tmp_path, ["--array=0-3"], [*workload, f"output.dir={out}"])
    wait_gone(job)
    assert_exactly_once_as(out, reference)
    status = subprocess.run(
        [sys.executable, "-m", "batchjob.status", f"output.dir={out}", f"data.path={workload[1].split('=', 1)[1]}"],
        capture_output=True,
        text=True,
        env=job_env(),
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert "every row exactly once" in status.stdout


def test_submitit_launcher_submits_the_array(workload, reference, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "batchjob",
        "-m",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.gpus_per_task=null",
        "hydra.launcher.timeout_min=10",
        *workload,
        f"output.dir={out}",
        "shard.count=4",
        "shard.index=range(0,4)",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), cwd=tmp_path, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_exactly_once_as(out, reference)


@ON_BOTH_ENGINES
def test_task_requeued_mid_run_resumes_from_its_manifest(workload, reference, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = sbatch(tmp_path, ["--array=0-3"], [*workload, f"output.dir={out}"])
    wait_until(lambda: committed_parts(out, 1) >= 2, 120, "task 1 to commit its first rows")
    subprocess.run(["scontrol", "requeue", f"{job}_1"], check=True)
    wait_gone(job)
    assert "resuming:" in logs(tmp_path), "the requeued task started over instead of resuming"
    assert "(restart 1)" in logs(tmp_path)
    assert_exactly_once_as(out, reference)


def test_usr1_before_the_time_limit_commits_and_requeues_the_task(workload, reference, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = sbatch(tmp_path, ["--array=0-3"], [*workload, f"output.dir={out}"])
    wait_until(lambda: committed_parts(out, 2) >= 2, 120, "task 2 to commit its first rows")
    # What --signal=B:USR1@<margin> delivers: to the batch shell, which forwards it to the runner.
    subprocess.run(["scancel", "--batch", "--signal=USR1", f"{job}_2"], check=True)
    wait_gone(job)
    assert "resumable: rerun the same command" in logs(tmp_path)
    assert "(restart 1)" in logs(tmp_path)
    assert_exactly_once_as(out, reference)


def test_task_killed_and_resubmitted_resumes(workload, reference, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = sbatch(tmp_path, ["--array=0-3"], [*workload, f"output.dir={out}"])
    wait_until(lambda: committed_parts(out, 3) >= 2, 120, "task 3 to commit its first rows")
    os.kill(lock_holder_pid(out, 3), signal.SIGKILL)
    wait_gone(job)
    assert not job_status(str(out)).complete
    # Resubmitting one shard of a 4-shard job: the array is no longer 0..N-1, so the count is given.
    wait_gone(sbatch(tmp_path, ["--array=3"], [*workload, f"output.dir={out}", "shard.count=4"]))
    assert "resuming:" in logs(tmp_path)
    assert_exactly_once_as(out, reference)
