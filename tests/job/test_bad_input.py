"""Bad rows become error rows (or are skipped, or stop the job); bad configs fail before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from jobtools import (
    bookkeeping,
    cli_env,
    read_output,
    read_report,
    run_cli,
    run_in_process,
    unloadable_copy,
    write_prompts,
    write_table,
)

LONG_PROMPT = " ".join(f"word{i}" for i in range(1500))  # far more tokens than the tiny model's 1024 context
# Inputs that are mostly bad rows on purpose: a complete job with that many failed rows exits 3 by default.
ACCEPT_FAILED = "job.max_error_fraction=1"


def errors_by_row(out: Path) -> dict[int, str | None]:
    table = read_output(out)
    assert all(
        (reason == "error") == (error is not None)
        for reason, error in zip(
            table.column("finish_reason").to_pylist(), table.column("error").to_pylist(), strict=True
        )
    )
    return dict(zip(table.column("row_id").to_pylist(), table.column("error").to_pylist(), strict=True))


def test_each_bad_prompt_kind_is_recorded_as_an_error_row(tmp_path: Path) -> None:
    path = write_table(tmp_path / "p.parquet", {"prompt": ["Fine prompt", None, "", "   ", LONG_PROMPT]})
    assert run_in_process(f"data.path={path}", f"output.dir={tmp_path / 'o'}", ACCEPT_FAILED) == 0
    errors = errors_by_row(tmp_path / "o")
    assert errors[0] is None
    assert "null" in errors[1]
    assert "empty" in errors[2] and "empty" in errors[3]
    assert "context is 1024" in errors[4]
    report = read_report(tmp_path / "o")
    assert (report["ok"], report["errors"], report["rows"]) == (1, 4, 5)


def test_undecodable_text_is_recorded_as_an_error_row(tmp_path: Path) -> None:
    prompts = pa.array([b"Plain bytes are fine", b"\xff\xfe not utf-8"], pa.binary())
    path = write_table(tmp_path / "p.parquet", {"prompt": prompts})
    assert run_in_process(f"data.path={path}", f"output.dir={tmp_path / 'o'}") == 0
    errors = errors_by_row(tmp_path / "o")
    assert errors[0] is None
    assert "not valid UTF-8" in errors[1]


def test_messages_of_the_wrong_type_are_recorded_as_error_rows(tmp_path: Path) -> None:
    good = json.dumps([{"role": "user", "content": "Hi"}])
    path = write_table(tmp_path / "m.parquet", {"messages": [good, "42", "not json", json.dumps([{"role": 1}])]})
    overrides = (f"data.path={path}", "data.messages_column=messages", f"output.dir={tmp_path / 'o'}", ACCEPT_FAILED)
    assert run_in_process(*overrides) == 0
    errors = errors_by_row(tmp_path / "o")
    assert errors[0] is None
    assert "must be a non-empty list" in errors[1]
    assert "not JSON" in errors[2]
    assert "role: str" in errors[3]


def test_skip_policy_drops_bad_rows_and_counts_them(tmp_path: Path) -> None:
    path = write_table(tmp_path / "p.parquet", {"prompt": ["One", None, "Two", LONG_PROMPT]})
    assert run_in_process(f"data.path={path}", "on_error=skip", f"output.dir={tmp_path / 'o'}") == 0
    assert read_output(tmp_path / "o").column("row_id").to_pylist() == [0, 2]
    report = read_report(tmp_path / "o")
    assert (report["ok"], report["errors"], report["skipped"]) == (2, 0, 2)


def test_fail_policy_stops_non_zero_after_committing_finished_rows(tmp_path: Path, capsys) -> None:
    prompts = ["Hello there"] * 12 + [None] + ["More"] * 4
    path = write_table(tmp_path / "p.parquet", {"prompt": prompts})
    overrides = (
        f"data.path={path}",
        "on_error=fail",
        "pipeline.tokenize_batch_rows=4",
        "output.commit_every_rows=100",
        f"output.dir={tmp_path / 'o'}",
    )
    assert run_in_process(*overrides) == 1
    message = capsys.readouterr().err
    assert "row 12: prompt is null (on_error=fail)" in message
    committed = read_output(tmp_path / "o").column("row_id").to_pylist()
    assert committed == list(range(12))
    assert not (bookkeeping(tmp_path / "o") / "_SUCCESS").exists()
    assert run_in_process(*overrides) == 1
    assert read_output(tmp_path / "o").column("row_id").to_pylist() == committed


@pytest.fixture
def unloadable_model(tmp_path: Path, model_dir: str) -> Path:
    """A model whose weights cannot load: any error other than the config's means the model was loaded."""
    return unloadable_copy(model_dir, tmp_path / "broken-model")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.prompt_column=question", "no column 'question'; its columns are id, prompt, topic"),
        ("data.path=/nonexistent/prompts.parquet", "/nonexistent/prompts.parquet"),
        ("data.path=", "data.path is empty (an unset shell variable?): set data.path=PATH"),
        ("model.path=", "model.path is empty (an unset shell variable?): set model.path=PATH"),
        ("sampling.top_p=1.5", "top_p must be in (0, 1]"),
        ("sampling.max_new_tokens=0", "max_new_tokens must be >= 1"),
        ("on_error=ignore", "on_error='ignore': choose one of record, skip, fail"),
        ("resume=no", "resume='no': must be true or false"),  # bool("no") would resume
        ("pipeline.add_special_tokens=off", "pipeline.add_special_tokens='off': must be true or false"),
        ("output.ordered=yes", "output.ordered='yes': must be true or false"),
        ("job.max_error_fraction=1.5", "job.max_error_fraction=1.5: must be a number from 0 to 1"),
        ("job.max_error_fraction=half", "job.max_error_fraction='half': must be a number from 0 to 1"),
        ("engine.max_batch_size=0", "engine.max_batch_size must be a positive integer"),
        ("engine.max_batch_size=true", "engine.max_batch_size must be a positive integer, got True"),
        ("engine.attn_implementation=flash", "engine.attn_implementation='flash': use sdpa, eager, flex_attention"),
        ("+engine.max_batch_siz=4", "engine.max_batch_siz (did you mean engine.max_batch_size?)"),
        ("data.passthrough_columns=[nope]", "passthrough_columns names nope, not in the input"),
        ("data.passthrough_columns=[1,topic]", "data.passthrough_columns=[1, 'topic']: give a list of column names"),
        ("shard.index=3", "shard.index=3 must be below shard.count=1"),
        ("output.lock_timeout_s=0", "output.lock_timeout_s=0: must be a number of seconds > 0"),
        ("output.commit_every_s=soon", "output.commit_every_s='soon': must be a number of seconds > 0"),
        ("progress.log_every_s=abc", "progress.log_every_s='abc': must be a number of seconds >= 0"),
        ("progress.log_every_s=-1", "progress.log_every_s=-1: must be a number of seconds >= 0"),
        ("sampling.json_schema={type: nonsense}", "sampling.json_schema: json_schema cannot be compiled"),
        ("sampling.json_schema=/no/such/schema.json", "neither inline text nor an existing file"),
        ("sampling.json_schema={name: Alice, age: 30}", "only age, name: it looks like an example value, not a schema"),
        (
            "sampling.json_schema={name: pet, strict: true, schema: {type: object}}",
            "it looks like the wrapper of an OpenAI response_format; give the schema inside it",
        ),
        ("sampling.regex='(ab'", "sampling.regex: regex cannot be compiled"),
        ("sampling.grammar='start: undefined_rule'", "sampling.grammar: grammar cannot be compiled"),
        ("sampling.choice=[]", "choice must be a non-empty list"),
        ("sampling.stop=5", "sampling.stop=5: must be a string or a list of strings"),
        ("sampling.stop_token_ids=2", "sampling.stop_token_ids=2: must be a list of token ids"),
        ("pipeline.template=5", """pipeline.template=5: must be text; quote it for Hydra"""),
        ("sampling.choice=yes", "sampling.choice='yes' is one string: give the choices as a list"),
        ('sampling.choice="yes, no"', "sampling.choice=[yes,no]"),
        ("data.json_schema_column=schema", "data.json_schema_column='schema' is not in the input"),
    ],
)
def test_bad_config_fails_before_model_load_naming_the_problem(
    tmp_path: Path, unloadable_model: Path, capsys, override: str, message: str
) -> None:
    data = write_prompts(tmp_path / "p.parquet", 3)
    code = run_in_process(
        f"model.path={unloadable_model}", f"data.path={data}", f"output.dir={tmp_path / 'o'}", override
    )
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (pa.array([1, 2]), "holds int64, not text: choose a text column, or make the prompt from it with pipeline."),
        (pa.array([["a"], ["b"]]), "data.prompt_column='prompt' holds list<element: string>, not text: choose a text"),
        (pa.array([{"text": "a"}, {"text": "b"}]), "holds struct<text: string>, not text"),
        (
            pa.array([[{"role": "user", "content": "Hi"}]] * 2),
            "looks like chat messages: set data.messages_column=prompt",
        ),
    ],
    ids=["int", "list", "struct", "messages"],
)
def test_a_prompt_column_that_holds_no_text_fails_before_model_load(
    tmp_path: Path, unloadable_model: Path, capsys, prompts: pa.Array, message: str
) -> None:
    data = write_table(tmp_path / "p.parquet", {"prompt": prompts})
    code = run_in_process(f"model.path={unloadable_model}", f"data.path={data}", f"output.dir={tmp_path / 'o'}")
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["Prompt", " prompt "])
def test_a_column_named_like_the_prompt_column_but_for_case_or_spaces_is_pointed_out(
    tmp_path: Path, unloadable_model: Path, capsys, name: str
) -> None:
    data = write_table(tmp_path / "p.parquet", {name: ["Hi"]})
    code = run_in_process(f"model.path={unloadable_model}", f"data.path={data}", f"output.dir={tmp_path / 'o'}")
    assert code == 2
    assert f"{name!r} differs from 'prompt' only in case or spaces" in capsys.readouterr().err


