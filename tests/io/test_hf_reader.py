"""Hugging Face datasets as input: save_to_disk directories and load_dataset."""

from __future__ import annotations

import os
import re
from pathlib import Path

import datasets
import pytest
from conftest import prompts_table, write_prompts

from batchjob.io import InputError, InputSpec, open_input


@pytest.fixture(scope="module")
def saved_splits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "splits"
    splits = {"train": datasets.Dataset(prompts_table(0, 6)), "test": datasets.Dataset(prompts_table(6, 9))}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


def test_saved_dataset_dict_reads_the_chosen_split(saved_splits: Path) -> None:
    source = open_input(InputSpec(str(saved_splits), split="test"))
    assert source.num_rows() == 3
    assert next(source.iter_batches(["prompt"])).column("prompt").to_pylist() == ["prompt 6", "prompt 7", "prompt 8"]


def test_missing_split_lists_the_splits(saved_splits: Path) -> None:
    with pytest.raises(InputError, match="has no split 'validation'; its splits are: train, test"):
        open_input(InputSpec(str(saved_splits), split="validation"))


def test_saved_dataset_fingerprint_is_stable(saved_splits: Path) -> None:
    first = open_input(InputSpec(str(saved_splits))).fingerprint()
    assert first == open_input(InputSpec(str(saved_splits))).fingerprint()
    assert first["rows"] == 6


def test_load_dataset_failure_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="datasets.load_dataset"):
        open_input(InputSpec("parquet", data_files=str(tmp_path / "absent.parquet")))


def test_streaming_id_column_must_exist(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.parquet", 0, 5, row_group_rows=5)
    with pytest.raises(InputError, match="columns are: id, prompt, topic"):
        open_input(InputSpec("parquet", data_files=str(path), streaming=True, id_column="uid"))


def test_streaming_parquet_shard_reads_only_its_own_files(tmp_path: Path) -> None:
    first = write_prompts(tmp_path / "a.parquet", 0, 10, row_group_rows=5)
    write_prompts(tmp_path / "b.parquet", 10, 20, row_group_rows=5)
    spec = InputSpec("parquet", data_files=str(tmp_path / "*.parquet"), streaming=True, shard_index=1, shard_count=2)
    source = open_input(spec)
    first.unlink()  # opening read the footers; iterating shard 1 must never touch the other shard's file
    ids = [i for b in source.iter_batches(["prompt"]) for i in b.column("row_id").to_pylist()]
    assert ids == list(range(10, 20))


def test_streaming_fingerprint_follows_content_not_file_times(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    prompts_table(0, 5).to_pandas().to_json(jsonl, orient="records", lines=True)
    spec = InputSpec("json", data_files=str(jsonl), streaming=True)
    before = open_input(spec).fingerprint()
    os.utime(jsonl, (1, 1))
    assert open_input(spec).fingerprint() == before
    jsonl.write_text(jsonl.read_text().replace("prompt 3", "prompt 9"))
    assert open_input(spec).fingerprint() != before


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "json", "csv"])
def test_a_plain_file_of_prompts_is_read_by_the_datasets_builder_of_its_kind(tmp_path: Path, kind: str) -> None:
    frame = prompts_table(0, 5).to_pandas()
    path = tmp_path / f"prompts.{kind}"
    if kind == "csv":
        frame.to_csv(path, index=False)
    elif kind == "json":
        frame.to_json(path, orient="records")
    else:
        frame.to_json(path, orient="records", lines=True)
    source = open_input(InputSpec(str(path)))
    assert source.num_rows() == 5
    table = next(source.iter_batches(["prompt"]))
    assert table.column("prompt").to_pylist() == [f"prompt {i}" for i in range(5)]
    assert table.column("row_id").to_pylist() == list(range(5))


