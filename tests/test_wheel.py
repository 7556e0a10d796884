"""The built wheel is the package: conf/ and pipelines/ (top level in the repository) ship inside it as
batchjob.conf and batchjob.pipelines, and an installed wheel runs the default job with no checkout in sight."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow.dataset as pads

REPO = Path(__file__).resolve().parents[1]


def test_the_built_wheel_runs_the_default_job_without_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, REPO],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("batchjob-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "batchjob/conf/config.yaml" in names and "batchjob/conf/engine/native.yaml" in names
    assert "batchjob/pipelines/prompts.py" in names and "batchjob/data/sample_prompts.parquet" in names

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site, wheel], check=True
    )
    # The installed copy comes first on the path, ahead of any editable install of the checkout.
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", "import batchjob, sys; print(batchjob.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.startswith(str(site))
    out = tmp_path / "out"
    job = subprocess.run(
        [sys.executable, "-m", "batchjob", f"output.dir={out}", "sampling.max_new_tokens=2", "data.limit=20"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert job.returncode == 0, job.stderr[-2000:]
    assert pads.dataset(out).count_rows() == 20


def _checkout_copy(dest: Path) -> Path:
    """The repository's tracked files, as a fresh clone has them, in a folder no install points at."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes((REPO / name).read_bytes())
    return dest


def test_a_checkout_runs_without_installing_the_package(tmp_path):
    checkout = _checkout_copy(tmp_path / "checkout")
    # The copy comes first on the path, as `PYTHONPATH=. python -m batchjob` in a checkout puts it, ahead of any
    # install of the package (editable or not).
    env = {**os.environ, "PYTHONPATH": "."}
    where = subprocess.run(
        [sys.executable, "-c", "import batchjob.conf, batchjob.pipelines; print(batchjob.conf.__file__)"],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(checkout / "conf"))
    shown = subprocess.run(
        [sys.executable, "-m", "batchjob", "--help"], env=env, cwd=checkout, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "sampling.max_new_tokens" in shown.stdout
    out = tmp_path / "out"
    job = subprocess.run(
        [sys.executable, "-m", "batchjob", f"output.dir={out}", "sampling.max_new_tokens=2", "data.limit=20"],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
    )
    assert job.returncode == 0, job.stderr[-2000:]
    assert pads.dataset(out).count_rows() == 20
