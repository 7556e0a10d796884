"""Structured outputs through the job: a job-level schema file, a per-row schema column mixed with
unconstrained rows, a row whose schema cannot compile becoming an error row, and an OpenAI batch file's
per-line response_format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from jobtools import read_output, read_report, run_cli, run_in_process, write_prompts
from structured_cases import CHOICES, PET_SCHEMA, POINT_SCHEMA, valid_json

NATIVE = ("engine=native", "engine.dtype=float32", "sampling.max_new_tokens=160")


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_a_job_level_schema_file_makes_every_stopped_row_valid(tmp_path: Path, engine: str) -> None:
    schema = tmp_path / "pet.json"
    schema.write_text(json.dumps(PET_SCHEMA))
    data = write_prompts(tmp_path / "p.parquet", 16)
    overrides = (*NATIVE, f"engine={engine}") if engine == "hf" else NATIVE
    code = run_in_process(
        *overrides, f"data.path={data}", f"sampling.json_schema={schema}", f"output.dir={tmp_path / 'o'}"
    )
    assert code == 0
    rows = read_output(tmp_path / "o").to_pylist()
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    assert len(stopped) >= 0.8 * len(rows)
    assert all(valid_json(r["generation"], PET_SCHEMA) for r in stopped)


def test_per_row_schemas_mix_with_job_level_choice_rows_and_a_bad_schema_is_an_error_row(tmp_path: Path) -> None:
    schemas = [
        json.dumps(POINT_SCHEMA),
        None,
        json.dumps(PET_SCHEMA),
        '{"type": "nonsense"}',
        "not json",
        None,
        "",
        " ",
    ]
    data = write_prompts(tmp_path / "p.parquet", len(schemas), schema=schemas)
    code = run_in_process(
        *NATIVE,
        f"data.path={data}",
        "data.json_schema_column=schema",
        f"sampling.choice=[{','.join(CHOICES)}]",
        "sampling.temperature=0.8",
        f"output.dir={tmp_path / 'o'}",
    )
    assert code == 0
    rows = {r["row_id"]: r for r in read_output(tmp_path / "o").to_pylist()}
    assert valid_json(rows[0]["generation"], POINT_SCHEMA) and rows[0]["finish_reason"] == "stop"
    assert rows[2]["finish_reason"] != "stop" or valid_json(rows[2]["generation"], PET_SCHEMA)
    for row_id in (1, 5, 6, 7):  # no schema of their own (null, or a blank cell): the job's choice applies
        assert rows[row_id]["generation"] in CHOICES
    assert rows[3]["finish_reason"] == "error" and "json_schema cannot be compiled" in rows[3]["error"]
    assert rows[4]["finish_reason"] == "error" and "schema: invalid sampling parameters" in rows[4]["error"]
    report = read_report(tmp_path / "o")
    assert report["errors"] == 2
    assert report["engine"]["grammars_compiled"] == 3  # the choice and two schemas, each compiled once


def test_per_row_schemas_written_as_dicts_constrain_their_rows(tmp_path: Path) -> None:
    # pandas and pyarrow write a column of dicts as a struct column: each row then has every field of every
    # row's schema, null where its own had none.
    import pyarrow as pa
    import pyarrow.parquet as pq

    schemas = [POINT_SCHEMA, None, PET_SCHEMA, POINT_SCHEMA]
    table = pa.table({"prompt": [f"Describe thing {i}." for i in range(len(schemas))], "schema": schemas})
    assert pa.types.is_struct(table.schema.field("schema").type)
    assert table.column("schema")[0].as_py()["properties"].get("name", 0) is None  # PET's field, null here
    pq.write_table(table, tmp_path / "p.parquet")
    code = run_in_process(
        *NATIVE, f"data.path={tmp_path / 'p.parquet'}", "data.json_schema_column=schema", f"output.dir={tmp_path / 'o'}"
    )
    assert code == 0
    rows = {r["row_id"]: r for r in read_output(tmp_path / "o").to_pylist()}
    for row_id, schema in enumerate(schemas):
        if schema is not None:
            assert rows[row_id]["finish_reason"] in ("stop", "length"), rows[row_id]["error"]
    assert rows[0]["finish_reason"] == "stop" and valid_json(rows[0]["generation"], POINT_SCHEMA)
    assert rows[2]["finish_reason"] != "stop" or valid_json(rows[2]["generation"], PET_SCHEMA)
    assert read_report(tmp_path / "o")["errors"] == 0


def test_a_schema_on_an_object_store_is_read_from_there(s3_output_dir: str, tmp_path: Path, capsys) -> None:
    import s3fs

    bucket = s3_output_dir.split("/")[2]
    s3fs.S3FileSystem(skip_instance_cache=True).pipe(f"{bucket}/schemas/point.json", json.dumps(POINT_SCHEMA).encode())
    data = write_prompts(tmp_path / "p.parquet", 6)
    schema = f"s3://{bucket}/schemas/point.json"
    code = run_in_process(
        *NATIVE, f"data.path={data}", f"sampling.json_schema={schema}", f"output.dir={tmp_path / 'o'}"
    )
    assert code == 0
    rows = read_output(tmp_path / "o").to_pylist()
    assert all(r["finish_reason"] == "stop" and valid_json(r["generation"], POINT_SCHEMA) for r in rows)
    missing = f"s3://{bucket}/schemas/none.json"
    code = run_in_process(
        *NATIVE, f"data.path={data}", f"sampling.json_schema={missing}", f"output.dir={tmp_path / 'x'}"
    )
    assert code == 2 and f"sampling.json_schema='{missing}': no such object or file" in capsys.readouterr().err


def test_an_inline_grammar_naming_a_url_is_taken_as_grammar_text(tmp_path: Path) -> None:
    # Only a value that is one URL and nothing else is read from where it points.
    data = write_prompts(tmp_path / "p.parquet", 4)
    grammar = """'start: "ftp://" /[a-z]{3}/'"""
    code = run_in_process(*NATIVE, f"data.path={data}", f"sampling.grammar={grammar}", f"output.dir={tmp_path / 'o'}")
    assert code == 0
    rows = read_output(tmp_path / "o").to_pylist()
    assert all(re.fullmatch(r"ftp://[a-z]{3}", r["generation"]) for r in rows), rows


def _chat_line(custom_id: str, text: str, response_format: dict | None) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
    if response_format is not None:
        body["response_format"] = response_format
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}


def test_openai_batch_response_formats_constrain_their_lines(tmp_path: Path) -> None:
    formats = {
        "pet-0": _schema_format(PET_SCHEMA),
        "pet-1": _schema_format(PET_SCHEMA),
        "point-0": _schema_format(POINT_SCHEMA),
        "point-1": _schema_format(POINT_SCHEMA),
        "object-0": {"type": "json_object"},
        "object-1": {"type": "json_object"},
        "text": {"type": "text"},
        "no-schema": {"type": "json_schema", "json_schema": {"name": "answer"}},
    }
    batch = tmp_path / "requests.jsonl"
    batch.write_text("".join(_chat_line(i, f"Answer {i} in JSON.", f) + "\n" for i, f in formats.items()))
    assert run_in_process(*NATIVE, f"data.path={batch}", f"output.dir={tmp_path / 'o'}") == 0
    rows = {r["custom_id"]: r for r in read_output(tmp_path / "o").to_pylist()}
    for custom_id, schema in [("pet", PET_SCHEMA), ("point", POINT_SCHEMA), ("object", {"type": "object"})]:
        for row in (rows[f"{custom_id}-0"], rows[f"{custom_id}-1"]):
            assert row["error"] is None
            assert row["finish_reason"] != "stop" or valid_json(row["generation"], schema), row["generation"]
    assert all(rows[f"point-{i}"]["finish_reason"] == "stop" for i in range(2))
    # The tiny model's noise runs on inside a key until max_tokens; constrained, it still opens an object.
    assert all(rows[f"object-{i}"]["generation"].startswith('{"') for i in range(2))
    assert rows["text"]["error"] is None
    assert rows["no-schema"]["finish_reason"] == "error" and "json_schema.schema" in rows["no-schema"]["error"]
    assert read_report(tmp_path / "o")["engine"]["grammars_compiled"] == 3  # pet, point, object: once each


def test_a_lines_schema_keeps_its_null_values(tmp_path: Path) -> None:
    # Only a Parquet struct column's nulls are other rows' fields; in a JSON line a null is the schema's own.
    schema = {"type": "object", "properties": {"x": {"const": None}}, "required": ["x"], "additionalProperties": False}
    batch = tmp_path / "requests.jsonl"
    batch.write_text(_chat_line("null", "Answer in JSON.", _schema_format(schema)) + "\n")
    assert run_in_process(*NATIVE, f"data.path={batch}", f"output.dir={tmp_path / 'o'}") == 0
    (row,) = read_output(tmp_path / "o").to_pylist()
    assert (row["finish_reason"], row["generation"]) == ("stop", '{"x":null}')


def test_stops_apply_to_unconstrained_rows_only_and_with_a_job_level_constraint_are_refused(
    tmp_path: Path, capsys
) -> None:
    # A per-row schema beside free-text rows: the job's stop strings cut the free rows, never a schema's JSON.
    schemas = [json.dumps(PET_SCHEMA), None] * 4
    data = write_prompts(tmp_path / "p.parquet", len(schemas), schema=schemas)
    stops = ("sampling.stop=['\"','}',e,a,' ']", "sampling.temperature=1.0")
    code = run_in_process(
        *NATIVE, *stops, f"data.path={data}", "data.json_schema_column=schema", f"output.dir={tmp_path / 'o'}"
    )
    assert code == 0
    rows = read_output(tmp_path / "o").to_pylist()
    constrained = [r for r in rows if r["row_id"] % 2 == 0]
    assert all(valid_json(r["generation"], PET_SCHEMA) for r in constrained if r["finish_reason"] == "stop")
    assert sum(r["finish_reason"] == "stop" for r in constrained) >= 3
    free = [r for r in rows if r["row_id"] % 2 == 1]
    assert all(r["finish_reason"] == "stop" and not set(r["generation"]) & set('"}ea ') for r in free)
    # Every row under the job's schema: the stop would apply to none, so the job refuses it before any work.
    schema = tmp_path / "pet.json"
    schema.write_text(json.dumps(PET_SCHEMA))
    code = run_in_process(
        *NATIVE,
        "sampling.stop=[END]",
        f"data.path={data}",
        f"sampling.json_schema={schema}",
        f"output.dir={tmp_path / 'x'}",
    )
    assert code == 2 and not (tmp_path / "x").exists()
    err = capsys.readouterr().err
    assert "sampling.stop with sampling.json_schema" in err and "remove sampling.stop" in err


def test_choices_hydra_reads_as_yaml_values_are_spelt_as_typed(tmp_path: Path) -> None:
    # YAML makes true/false/null booleans and None: their Python spelling ("True", "None") was not what was typed.
    data = write_prompts(tmp_path / "p.parquet", 12)
    code = run_in_process(
        *NATIVE, f"data.path={data}", "sampling.choice=[true,false,null,7]", "sampling.temperature=1.0",
        f"output.dir={tmp_path / 'o'}",
    )  # fmt: skip
    assert code == 0
    texts = {r["generation"] for r in read_output(tmp_path / "o").to_pylist()}
    assert texts <= {"true", "false", "null", "7"} and len(texts) >= 2


# `\d`, `\w` and `\s` are ASCII; their negations keep out what any dialect counts in them (README, "Structured
# outputs"). The default tiny model writes other scripts' digits byte by byte wherever it is allowed to.
DIGITS_PATTERNS = {"code": r"^[A-Z]{2}-\d{3,5}$", "label": r"^\D{2,4}$", "pair": r"^[a-z]{1,3}\s[a-z]{1,3}$"}
DIGITS_SCHEMA = {
    "type": "object",
    "properties": {key: {"type": "string", "pattern": pattern} for key, pattern in DIGITS_PATTERNS.items()},
    "required": list(DIGITS_PATTERNS),
    "additionalProperties": False,
}


def _matches_in_both_modes(pattern: str, text: str) -> bool:
    return bool(re.fullmatch(pattern, text) and re.fullmatch(pattern, text, re.ASCII))


def _follows_digits_schema(text: str) -> bool:
    return valid_json(text, DIGITS_SCHEMA) and all(
        _matches_in_both_modes(DIGITS_PATTERNS[key], value) for key, value in json.loads(text).items()
    )


def test_a_regexs_digit_class_writes_ascii_digits_only(tmp_path: Path) -> None:
    regex = r"[A-Z]{2}-\d{3,5}"
    result = run_cli(
        "engine=native", "engine.dtype=float32", "sampling.temperature=1", "sampling.max_new_tokens=16",
        "data.limit=24", f'sampling.regex="{regex}"', f"output.dir={tmp_path / 'o'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = read_output(tmp_path / "o").to_pylist()
    assert len(rows) == 24 and all(r["finish_reason"] == "stop" for r in rows)
    assert [r["generation"] for r in rows if not _matches_in_both_modes(regex, r["generation"])] == []


def test_per_row_schemas_patterns_write_ascii_digits_and_spaces_only(tmp_path: Path) -> None:
    data = write_prompts(tmp_path / "p.parquet", 12, schema=[json.dumps(DIGITS_SCHEMA)] * 12)
    overrides = ("data.json_schema_column=schema", "sampling.temperature=1.0")
    assert run_in_process(*NATIVE, *overrides, f"data.path={data}", f"output.dir={tmp_path / 'o'}") == 0
    rows = read_output(tmp_path / "o").to_pylist()
    stopped = [r["generation"] for r in rows if r["finish_reason"] == "stop"]
    assert len(stopped) >= 10 and [t for t in stopped if not _follows_digits_schema(t)] == []


def test_an_openai_batch_lines_schema_patterns_write_ascii_digits_and_spaces_only(tmp_path: Path) -> None:
    batch = tmp_path / "requests.jsonl"
    lines = [_chat_line(f"code-{i}", f"Code {i}.", _schema_format(DIGITS_SCHEMA)) for i in range(12)]
    batch.write_text("".join(line + "\n" for line in lines))
    code = run_in_process(*NATIVE, "sampling.temperature=1.0", f"data.path={batch}", f"output.dir={tmp_path / 'o'}")
    assert code == 0
    rows = read_output(tmp_path / "o").to_pylist()
    stopped = [r["generation"] for r in rows if r["finish_reason"] == "stop"]
    assert len(stopped) >= 10 and [t for t in stopped if not _follows_digits_schema(t)] == []


def test_a_word_boundary_is_refused_before_the_model_loads_naming_where_it_is(tmp_path: Path) -> None:
    result = run_cli(r'sampling.regex="[a-z]+\b"', f"output.dir={tmp_path / 'o'}")
    assert result.returncode == 2 and not (tmp_path / "o").exists()
    assert result.stderr.strip().splitlines() == [
        r"error: sampling.regex: regex cannot be compiled: \b (a word boundary) at position 6 of '[a-z]+\b' is not "
        "supported: the grammar library has no look-around; remove it, or match the characters on either side of it "
        "(a word character [0-9A-Za-z_] beside a non-word one)"
    ]
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string", "pattern": r"\bAda"}}}))
    result = run_cli(f"sampling.json_schema={schema}", f"output.dir={tmp_path / 'o'}")
    assert result.returncode == 2 and "the pattern at /properties/name/pattern: \\b (a word boundary)" in result.stderr
