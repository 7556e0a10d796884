"""A job, wired: config → input → prompts → engine → output, under a checkpoint.

Everything that can be wrong with the config, the paths or the columns is checked before the model is
loaded (`prepare`), so a typo costs seconds, not a model load or a queue wait.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from batchjob.config import JobSettings, load_settings
from batchjob.engine import EngineFailure, choose_backend, create_engine
from batchjob.errors import EXIT_USAGE, ConfigError
from batchjob.fingerprint import job_record, resolve_model_path
from batchjob.io.job_record import JobRecordMismatch
from batchjob.io.layout import OutputDirError
from batchjob.io.lock import LockError, LockLost
from batchjob.io.openai_batch_reader import ID_COLUMN as OPENAI_BATCH_ID
from batchjob.io.output import OutputDataset
from batchjob.io.readers import InputError, InputSpec, open_input, resolve_format
from batchjob.io.record_guard import record_is_stored
from batchjob.io.storage import StorageFull
from batchjob.io.unique_ids import check_unique_ids
from batchjob.pipelines.feeder import PromptFeeder
from batchjob.pipelines.pipeline import Builder, for_openai_batch, make_builder
from batchjob.pipelines.rows import RESERVED_COLUMNS
from batchjob.run_files import recorded_run
from batchjob.shard_run import ShardRun
from batchjob.signals import Interrupted, exit_code_for

log = logging.getLogger("batchjob")
# sysexits' EX_TEMPFAIL: the output could take no more rows (a full disk, a lost lock) or the engine broke down
# (a tensor-parallel rank died); everything committed is kept, and the same command resumes once the cause is gone.
EXIT_RESUMABLE = 75
USER_ERRORS = (ConfigError, InputError, JobRecordMismatch, LockError, OutputDirError)


def quiet_libraries() -> None:
    """No per-load progress bars or advisory warnings from transformers/datasets in a batch job's log."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    warnings.filterwarnings("ignore", module=r"(transformers|datasets|torch)(\..*)?")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # `datasets` is imported only for HF inputs (batchjob.io.hf_reader quiets it then): a Parquet job skips it.


# Files a tokenizer is loaded from; a model directory with none of them cannot tokenise at all.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "*.tiktoken", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class PreparedJob:
    settings: JobSettings
    model_path: str
    source: Any
    builder: Builder
    passthrough: list[str]
    output: OutputDataset
    complete: bool  # the shard was already complete under this same job record: nothing to do or write


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
    return dataclasses.replace(settings, engine_name=choice.name, engine_options=choice.options)


def prepare(settings: JobSettings) -> PreparedJob:
    """Check the model, the engine for it, the input and the output directory; lock the shard. Loads no
    model weights."""
    model_path = resolve_model_path(settings.model_path)
    settings = choose_engine(settings, model_path)
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
    builder = make_builder(settings.prompt, load_tokenizer(model_path), settings.sampling, data.json_schema_column)
    builder.check(list(source.columns))
    passthrough = passthrough_columns(
        settings, list(source.columns), settings.prompt.consumed_columns, string_ids=source.string_ids
    )
    record = job_record(settings, model_path, source.fingerprint(), passthrough, source.job_rows(), source.string_ids)
    output = OutputDataset(
        settings.output.dir, settings.shard_index, settings.shard_count, settings.output.lock_timeout_s
    )
    # A shard complete under this same record needs no lock and no write: a finished job reruns fine from
    # a read-only directory.
    complete = settings.resume and output.is_complete_for(record)
    if not complete:
        # The record is written only once every check has passed, so a stored, identical record means the
        # ids were found unique already (by this shard earlier, or another): a restart skips the full read.
        if not record_is_stored(settings.output.dir, {"shard_count": settings.shard_count, **record}):
            check_unique_ids(source)
        open_output(output, record, settings)
    return PreparedJob(settings, model_path, source, builder, passthrough, output, complete)


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as err:
        local = Path(model_path)
        if local.is_dir() and not any(f for pattern in TOKENIZER_FILES for f in local.glob(pattern)):
            # transformers then falls back to converting a slow tokenizer and asks for sentencepiece.
            raise ConfigError(
                f"model.path={model_path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy them from "
                "the model the weights came from"
            ) from err
        raise ConfigError(f"cannot load the tokenizer of model.path={model_path}: {err}") from err


def open_output(output: OutputDataset, record: dict[str, Any], settings: JobSettings) -> None:
    """Lock and resume (or reset) the shard's output; an unusable output.dir is a ConfigError."""
    out_dir = settings.output.dir
    if output.storage.exists(output.path) and not output.storage.isdir(output.path):
        raise ConfigError(f"output.dir={out_dir} is a file: set output.dir to a directory (new or a job's)")
    try:
        output.open(record, resume=settings.resume, overwrite=settings.output.overwrite)
    except OSError as err:
        raise ConfigError(
            f"output.dir={out_dir} cannot be written ({err.strerror or err}: {err.filename or out_dir}): set "
            "output.dir to a writable directory"
        ) from err


