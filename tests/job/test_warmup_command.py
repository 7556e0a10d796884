"""`python -m batchjob.warmup`: the job's start-up without the job. It fills `$BATCHJOB_CACHE` from the job's own
overrides, ignores `data.limit` (which would lower `engine.max_num_seqs` and so compile only small steps' kernels),
never touches the input or `output.dir`, and refuses a bad config as the job does (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jobtools import REPO, cli_env


def warmup(*overrides: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**cli_env(), "BATCHJOB_CACHE": str(cache)}
    command = [sys.executable, "-m", "batchjob.warmup", *overrides]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_warmup_fills_the_cache_with_the_jobs_settings_and_writes_no_output(tmp_path: Path) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out"
    done = warmup(
        "engine=native", "engine.max_num_seqs=48", "data.limit=1", "data.path=/nonexistent.parquet",
        f"output.dir={out}", cache=cache,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stderr.splitlines() if "warm: engine=native" in line)
    assert "engine.max_num_seqs=48" in line  # not lowered to data.limit's one row
    assert f"caches in {cache}" in line
    assert any((cache / "model-specs").iterdir()) and any((cache / "tokenizer-classes").iterdir())
    assert not out.exists()


def test_a_bad_override_is_refused_as_the_job_refuses_it(tmp_path: Path) -> None:
    refused = warmup("engine=native", "engine.max_num_sqs=3", cache=tmp_path / "cache")
    assert refused.returncode == 2
    assert "unknown key engine.max_num_sqs (did you mean engine.max_num_seqs?)" in refused.stderr
    assert "Traceback" not in refused.stderr
