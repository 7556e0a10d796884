"""A job, wired: config → input → prompts → engine → output, under a checkpoint.

Everything that can be wrong with the config, the paths or the columns is checked before the model is
loaded (`prepare`), so a typo costs seconds, not a model load or a queue wait. The start-up work that needs
no engine and can take seconds runs in a thread while the engine loads (`check_beside_engine`): the
tokenizer, and on a job's first run with an id column the duplicate-id scan, then the output's lock and
record, which wait for it. Their errors still stop the job with exit 2, after the engine loads and before
anything is generated or committed. `startup.py` times every phase.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
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
from batchjob.pipelines.prompts import check_columns
from batchjob.pipelines.rows import RESERVED_COLUMNS
from batchjob.run_files import recorded_run
from batchjob.shard_run import ShardRun
from batchjob.signals import Interrupted, exit_code_for
from batchjob.startup import StartupClock

log = logging.getLogger("batchjob")
# sysexits' EX_TEMPFAIL: the output could take no more rows (a full disk, a lost lock) or the engine broke down
# (a tensor-parallel rank died); everything committed is kept, and the same command resumes once the cause is gone.
EXIT_RESUMABLE = 75
USER_ERRORS = (ConfigError, InputError, JobRecordMismatch, LockError, OutputDirError)


def import_libraries() -> None:
    """Import torch and transformers' tokenizer and config machinery (seconds, the largest part of a warm
    start-up) here, in one phase, rather than inside the first check that needs them; and silence them: no
    per-load progress bars or advisory warnings from transformers/datasets in a batch job's log."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    warnings.filterwarnings("ignore", module=r"(transformers|datasets|torch)(\..*)?")
    import torch  # noqa: F401
    import transformers
    import transformers.activations  # noqa: F401  (every model's config class imports it, and torch.distributed)
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (lazy attributes: this imports them)

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
    return dataclasses.replace(settings, engine_name=choice.name, engine_options=choice.options)


def prepare(settings: JobSettings, startup: StartupClock) -> PreparedJob:
    """Check the model, the engine for it, the input's columns and the output directory; lock the shard unless
    the ids must be scanned first (`PreparedJob.scan_ids`). Loads no tokenizer and no model weights."""
    model_path = resolve_model_path(settings.model_path)
    settings = choose_engine(settings, model_path)
    startup.lap("config_s")
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


def run_job(cfg: DictConfig, startup: StartupClock | None = None) -> int:
    """Run this process's shard of the job; returns the exit status: 0 when the shard is complete,
    2 for a bad config or input, 1 when a bad row stopped it (on_error=fail), 128+N after signal N, 75 when a
    rerun resumes it (the engine failed, the disk is full, the shard's lock was lost).
    `startup`: the clock started with the process, for the start-up breakdown (default: one started now)."""
    try:
        return run_shard(cfg, startup)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except StorageFull as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_RESUMABLE


def run_shard(cfg: DictConfig, startup: StartupClock | None = None) -> int:
    """`run_job`, but a bad config or input raises (one of `USER_ERRORS`) instead of returning 2, and a full
    disk while preparing raises `StorageFull` instead of returning 75."""
    startup = startup or StartupClock()
    startup.lap("config_s")  # Hydra composed the config since the clock's last lap
    import_libraries()
    startup.lap("imports_s")
    job = prepare(load_settings(cfg), startup)
    startup.lap("checks_s")
    settings = job.settings
    if job.complete:
        log.info(
            "shard %d/%d of %s is already complete", settings.shard_index, settings.shard_count, settings.output.dir
        )
        return 0
    with contextlib.ExitStack() as run_files, ThreadPoolExecutor(1, thread_name_prefix="batchjob-checks") as pool:

        def record_run() -> None:  # once the shard's output is open: its config and log go beside it
            run_files.enter_context(recorded_run(cfg, settings.output.dir, settings.shard_index, settings.shard_count))

        checks = pool.submit(check_beside_engine, job, startup)
        try:
            if not job.scan_ids:
                record_run()
            return _generate(job, checks, startup, record_run if job.scan_ids else None)
        except Interrupted as stopped:  # a second signal while the first one's commit was running
            print(
                "interrupted again: rows committed so far are kept; resumable: rerun the same command", file=sys.stderr
            )
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
            wait_for([checks])  # the checks' thread may be opening the output: let it finish before closing
            job.output.close()


def _check_error(checks: Future[ReadyToFeed]) -> BaseException | None:
    """The error of the checks beside the engine once they end, if a user's (it says what to fix)."""
    wait_for([checks])
    error = checks.exception()
    return error if isinstance(error, (*USER_ERRORS, StorageFull)) else None


def _generate(
    job: PreparedJob, checks: Future[ReadyToFeed], startup: StartupClock, record_run: Callable[[], None] | None
) -> int:
    """`record_run`: when the checks beside the engine open the output, what starts saving the run's config
    and log once they have."""
    settings, output = job.settings, job.output
    try:
        engine = create_engine(settings.engine_name, job.model_path, settings.engine_options)
    except Exception:
        # A bad tokenizer or output directory found beside the engine explains a failed load better.
        error = _check_error(checks)
        if error is not None:
            raise error from None
        raise
    try:
        startup.lap("engine_s")
        ready = checks.result()
        builder, committed = ready.builder, ready.committed
        startup.lap("wait_s")
        phases = startup.summary(engine.stats())
        if record_run is not None:
            record_run()
        log.info("%s", startup.ready_line(phases))
        total = job.source.num_rows()
        remaining = None if total is None else max(total - len(committed), 0)
        if len(committed):
            log.info(
                "resuming: %d rows already committed, %s to go",
                len(committed),
                "?" if remaining is None else remaining,
            )
        columns = list(dict.fromkeys([*builder.columns, *job.passthrough]))
        feeder = PromptFeeder(
            job.source.iter_batches(columns, skip_row_ids=committed),
            builder,
            job.passthrough,
            queue_batches=settings.queue_batches,
            tokenize_batch_rows=settings.tokenize_batch_rows,
        )
        types = job.source.column_types(job.passthrough)
        layout = builder.layout(settings.output.token_ids)
        return ShardRun(
            settings, engine, output, feeder, layout, committed, remaining, startup=phases, passthrough_types=types
        ).run()
    finally:
        engine.close()
