"""Helpers for tests on a real Slurm cluster (scripts/slurm/local-cluster.sh start)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

import batchjob

REPO = Path(batchjob.__file__).resolve().parents[1]
TEMPLATE = REPO / "scripts" / "slurm" / "batchjob.sbatch"
# Slow enough that a test can catch a task mid-run: one row at a time, every row forced to 256 tokens
# (0.5 s a row with hf, 0.7 s with native, on one uncontended core of a CI machine) and committed on its own,
# so a task of 20 rows is still generating for seconds after its first commits; every Slurm test generates
# all 80 rows at least once, on two cores shared with the rest of the suite, so each token more is CI time.
# Identical for every run: outputs compare row by row.
ENGINES = {
    "native": ["engine=native", "engine.max_num_seqs=1"],
    "hf": ["engine=hf", "engine.max_batch_size=1"],
}
JOB_OVERRIDES = [
    "sampling.max_new_tokens=256",
    "sampling.ignore_eos=true",
    "output.commit_every_rows=1",
]


def cluster_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0


def job_env() -> dict[str, str]:
    """The submitting environment, with this checkout's batchjob and Python, which sbatch exports."""
    return {**os.environ, "PYTHONPATH": str(REPO), "BATCHJOB_PYTHON": sys.executable}


def sbatch(workdir: Path, sbatch_args: list[str], overrides: list[str]) -> str:
    cmd = [
        "sbatch",
        "--parsable",
        "--cpus-per-task=1",
        "--gpus-per-task=0",
        f"--output={workdir}/log-%A_%a.out",
        *sbatch_args,
        str(TEMPLATE),
        *overrides,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), cwd=workdir, check=True)
    return done.stdout.strip().split(";")[0]


def wait_gone(job_id: str, timeout_s: float = 240) -> None:
    """Until no task of `job_id` is pending or running (requeued tasks count as still there)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout
        if not queued.strip():
            return
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise TimeoutError(f"Slurm job {job_id} still queued after {timeout_s}s")


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def committed_parts(out: Path, shard: int) -> int:
    return len(list(out.glob(f"part-s{shard:05d}-*.parquet")))


def lock_holder_pid(out: Path, shard: int) -> int | None:
    try:
        return json.loads((out.with_name(out.name + ".batchjob") / "locks" / f"s{shard:05d}.json").read_text())["pid"]
    except (FileNotFoundError, ValueError):
        return None


def generations(out: Path) -> dict[int, str]:
    table = pq.read_table(out, columns=["row_id", "generation"])
    return dict(zip(table.column("row_id").to_pylist(), table.column("generation").to_pylist(), strict=True))


def logs(workdir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(workdir.glob("log-*.out")))