def run_job(cfg: DictConfig, started: float | None = None) -> int:
    """Run this process's shard of the job; returns the exit status: 0 when the shard is complete,
    2 for a bad config or input, 1 when a bad row stopped it (on_error=fail), 128+N after signal N, 75 when a
    rerun resumes it (the engine failed, the disk is full, the shard's lock was lost).
    `started`: the process's `time.perf_counter()` at start, for the start-up breakdown (default: now)."""
    try:
        return run_shard(cfg, started)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except StorageFull as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_RESUMABLE


def run_shard(cfg: DictConfig, started: float | None = None) -> int:
    """`run_job`, but a bad config or input raises (one of `USER_ERRORS`) instead of returning 2, and a full
    disk while preparing raises `StorageFull` instead of returning 75."""
    startup = StartupClock(time.perf_counter() if started is None else started)
    quiet_libraries()
    startup.lap("imports_config_s")
    job = prepare(load_settings(cfg))
    startup.lap("checks_s")
    settings = job.settings
    if job.complete:
        log.info(
            "shard %d/%d of %s is already complete", settings.shard_index, settings.shard_count, settings.output.dir
        )
        return 0
    try:
        with recorded_run(cfg, settings.output.dir, settings.shard_index, settings.shard_count):
            return _generate(job, startup)
    except Interrupted as stopped:  # a second signal while the first one's commit was running
        print("interrupted again: rows committed so far are kept; resumable: rerun the same command", file=sys.stderr)
        return exit_code_for(stopped.signum)
    except KeyboardInterrupt:  # Ctrl-C while the model was still loading: nothing was generated yet
        print("interrupted before generation started; resumable: rerun the same command", file=sys.stderr)
        return exit_code_for(signal.SIGINT)
    except EngineFailure as err:  # the finished rows were committed on the way out of the generation loop
        print(
            f"error: the engine failed: {err}\n{job.output.committed_rows} rows committed; "
            "resumable: rerun the same command",
            file=sys.stderr,
        )
        return EXIT_RESUMABLE
    except (StorageFull, LockLost) as err:
        print(f"error: {err} ({job.output.committed_rows} rows committed)", file=sys.stderr)
        return EXIT_RESUMABLE
    finally:
        job.output.close()


# The engine's own start-up phases, when its stats() report them.
ENGINE_PHASES = {
    "load_s": "weights and tokenizer",
    "kv_sizing_s": "KV sizing",
    "graph_capture_s": "CUDA graphs",
    "warmup_s": "warm-up",
}


class StartupClock:
    """Seconds from process start to the first generate, by phase; logged once and kept in the report."""

    def __init__(self, started: float) -> None:
        self.phases: dict[str, float] = {}
        self._last = started

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now

    def summary(self) -> dict[str, float]:
        return {**self.phases, "total_s": sum(self.phases.values())}


def _generate(job: PreparedJob, startup: StartupClock) -> int:
    settings, output = job.settings, job.output
    committed = output.committed_row_ids()
    total = job.source.num_rows()
    remaining = None if total is None else max(total - len(committed), 0)
    if len(committed):
        log.info(
            "resuming: %d rows already committed, %s to go", len(committed), "?" if remaining is None else remaining
        )
    engine = create_engine(settings.engine_name, job.model_path, settings.engine_options)
    startup.lap("engine_s")
    phases = startup.summary()
    engine_stats = engine.stats()
    engine_phases = ", ".join(
        f"{label} {engine_stats[key]:.1f} s" for key, label in ENGINE_PHASES.items() if key in engine_stats
    )
    log.info(
        "ready to generate %.1f s after start: imports and config %.1f s, input/tokenizer/output checks %.1f s, "
        "engine %.1f s%s",
        phases["total_s"],
        phases["imports_config_s"],
        phases["checks_s"],
        phases["engine_s"],
        f" ({engine_phases})" if engine_phases else "",
    )
    try:
        columns = list(dict.fromkeys([*job.builder.columns, *job.passthrough]))
        feeder = PromptFeeder(
            job.source.iter_batches(columns, skip_row_ids=committed),
            job.builder,
            job.passthrough,
            queue_batches=settings.queue_batches,
            tokenize_batch_rows=settings.tokenize_batch_rows,
        )
        types = job.source.column_types(job.passthrough)
        layout = job.builder.layout(settings.output.token_ids)
        return ShardRun(
            settings, engine, output, feeder, layout, committed, remaining, startup=phases, passthrough_types=types
        ).run()
    finally:
        engine.close()
