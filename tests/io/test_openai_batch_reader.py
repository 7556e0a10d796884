"""OpenAI batch input files: one row per non-blank line, numbered in file order, sharded and resumed like any
input, with a malformed line kept as a row that says what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import run_proc

from batchjob.io import InputError, InputSpec, open_input
from batchjob.io import openai_batch_reader as reader
from batchjob.io.inputs import INPUT_ERROR_COLUMN
from batchjob.io.readers import resolve_format
from batchjob.io.unique_ids import check_unique_ids


def request(i: int) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 3}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_batch(path: Path, lines: list[dict | str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def read_all(spec: InputSpec, skip: np.ndarray | None = None) -> pa.Table:
    source = open_input(spec)
    return pa.Table.from_batches(list(source.iter_batches(["custom_id", "body"], skip)))


def test_each_line_is_a_row_numbered_in_file_order(tmp_path: Path) -> None:
    path = write_batch(tmp_path / "in.jsonl", [request(i) for i in range(10)])
    table = read_all(InputSpec(str(path), format="openai_batch", batch_rows=3))
    assert table.column("row_id").to_pylist() == list(range(10))
    assert table.column("custom_id").to_pylist() == [f"req-{i}" for i in range(10)]
    assert json.loads(table.column("body")[4].as_py())["messages"][0]["content"] == "question 4"
    assert table.column(INPUT_ERROR_COLUMN).null_count == 10


def test_blank_lines_are_not_rows(tmp_path: Path) -> None:
    path = write_batch(tmp_path / "in.jsonl", [request(0), "", "   ", request(1), ""])
    table = read_all(InputSpec(str(path), format="openai_batch"))
    assert table.column("custom_id").to_pylist() == ["req-0", "req-1"]
    assert table.column("row_id").to_pylist() == [0, 1]


@pytest.mark.parametrize(
    ("line", "custom_id", "error"),
    [
        ("{not json", None, "not valid JSON"),
        ("[1, 2]", None, "must be a JSON object"),
        ({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "text"}, "a", "body must be"),
        ({"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}, None, "custom_id must be"),
        ({"custom_id": "b", "body": {}}, "b", "method must be a non-empty string; url must be"),
    ],
)
def test_a_malformed_line_is_a_row_saying_why(tmp_path: Path, line, custom_id, error) -> None:
    path = write_batch(tmp_path / "in.jsonl", [request(0), line, request(2)])
    table = read_all(InputSpec(str(path), format="openai_batch"))
    assert table.column("row_id").to_pylist() == [0, 1, 2]
    assert table.column("custom_id")[1].as_py() == custom_id
    assert error in table.column(INPUT_ERROR_COLUMN)[1].as_py()
    assert table.column(INPUT_ERROR_COLUMN)[2].as_py() is None


def test_a_line_that_is_not_utf8_is_a_row_saying_why(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(json.dumps(request(0)).encode() + b'\n{"custom_id": "\xff"}\n')
    table = read_all(InputSpec(str(path), format="openai_batch"))
    assert "not valid JSON" in table.column(INPUT_ERROR_COLUMN)[1].as_py()


def test_shards_tile_the_lines_exactly_once_across_checkpoints(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(reader, "_CHECKPOINT_LINES", 4)
    write_batch(tmp_path / "dir" / "a.jsonl", [request(i) for i in range(11)])
    write_batch(tmp_path / "dir" / "b.jsonl", ["", *[request(i) for i in range(11, 30)]])
    seen = []
    for index in range(3):
        spec = InputSpec(str(tmp_path / "dir"), format="openai_batch", shard_index=index, shard_count=3, batch_rows=5)
        source = open_input(spec)
        table = read_all(spec)
        assert table.num_rows == source.num_rows()
        seen += table.column("custom_id").to_pylist()
        assert table.column("row_id").to_pylist() == [
            int(c.split("-")[1]) for c in table.column("custom_id").to_pylist()
        ]
    assert seen == [f"req-{i}" for i in range(30)]


def test_committed_rows_are_skipped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(reader, "_CHECKPOINT_LINES", 4)
    path = write_batch(tmp_path / "in.jsonl", [request(i) for i in range(20)])
    skip = np.array([0, 1, 2, 3, 4, 5, 6, 7, 9, 15], dtype=np.int64)
    table = read_all(InputSpec(str(path), format="openai_batch"), skip)
    assert table.column("row_id").to_pylist() == [8, *range(10, 15), *range(16, 20)]


def test_limit_takes_the_first_lines(tmp_path: Path) -> None:
    path = write_batch(tmp_path / "in.jsonl", [request(i) for i in range(10)])
    source = open_input(InputSpec(str(path), format="openai_batch", limit=4))
    assert source.job_rows() == 4
    assert read_all(InputSpec(str(path), format="openai_batch", limit=4)).num_rows == 4


def test_auto_format_recognises_an_openai_batch_file(tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "in.jsonl", ["", request(0)])
    other = write_batch(tmp_path / "other.jsonl", [{"text": "hello"}])
    assert resolve_format(InputSpec(str(batch))) == "openai_batch"
    assert resolve_format(InputSpec(str(other))) == "file"  # other JSON Lines: read by datasets' json builder


def test_the_fingerprint_is_the_content_a_copy_keeps_and_an_edit_changes(tmp_path: Path) -> None:
    def fingerprint(path: Path) -> dict:
        return open_input(InputSpec(str(path), format="openai_batch")).fingerprint()

    lines = [request(i) for i in range(3)]
    original = fingerprint(write_batch(tmp_path / "a" / "in.jsonl", lines))
    assert fingerprint(write_batch(tmp_path / "copy" / "in.jsonl", lines)) == original
    lines[1]["body"]["max_tokens"] = 4
    assert fingerprint(write_batch(tmp_path / "a" / "in.jsonl", lines)) != original


def test_custom_ids_are_string_ids_carried_by_every_batch(tmp_path: Path) -> None:
    path = write_batch(tmp_path / "in.jsonl", [request(i) for i in range(4)])
    spec = InputSpec(str(path), format="openai_batch", id_column="custom_id")
    assert open_input(spec).string_ids
    table = pa.Table.from_batches(list(open_input(spec).iter_batches(["body"])))
    assert table.column("row_id").to_pylist() == [0, 1, 2, 3]
    assert table.column("custom_id").to_pylist() == [f"req-{i}" for i in range(4)]


def test_repeated_custom_ids_are_refused_and_malformed_lines_are_not_counted(tmp_path: Path) -> None:
    lines = [request(0), "{broken", "{also broken", request(1)]
    spec = InputSpec(str(write_batch(tmp_path / "ok.jsonl", lines)), format="openai_batch", id_column="custom_id")
    check_unique_ids(open_input(spec))
    repeated = write_batch(tmp_path / "twice.jsonl", [*lines, request(1)])
    with pytest.raises(InputError, match="repeats values \\('req-1'\\)"):
        check_unique_ids(open_input(InputSpec(str(repeated), format="openai_batch", id_column="custom_id")))


def test_another_id_column_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = write_batch(tmp_path / "in.jsonl", [request(0)])
    with pytest.raises(InputError, match="leave data.id_column unset"):
        open_input(InputSpec(str(path), format="openai_batch", id_column="url"))


def test_peak_memory_does_not_grow_with_input_lines(tmp_path: Path) -> None:
    def peak(lines: int) -> float:
        path = write_batch(tmp_path / f"{lines}.jsonl", [])
        with path.open("w") as f:
            for i in range(lines):
                f.write(json.dumps(request(i)) + "\n")
        result = run_proc("peak-rss", str(path), "1024", "body")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["rows"] == lines
        return report["peak_mib"]

    small, large = peak(50_000), peak(250_000)
    assert large < small + 40, f"peak RSS {large:.0f} MiB for 250k lines vs {small:.0f} MiB for 50k"
