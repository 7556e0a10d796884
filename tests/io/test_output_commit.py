"""Output parts: committed exactly once, across reopen, torn writes and real crashes."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from conftest import run_proc, start_proc

from batchjob.io import OutputDataset, shard_status

JOB = {"model": "tiny", "sampling": {"max_new_tokens": 4}}


def rows(ids: list[int] | np.ndarray) -> pa.Table:
    ids = np.asarray(ids, dtype=np.int64)
    return pa.table({"row_id": ids, "generation": [f"gen {i}" for i in ids]})


def view_ids(directory: Path) -> np.ndarray:
    """Row ids as any reader of the output directory sees them."""
    return pads.dataset(str(directory)).to_table(columns=["row_id"]).column("row_id").to_numpy()


def opened(directory: Path, **kwargs: int) -> OutputDataset:
    dataset = OutputDataset(str(directory), **kwargs)
    dataset.open(JOB)
    return dataset


def test_committed_rows_survive_reopen(tmp_path: Path) -> None:
    with opened(tmp_path) as out:
        out.commit(rows([5, 3]))
        out.commit(rows([4, 0]))
    with opened(tmp_path) as out:
        assert out.committed_row_ids().tolist() == [0, 3, 4, 5]
        out.commit(rows([1]))
        assert out.committed_row_ids().tolist() == [0, 1, 3, 4, 5]
    assert sorted(view_ids(tmp_path).tolist()) == [0, 1, 3, 4, 5]


def test_only_part_files_are_visible_to_dataset_readers(tmp_path: Path) -> None:
    with opened(tmp_path) as out:
        out.commit(rows([0, 1]))
        out.write_report({"rows": 2, "tokens_per_s": np.float32(1.5)})
        out.mark_success()
    visible = [n for n in os.listdir(tmp_path) if not n.startswith(("_", "."))]
    assert visible == ["part-s00000-000000.parquet"]
    assert pq.read_table(str(tmp_path)).num_rows == 2
    assert json.loads((tmp_path / "_report.json").read_text()) == {"rows": 2, "tokens_per_s": 1.5}


def test_commit_requires_an_int64_row_id(tmp_path: Path) -> None:
    with opened(tmp_path) as out, pytest.raises(ValueError, match="no row_id column"):
        out.commit(pa.table({"generation": ["x"]}))


def test_part_not_in_manifest_is_deleted_on_open(tmp_path: Path) -> None:
    with opened(tmp_path) as out:
        out.commit(rows([0, 1]))
    # What a crash between the part's rename and its manifest line leaves behind.
    pq.write_table(rows([2, 3]), tmp_path / "part-s00000-000001.parquet")
    with opened(tmp_path) as out:
        assert out.committed_row_ids().tolist() == [0, 1]
        assert not (tmp_path / "part-s00000-000001.parquet").exists()
        out.commit(rows([2, 3]))
    assert sorted(view_ids(tmp_path).tolist()) == [0, 1, 2, 3]


def test_torn_last_manifest_line_is_dropped(tmp_path: Path) -> None:
    with opened(tmp_path) as out:
        out.commit(rows([0, 1]))
        out.commit(rows([2, 3]))
    manifest = tmp_path / "_manifest-s00000.jsonl"
    data = manifest.read_bytes()
    manifest.write_bytes(data[: len(data) - 20])  # the second line, torn by a crash mid-append
    with opened(tmp_path) as out:
        assert out.committed_row_ids().tolist() == [0, 1]
        out.commit(rows([2, 3]))
    assert sorted(view_ids(tmp_path).tolist()) == [0, 1, 2, 3]
    assert all(json.loads(line) for line in manifest.read_text().splitlines())


def test_killed_writer_leaves_every_committed_row_exactly_once(tmp_path: Path) -> None:
    total = 3000
    for _ in range(3):
        writer = start_proc("job", str(tmp_path), str(total), "7")
        for _ in range(20):  # let it commit a while, then kill it wherever it is
            assert writer.stdout.readline() == "commit\n", writer.stderr.read()
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        with opened(tmp_path) as out:
            committed = out.committed_row_ids()
            seen = view_ids(tmp_path)
            assert len(seen) == len(np.unique(seen)), "a row is in two committed parts"
            assert np.array_equal(np.sort(seen), committed)
            assert not out.is_success()
    finished = run_proc("job", str(tmp_path), str(total), "7")
    assert finished.returncode == 0, finished.stderr
    assert np.array_equal(np.sort(view_ids(tmp_path)), np.arange(total))


def test_rewrite_ordered_puts_rows_in_row_id_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ids = rng.permutation(50)
    with opened(tmp_path) as out:
        for chunk in np.array_split(ids, 6):
            out.commit(rows(chunk))
        out.rewrite_ordered(rows_per_part=8)
        assert out.committed_row_ids().tolist() == list(range(50))
    table = pads.dataset(str(tmp_path)).to_table()
    assert table.column("row_id").to_pylist() == list(range(50))
    assert table.column("generation").to_pylist() == [f"gen {i}" for i in range(50)]
    assert len(list(tmp_path.glob("part-*.parquet"))) == 7


def test_rewrite_ordered_interrupted_after_its_manifest_line_rolls_forward(tmp_path: Path) -> None:
    with opened(tmp_path) as out:
        out.commit(rows([3, 1]))
        out.commit(rows([2, 0]))
        out.rewrite_ordered()
    # Undo the file moves that followed the manifest line, as if the process died right after it.
    os.rename(tmp_path / "part-s00000-000002.parquet", tmp_path / "_tmp" / "part-s00000-000002.parquet")
    pq.write_table(rows([3, 1]), tmp_path / "part-s00000-000000.parquet")
    with opened(tmp_path) as out:
        assert out.committed_row_ids().tolist() == [0, 1, 2, 3]
    assert view_ids(tmp_path).tolist() == [0, 1, 2, 3]


def test_shards_share_a_directory_without_touching_each_other(tmp_path: Path) -> None:
    with opened(tmp_path, shard_index=0, shard_count=2) as first:
        first.commit(rows([0, 1]))
        first.mark_success()
    with opened(tmp_path, shard_index=1, shard_count=2) as second:
        second.commit(rows([2]))
        assert second.committed_row_ids().tolist() == [2]
        assert not second.is_success()
    assert (tmp_path / "_SUCCESS-s00000").exists() and not (tmp_path / "_SUCCESS").exists()
    assert sorted(view_ids(tmp_path).tolist()) == [0, 1, 2]


def test_shard_status_reports_rows_and_success_per_shard(tmp_path: Path) -> None:
    with opened(tmp_path, shard_index=1, shard_count=3) as out:
        out.commit(rows([5, 6, 7]))
        out.write_report({"rows": 3})
        out.mark_success()
        statuses = shard_status(str(tmp_path))
    assert [(s["shard"], s["rows"], s["success"]) for s in statuses] == [(0, 0, False), (1, 3, True), (2, 0, False)]
    assert statuses[1]["report"] == {"rows": 3}
    assert statuses[1]["locked"] and not statuses[0]["locked"]


def test_output_on_an_fsspec_filesystem(tmp_path: Path) -> None:
    uri = "memory://batchjob-test/out"
    with OutputDataset(uri) as out:
        out.open(JOB)
        out.commit(rows([1, 0]))
        out.mark_success()
    with OutputDataset(uri) as out:
        out.open(JOB)
        assert out.committed_row_ids().tolist() == [0, 1]
        assert out.is_success()
