"""A job whose output disk fills up: a clear message, the resumable exit status, nothing committed lost."""

from __future__ import annotations

import os
from pathlib import Path

from jobtools import read_output, run_cli, write_prompts

ROWS = 40


def test_a_full_disk_ends_the_run_resumable_and_keeps_every_committed_row(small_tmpfs, tmp_path: Path) -> None:
    # Incompressible pass-through text makes each two-row part about 24 KiB: the 256 KiB disk fills midway.
    padding = [os.urandom(6 * 1024).hex() for _ in range(ROWS)]
    prompts = write_prompts(tmp_path / "prompts.parquet", ROWS, padding=padding)
    out = small_tmpfs.path / "out"
    # Hydra's own log goes elsewhere, so what the disk refuses is batchjob's output alone.
    args = (f"data.path={prompts}", f"output.dir={out}", "output.commit_every_rows=2", f"hydra.run.dir={tmp_path}")
    full = run_cli(*args)
    assert full.returncode == 75, full.stderr
    assert "error: no space left on the device holding" in full.stderr
    assert "free some space (or raise the quota) and rerun the same command to resume" in full.stderr
    assert "Traceback" not in full.stderr
    committed = {part.name: part.read_bytes() for part in out.iterdir()}
    assert 0 < len(read_output(out)) < ROWS
    small_tmpfs.resize(64 * 1024 * 1024)  # the user frees space
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    table = read_output(out)
    assert table.column("row_id").to_pylist() == list(range(ROWS))
    assert table.column("padding").to_pylist() == padding
    assert all((out / name).read_bytes() == data for name, data in committed.items()), "committed parts untouched"