def test_missing_model_path_is_a_config_error(tmp_path: Path, capsys) -> None:
    assert run_in_process("model.path=/no/such/model", f"output.dir={tmp_path / 'o'}") == 2
    assert "model.path=/no/such/model does not exist" in capsys.readouterr().err


def test_a_model_file_instead_of_its_directory_is_named(tmp_path: Path, capsys, model_dir: str) -> None:
    weights = Path(model_dir) / "model.safetensors"
    assert run_in_process(f"model.path={weights}", f"output.dir={tmp_path / 'o'}") == 2
    error = capsys.readouterr().err
    assert f"model.path={weights} is a file (its folder {model_dir} holds config.json)" in error
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert run_in_process(f"model.path={gguf}", f"output.dir={tmp_path / 'o'}") == 2
    assert "GGUF are not read" in capsys.readouterr().err


def test_a_bucket_root_as_output_dir_is_a_config_error(capsys) -> None:
    assert run_in_process("output.dir=s3://bucket") == 2
    assert "output.dir='s3://bucket' is a bucket's root" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [
        ("batchjob", "output.dir=s3://bucket/run1", "data.limit=2"),
        ("batchjob.status", "output.dir=s3://bucket/run1"),
        ("batchjob.export", "output.dir=s3://bucket/run1", "format=jsonl", "path=PATH"),
    ],
    ids=["job", "status", "export"],
)
def test_an_object_store_without_credentials_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, command) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached: an unsigned request is not sent
    module, *args = command
    args = [arg.replace("PATH", str(tmp_path / "out.jsonl")) for arg in args]
    if module == "batchjob":
        done = run_cli(*args)
    else:
        done = subprocess.run(
            [sys.executable, "-m", module, *args], env=cli_env(), capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error = done.stderr[done.stderr.index("error: ") :]
    assert "cannot access s3://bucket/run1: NoCredentialsError" in error and "AWS_ACCESS_KEY_ID" in error


def test_an_output_dir_of_the_older_layout_is_refused_before_the_model_loads(
    tmp_path: Path, unloadable_model: Path, capsys
) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "_job.json").write_text("{}")
    assert run_in_process(f"model.path={unloadable_model}", f"output.dir={out}") == 2
    assert "written by an older batchjob" in capsys.readouterr().err
