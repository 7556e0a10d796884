"""Jobs over OpenAI batch files: each line's prompt and settings, error rows for bad lines, exactly-once resume
per custom_id, and an export that the `openai` package's own types accept."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from batchjob.pipelines.openai_batch import chat_sampling
from batchjob.pipelines.sampling import overridden
from jobtools import REPO, cli_env, read_output, run_cli, run_in_process, start_cli, wait_for, write_prompts
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion

from batchjob.engine import SamplingParams
from batchjob.io.job_status import job_status
from batchjob.job.tiny_model import default_tiny_model

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "tiny", **body}}


def chat(custom_id: str, text: str, **settings) -> dict:
    return line(custom_id, CHAT, messages=[{"role": "user", "content": text}], **settings)


def completion(custom_id: str, prompt, **settings) -> dict:
    return line(custom_id, COMPLETIONS, prompt=prompt, **settings)


LINES = [
    chat("chat-short", "Say hello.", max_tokens=2),
    chat(
        "chat-n3",
        "Name three colours.",
        max_completion_tokens=5,
        n=3,
        temperature=1.0,
        seed=5,
        logprobs=True,
        top_logprobs=2,
    ),
    completion("text-stop", "Once upon a time", max_tokens=6, temperature=0.8, top_p=0.9, stop=["e"], logprobs=1),
    "{this line is not JSON",
    completion("text-ids", [5, 6, 7, 8], max_tokens=3),
    line("embeddings", "/v1/embeddings", input="x"),
    chat("penalised", "Hi", presence_penalty=0.5),
    completion("seeded-a", "Tell me", temperature=1.0, seed=42, max_tokens=6, ignore_eos=True),
    completion("seeded-b", "Tell me", temperature=1.0, seed=42, max_tokens=6, ignore_eos=True),
    completion("row-seeded-a", "Tell me", temperature=1.0, max_tokens=6, ignore_eos=True),
    completion("row-seeded-b", "Tell me", temperature=1.0, max_tokens=6, ignore_eos=True),
]
ERRORS = {None: "not valid JSON", "embeddings": "/v1/embeddings", "penalised": "presence_penalty"}
# One request per micro-batch: generations are then identical however rows group across restarts.
ALONE = ("engine.max_batch_size=1",)


def write_batch(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("openai")
    batch = write_batch(root / "requests.jsonl", LINES)
    out = root / "out"
    assert run_in_process(f"data.path={batch}", f"output.dir={out}", "sampling.max_new_tokens=8", *ALONE) == 0
    return out


def rows_by_custom_id(out: Path) -> dict:
    return {row["custom_id"]: row for row in read_output(out).to_pylist()}


def test_every_line_is_one_row_and_bad_lines_are_error_rows(finished: Path) -> None:
    rows = rows_by_custom_id(finished)
    assert len(read_output(finished)) == len(LINES)
    for custom_id, reason in ERRORS.items():
        assert rows[custom_id]["finish_reason"] == "error"
        assert reason in rows[custom_id]["error"]
        assert rows[custom_id]["choices"] is None
    ok = [r for r in rows.values() if r["error"] is None]
    assert len(ok) == len(LINES) - len(ERRORS)
    assert {r["url"] for r in ok} == {CHAT, COMPLETIONS}


def test_each_line_generates_with_its_own_settings(finished: Path) -> None:
    rows = rows_by_custom_id(finished)
    assert rows["chat-short"]["completion_tokens"] <= 2
    assert rows["text-ids"]["prompt_tokens"] == 4
    assert rows["text-ids"]["completion_tokens"] <= 3
    assert "e" not in rows["text-stop"]["generation"]
    three = rows["chat-n3"]["choices"]
    assert len(three) == 3
    assert rows["chat-n3"]["generation"] == three[0]["text"]
    assert all(1 <= len(c["logprobs"]) <= 5 and all(len(t["top_logprobs"]) == 2 for t in c["logprobs"]) for c in three)
    assert rows["chat-short"]["choices"][0]["logprobs"] is None
    assert all(len(t["top_logprobs"]) == 1 for t in rows["text-stop"]["choices"][0]["logprobs"])


def test_a_lines_seed_is_used_as_is_and_other_lines_are_seeded_by_row(finished: Path) -> None:
    rows = rows_by_custom_id(finished)
    assert rows["seeded-a"]["completion_tokens"] == 6
    assert rows["seeded-a"]["generation"] == rows["seeded-b"]["generation"]
    assert rows["row-seeded-a"]["generation"] != rows["row-seeded-b"]["generation"]


def export(out: Path, fmt: str, path: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "batchjob.export", f"output.dir={out}", f"format={fmt}", f"path={path}"]
    return subprocess.run(command, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)


def test_export_is_a_batch_output_file_the_openai_types_accept(finished: Path, tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    done = export(finished, "openai_batch", path)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == len(LINES)
    by_id = {x["custom_id"]: x for x in lines}
    assert len({x["id"] for x in lines}) == len(lines)
    for custom_id, reason in ERRORS.items():
        failed = by_id[custom_id]
        assert failed["response"]["status_code"] == 400
        assert reason in BatchError.model_validate(failed["error"]).message
    rows = rows_by_custom_id(finished)
    for custom_id, result in by_id.items():
        if custom_id in ERRORS:
            continue
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        row = rows[custom_id]
        if row["url"] == CHAT:
            parsed = ChatCompletion.model_validate(body)
            texts = [c.message.content for c in parsed.choices]
        else:
            parsed = Completion.model_validate(body)
            texts = [c.text for c in parsed.choices]
        assert texts == [c["text"] for c in row["choices"]]
        assert parsed.usage.completion_tokens == row["completion_tokens"]
        assert parsed.usage.total_tokens == row["prompt_tokens"] + row["completion_tokens"]
    models = {x["response"]["body"]["model"] for x in lines if x["error"] is None}
    assert models == {str(default_tiny_model())}  # the model the job read, as its record keeps it
    three = ChatCompletion.model_validate(by_id["chat-n3"]["response"]["body"])
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len(three.choices[0].logprobs.content[0].top_logprobs) == 2
    text_logprobs = Completion.model_validate(by_id["text-stop"]["response"]["body"]).choices[0].logprobs
    assert len(text_logprobs.tokens) == len(text_logprobs.token_logprobs) == len(text_logprobs.text_offset)


def test_export_as_plain_json_lines_has_every_column(finished: Path, tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    assert export(finished, "jsonl", path).returncode == 0
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert sorted(r["row_id"] for r in records) == list(range(len(LINES)))
    assert set(records[0]) == set(read_output(finished).column_names)


def test_exporting_a_plain_job_as_openai_batch_is_refused(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.parquet", 2)
    assert run_in_process(f"data.path={prompts}", f"output.dir={tmp_path / 'out'}", "sampling.max_new_tokens=2") == 0
    refused = export(tmp_path / "out", "openai_batch", tmp_path / "x.jsonl")
    assert refused.returncode == 2
    assert "format=jsonl" in refused.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_exporting_as_parquet_is_refused_pointing_at_the_output_itself(finished: Path, tmp_path: Path) -> None:
    refused = export(finished, "parquet", tmp_path / "x.parquet")
    assert refused.returncode == 2
    assert "choose openai_batch or jsonl (the output is Parquet already: read output.dir itself)" in refused.stderr


def test_exporting_a_jobs_bookkeeping_folder_points_at_its_output(finished: Path, tmp_path: Path) -> None:
    refused = export(Path(f"{finished}.batchjob"), "jsonl", tmp_path / "x.jsonl")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"error: {finished}.batchjob is the folder where batchjob keeps a job's record, manifests and locks: set "
        f"output.dir to the job's output itself, {finished}"
    )
    assert not (tmp_path / "x.jsonl").exists()


def test_a_prompt_template_with_an_openai_batch_input_is_refused(tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "in.jsonl", LINES[:1])
    refused = run_cli(f"data.path={batch}", f"output.dir={tmp_path / 'out'}", "pipeline.system_prompt=Be brief.")
    assert refused.returncode == 2
    assert "builds each prompt from its line's body" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_json_schema_column_with_an_openai_batch_input_is_refused(tmp_path: Path, capsys) -> None:
    batch = write_batch(tmp_path / "in.jsonl", LINES[:1])
    code = run_in_process(f"data.path={batch}", f"output.dir={tmp_path / 'out'}", "data.json_schema_column=body")
    assert code == 2
    assert "give a line its schema in its body's response_format" in capsys.readouterr().err


def test_a_lines_response_format_replaces_the_jobs_constraint_and_text_keeps_it() -> None:
    job = SamplingParams(choice=("yes", "no"))
    as_object = overridden(job, 3, chat_sampling({"response_format": {"type": "json_object"}}))
    assert (as_object.json_schema, as_object.choice) == ('{"type":"object"}', None)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    as_schema = overridden(job, 3, chat_sampling({"response_format": response_format}))
    assert json.loads(as_schema.json_schema) == schema and as_schema.constraint.kind == "json_schema"
    assert overridden(job, 3, chat_sampling({"response_format": {"type": "text"}})) == job


def test_a_repeated_custom_id_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "in.jsonl", [LINES[0], LINES[2], LINES[0]])
    refused = run_cli(f"data.path={batch}", f"output.dir={tmp_path / 'out'}")
    assert refused.returncode == 2
    assert "repeats values ('chat-short')" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_status_checks_the_output_once_per_line_and_custom_id(finished: Path) -> None:
    status = job_status(str(finished))
    assert status.complete and status.validation.ids_checked
    assert status.validation.id_column == "custom_id"


def test_sigkill_then_rerun_gives_every_custom_id_exactly_once(tmp_path: Path) -> None:
    lines = []
    for i in range(36):
        if i % 9 == 4:
            lines.append("{broken")
        elif i % 2:
            lines.append(chat(f"c{i}", f"Question {i}?", max_tokens=1 + i % 4, n=1 + i % 2, temperature=0.9))
        else:
            lines.append(completion(f"t{i}", f"Text {i}", max_tokens=2 + i % 3, seed=i))
    batch = write_batch(tmp_path / "in.jsonl", lines)
    settings = (f"data.path={batch}", "output.commit_every_rows=3", "output.commit_every_s=1000", *ALONE)
    reference = tmp_path / "reference"
    assert run_in_process(*settings, f"output.dir={reference}") == 0

    out = tmp_path / "out"
    job = start_cli(*settings, f"output.dir={out}")
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 2, job, "2 committed parts")
    job.kill()
    job.wait()
    assert job.returncode == -signal.SIGKILL
    partial = export(out, "openai_batch", tmp_path / "partial.jsonl")
    assert partial.returncode == 0 and "not complete" in partial.stderr
    committed = job_status(str(out)).validation.rows_committed
    assert 0 < committed < len(lines)
    assert len((tmp_path / "partial.jsonl").read_text().splitlines()) == committed
    finished = run_cli(*settings, f"output.dir={out}")
    assert finished.returncode == 0, finished.stderr
    assert "resuming:" in finished.stderr

    got = read_output(out)
    custom_ids = [c for c in got.column("custom_id").to_pylist() if c is not None]
    assert sorted(got.column("row_id").to_pylist()) == list(range(len(lines)))
    assert sorted(custom_ids) == sorted(x["custom_id"] for x in lines if isinstance(x, dict))
    assert got.to_pylist() == read_output(reference).to_pylist()


def test_a_shard_without_lines_commits_a_part_with_custom_id_and_url(tmp_path: Path) -> None:
    batch_file = tmp_path / "requests.jsonl"
    batch_file.write_text(json.dumps(completion("only", "Hello", max_tokens=2)) + "\n")
    out = tmp_path / "out"
    for shard in (0, 1):
        assert (
            run_in_process(f"data.path={batch_file}", f"output.dir={out}", "shard.count=2", f"shard.index={shard}") == 0
        )
    # Shard 0 owns no line, and its part is the first a reader opens: it must not hide the custom ids.
    table = read_output(out)
    assert table.column("custom_id").to_pylist() == ["only"]
    assert table.column("url").to_pylist() == [COMPLETIONS]


def test_an_empty_batch_file_is_a_job_of_no_rows(tmp_path: Path) -> None:
    batch_file = tmp_path / "requests.jsonl"
    batch_file.write_text("\n")
    out = tmp_path / "out"
    assert run_in_process(f"data.path={batch_file}", "data.format=openai_batch", f"output.dir={out}") == 0
    assert read_output(out).num_rows == 0
