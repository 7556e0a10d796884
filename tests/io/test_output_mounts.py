"""Parts commit into an output.dir that is a mount point (a tmpfs, a bind mount), where no rename from the folder
beside it reaches it: exactly once, across reopens, ordered rewrites and a kill at every commit step, and no
reader of the directory ever sees a part being written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import duckdb
import numpy as np
import polars
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import bookkeeping, run_proc
from output_readers import READERS, every_reader_reads, row_ids_by_reader

from batchjob.io import OutputDataset
from batchjob.io.crash_points import ENV, EXIT_STATUS
from batchjob.io.storage import Storage

JOB = {"model": "tiny", "sampling": {"max_new_tokens": 4}}
TOTAL, BATCH = 40, 7
STEPS = ("part-written", "part-committed", "part-synced", "manifest-written", "manifest-synced")


def rows(ids: list[int]) -> pa.Table:
    return pa.table({"row_id": pa.array(ids, pa.int64()), "generation": [f"gen {i}" for i in ids]})


def opened(out: Path) -> OutputDataset:
    dataset = OutputDataset(str(out))
    dataset.open(JOB)
    return dataset


def test_parts_commit_into_a_mounted_output_dir_and_survive_reopen(mounted_output: Path) -> None:
    out = mounted_output
    with opened(out) as dataset:
        dataset.commit(rows([5, 3]))
        dataset.commit(rows([4, 0]))
    with opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [0, 3, 4, 5]
        dataset.mark_success()
    assert sorted(os.listdir(out)) == ["part-s00000-000000.parquet", "part-s00000-000001.parquet"]
    assert os.listdir(bookkeeping(out) / "tmp") == []
    assert every_reader_reads(out, [0, 3, 4, 5])


def test_an_ordered_rewrite_moves_its_parts_into_a_mounted_output_dir(mounted_output: Path) -> None:
    out = mounted_output
    with opened(out) as dataset:
        dataset.commit(rows([3, 1]))
        dataset.commit(rows([2, 0]))
        dataset.rewrite_ordered()
    names = sorted(os.listdir(out))
    assert names == ["part-s00000-000002.parquet", "part-s00000-000003.parquet"]
    assert [i for n in names for i in pq.read_table(out / n).column("row_id").to_pylist()] == [0, 1, 2, 3]


def test_an_interrupted_rewrite_rolls_forward_from_parts_staged_inside_the_mount(mounted_output: Path) -> None:
    out = mounted_output
    manifests = bookkeeping(out) / "manifests" / "s00000"
    with opened(out) as dataset:
        dataset.commit(rows([3, 1]))
        dataset.commit(rows([2, 0]))
        old = {p.name: p.read_bytes() for p in out.iterdir()}
        old_manifests = {p.name: p.read_bytes() for p in manifests.iterdir()}
        dataset.rewrite_ordered()
    # Undo what followed the rewrite record, as if the process died right after writing it: its new part is
    # where the rewrite wrote it, staged inside output.dir.
    new = [json.loads(p.read_text()) for p in manifests.iterdir()]
    for part in out.iterdir():
        part.rename(out / f".{part.name}.tmp")
    for manifest in manifests.iterdir():
        manifest.unlink()
    for name, data in old.items():
        (out / name).write_bytes(data)
    for name, data in old_manifests.items():
        (manifests / name).write_bytes(data)
    (manifests / "rewrite.json").write_text(json.dumps({"remove": sorted(old), "add": new}))
    with opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [0, 1, 2, 3]
    assert sorted(os.listdir(out)) == ["part-s00000-000002.parquet", "part-s00000-000003.parquet"]
    assert not (manifests / "rewrite.json").exists()


def test_a_rewrite_staged_beside_a_mounted_output_dir_is_copied_in(mounted_output: Path) -> None:
    """A rewrite record whose new part waits in the temp folder beside output.dir (where it would be written
    when output.dir was not yet a mount, e.g. before a container's volume was mounted there; here under its own
    name, as an earlier batchjob wrote it) cannot be renamed in: it is copied under its staged name and renamed
    into place."""
    out = mounted_output
    manifests = bookkeeping(out) / "manifests" / "s00000"
    with opened(out) as dataset:
        dataset.commit(rows([1, 0]))
        old = {p.name: p.read_bytes() for p in out.iterdir()}
        old_manifests = {p.name: p.read_bytes() for p in manifests.iterdir()}
        dataset.rewrite_ordered()
    new = [json.loads(p.read_text()) for p in manifests.iterdir()]
    for part in out.iterdir():
        (bookkeeping(out) / "tmp" / part.name).write_bytes(part.read_bytes())
        part.unlink()
    for manifest in manifests.iterdir():
        manifest.unlink()
    for name, data in old.items():
        (out / name).write_bytes(data)
    for name, data in old_manifests.items():
        (manifests / name).write_bytes(data)
    (manifests / "rewrite.json").write_text(json.dumps({"remove": sorted(old), "add": new}))
    with opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [0, 1]
    assert os.listdir(out) == ["part-s00000-000001.parquet"]
    assert os.listdir(bookkeeping(out) / "tmp") == []


@pytest.mark.parametrize("step", STEPS)
def test_a_writer_killed_at_any_commit_step_into_a_mounted_output_dir_resumes_exactly_once(
    mounted_output: Path, step: str
) -> None:
    out = mounted_output
    crashed = run_proc("job", str(out), str(TOTAL), str(BATCH), env={ENV: f"{step}:3"})
    assert crashed.returncode == EXIT_STATUS, crashed.stderr
    parts = 2 if step == "part-written" else 3  # the third part is committed once it is linked into output.dir
    assert every_reader_reads(out, list(range(parts * BATCH))), row_ids_by_reader(out)
    finished = run_proc("job", str(out), str(TOTAL), str(BATCH))
    assert finished.returncode == 0, finished.stderr
    assert every_reader_reads(out, list(range(TOTAL))), "every row exactly once"
    assert all(name.startswith("part-") for name in os.listdir(out)), "nothing but parts"
    assert os.listdir(bookkeeping(out) / "tmp") == []


def test_every_reader_skips_a_part_being_written_into_a_mounted_output_dir(mounted_output: Path) -> None:
    """There a part is written as a file without a name (O_TMPFILE), linked under its name at the commit."""
    out = mounted_output
    with opened(out) as dataset:
        dataset.commit(rows([0, 1]))
        storage, _ = Storage.for_uri(str(out))
        data = pa.BufferOutputStream()
        pq.write_table(rows([2]), data)
        fd = storage.write_unnamed(str(out), data.getvalue().to_pybytes())
        assert fd is not None, "tmpfs and the test's disk take files without a name"
        assert every_reader_reads(out, [0, 1]), row_ids_by_reader(out)
        storage.link_unnamed(fd, str(out / "part-s00000-000001.parquet"))
        assert every_reader_reads(out, [0, 1, 2])


def test_every_reader_skips_a_part_being_written_beside_output_dir(tmp_path: Path) -> None:
    """On one filesystem a part is written in the temp folder beside output.dir: a crash just before its rename
    (the commit point) leaves it there, outside what readers read, and the next open deletes it."""
    out = tmp_path / "out"
    crashed = run_proc("job", str(out), str(TOTAL), str(BATCH), env={ENV: "part-written:2"})
    assert crashed.returncode == EXIT_STATUS, crashed.stderr
    assert os.listdir(bookkeeping(out) / "tmp") == [".part-s00000-000001.parquet.tmp"]
    assert every_reader_reads(out, list(range(BATCH))), row_ids_by_reader(out)
    # A glob over the folder that holds output.dir and its bookkeeping folder, as over a folder of runs.
    assert sorted(polars.read_parquet(f"{tmp_path}/**/*.parquet")["row_id"].to_list()) == list(range(BATCH))
    runs = duckdb.sql(f"SELECT row_id FROM read_parquet('{tmp_path}/**/*.parquet')").fetchall()
    assert sorted(row[0] for row in runs) == list(range(BATCH))
    with opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == list(range(BATCH))
    assert os.listdir(bookkeeping(out) / "tmp") == []


def test_a_staged_part_name_is_skipped_by_every_reader_but_polars(tmp_path: Path) -> None:
    """Where the filesystem has no files without a name, a part is written inside a mounted output.dir under its
    staged name for the moment of its commit (and a crash leaves it until the next open): hidden and not
    `*.parquet`. polars reads hidden files too, and refuses a directory with mixed extensions."""
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit(rows([0, 1]))
    pq.write_table(rows([2]), out / ".part-s00000-000001.parquet.tmp")
    seen = row_ids_by_reader(out)
    assert seen == {**dict.fromkeys(READERS, [0, 1]), "polars": seen["polars"]}
    assert "different file extensions" in str(seen["polars"])
    with opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [0, 1]
    assert every_reader_reads(out, [0, 1]), "the next open deleted the staged part"


def test_a_layout_probe_left_by_a_killed_open_is_accepted_and_cleaned(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit(rows([0]))
    (out / ".part-s00000-probe-0123abcd.tmp").write_bytes(b"")
    with opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [0]
    assert os.listdir(out) == ["part-s00000-000000.parquet"]
    assert np.array_equal(pq.read_table(out).column("row_id").to_numpy(), [0])
