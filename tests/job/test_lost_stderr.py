"""A job whose stderr has lost its reader (`python -m batchjob ... 2>&1 | tee run.log`, the tee stopped by the same
Ctrl-C) stops as any other: it commits and exits 128 + the signal, where its "interrupted" line would have failed it
with status 1 after the commit (and before a Slurm task's requeue)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from jobtools import HUNG_S, REPO, SAMPLE_PROMPTS, cli_command, cli_env, read_output, wait_for


def test_a_job_whose_stderr_reader_is_gone_still_commits_and_exits_as_interrupted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = cli_command(
        f"data.path={SAMPLE_PROMPTS}",
        f"output.dir={out}",
        "sampling.max_new_tokens=512",
        "sampling.ignore_eos=true",
        "output.commit_every_rows=4",
    )
    reader, writer = os.pipe()
    job = subprocess.Popen(command, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=writer)
    os.close(writer)
    try:
        wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 1, job, "a committed part")
    finally:
        os.close(reader)  # its stderr's reader is gone: what it writes there now fails
    job.send_signal(signal.SIGINT)
    assert job.wait(timeout=HUNG_S) == 128 + signal.SIGINT
    assert read_output(out).num_rows > 0
