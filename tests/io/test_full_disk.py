"""A part that does not fit on the disk: a clear error, the shard unchanged, and the commit retried later."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest
from conftest import bookkeeping

from batchjob.io import OutputDataset, StorageFull

JOB = {"model": "tiny", "sampling": {"max_new_tokens": 4}}


def incompressible_rows(ids: range) -> pa.Table:
    return pa.table({"row_id": pa.array(ids, pa.int64()), "generation": [os.urandom(8 * 1024).hex() for _ in ids]})


def test_a_full_disk_fails_the_commit_with_the_fix_and_keeps_every_committed_part(small_tmpfs) -> None:
    out = small_tmpfs.path / "out"
    with OutputDataset(str(out)) as dataset:
        dataset.open(JOB)
        with pytest.raises(StorageFull, match="no space left on the device holding .* rerun the same command"):
            for start in range(0, 1000, 4):
                dataset.commit(incompressible_rows(range(start, start + 4)))
        committed = dataset.committed_row_ids()
        assert start > 0 and committed.tolist() == list(range(start)), "the parts before the full one"
        parts = {p.name: p.read_bytes() for p in out.iterdir()}
        seen = pads.dataset(str(out)).to_table().column("row_id").to_numpy()
        assert np.array_equal(np.sort(seen), committed), "the directory reads as exactly the committed rows"
        assert os.listdir(bookkeeping(out) / "tmp") == [], "the part that did not fit left nothing behind"
        small_tmpfs.resize(16 * 1024 * 1024)
        dataset.commit(incompressible_rows(range(start, start + 4)))  # the failed commit, retried
        assert dataset.committed_row_ids().tolist() == [*committed.tolist(), *range(start, start + 4)]
    assert all((out / name).read_bytes() == data for name, data in parts.items())
