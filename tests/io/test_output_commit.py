"""Output parts: committed exactly once, across reopen, damaged parts and real crashes, locally and on S3."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from conftest import bookkeeping, run_proc, start_proc

from batchjob.io import OutputDataset, OutputDirError, shard_status

JOB = {"model": "tiny", "sampling": {"max_new_tokens": 4}}


def rows(ids: list[int] | np.ndarray) -> pa.Table:
    ids = np.asarray(ids, dtype=np.int64)
    return pa.table({"row_id": ids, "generation": [f"gen {i}" for i in ids]})


def view_ids(directory: Path | str) -> np.ndarray:
    """Row ids as any reader of the output directory sees them."""
    fs, path = fsspec.core.url_to_fs(str(directory), use_listings_cache=False)
    table = pads.dataset(path, filesystem=fs, format="parquet").to_table(columns=["row_id"])
    return table.column("row_id").to_numpy()


def opened(directory: Path | str, **kwargs: int) -> OutputDataset:
    dataset = OutputDataset(str(directory), **kwargs)
    dataset.open(JOB)
    return dataset


def test_committed_rows_survive_reopen(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit(rows([5, 3]))
        dataset.commit(rows([4, 0]))
    with opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [0, 3, 4, 5]
        dataset.commit(rows([1]))
        assert dataset.committed_row_ids().tolist() == [0, 1, 3, 4, 5]
    assert sorted(view_ids(out).tolist()) == [0, 1, 3, 4, 5]


def test_output_dir_holds_only_parts_and_bookkeeping_lies_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit(rows([0, 1]))
        dataset.write_report({"rows": 2, "tokens_per_s": np.float32(1.5)})
        dataset.mark_success()
    assert os.listdir(out) == ["part-s00000-000000.parquet"]
    meta = bookkeeping(out)
    assert json.loads((meta / "_report.json").read_text()) == {"rows": 2, "tokens_per_s": 1.5}
    assert (meta / "_SUCCESS").exists() and (meta / "_job.json").exists()
    assert [p.name for p in (meta / "manifests" / "s00000").iterdir()] == ["part-s00000-000000.parquet.json"]


def test_commit_requires_an_int64_row_id(tmp_path: Path) -> None:
    with opened(tmp_path / "out") as out, pytest.raises(ValueError, match="no row_id column"):
        out.commit(pa.table({"generation": ["x"]}))


def test_part_committed_without_its_manifest_object_is_recorded_on_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit(rows([0, 1]))
        dataset.commit(rows([2, 3]))
    manifest = bookkeeping(out) / "manifests" / "s00000" / "part-s00000-000001.parquet.json"
    recorded = manifest.read_text()
    manifest.unlink()  # what a crash between the part's rename and its manifest object leaves
    with caplog.at_level(logging.WARNING), opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [0, 1, 2, 3]
    assert "part part-s00000-000001.parquet was committed just before a crash; recording it" in caplog.text
    assert json.loads(manifest.read_text()) == json.loads(recorded)


def test_an_unrecorded_part_holding_rows_of_other_parts_is_deleted_not_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit(rows([0, 4]))
        dataset.commit(rows([2, 3]))
        dataset.commit(rows([1, 5]))
    # A crash's leftover (its rows in no other part, though its row id range overlaps theirs) beside a copy of a
    # part (a part put back after its rows were recomputed elsewhere).
    (bookkeeping(out) / "manifests" / "s00000" / "part-s00000-000002.parquet.json").unlink()
    (out / "part-s00000-000007.parquet").write_bytes((out / "part-s00000-000001.parquet").read_bytes())
    with caplog.at_level(logging.WARNING), opened(out) as dataset:
        assert dataset.part_names == tuple(f"part-s00000-00000{i}.parquet" for i in range(3))
        assert dataset.committed_row_ids().tolist() == [0, 1, 2, 3, 4, 5]
    assert "part-s00000-000007.parquet holds rows that other parts committed" in caplog.text
    assert sorted(view_ids(out).tolist()) == [0, 1, 2, 3, 4, 5]


def test_a_zero_row_part_is_recorded_without_a_row_id_range_and_checked_on_open(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit_empty(rows([]).schema)
    manifest = bookkeeping(out) / "manifests" / "s00000" / "part-s00000-000000.parquet.json"
    recorded = json.loads(manifest.read_text())
    assert (recorded["rows"], recorded["row_id_min"], recorded["row_id_max"]) == (0, None, None)
    manifest.unlink()  # a crash right after the part became visible: recovery records it again
    with opened(out) as dataset:
        assert dataset.committed_rows == 0
    assert json.loads(manifest.read_text()) == recorded
    assert pq.read_table(out / "part-s00000-000000.parquet").schema.names == ["row_id", "generation"]


def flip_a_byte(part: Path) -> None:
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [flip_a_byte, lambda part: part.write_bytes(part.read_bytes()[:-7]), lambda part: part.unlink()],
    ids=["flipped-byte", "truncated", "deleted"],
)
def test_damaged_part_is_uncommitted_and_its_rows_recomputed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage
) -> None:
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit(rows([0, 1]))
        dataset.commit(rows([2, 3]))
    damage(out / "part-s00000-000000.parquet")
    with caplog.at_level(logging.WARNING), opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [2, 3]
        dataset.commit(rows([0, 1]))  # what the rerun recomputes
    assert "its rows are recomputed" in caplog.text or "rows recomputed" in caplog.text
    assert sorted(view_ids(out).tolist()) == [0, 1, 2, 3]


def test_a_part_deleted_from_a_complete_shard_makes_it_incomplete_until_its_rows_are_recomputed(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit(rows([0, 1]))
        dataset.commit(rows([2, 3]))
        dataset.mark_success()
    assert OutputDataset(str(out)).is_complete_for(JOB)
    (out / "part-s00000-000000.parquet").unlink()
    assert not OutputDataset(str(out)).is_complete_for(JOB)
    with opened(out) as dataset:
        assert not dataset.is_success(), "a crash from here must not leave the shard called complete"
        assert dataset.committed_row_ids().tolist() == [2, 3]
        dataset.commit(rows([0, 1]))
        dataset.mark_success()
    assert OutputDataset(str(out)).is_complete_for(JOB)
    assert sorted(view_ids(out).tolist()) == [0, 1, 2, 3]


def test_unreadable_manifest_object_gets_its_part_checked_and_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with opened(out) as dataset:
        dataset.commit(rows([0, 1]))
    manifest = bookkeeping(out) / "manifests" / "s00000" / "part-s00000-000000.parquet.json"
    manifest.write_text("{not json")
    with opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [0, 1]
    assert json.loads(manifest.read_text())["rows"] == 2


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_killed_writer_leaves_every_committed_row_exactly_once(tmp_path: Path, storage: str, request) -> None:
    out = str(tmp_path / "out") if storage == "local" else request.getfixturevalue("s3_output_dir")
    total = 300
    for _ in range(3):
        writer = start_proc("job", out, str(total), "7")
        for _ in range(6):  # let it commit a while, then kill it wherever it is
            assert writer.stdout.readline() == "commit\n", writer.stderr.read()
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        seen = view_ids(out)  # before any recovery: the plain directory is exactly the committed rows
        assert len(seen) == len(np.unique(seen)), "a row is in two committed parts"
        with opened(out) as dataset:
            assert np.array_equal(np.sort(seen), dataset.committed_row_ids())
            assert not dataset.is_success()
    finished = run_proc("job", out, str(total), "7")
    assert finished.returncode == 0, finished.stderr
    assert np.array_equal(np.sort(view_ids(out)), np.arange(total))


def test_rewrite_ordered_puts_rows_in_row_id_order(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ids = np.random.default_rng(0).permutation(50)
    with opened(out) as dataset:
        for chunk in np.array_split(ids, 6):
            dataset.commit(rows(chunk))
        dataset.rewrite_ordered(rows_per_part=8)
        assert dataset.committed_row_ids().tolist() == list(range(50))
    table = pads.dataset(str(out)).to_table()
    assert table.column("row_id").to_pylist() == list(range(50))
    assert table.column("generation").to_pylist() == [f"gen {i}" for i in range(50)]
    assert len(list(out.glob("part-*.parquet"))) == 7
    assert len(list((bookkeeping(out) / "manifests" / "s00000").iterdir())) == 7


def test_rewrite_ordered_interrupted_after_its_record_rolls_forward(tmp_path: Path) -> None:
    out = tmp_path / "out"
    meta = bookkeeping(out)
    with opened(out) as dataset:
        dataset.commit(rows([3, 1]))
        dataset.commit(rows([2, 0]))
        old = {p.name: p.read_bytes() for p in out.iterdir()}
        old_manifests = {p.name: p.read_bytes() for p in (meta / "manifests" / "s00000").iterdir()}
        dataset.rewrite_ordered()
    # Undo what followed the rewrite record, as if the process died right after writing it.
    new = [json.loads(p.read_text()) for p in (meta / "manifests" / "s00000").iterdir()]
    record = {"remove": sorted(old), "add": new}
    for part in out.iterdir():
        part.rename(meta / "tmp" / f".{part.name}.tmp")
    for manifest in (meta / "manifests" / "s00000").iterdir():
        manifest.unlink()
    for name, data in old.items():
        (out / name).write_bytes(data)
    for name, data in old_manifests.items():
        (meta / "manifests" / "s00000" / name).write_bytes(data)
    (meta / "manifests" / "s00000" / "rewrite.json").write_text(json.dumps(record))
    with opened(out) as dataset:
        assert dataset.committed_row_ids().tolist() == [0, 1, 2, 3]
    assert view_ids(out).tolist() == [0, 1, 2, 3]
    assert not (meta / "manifests" / "s00000" / "rewrite.json").exists()


def test_shards_share_a_directory_without_touching_each_other(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with opened(out, shard_index=0, shard_count=2) as first:
        first.commit(rows([0, 1]))
        first.mark_success()
    with opened(out, shard_index=1, shard_count=2) as second:
        second.commit(rows([2]))
        assert second.committed_row_ids().tolist() == [2]
        assert not second.is_success()
    assert (bookkeeping(out) / "_SUCCESS-s00000").exists() and not (bookkeeping(out) / "_SUCCESS").exists()
    assert sorted(view_ids(out).tolist()) == [0, 1, 2]


def test_shard_status_reports_rows_and_success_per_shard(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with opened(out, shard_index=1, shard_count=3) as dataset:
        dataset.commit(rows([5, 6, 7]))
        dataset.write_report({"rows": 3})
        dataset.mark_success()
        statuses = shard_status(str(out))
    assert [(s["shard"], s["rows"], s["success"]) for s in statuses] == [(0, 0, False), (1, 3, True), (2, 0, False)]
    assert statuses[1]["report"] == {"rows": 3}
    assert statuses[1]["locked"] and not statuses[0]["locked"]


def test_output_on_an_fsspec_filesystem() -> None:
    uri = "memory://batchjob-test/out"
    with OutputDataset(uri) as out:
        out.open(JOB)
        out.commit(rows([1, 0]))
        out.commit(rows([2]))
        out.mark_success()
    with OutputDataset(uri) as out:
        out.open(JOB)
        assert out.committed_row_ids().tolist() == [0, 1, 2]
        assert out.is_success()


def test_output_on_an_s3_server(s3_output_dir: str) -> None:
    with opened(s3_output_dir) as dataset:
        dataset.commit(rows([1, 0]))
        dataset.commit(rows([2]))
        dataset.write_report({"rows": 3})
        dataset.mark_success()
    fs, path = fsspec.core.url_to_fs(s3_output_dir, use_listings_cache=False)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(path))
    assert names == ["part-s00000-000000.parquet", "part-s00000-000001.parquet"]
    assert fs.exists(path + ".batchjob/_SUCCESS")
    with opened(s3_output_dir) as dataset:
        assert dataset.committed_row_ids().tolist() == [0, 1, 2]
        assert dataset.is_success()


def test_an_output_dir_of_the_older_layout_is_refused_with_what_to_do(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "_job.json").write_text("{}")
    pq.write_table(rows([0]), out / "part-s00000-000000.parquet")
    with pytest.raises(OutputDirError, match="older batchjob .* Finish the job with the batchjob version"):
        OutputDataset(str(out)).open(JOB)


@pytest.mark.parametrize("uri", ["s3://bucket", "/"])
def test_a_bucket_or_filesystem_root_is_refused_as_output_dir(uri: str) -> None:
    with pytest.raises(OutputDirError, match="set output.dir to a folder inside it"):
        OutputDataset(uri)


def test_a_location_that_cannot_be_reached_is_named_and_other_errors_pass(tmp_path: Path) -> None:
    from batchjob.io.access import StorageAccessError, access_reported

    denied = pytest.raises(StorageAccessError, match=r"cannot access s3://b/out: PermissionError: denied")
    with denied, access_reported((str(tmp_path / "in.parquet"), "s3://b/out")):
        raise PermissionError("denied")
    with pytest.raises(KeyError), access_reported(("s3://b/out",)):
        raise KeyError("not an access error")
    local = pytest.raises(StorageAccessError, match=r"cannot access /in or /out: .* this user may read the input")
    with local, access_reported(("/in", "/out")):
        raise PermissionError("denied")


def test_asyncio_records_of_lost_connections_are_dropped_and_others_kept() -> None:
    import sys

    from batchjob.io.access import quiet_lost_connections

    quiet_lost_connections()
    quiet_lost_connections()  # installed once
    asyncio_log = logging.getLogger("asyncio")
    assert len(asyncio_log.filters) == 1

    def record(err: BaseException) -> logging.LogRecord:
        try:
            raise err
        except BaseException:
            info = sys.exc_info()
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved", (), info)

    assert not asyncio_log.filter(record(ConnectionRefusedError(111, "Connect call failed")))
    assert asyncio_log.filter(record(ValueError("a bug of someone's")))
