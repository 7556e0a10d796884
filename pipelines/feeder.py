"""Tokenisation ahead of generation, off the main loop, through a bounded queue.

A background thread reads record batches, builds prompts and tokenises them (HF fast tokenizers release
the GIL while encoding), so the engine never waits on text work; the bounded queue keeps memory flat for
any input size. The main thread only takes ready batches.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from batchjob.pipelines.pipeline import Builder

from batchjob.engine.api import SamplingParams
from batchjob.io.inputs import INPUT_ERROR_COLUMN

_END = object()


@dataclass(frozen=True)
class PreparedBatch:
    """Rows ready for the engine: `errors[i]` says why row i cannot run (None: it can; `prompt_ids[i]` is None
    when it has no prompt); `sampling[i]` is row i's settings."""

    row_ids: list[int]
    prompt_ids: list[list[int] | None]
    errors: list[str | None]
    sampling: list[SamplingParams]
    passthrough: list[dict[str, Any]]


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class PromptFeeder:
    """Iterate to get `PreparedBatch`es in input order; `close()` stops the thread early."""

    def __init__(
        self,
        batches: Iterator[pa.RecordBatch],
        builder: Builder,
        passthrough: list[str],
        queue_batches: int,
        tokenize_batch_rows: int,
    ) -> None:
        self.read_s = 0.0
        self.tokenize_s = 0.0
        self.passthrough_schema: pa.Schema | None = None
        self._batches = batches
        self._builder = builder
        self._passthrough = passthrough
        self._slice = tokenize_batch_rows
        self._queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="batchjob-tokenize", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[PreparedBatch]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item

    def close(self) -> None:
        self._stop.set()
        # Draining unblocks a producer waiting on a full queue; a slow read is not waited for (daemon).
        deadline = time.monotonic() + 5.0
        while self._thread.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.05)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            batches = iter(self._batches)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                batch = next(batches, None)
                self.read_s += time.perf_counter() - t0
                if batch is None:
                    break
                if self.passthrough_schema is None:
                    self.passthrough_schema = pa.schema([batch.schema.field(c) for c in self._passthrough])
                for start in range(0, batch.num_rows, self._slice):
                    if not self._put(self._prepare(batch.slice(start, self._slice))):
                        return
            self._put(_END)
        except BaseException as err:  # handed to the consumer, which raises it in the main thread
            self._put(_Failure(err))

    def _prepare(self, batch: pa.RecordBatch) -> PreparedBatch:
        t0 = time.perf_counter()
        encoded = self._builder.encode(batch)
        ids, errors = encoded.prompt_ids, encoded.errors
        if INPUT_ERROR_COLUMN in batch.schema.names:  # the reader already knows these rows cannot run
            for i, problem in enumerate(batch.column(INPUT_ERROR_COLUMN).to_pylist()):
                if problem is not None:
                    ids[i], errors[i] = None, problem
        passthrough = batch.select(self._passthrough).to_pylist() if self._passthrough else [{}] * batch.num_rows
        prepared = PreparedBatch(
            row_ids=batch.column("row_id").to_pylist(),
            prompt_ids=ids,
            errors=errors,
            sampling=encoded.sampling,
            passthrough=passthrough,
        )
        self.tokenize_s += time.perf_counter() - t0
        return prepared
