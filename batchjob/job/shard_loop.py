"""One shard's generation loop: prompts in, completions out, finished rows committed in parts.

Completions arrive in any order, so finished rows are buffered by row id and committed every
`output.commit_every_rows` rows or `output.commit_every_s` seconds; a row is either in a committed part
or recomputed by the next run (the rerun skips exactly the committed row ids).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from batchjob.cluster.slurm import requeue_after_preemption
from batchjob.config.settings import JobSettings
from batchjob.engine import Completion, Engine, Request
from batchjob.errors import EXIT_TOO_MANY_FAILED
from batchjob.io.output import OutputDataset
from batchjob.job.failed_rows import FailedRows, failed_rows_report, summary, too_many_failed
from batchjob.job.progress import Progress
from batchjob.job.signals import Interrupted, StopSignals, exit_code_for
from batchjob.pipelines.feeder import PromptFeeder
from batchjob.pipelines.pipeline import Layout

log = logging.getLogger("batchjob")
EXIT_OK = 0
EXIT_FAILED_ROW = 1


@dataclass
class RunCounts:
    rows: int = 0
    ok: int = 0
    errors: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    committed: int = 0
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("generate", "write"), 0.0))


class ShardRun:
    def __init__(
        self,
        settings: JobSettings,
        engine: Engine,
        output: OutputDataset,
        feeder: PromptFeeder,
        layout: Layout,
        already_committed: np.ndarray,
        total_rows: int | None,
        startup: dict[str, float] | None = None,
        passthrough_types: pa.Schema | None = None,
    ) -> None:
        """`passthrough_types`: the pass-through columns' types from the input's metadata, for the part a
        shard without rows writes (None: unknown before a row is read; that part then omits them)."""
        self.settings = settings
        self.passthrough_types = passthrough_types
        self.startup = startup or {}
        self.engine = engine
        self.output = output
        self.feeder = feeder
        self.layout = layout
        self.previously_committed = len(already_committed)
        self._earlier_parts = output.part_names
        self.counts = RunCounts()
        self.failed = FailedRows()  # this run's failed rows; `_shard_failures` adds the earlier runs' error rows
        self.progress = Progress(total_rows, settings.log_every_s, live_tokens=engine.tokens_generated)
        self._pending: dict[int, dict[str, Any]] = {}
        self._finished: list[dict[str, Any]] = []
        self._last_commit = time.monotonic()
        self._failure: str | None = None

    def run(self) -> int:
        """Generate every remaining row; returns the process exit status."""
        started = time.perf_counter()
        complete = False
        stop = StopSignals()
        with stop:
            completions = self.engine.generate(self._requests(stop))
            try:
                # After a bad row under on_error=fail no new rows are taken, but rows already in the
                # engine finish and are committed; a signal stops at once.
                while not stop.requested:
                    t0 = time.perf_counter()
                    with stop.interruptible():
                        completion = next(completions, None)
                    self.counts.stage_s["generate"] += time.perf_counter() - t0
                    if completion is None:
                        complete = True
                        break
                    self._finish(completion)
                    self._maybe_commit()
            except Interrupted:
                pass
            finally:
                self.feeder.close()
                completions.close()
                self.progress.close()
                # Whatever ends the loop (done, signal, bad row, crash), finished rows are kept, unless a
                # commit failed past its commit point: its rows may be committed, so never retry them.
                if self.output.writable:
                    self._commit()
        total = self.previously_committed + self.counts.committed
        if stop.requested and not complete:
            print(f"interrupted: {total} rows committed; resumable: rerun the same command", file=sys.stderr)
            # Only after the commit: a requeued task restarts from the manifest. No-op outside Slurm.
            requeue_after_preemption(stop.signum)
            return exit_code_for(stop.signum)
        if self._failure is not None:
            print(
                f"error: {self._failure} (on_error=fail); {total} rows committed. Fix the input, or rerun with "
                "on_error=record to keep bad rows as errors or on_error=skip to drop them",
                file=sys.stderr,
            )
            return EXIT_FAILED_ROW
        failed_rows = self._shard_failures(total)  # before an ordered rewrite renames the earlier runs' parts
        if self.settings.output.ordered:
            self.output.rewrite_ordered()
        if not self.output.committed_rows:
            self._commit_empty_part()
        report = self.report(time.perf_counter() - started, total, failed_rows)
        self.output.write_report(report)
        self.output.mark_success()
        log.info(
            "done: %d rows (%d ok, %d errors, %d skipped), %d output tokens in %.1fs (%.1f tok/s); %d rows in %s%s",
            self.counts.rows,
            self.counts.ok,
            self.counts.errors,
            self.counts.skipped,
            self.counts.completion_tokens,
            report["wall_s"],
            report["output_tokens_per_s"],
            total,
            self.settings.output.dir,
            f"; {summary(failed_rows)}" if failed_rows["rows"] else "",
        )
        verdict = too_many_failed(failed_rows, self.settings.max_error_fraction)
        if verdict is not None:
            print(f"error: {verdict}", file=sys.stderr)
            return EXIT_TOO_MANY_FAILED
        return EXIT_OK

    def _requests(self, stop: StopSignals) -> Iterator[Request]:
        for batch in self.feeder:
            for row_id, ids, error, sampling, extra in zip(
                batch.row_ids, batch.prompt_ids, batch.errors, batch.sampling, batch.passthrough, strict=True
            ):
                if error is not None:
                    self._bad_row(row_id, error, 0 if ids is None else len(ids), extra)
                    if self._failure is not None:
                        return
                else:
                    self._pending[row_id] = extra
                    yield Request(row_id, ids, sampling)
            if stop.requested or self._failure is not None:
                return

    def _finish(self, completion: Completion) -> None:
        extra = self._pending.pop(completion.id)
        if completion.error is not None:
            self._bad_row(completion.id, completion.error, completion.prompt_tokens, extra)
            return
        self._finished.append(self.layout.completed(completion.id, completion, extra))
        self.counts.rows += 1
        self.counts.ok += 1
        self.counts.prompt_tokens += completion.prompt_tokens
        self.counts.completion_tokens += completion.completion_tokens
        self.progress.update(1, completion.completion_tokens)

    def _bad_row(self, row_id: int, error: str, prompt_tokens: int, extra: dict[str, Any]) -> None:
        policy = self.settings.on_error
        if policy == "fail":
            if self._failure is None:
                self._failure = f"row {row_id}: {error}"
            return
        self.failed.add(row_id, error)
        if policy == "record":
            self._finished.append(self.layout.failed(row_id, error, prompt_tokens, extra))
            self.counts.rows += 1
            self.counts.errors += 1
            self.counts.prompt_tokens += prompt_tokens
        else:
            self.counts.skipped += 1
        self.progress.update(1, 0)

    def _maybe_commit(self) -> None:
        out = self.settings.output
        due = time.monotonic() - self._last_commit >= out.commit_every_s
        if len(self._finished) >= out.commit_every_rows or (due and self._finished):
            self._commit()

    def _commit(self) -> None:
        if not self._finished:
            return
        t0 = time.perf_counter()
        schema = self.feeder.passthrough_schema
        self.output.commit(self.layout.table(self._finished, schema))
        self.counts.committed += len(self._finished)
        self._finished = []
        self._last_commit = time.monotonic()
        self.counts.stage_s["write"] += time.perf_counter() - t0

    def _shard_failures(self, committed_total: int) -> dict[str, Any]:
        """The report's `failed_rows` over all the shard's rows: this run's failed rows, the error rows earlier runs
        committed, and, of the shard's rows, those committed plus those skipped (a resume skips all of them again:
        they were never committed)."""
        failed = self.failed
        for row_id, error in self.output.committed_errors(self._earlier_parts):
            failed.add(row_id, error)
        return failed_rows_report(failed, committed_total + self.counts.skipped)

    def _commit_empty_part(self) -> None:
        """A shard that ends with no rows (an empty input or slice, every row skipped) still commits a part:
        readers of the output then see its columns instead of failing on a directory without Parquet files."""
        passthrough = self.feeder.passthrough_schema or self.passthrough_types or pa.schema([])
        log.warning(
            "shard %d/%d has no rows to write (empty input, or every row skipped): committing a zero-row part "
            "with the output columns",
            self.settings.shard_index,
            self.settings.shard_count,
        )
        self.output.commit_empty(self.layout.schema(passthrough))

    def report(self, wall_s: float, total_committed: int, failed_rows: dict[str, Any]) -> dict[str, Any]:
        """`failed_rows`: over all the shard's rows (`_shard_failures`); the other counts are this run's."""
        counts = self.counts
        return {
            "rows": counts.rows,
            "ok": counts.ok,
            "errors": counts.errors,
            "skipped": counts.skipped,
            "rows_committed_total": total_committed,
            "rows_committed_before_this_run": self.previously_committed,
            "failed_rows": failed_rows,
            "prompt_tokens": counts.prompt_tokens,
            "completion_tokens": counts.completion_tokens,
            "wall_s": wall_s,
            # process start to first generate, by phase (not in wall_s, which is the generation loop)
            "startup_s": self.startup,
            "output_tokens_per_s": counts.completion_tokens / wall_s if wall_s > 0 else 0.0,
            # read and tokenize run in the feeder thread, overlapping generate: busy time, not wall time.
            "stage_s": {
                "read": self.feeder.read_s,
                "tokenize": self.feeder.tokenize_s,
                **counts.stage_s,
            },
            "engine": {
                "name": self.settings.engine_name,
                "deterministic": bool(self.settings.engine_options.get("deterministic", False)),
                **self.engine.stats(),
            },
            "shard": {"index": self.settings.shard_index, "count": self.settings.shard_count},
        }
