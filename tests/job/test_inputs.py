"""Each input shape and prompt kind, through the whole job (in process: one model load per test)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from jobtools import bookkeeping, read_output, read_report, run_cli, run_in_process, write_prompts, write_table
from transformers import AutoTokenizer

from batchjob.job.tiny_model import SAMPLE_PROMPTS


def test_parquet_directory_input_reads_every_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_prompts(data / "a.parquet", 7)
    pq.write_table(pq.read_table(SAMPLE_PROMPTS).slice(7, 5), data / "b.parquet")
    assert run_in_process(f"data.path={data}", f"output.dir={tmp_path / 'out'}") == 0
    table = read_output(tmp_path / "out")
    assert table.column("row_id").to_pylist() == list(range(12))
    expected_ids = pq.read_table(SAMPLE_PROMPTS).column("id").to_pylist()[:12]
    assert table.column("id").to_pylist() == expected_ids


def test_a_hive_partitioned_directory_keeps_its_partition_column(tmp_path: Path) -> None:
    frame = pq.read_table(SAMPLE_PROMPTS).slice(0, 6).to_pandas()
    frame["lang"] = ["en", "fr", "en", "de", "fr", "en"]
    frame.to_parquet(tmp_path / "data", partition_cols=["lang"])
    template = "pipeline.template='[{lang}] {prompt}'"
    overrides = (f"data.path={tmp_path / 'data'}", template, "data.passthrough_columns=[lang]")
    assert run_in_process(*overrides, f"output.dir={tmp_path / 'o'}") == 0
    table = read_output(tmp_path / "o").sort_by("row_id")
    assert table.column("lang").to_pylist() == ["de", "en", "en", "en", "fr", "fr"]  # lang=de/ sorts first
    assert table.column("error").null_count == 6


def test_hf_save_to_disk_input(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"question": ["What is a cat?", "Why is the sky blue?", "Name a prime."]})
    ds.save_to_disk(str(tmp_path / "ds"))
    code = run_in_process(f"data.path={tmp_path / 'ds'}", "data.prompt_column=question", f"output.dir={tmp_path / 'o'}")
    assert code == 0
    table = read_output(tmp_path / "o")
    assert table.num_rows == 3
    assert table.column("error").null_count == 3


def test_messages_column_is_rendered_with_the_chat_template(tmp_path: Path, model_dir: str) -> None:
    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
        [{"role": "user", "content": "Count to three."}],
    ]
    path = write_table(tmp_path / "chat.parquet", {"messages": conversations})
    assert run_in_process(f"data.path={path}", "data.messages_column=messages", f"output.dir={tmp_path / 'o'}") == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    expected = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered]
    assert read_output(tmp_path / "o").column("prompt_tokens").to_pylist() == expected


def test_messages_column_may_hold_json_text(tmp_path: Path) -> None:
    messages = [json.dumps([{"role": "user", "content": "Hi there"}])]
    path = write_table(tmp_path / "chat.parquet", {"messages": messages})
    assert run_in_process(f"data.path={path}", "data.messages_column=messages", f"output.dir={tmp_path / 'o'}") == 0
    assert read_output(tmp_path / "o").column("finish_reason").to_pylist()[0] in ("stop", "length")


def test_system_prompt_wraps_the_prompt_column_in_a_chat(tmp_path: Path, model_dir: str) -> None:
    path = write_table(tmp_path / "p.parquet", {"prompt": ["Tell me a joke."]})
    overrides = (f"data.path={path}", "pipeline.system_prompt=You are terse.", f"output.dir={tmp_path / 'o'}")
    assert run_in_process(*overrides) == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a joke."}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    expected = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert read_output(tmp_path / "o").column("prompt_tokens").to_pylist() == [expected]


def test_template_pipeline_formats_row_fields(tmp_path: Path, model_dir: str) -> None:
    path = write_table(tmp_path / "t.parquet", {"city": ["Paris", "Lima"], "country": ["France", "Peru"]})
    template = "Q: Is {city} in {country}? A:"
    overrides = (f"data.path={path}", f"pipeline.template='{template}'", f"output.dir={tmp_path / 'o'}")
    assert run_in_process(*overrides) == 0
    table = read_output(tmp_path / "o")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = [
        len(tokenizer(f"Q: Is {c} in {k}? A:")["input_ids"]) for c, k in [("Paris", "France"), ("Lima", "Peru")]
    ]
    assert table.column("prompt_tokens").to_pylist() == expected
    # The columns a prompt is built from are not passed through by default (the input has them).
    assert "city" not in table.column_names


def test_id_column_gives_row_ids_and_passthrough_columns_are_chosen(tmp_path: Path) -> None:
    path = write_table(
        tmp_path / "p.parquet",
        {"uid": pa.array([40, 10, 30], pa.int64()), "prompt": ["a b", "c d", "e f"], "lang": ["x", "y", "z"]},
    )
    overrides = (f"data.path={path}", "data.id_column=uid", "data.passthrough_columns=[lang]")
    assert run_in_process(*overrides, f"output.dir={tmp_path / 'o'}") == 0
    table = read_output(tmp_path / "o")
    assert table.column("row_id").to_pylist() == [10, 30, 40]
    assert table.column("lang").to_pylist() == ["y", "z", "x"]
    assert "uid" not in table.column_names and "prompt" not in table.column_names


def test_n_samples_add_a_generations_list_and_ordered_output_sorts_parts(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.parquet", 6)
    overrides = (
        f"data.path={path}",
        "sampling.n=3",
        "sampling.temperature=1.0",
        "output.ordered=true",
        "output.commit_every_rows=2",
        f"output.dir={tmp_path / 'o'}",
    )
    assert run_in_process(*overrides) == 0
    table = read_output(tmp_path / "o")
    assert [len(g) for g in table.column("generations").to_pylist()] == [3] * 6
    assert table.column("generation").to_pylist() == [g[0] for g in table.column("generations").to_pylist()]
    assert read_report(tmp_path / "o")["completion_tokens"] == sum(table.column("completion_tokens").to_pylist())
    unsorted_read = pq.ParquetDataset(str(tmp_path / "o")).read().column("row_id").to_pylist()
    assert unsorted_read == sorted(unsorted_read)


def test_an_empty_input_commits_a_zero_row_part_with_the_output_columns(tmp_path: Path) -> None:
    empty = write_table(
        tmp_path / "empty.parquet", {"prompt": pa.array([], pa.string()), "k": pa.array([], pa.int32())}
    )
    done = run_cli(f"data.path={empty}", f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 0, done.stderr
    assert "no rows to write" in done.stderr
    assert (bookkeeping(tmp_path / "out") / "_SUCCESS").exists()
    table = read_output(tmp_path / "out")
    assert table.num_rows == 0
    assert table.schema.field("k").type == pa.int32()
    assert table.column_names[:6] == [
        "row_id",
        "generation",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "error",
    ]


def test_a_shard_without_rows_commits_a_part_typed_like_the_others(tmp_path: Path) -> None:
    data = write_prompts(tmp_path / "p.parquet", 1)
    for shard in (0, 1):
        assert (
            run_in_process(
                f"data.path={data}", f"output.dir={tmp_path / 'out'}", "shard.count=2", f"shard.index={shard}"
            )
            == 0
        )
    # Shard 0 owns no row of one, and its part is the first a reader opens: it must not hide any column.
    empty_part = pq.read_table(tmp_path / "out" / "part-s00000-000000.parquet")
    assert empty_part.num_rows == 0
    assert empty_part.schema.equals(pq.read_table(tmp_path / "out" / "part-s00001-000000.parquet").schema)
    table = read_output(tmp_path / "out")
    assert table.column("row_id").to_pylist() == [0]
    assert table.column("topic").to_pylist() == pq.read_table(data).column("topic").to_pylist()
