"""A writer killed between any two steps of a commit, locally and on an S3 server: the plain directory holds
exactly the committed rows at once, and the rerun completes the job with every row exactly once."""

from __future__ import annotations

import fsspec
import numpy as np
import pyarrow.dataset as pads
import pytest
from conftest import run_proc

from batchjob.io.crash_points import ENV, EXIT_STATUS

TOTAL, BATCH = 40, 7
LOCAL_STEPS = ("part-written", "part-committed", "part-synced", "manifest-written", "manifest-synced")
S3_STEPS = ("part-committed", "manifest-written")  # an object store has no temp file and no fsync


def visible_ids(out: str) -> np.ndarray:
    fs, path = fsspec.core.url_to_fs(out, use_listings_cache=False)
    return pads.dataset(path, filesystem=fs, format="parquet").to_table().column("row_id").to_numpy()


def bookkeeping_files(out: str, folder: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(out, use_listings_cache=False)
    where = f"{path}.batchjob/{folder}"
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(where)) if fs.exists(where) else []


def crash_then_rerun(out: str, step: str) -> None:
    crashed = run_proc("job", out, str(TOTAL), str(BATCH), env={ENV: f"{step}:3"})
    assert crashed.returncode == EXIT_STATUS, crashed.stderr
    seen = visible_ids(out)
    # The third part is committed once it is visible under its final name, before its manifest object.
    parts = 2 if step == "part-written" else 3
    assert sorted(seen.tolist()) == list(range(parts * BATCH)), "exactly the committed rows, before any recovery"
    finished = run_proc("job", out, str(TOTAL), str(BATCH))
    assert finished.returncode == 0, finished.stderr
    assert np.array_equal(np.sort(visible_ids(out)), np.arange(TOTAL)), "every row exactly once"
    parts_now = (TOTAL + BATCH - 1) // BATCH
    assert len(bookkeeping_files(out, "manifests/s00000")) == parts_now, "every committed part is recorded"
    assert bookkeeping_files(out, "tmp") == []


@pytest.mark.parametrize("step", LOCAL_STEPS)
def test_crash_between_commit_steps_on_a_local_disk(tmp_path, step: str) -> None:
    crash_then_rerun(str(tmp_path / "out"), step)


@pytest.mark.parametrize("step", S3_STEPS)
def test_crash_between_commit_steps_on_s3(s3_output_dir: str, step: str) -> None:
    crash_then_rerun(s3_output_dir, step)
