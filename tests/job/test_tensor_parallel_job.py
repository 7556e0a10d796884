"""A job on a tensor-parallel engine: a rank that dies ends it resumably (finished rows kept), bad splits are
config errors before anything loads, and data parallelism hands each engine a group of GPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jobtools import HUNG_S, REPO, cli_env, read_output, wait_for, write_prompts

from batchjob.cluster.data_parallel import plan_children
from batchjob.errors import ConfigError
from batchjob.job.run import EXIT_RESUMABLE, EXIT_USAGE

ROWS = 48
TP_JOB = (
    "engine=native",
    "engine.tensor_parallel=2",
    "engine.device=cpu",
    "engine.dtype=float32",
    "engine.max_model_len=256",
    "engine.num_kv_blocks=128",
    "engine.max_num_seqs=4",
    "sampling.max_new_tokens=8",
    "output.commit_every_rows=4",
    "output.commit_every_s=1000",
)


def command(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "batchjob", *TP_JOB, *overrides]


def rank_pids(job_pid: int) -> list[int]:
    """The tensor-parallel rank processes the job started (its children running rank_process)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if parent == job_pid and b"rank_process" in cmdline:
            pids.append(int(proc.name))
    return sorted(pids)


def committed_rows(out: Path) -> int:
    return len(read_output(out)) if list(out.glob("part-*.parquet")) else 0


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the rank processes through /proc")
def test_a_killed_rank_ends_the_job_resumably_and_a_rerun_completes_every_row_once(tmp_path):
    data = write_prompts(tmp_path / "prompts.parquet", ROWS)
    out = tmp_path / "out"
    args = (f"data.path={data}", f"output.dir={out}")
    job = subprocess.Popen(
        command(*args), cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: committed_rows(out) >= 4, job, "4 committed rows")
    ranks = rank_pids(job.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    _, stderr = job.communicate(timeout=HUNG_S)

    assert job.returncode == EXIT_RESUMABLE, stderr[-3000:]
    assert "tensor-parallel rank 1" in stderr and "resumable: rerun the same command" in stderr
    kept = committed_rows(out)
    assert 4 <= kept < ROWS and not (out / "_SUCCESS").exists()
    assert rank_pids(job.pid) == []

    rerun = subprocess.run(command(*args), cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=HUNG_S)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming: {kept} rows already committed" in rerun.stderr
    assert read_output(out).column("row_id").to_pylist() == list(range(ROWS))


def test_sigterm_stops_a_tensor_parallel_job_resumably_and_its_ranks_with_it(tmp_path):
    data = write_prompts(tmp_path / "prompts.parquet", ROWS)
    out = tmp_path / "out"
    job = subprocess.Popen(
        command(f"data.path={data}", f"output.dir={out}"),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: committed_rows(out) >= 4, job, "4 committed rows")
    ranks = rank_pids(job.pid)
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=HUNG_S)

    assert job.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "resumable: rerun the same command" in stderr and "engine failed" not in stderr
    assert len(ranks) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in ranks)
    assert committed_rows(out) >= 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("engine=native", "engine.device=cpu", "engine.tensor_parallel=3"),
            "engine.tensor_parallel=3 does not divide its 4 attention heads",
        ),
        (("engine=hf", "engine.tensor_parallel=2"), "the hf engine runs a model on one device"),
        (
            ("engine=native", "engine.device=cpu", "engine.tensor_parallel=2", "sampling.regex='[a-z]+'"),
            "sampling.regex: structured outputs are not supported with engine.tensor_parallel=2",
        ),
        (
            ("engine=native", "engine.device=cpu", "engine.tensor_parallel=2", "data.json_schema_column=schema"),
            "data.json_schema_column=schema: structured outputs are not supported with engine.tensor_parallel=2",
        ),
    ],
)
def test_a_tensor_parallel_the_engine_cannot_run_is_a_config_error_before_anything_loads(tmp_path, overrides, message):
    data = write_prompts(tmp_path / "prompts.parquet", 4)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "batchjob", f"data.path={data}", f"output.dir={out}", *overrides],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_USAGE, done.stderr[-3000:]
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (out / "_job.json").exists()


def test_data_parallel_children_each_get_a_group_of_tensor_parallel_gpus():
    children = plan_children(2, 1, 3, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, tensor_parallel=2)
    assert [(c.gpu, c.shard_index, c.shard_count) for c in children] == [("4,5", 2, 6), ("6,7", 3, 6)]


def test_data_parallel_times_tensor_parallel_beyond_the_visible_gpus_is_refused():
    with pytest.raises(ConfigError, match="data_parallel=2 x engine.tensor_parallel=2 needs 4 GPUs but only 3"):
        plan_children(2, 0, 1, env={"CUDA_VISIBLE_DEVICES": "0,1,2"}, tensor_parallel=2)
