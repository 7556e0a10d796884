"""A job's checks, before the engine loads and beside it.

`check_model_and_input` and then `prepare` check everything a user controls that needs neither a tokenizer nor
the model, so a typo costs seconds, not a model load or a queue wait: first what needs no torch (the model
directory's files, the input's columns), then the engine for the model, the job record and the output
directory. `check_beside_engine` runs in a thread while the engine loads: what takes seconds and needs no engine
(the tokenizer, the committed row ids of a resume, and on a job's first run with an id column the duplicate-id
scan, with the shard's lock and record after it). run.py wires them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchjob.config.settings import JobSettings, for_shard_rows
from batchjob.engine import choose_backend
from batchjob.engine.config_files import BrokenConfigFileError, read_json_file
from batchjob.engine.transformers_import import load_tokenizer as load_hf_tokenizer
from batchjob.errors import ConfigError
from batchjob.io.openai_batch_reader import ID_COLUMN as OPENAI_BATCH_ID
from batchjob.io.output import OutputDataset
from batchjob.io.readers import InputSpec, open_input, resolve_format
from batchjob.io.record_guard import record_is_stored
from batchjob.io.unique_ids import check_unique_ids
from batchjob.job.fingerprint import job_record, resolve_model_path
from batchjob.job.startup import StartupClock
from batchjob.pipelines.pipeline import Builder, for_openai_batch, make_builder
from batchjob.pipelines.prompts import check_column_types, check_columns
from batchjob.pipelines.rows import RESERVED_COLUMNS

log = logging.getLogger("batchjob")


# Files a tokenizer is loaded from; a model directory with none of them cannot tokenise at all.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "*.tiktoken", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class PreparedJob:
    settings: JobSettings
    model_path: str
    source: Any
    passthrough: list[str]
    output: OutputDataset
    record: dict[str, Any]
    complete: bool  # the shard was already complete under this same job record: nothing to do or write
    # The ids must be found unique before the record is written (a first run with an id column): the scan,
    # then the output's lock and record, run beside the engine. Otherwise the output is open already.
    scan_ids: bool


def passthrough_columns(
    settings: JobSettings, columns: list[str], prompt_columns: tuple[str, ...], string_ids: bool = False
) -> list[str]:
    """The input columns copied to the output. Default: every column except the prompt source, an integer
    id column (it is the row_id) and names the output already uses. A string id column is always copied,
    first, under its own name: it is how output rows are matched to input rows."""
    id_column = settings.data.id_column
    if string_ids:
        if id_column in RESERVED_COLUMNS:
            raise ConfigError(
                f"data.id_column={id_column!r} is a string column named like one of batchjob's output columns: "
                "rename it in the input"
            )
        wanted = passthrough_columns(settings, columns, prompt_columns)
        return [id_column, *(c for c in wanted if c != id_column)]
    wanted = settings.data.passthrough_columns
    if wanted is None:
        skip = set(prompt_columns) | {id_column} | RESERVED_COLUMNS
        return [c for c in columns if c not in skip]
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise ConfigError(
            f"data.passthrough_columns names {', '.join(missing)}, not in the input; its columns are "
            f"{', '.join(columns)}"
        )
    clashing = [c for c in wanted if c in RESERVED_COLUMNS]
    if clashing:
        raise ConfigError(
            f"data.passthrough_columns {', '.join(clashing)} would overwrite batchjob's own output columns: "
            "drop them from the list"
        )
    return list(wanted)


def choose_engine(settings: JobSettings, model_path: str) -> JobSettings:
    """The settings with `engine=auto` resolved to the backend that runs this model (logged, with why); an
    explicitly chosen backend that cannot run the model is a `ConfigError`. Reads config files only."""
    try:
        choice = choose_backend(settings.engine_name, model_path, settings.engine_options)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"engine={settings.engine_name}: {err}") from err
    if choice.name != settings.engine_name:
        log.info("engine=%s: running %s, since %s", settings.engine_name, choice.name, choice.reason)
    asked = settings.engine_asked or settings.engine_name
    return dataclasses.replace(settings, engine_name=choice.name, engine_options=choice.options, engine_asked=asked)


@dataclass(frozen=True)
class CheckedInput:
    """What the checks before the engine's imports found: the model directory, and the input opened."""

    settings: JobSettings  # an OpenAI batch input's id column and prompts filled in
    model_path: str
    source: Any
    passthrough: list[str]


def check_model_and_input(settings: JobSettings) -> CheckedInput:
    """Check the model directory's files and the input's columns: what needs neither torch nor the engine, so a
    wrong path, a broken config.json or a missing column is refused before the engine's imports (seconds)."""
    model_path = resolve_model_path(settings.model_path)
    data = settings.data
    spec = InputSpec(
        path=data.path,
        format=data.format,
        split=data.split,
        name=data.dataset_config,
        data_files=data.data_files,
        streaming=data.streaming,
        id_column=data.id_column,
        limit=data.limit,
        shard_index=settings.shard_index,
        shard_count=settings.shard_count,
        batch_rows=data.batch_rows,
    )
    if resolve_format(spec) == "openai_batch":
        # Each line brings its prompt, and its custom_id is its identity (unique, and in the output).
        id_column = data.id_column or OPENAI_BATCH_ID
        data = dataclasses.replace(data, id_column=id_column)
        settings = dataclasses.replace(settings, data=data, prompt=for_openai_batch(settings.prompt))
        spec = dataclasses.replace(spec, id_column=id_column)
    source = open_input(spec)
    check_columns(settings.prompt, list(source.columns), data.json_schema_column)
    check_column_types(settings.prompt, source.column_types(list(settings.prompt.input_columns)))
    passthrough = passthrough_columns(
        settings, list(source.columns), settings.prompt.consumed_columns, string_ids=source.string_ids
    )
    return CheckedInput(settings, model_path, source, passthrough)


