"""A data-parallel job (`engine.data_parallel=2`: one child job per shard) killed with SIGKILL: its children
stop as on preemption (commit, exit) instead of running on without it, and the rerun writes every row once.
Interrupted from its terminal, each child stops once, though it hears the signal from the terminal and its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from jobtools import HUNG_S, REPO, SAMPLE_PROMPTS, cli_command, cli_env, read_output, running, wait_for, wait_for_line

from batchjob.io.job_status import job_status
from batchjob.processes import descendants

COPIES = 4  # of the bundled prompts: a job that runs far longer than its children take to stop
ARGS = (
    "engine.data_parallel=2",
    "sampling.max_new_tokens=512",
    "sampling.ignore_eos=true",
    "output.commit_every_rows=4",
)


def _env() -> dict[str, str]:
    return {k: v for k, v in cli_env().items() if not k.startswith("SLURM_") and k != "CUDA_VISIBLE_DEVICES"}


def _prompts(tmp_path: Path) -> Path:
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.concat_tables([pq.read_table(SAMPLE_PROMPTS)] * COPIES), prompts)
    return prompts


def test_a_killed_data_parallel_job_stops_its_children_and_resumes_every_row_once(tmp_path: Path) -> None:
    prompts = _prompts(tmp_path)
    rows = pq.read_metadata(prompts).num_rows
    out = tmp_path / "out"
    command = cli_command(f"data.path={prompts}", f"output.dir={out}", *ARGS)
    parent = subprocess.Popen(
        command, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 1, parent, "a committed part")
    children = [pid for pid in descendants(parent.pid) if "batchjob" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(children) >= 2
    parent.kill()
    deadline = time.monotonic() + 10  # they stop in a second or two; the job has far more left
    while any(running(pid) for pid in children):
        assert time.monotonic() < deadline, "the children of a killed data-parallel job run on"
        time.sleep(0.1)
    stderr = parent.communicate()[1]  # the children shared its stderr: it ends when they have gone
    assert "resumable: rerun the same command" in stderr, stderr[-3000:]
    assert not job_status(str(out)).complete

    rerun = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert sorted(read_output(out).column("row_id").to_pylist()) == list(range(rows))
    assert job_status(str(out)).complete


def test_a_data_parallel_job_interrupted_from_its_terminal_stops_each_child_once(tmp_path: Path) -> None:
    """Ctrl-C signals the terminal's whole foreground process group: the children as well as the parent, which
    relays it to them. Each child commits and exits 130; none takes the relay for a second Ctrl-C."""
    out = tmp_path / "out"
    command = cli_command(f"data.path={_prompts(tmp_path)}", f"output.dir={out}", *ARGS)
    # A process group of its own, as a shell gives a job it starts.
    parent = subprocess.Popen(
        command,
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready = [wait_for_line(parent, "ready to generate") for _ in range(2)]  # a child still starting dies of a signal
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 1, parent, "a committed part")
    os.killpg(parent.pid, signal.SIGINT)
    stderr = "".join(ready) + parent.communicate(timeout=HUNG_S)[1]
    assert parent.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert "interrupted again" not in stderr, stderr[-3000:]
    assert stderr.count(" rows committed; resumable: rerun the same command") == 2, stderr[-3000:]