def test_a_text_file_is_a_prompt_a_line_in_its_text_column(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("first\nsecond\n")
    source = open_input(InputSpec(str(path)))
    assert source.columns[:1] == ["text"] and source.num_rows() == 2


def test_a_copied_prompt_file_keeps_its_identity_and_an_edit_changes_it(tmp_path: Path) -> None:
    path = tmp_path / "a" / "prompts.jsonl"
    path.parent.mkdir()
    prompts_table(0, 5).to_pandas().to_json(path, orient="records", lines=True)
    before = open_input(InputSpec(str(path))).fingerprint()
    copy = tmp_path / "b" / "prompts.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert open_input(InputSpec(str(copy))).fingerprint() == before
    copy.write_text(copy.read_text().replace("prompt 3", "prompt 9"))
    assert open_input(InputSpec(str(copy))).fingerprint() != before


def test_a_file_of_another_kind_names_the_kinds_read(tmp_path: Path) -> None:
    path = tmp_path / "prompts.xlsx"
    path.write_bytes(b"PK")
    with pytest.raises(InputError, match="a JSON Lines, JSON, CSV or text file"):
        open_input(InputSpec(str(path)))


@pytest.mark.parametrize(
    ("content", "said"),
    [
        # A byte order mark and a blank line do not shift the count: lines are numbered as an editor shows them.
        ('\ufeff{"prompt": "a"}\n\n{"prompt": b}\n', "line 3 is not JSON (Expecting value at column 12)"),
        ('{"prompt": "a"}\r\n["b"]\r\n', "line 2 is a JSON list, not an object of column values"),
    ],
)
def test_a_json_lines_line_that_cannot_be_a_row_is_named_by_its_number(tmp_path: Path, content: str, said: str):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content.encode())
    with pytest.raises(
        InputError, match=re.escape(f"prompts.jsonl cannot be read as JSON Lines or JSON: {said}: fix or delete")
    ):
        open_input(InputSpec(str(path)))


def test_a_csv_file_not_in_utf8_says_to_save_it_as_utf8(tmp_path: Path) -> None:
    path = tmp_path / "prompts.csv"
    path.write_bytes("prompt\nfine\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(
        InputError, match="prompts.csv cannot be read as CSV: line 3 is not UTF-8 .*save the file as UTF"
    ):
        open_input(InputSpec(str(path)))


@pytest.mark.parametrize(
    ("name", "content", "said"), [("p.jsonl", "\n\n", "no line with text"), ("p.csv", "prompt\n", "only a header")]
)
def test_a_file_without_rows_says_so(tmp_path: Path, name: str, content: str, said: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(InputError, match=f"it holds no rows \\({said}\\): give a file with prompts"):
        open_input(InputSpec(str(path)))


def test_a_csv_parse_error_is_one_line_naming_the_file_and_the_parsers_reason(tmp_path: Path) -> None:
    path = tmp_path / "prompts.csv"
    path.write_text("prompt,topic\nhello,a\nx,y,z\n")
    with pytest.raises(InputError) as refused:
        open_input(InputSpec(str(path)))
    assert "\n" not in str(refused.value)
    assert "prompts.csv cannot be read as CSV (ParserError: " in str(refused.value)
    assert "Expected 2 fields in line 3, saw 3): fix the file" in str(refused.value)


@pytest.mark.parametrize("streaming", [False, True], ids=["loaded", "streamed"])
@pytest.mark.parametrize("name", ["prompts.tsv", "prompts.tsv.gz"])
def test_a_tab_separated_file_is_read_by_its_tabs(tmp_path: Path, name: str, streaming: bool) -> None:
    import gzip

    text = 'prompt\ttopic\nhello, world\ta\n"quoted\ttab"\tb\n'
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    source = open_input(InputSpec(str(path), streaming=streaming))
    rows = [row for batch in source.iter_batches(["prompt", "topic"]) for row in batch.to_pylist()]
    assert [(r["prompt"], r["topic"]) for r in rows] == [("hello, world", "a"), ("quoted\ttab", "b")]


def test_an_integer_id_column_with_a_blank_cell_says_the_blank_made_it_floats(tmp_path: Path) -> None:
    path = tmp_path / "prompts.csv"
    path.write_text("id,prompt\n1,hello\n,there\n3,again\n")
    with pytest.raises(InputError, match="has type double.*fill the missing ids and write the column as integers"):
        open_input(InputSpec(str(path), id_column="id"))


def test_streaming_a_file_with_a_broken_line_names_the_line_as_it_opens(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(InputError, match="prompts.jsonl cannot be read as JSON Lines or JSON: line 2 is not JSON"):
        open_input(InputSpec(str(path), streaming=True))


def test_streaming_to_a_broken_line_past_the_first_block_names_the_line_where_it_is_met(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = 120_000  # about 12 MB: more than the 10 MB block datasets' JSON builder reads at once
    path.write_text("".join(f'{{"prompt": "prompt number {i:07d} {"x" * 70}"}}\n' for i in range(rows)) + "{oops\n")
    source = open_input(InputSpec(str(path), streaming=True, batch_rows=50_000))
    with pytest.raises(InputError, match=f"line {rows + 1} is not JSON .*: fix or delete that line"):
        for _ in source.iter_batches(["prompt"]):
            pass