def prepare(checked: CheckedInput, startup: StartupClock) -> PreparedJob:
    """Choose the engine for the model and check the output directory; lock the shard unless the ids must be
    scanned first (`PreparedJob.scan_ids`). Loads no tokenizer and no model weights."""
    model_path, source, passthrough = checked.model_path, checked.source, checked.passthrough
    settings = for_shard_rows(choose_engine(checked.settings, model_path), source.num_rows())
    startup.lap("config_s")
    data = settings.data
    record = job_record(settings, model_path, source.fingerprint(), passthrough, source.job_rows(), source.string_ids)
    output = OutputDataset(
        settings.output.dir, settings.shard_index, settings.shard_count, settings.output.lock_timeout_s
    )
    # A shard complete under this same record needs no lock and no write: a finished job reruns fine from
    # a read-only directory.
    complete = settings.resume and output.is_complete_for(record)
    if not complete:
        check_output_dir(output, settings.output.dir)  # before the ids scan too: a wrong folder costs nothing
    # The record is written only once the ids were found unique, so a stored, identical record means they were
    # (by this shard earlier, or another): a restart skips the full read.
    scan_ids = (
        not complete
        and data.id_column is not None
        and not record_is_stored(settings.output.dir, {"shard_count": settings.shard_count, **record})
    )
    if not (complete or scan_ids):
        open_output(output, record, settings)  # here, so a refused output directory costs no model load
    return PreparedJob(settings, model_path, source, passthrough, output, record, complete, scan_ids)


@dataclass(frozen=True)
class ReadyToFeed:
    """What the checks beside the engine hand the generation loop."""

    builder: Builder
    committed: np.ndarray  # row ids this shard committed in earlier runs, sorted


def check_beside_engine(job: PreparedJob, startup: StartupClock) -> ReadyToFeed:
    """The start-up work a thread does while the engine loads: the duplicate-id scan and then the output's lock
    and record (when `job.scan_ids`), the row ids committed by earlier runs (a resume reads every part), and the
    tokenizer with the pipeline's check of it (a chat template). The engine loads its own tokenizer: one shared
    between the feeder's thread and the engine's detokenizer would be used from two threads at once."""
    settings = job.settings
    if job.scan_ids:
        with startup.timed("ids_s", beside_engine=True):
            check_unique_ids(job.source)
        with startup.timed("output_s", beside_engine=True):
            open_output(job.output, job.record, settings)
    with startup.timed("resume_s", beside_engine=True):
        committed = job.output.committed_row_ids()
    with startup.timed("tokenizer_s", beside_engine=True):
        tokenizer = load_tokenizer(job.model_path)
        builder = make_builder(settings.prompt, tokenizer, settings.sampling, settings.data.json_schema_column)
        builder.check(list(job.source.columns))
    return ReadyToFeed(builder, committed)


def load_tokenizer(model_path: str) -> Any:
    try:
        return load_hf_tokenizer(model_path)
    except (OSError, ValueError) as err:
        local = Path(model_path)
        if local.is_dir() and not any(f for pattern in TOKENIZER_FILES for f in local.glob(pattern)):
            # transformers then falls back to converting a slow tokenizer and asks for sentencepiece.
            raise ConfigError(
                f"model.path={model_path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy them from "
                "the model the weights came from"
            ) from err
        if local.is_dir() and (local / "tokenizer.json").is_file():
            # Read only when loading failed: a model's tokenizer.json can be megabytes.
            try:
                read_json_file(local / "tokenizer.json")
            except BrokenConfigFileError as broken:
                raise ConfigError(f"model.path={model_path}: {broken}") from err
        raise ConfigError(f"cannot load the tokenizer of model.path={model_path}: {err}") from err


def check_output_dir(output: OutputDataset, out_dir: str) -> None:
    """An output.dir that is a file is a ConfigError; one holding anything but batchjob's parts (a stranger's
    folder, which every reader of the output would read too) an OutputDirError. Writes nothing."""
    if output.storage.exists(output.path) and not output.storage.isdir(output.path):
        raise ConfigError(f"output.dir={out_dir} is a file: set output.dir to a directory (new or a job's)")
    try:
        output.check_dir()
    except OSError as err:
        raise _unusable(out_dir, err) from err


def open_output(output: OutputDataset, record: dict[str, Any], settings: JobSettings) -> None:
    """Lock and resume (or reset) the shard's output (`check_output_dir` ran first); an unusable output.dir is a
    ConfigError."""
    out_dir = settings.output.dir
    try:
        output.open(record, resume=settings.resume, overwrite=settings.output.overwrite)
    except OSError as err:
        raise _unusable(out_dir, err) from err


def _unusable(out_dir: str, err: OSError) -> ConfigError:
    return ConfigError(
        f"output.dir={out_dir} cannot be written ({err.strerror or err}: {err.filename or out_dir}): set "
        "output.dir to a writable directory"
    )
