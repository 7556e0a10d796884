"""A job, wired: config → input → prompts → engine → output, under a checkpoint.

Everything that can be wrong with the config, the paths or the columns is checked before the model is
loaded (`checks.check_model_and_input`, before torch is imported, then `checks.prepare`), so a typo costs a
second, not a model load or a queue wait. The start-up work
that needs no engine and can take seconds runs in a thread while the engine loads
(`checks.check_beside_engine`); its errors still stop the job with exit 2, after the engine loads and
before anything is generated or committed. `startup.py` times every phase.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

from omegaconf import DictConfig

from batchjob.config.settings import load_settings
from batchjob.engine import EngineFailure, EngineSetupError, create_engine
from batchjob.errors import EXIT_TOO_MANY_FAILED, EXIT_USAGE, ConfigError
from batchjob.io.access import StorageAccessError, access_reported, is_access_error, quiet_lost_connections
from batchjob.io.job_record import JobRecordMismatch
from batchjob.io.layout import OutputDirError
from batchjob.io.lock import LockError, LockLost
from batchjob.io.readers import InputError
from batchjob.io.storage import StorageFull
from batchjob.job.checks import PreparedJob, ReadyToFeed, check_beside_engine, check_model_and_input, prepare
from batchjob.job.failed_rows import too_many_failed
from batchjob.job.run_files import recorded_run
from batchjob.job.shard_loop import ShardRun
from batchjob.job.signals import Interrupted, exit_code_for
from batchjob.job.startup import StartupClock, compiled_afresh
from batchjob.pipelines.feeder import PromptFeeder

log = logging.getLogger("batchjob")
# sysexits' EX_TEMPFAIL: the output could take no more rows (a full disk, a lost lock) or the engine broke down
# (a tensor-parallel rank died); everything committed is kept, and the same command resumes once the cause is gone.
EXIT_RESUMABLE = 75
USER_ERRORS = (ConfigError, InputError, JobRecordMismatch, LockError, OutputDirError, StorageAccessError)


def quiet_libraries() -> None:
    """No per-load progress bars or advisory warnings from transformers/datasets in a batch job's log (they read
    these variables when they are imported: an HF dataset input imports `datasets` in the input checks)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    warnings.filterwarnings("ignore", module=r"(transformers|datasets|torch)(\..*)?")
    quiet_lost_connections()


def import_libraries() -> None:
    """Import torch (seconds, a large part of a warm start-up) here, in one phase, once the input and the model's
    files are checked, rather than inside the first check that needs it (the engine's choice)."""
    import torch

    uncompiled = compiled_afresh(torch)
    if uncompiled:
        log.warning("%s", uncompiled)

    # transformers is imported where the tokenizer loads, beside the engine's start-up, and the native engine
    # reads a model's config through it only once per config (its spec is kept): on a GPU node its imports
    # were most of a job's 12 s to "ready to generate" (transformers 5.17). `datasets` is imported only for
    # HF inputs (batchjob.io.hf_reader quiets it then).


def run_job(cfg: DictConfig, startup: StartupClock | None = None) -> int:
    """Run this process's shard of the job; returns the exit status: 0 when the shard is complete,
    3 when it is complete with more failed rows than job.max_error_fraction allows, 2 for a bad config or input,
    1 when a bad row stopped it (on_error=fail), 128+N after signal N, 75 when a rerun resumes it (the engine
    failed, the disk is full, the shard's lock was lost).
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
    quiet_libraries()
    settings = load_settings(cfg)
    startup.lap("config_s")  # Hydra composed the config since the clock's last lap
    with access_reported((settings.data.path, settings.output.dir)):
        # A wrong path, a broken model file or a missing column is refused before torch is imported.
        checked = check_model_and_input(settings)
        startup.lap("checks_s")
        import_libraries()
        startup.lap("imports_s")
        job = prepare(checked, startup)
    startup.lap("checks_s")
    settings = job.settings
    if job.complete:
        log.info(
            "shard %d/%d of %s is already complete: nothing to generate",
            settings.shard_index,
            settings.shard_count,
            settings.output.dir,
        )
        return _complete_shard_status(job)
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
        except Exception as err:
            if not is_access_error(err):
                raise
            print(
                f"error: lost access to the output or input mid-run: {type(err).__name__}: {err}\n"
                f"{job.output.committed_rows} rows committed; resumable: rerun the same command once "
                f"{settings.output.dir} can be reached",
                file=sys.stderr,
            )
            return EXIT_RESUMABLE
        finally:
            wait_for([checks])  # the checks' thread may be opening the output: let it finish before closing
            job.output.close()


def _complete_shard_status(job: PreparedJob) -> int:
    """A complete shard's verdict on its failed rows again, from its report, under this run's
    job.max_error_fraction: a pipeline step that reruns a job sees the status its first complete run gave."""
    report = job.output.read_report()
    failed_rows = None if report is None else report.get("failed_rows")
    if failed_rows is None:
        log.warning(
            "the shard's report has no failed-row counts (an older batchjob completed it): job.max_error_fraction "
            "is not checked"
        )
        return 0
    verdict = too_many_failed(failed_rows, job.settings.max_error_fraction)
    if verdict is None:
        return 0
    print(f"error: {verdict}", file=sys.stderr)
    return EXIT_TOO_MANY_FAILED


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
        engine = create_engine(settings.engine_name, job.model_path, settings.engine_options, settings.engine_asked)
    except Exception as err:
        # A bad tokenizer or output directory found beside the engine explains a failed load better.
        error = _check_error(checks)
        if error is not None:
            raise error from None
        if isinstance(err, EngineSetupError):
            raise ConfigError(str(err)) from None
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
        try:
            return ShardRun(
                settings, engine, output, feeder, layout, committed, remaining, startup=phases, passthrough_types=types
            ).run()
        except EngineSetupError as err:  # found at the engine's first results, none of which it handed on
            raise ConfigError(str(err)) from None
    finally:
        engine.close()
