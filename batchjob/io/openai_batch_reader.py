"""OpenAI Batch API input files: one JSON request per line (`custom_id`, `method`, `url`, `body`).

The format of OpenAI's and most hosted batch services' `.jsonl` input, and of vLLM's `run-batch`. Each
non-blank line is one row, numbered from 0 in file order (files of a directory or glob in sorted path
order); with `id_column="custom_id"` the custom ids are the rows' string ids (unique, checked up front).
This reader checks only the envelope: a line that is not a JSON object, or lacks a string `custom_id`,
`method`, `url` or an object `body`, still becomes a row, its `INPUT_ERROR_COLUMN` saying why, so one bad
line costs one error row, not the job. What the body asks for is the prompt pipeline's business.

Memory is bounded by one batch of lines: opening the input reads it once to count its lines (and hash its
bytes: the job record's identity of the input, so a changed file is never resumed, while a copy is),
keeping a byte offset every `_CHECKPOINT_LINES` lines, so a shard (or a resume) seeks straight to its
rows and skips whole finished stretches unread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from batchjob.io.content_digest import relative_names
from batchjob.io.inputs import INPUT_ERROR_COLUMN, InputError, InputSource, InputSpec, list_input_files
from batchjob.io.sharding import all_skipped, shard_range
from batchjob.io.storage import Storage

COLUMNS = ("custom_id", "method", "url", "body")
ID_COLUMN = "custom_id"
SCHEMA = pa.schema([pa.field(name, pa.string()) for name in (*COLUMNS, INPUT_ERROR_COLUMN)])
_CHECKPOINT_LINES = 4096
FILE_HELP = "data.format=openai_batch needs a .jsonl file (or a directory or glob of them) of OpenAI batch requests"


@dataclass(frozen=True)
class Checkpoint:
    """Where row `position` starts: byte `offset` of `file`."""

    file: str
    offset: int
    position: int


def open_openai_batch(spec: InputSpec) -> OpenAIBatchSource:
    storage, path = Storage.for_uri(spec.path)
    files = list_input_files(storage, path, spec.path, ".jsonl", ".jsonl files", FILE_HELP)
    return OpenAIBatchSource(spec, storage, files)


def looks_like_openai_batch(storage: Storage, path: str) -> bool:
    """Whether the first non-blank line of the file at `path` is an OpenAI batch request (for data.format=auto)."""
    with storage.fs.open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except ValueError:
                    return False
                return isinstance(first, dict) and "custom_id" in first and "body" in first
    return False


def parse_line(line: bytes) -> tuple[str | None, str | None, str | None, str | None, str | None]:
    """(custom_id, method, url, body as JSON text, what is wrong or None) of one line; what could be read is
    kept."""
    try:
        request = json.loads(line)
    except ValueError as err:  # also UnicodeDecodeError: not UTF-8
        return None, None, None, None, f"line is not valid JSON: {err}"
    if not isinstance(request, dict):
        return None, None, None, None, f"line must be a JSON object, got {type(request).__name__}"
    fields = {name: request.get(name) for name in ("custom_id", "method", "url")}
    problems = [f"{name} must be a non-empty string" for name, value in fields.items() if not _text(value)]
    body = request.get("body")
    if not isinstance(body, dict):
        problems.append("body must be a JSON object")
    kept = [value if _text(value) else None for value in fields.values()]
    body_text = json.dumps(body, ensure_ascii=False) if isinstance(body, dict) else None
    return kept[0], kept[1], kept[2], body_text, "; ".join(problems) or None


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


class OpenAIBatchSource(InputSource):
    def __init__(self, spec: InputSpec, storage: Storage, files: list[str]) -> None:
        super().__init__(spec, list(COLUMNS))
        if spec.id_column not in (None, ID_COLUMN):
            raise InputError(
                f"data.id_column={spec.id_column!r}: the lines of an OpenAI batch file are identified by their "
                f"{ID_COLUMN}; leave data.id_column unset"
            )
        self._check_id_column(pa.string(), "string")
        self.storage = storage
        self.files = files
        self.checkpoints: list[Checkpoint] = []
        self.identities: list[dict[str, Any]] = []
        self.total_rows = self._index()
        self.limited_rows = self.total_rows if spec.limit is None else min(spec.limit, self.total_rows)
        self.start, self.stop = shard_range(self.limited_rows, spec.shard_index, spec.shard_count)

    def _index(self) -> int:
        """Count the rows, note checkpoints and hash each file; returns the row count."""
        checkpoints = self.checkpoints
        position = 0
        # Names below the input's root, not absolute paths: a staged copy of the input still resumes.
        for file, name in zip(self.files, relative_names(self.files), strict=True):
            digest = hashlib.sha256()
            with self.storage.fs.open(file, "rb") as f:
                offset = 0
                for line in f:
                    digest.update(line)
                    if line.strip():
                        if position % _CHECKPOINT_LINES == 0 or not checkpoints or checkpoints[-1].file != file:
                            checkpoints.append(Checkpoint(file, offset, position))
                        position += 1
                    offset += len(line)
            self.identities.append({"name": name, "size": offset, "sha256": digest.hexdigest()})
        return position

    def fingerprint(self) -> dict[str, Any]:
        return {"format": "openai_batch", "rows": self.total_rows, "files": self.identities}

    def num_rows(self) -> int:
        return self.stop - self.start

    def job_rows(self) -> int:
        return self.limited_rows

    def column_types(self, columns: list[str]) -> pa.Schema:
        return pa.schema([SCHEMA.field(c) for c in columns])

    def id_chunks(self) -> Iterator[pa.Array]:
        """The custom ids of every well-formed line of the job (a malformed line's row is an error row)."""
        ids: list[str] = []
        for _, line in self._lines(None, 0, self.limited_rows):
            custom_id, *_, problem = parse_line(line)
            if problem is None:
                ids.append(custom_id)
            if len(ids) == self.spec.batch_rows:
                yield pa.array(ids, pa.string())
                ids = []
        if ids:
            yield pa.array(ids, pa.string())

    def iter_batches(self, columns: list[str], skip_row_ids: np.ndarray | None = None) -> Iterator[pa.RecordBatch]:
        read_columns = self._columns_to_read(columns)
        rows: list[tuple] = []
        positions: list[int] = []
        for position, line in self._lines(skip_row_ids, self.start, self.stop):
            rows.append(parse_line(line))
            positions.append(position)
            if len(rows) == self.spec.batch_rows:
                yield from self._batch(rows, positions, read_columns, skip_row_ids)
                rows, positions = [], []
        if rows:
            yield from self._batch(rows, positions, read_columns, skip_row_ids)

    def _batch(
        self, rows: list[tuple], positions: list[int], columns: list[str], skip: np.ndarray | None
    ) -> Iterator[pa.RecordBatch]:
        arrays = [pa.array(values, pa.string()) for values in zip(*rows, strict=True)]
        table = pa.Table.from_arrays(arrays, schema=SCHEMA)
        batch = self._make_batch(table, np.asarray(positions, dtype=np.int64), columns, skip)
        if batch is not None:
            yield batch

    def _lines(self, skip_row_ids: np.ndarray | None, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
        """(row position, line) of rows [start, stop), minus stretches between checkpoints already finished
        (single finished rows of an unfinished stretch are dropped by `_make_batch`)."""
        # Each checkpoint's stretch ends where the next begins (the last at the end); a file without lines has none.
        bounds = [c.position for c in self.checkpoints[1:]] + [self.total_rows] * bool(self.checkpoints)
        for checkpoint, end in zip(self.checkpoints, bounds, strict=True):
            first, last = max(checkpoint.position, start), min(end, stop)
            if first >= last or all_skipped(skip_row_ids, first, last):
                continue
            position = checkpoint.position
            with self.storage.fs.open(checkpoint.file, "rb") as f:
                f.seek(checkpoint.offset)
                for line in f:
                    if not line.strip():
                        continue
                    if position >= last:
                        break
                    if position >= first:
                        yield position, line
                    position += 1
