"""Helpers for job tests: real configs (the packaged Hydra conf), real Parquet, the real job as a subprocess."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from batchjob.cluster.slurm import register_resolvers
from batchjob.io.layout import BOOKKEEPING_SUFFIX, REPORT_NAME
from batchjob.job.run import run_job
from batchjob.job.tiny_model import SAMPLE_PROMPTS

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = Path(importlib.import_module("batchjob.conf").__file__).resolve().parent
# Small and greedy everywhere: the suite runs on two shared CPU cores.
FAST = ("engine=hf", "sampling.max_new_tokens=4")
# How long a test waits for a job (to exit, or to reach a point it reports: a log line, a committed part) before
# calling it hung. Never a measurement: the suite runs on two cores beside other work, where everything takes
# 5-10 times as long as on an idle machine (8x measured, beside two CPU burners), so this is ten times the longest
# a job of these tests computes on an idle 2-core machine (under 30 s, start-up included). A job that ends early
# is seen at its exit, not at this limit.
HUNG_S = 300.0


def job_config(*overrides: str) -> DictConfig:
    register_resolvers()  # what `python -m batchjob` does first: the conf's shard defaults need them
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=[*FAST, *overrides])


def run_in_process(*overrides: str) -> int:
    return run_job(job_config(*overrides))


def cli_env() -> dict[str, str]:
    path = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def cli_command(*overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "batchjob", *flags, *FAST, *overrides]


def run_cli(
    *overrides: str,
    flags: tuple[str, ...] = (),
    timeout: float = HUNG_S,
    prefix: tuple[str, ...] = (),
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """`prefix`: a command the job runs under (see `read_only`)."""
    return subprocess.run(
        [*prefix, *cli_command(*overrides, flags=flags)],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def unloadable_copy(model_dir: str | Path, dest: Path) -> Path:
    """A copy of `model_dir` whose weights fail only when they load: the file is whole (the checks before loading
    read weight files' headers and would refuse a damaged one), but its one tensor has the wrong shape."""
    import torch
    from safetensors.torch import save_file

    shutil.copytree(model_dir, dest)
    save_file({"model.embed_tokens.weight": torch.zeros(3)}, dest / "model.safetensors")
    return dest


def tree_bytes(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` with its content, to show a refused or idle run changed nothing."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[tuple[str, ...]]:
    """A command prefix under which `directory` is read-only. Root ignores permission bits, so for root it
    is a read-only bind mount in a private mount namespace (the test's own mounts are untouched); for
    anyone else the tree's write bits are cleared for the duration."""
    if os.geteuid() == 0:
        if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
            pytest.skip("making a directory read-only as root needs `unshare -m` (mount namespaces)")
        yield ("unshare", "-m", "sh", "-c", 'mount --bind -o ro "$1" "$1" && shift && exec "$@"', "sh", str(directory))
        return
    paths = [directory, *directory.rglob("*")]
    modes = {p: p.stat().st_mode for p in paths}
    for p in paths:
        p.chmod(modes[p] & ~0o222)
    try:
        yield ()
    finally:
        for p in reversed(paths):
            p.chmod(modes[p])


def start_cli(*overrides: str, cwd: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen(
        cli_command(*overrides), cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition: Callable[[], bool], job: subprocess.Popen, what: str, timeout: float = HUNG_S) -> None:
    """Until `condition()` holds, while `job` runs: a job that exits first fails the test at once with its stderr;
    `timeout` only catches a hung job."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.poll() is None, f"the job exited ({job.returncode}) before {what}: {job.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s: the job hangs"
        time.sleep(0.02)


def wait_for_line(job: subprocess.Popen, text: str) -> str:
    """Read `job`'s stderr up to the first line holding `text` (the job's own report that it got there) and return
    that line; a job that exits first fails the test with what it wrote."""
    seen = []
    for line in job.stderr:
        if text in line:
            return line
        seen.append(line)
    job.wait()
    raise AssertionError(f"the job exited ({job.returncode}) without logging {text!r}: {''.join(seen)[-3000:]}")


def read_output(out_dir: Path) -> pa.Table:
    """Exactly what a user reading the directory gets, in row_id order."""
    return pads.dataset(str(out_dir), format="parquet").to_table().sort_by("row_id")


def bookkeeping(out_dir: Path) -> Path:
    """The folder beside output.dir with the job record, manifests, locks, reports, markers and logs."""
    return out_dir.with_name(out_dir.name + BOOKKEEPING_SUFFIX)


def read_report(out_dir: Path) -> dict:
    import json

    return json.loads((bookkeeping(out_dir) / REPORT_NAME).read_text())


def write_prompts(path: Path, rows: int, **extra_columns: list) -> Path:
    """The first `rows` bundled prompts (with their `id` and `topic`) as a Parquet file."""
    table = pq.read_table(SAMPLE_PROMPTS).slice(0, rows)
    for name, values in extra_columns.items():
        table = table.append_column(name, pa.array(values))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def write_table(path: Path, columns: dict[str, pa.Array | list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path
