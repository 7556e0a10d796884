"""The Python API: `LLM(...).generate` and `batchjob.run` give what the command line gives for the same settings,
and `generate` takes structured-output constraints per prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from jobtools import read_output, read_report, run_cli, write_prompts
from structured_cases import CHOICES, CODE_REGEX, POINT_SCHEMA, matches_code, valid_json

import batchjob
from batchjob import LLM, SamplingParams
from batchjob.errors import ConfigError

ROWS = 6
SAMPLED = {"max_new_tokens": 4, "temperature": 0.8, "top_p": 0.9, "seed": 3}
SAMPLED_ARGS = {f"sampling.{key}": value for key, value in SAMPLED.items()}
CHATS = [[{"role": "system", "content": "Be terse."}, {"role": "user", "content": f"Question {i}?"}] for i in range(4)]


@pytest.fixture(scope="module")
def llm():
    with LLM(engine="hf") as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.parquet", ROWS)


@pytest.fixture(scope="module")
def cli_output(prompts_file: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "out"
    sampling = [f"sampling.{key}={value}" for key, value in SAMPLED.items()]
    done = run_cli(f"data.path={prompts_file}", f"output.dir={out}", *sampling)
    assert done.returncode == 0, done.stderr
    return out


def generations(out: Path) -> list[str]:
    return read_output(out).column("generation").to_pylist()


def test_llm_generate_equals_the_command_line(llm: LLM, prompts_file: Path, cli_output: Path) -> None:
    prompts = pq.read_table(prompts_file).column("prompt").to_pylist()
    outputs = llm.generate(prompts, SamplingParams(**SAMPLED))
    assert [o.index for o in outputs] == list(range(ROWS))
    assert [o.outputs[0].text for o in outputs] == generations(cli_output)
    assert [o.outputs[0].finish_reason for o in outputs] == read_output(cli_output).column("finish_reason").to_pylist()
    assert all(len(o.outputs[0].token_ids) <= SAMPLED["max_new_tokens"] for o in outputs)


def test_run_equals_the_command_line_and_returns_the_report(prompts_file: Path, cli_output: Path, tmp_path) -> None:
    report = batchjob.run(engine="hf", data={"path": prompts_file}, output={"dir": tmp_path / "out"}, sampling=SAMPLED)
    assert generations(tmp_path / "out") == generations(cli_output)
    assert report["rows"] == report["ok"] == ROWS
    assert report == read_report(tmp_path / "out")
    again = batchjob.run(
        {"engine": "hf", "data.path": str(prompts_file), "output.dir": str(tmp_path / "out")}, SAMPLED_ARGS
    )
    assert again == report  # already complete: nothing reruns


def test_llm_chat_equals_a_job_over_a_messages_column(llm: LLM, tmp_path: Path) -> None:
    data = write_prompts(tmp_path / "chats.parquet", len(CHATS), messages=[json.dumps(c) for c in CHATS])
    batchjob.run(
        "engine=hf",
        f"data.path={data}",
        "data.messages_column=messages",
        f"output.dir={tmp_path / 'out'}",
        sampling=SAMPLED,
    )
    outputs = llm.generate(CHATS, SamplingParams(**SAMPLED))
    assert [o.text for o in outputs] == generations(tmp_path / "out")


def test_outputs_keep_input_order_with_errors_and_per_prompt_settings(llm: LLM) -> None:
    settings = [
        SamplingParams(max_new_tokens=2),
        SamplingParams(max_new_tokens=3, temperature=1.0, n=2, seed=1),
        SamplingParams(),
        SamplingParams(max_new_tokens=1, logprobs=0),
    ]
    outputs = llm.generate(["first", CHATS[0], "", "last"], settings)
    assert [o.prompt for o in outputs] == ["first", CHATS[0], "", "last"]
    assert len(outputs[0].outputs[0].token_ids) <= 2
    assert len(outputs[1].outputs) == 2
    assert outputs[2].error == "prompt is empty" and outputs[2].outputs == ()
    assert len(outputs[3].outputs[0].logprobs) == 1
    one = llm.generate("first", SamplingParams(max_new_tokens=2))
    assert one[0].text == outputs[0].text


def test_llm_generate_follows_each_prompts_constraint(llm: LLM) -> None:
    settings = [
        SamplingParams(max_new_tokens=40, json_schema=json.dumps(POINT_SCHEMA)),
        SamplingParams(max_new_tokens=10, choice=CHOICES, temperature=1.0, seed=2),
        SamplingParams(max_new_tokens=10, regex=CODE_REGEX),
        SamplingParams(max_new_tokens=3),
    ]
    point, choice, code, free = llm.generate(["a point", "a choice", CHATS[0], "free text"], settings)
    assert point.outputs[0].finish_reason == "stop" and valid_json(point.text, POINT_SCHEMA), point.text
    assert choice.outputs[0].finish_reason == "stop" and choice.text in CHOICES
    assert code.outputs[0].finish_reason == "stop" and matches_code(code.text), code.text
    assert free.error is None and len(free.outputs[0].token_ids) <= 3


def test_run_refuses_a_bad_setting_before_loading_the_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="on_error"):
        batchjob.run(on_error="sometimes", output={"dir": tmp_path / "out"})
