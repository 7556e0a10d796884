"""`python -m batchjob.export output.dir=DIR format=openai_batch|jsonl path=FILE [model=NAME]`: a job's rows
as a JSON-lines file.

- `format=openai_batch`: the OpenAI Batch API output format, for jobs that read an OpenAI batch file: one
  line per request (`id`, `custom_id`, `response: {status_code, request_id, body}`, `error`) with a
  `chat.completion` or `text_completion` body (all `n` choices, `usage`, log-probabilities when the line
  asked for them). A row that failed becomes an error line: status 400, an error body and `error`.
  `model` names the model in each body (default: the job's model.path).
- `format=jsonl`: every row as a plain JSON object with all its columns.

Only committed rows are written (output.dir holds committed parts only, so a crashed run's leftovers never
leak), one record batch at a time: memory stays flat for any output size. Rows come in commit order
(`output.ordered=true` sorts them by row id). The file appears at `path` only once complete. Exit status:
0 written, 2 for bad arguments or an output that cannot be exported that way.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.io.access import StorageAccessError, access_reported
from batchjob.io.layout import JOB_RECORD_NAME, OutputDirError, bookkeeping_dir, no_job_message
from batchjob.io.status import committed_parts, shard_status
from batchjob.io.storage import Storage
from batchjob.pipelines.openai_output import EXPORT_COLUMNS, batch_output_line

USAGE = "usage: python -m batchjob.export output.dir=DIR format=openai_batch|jsonl path=FILE [model=NAME]"
FORMATS = ("openai_batch", "jsonl")
_BATCH_ROWS = 1024


class ExportError(ValueError):
    """The output cannot be exported as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Exported:
    lines: int
    errors: int  # error rows among them
    complete: bool  # every shard of the job had finished


def export(output_dir: str, format: str, path: str, model: str | None = None) -> Exported:
    """Write the committed rows of `output_dir` to `path` (local or any fsspec URL) in `format`."""
    if format not in FORMATS:
        already = " (the output is Parquet already: read output.dir itself)" if format == "parquet" else ""
        raise ExportError(f"format={format!r}: choose {' or '.join(FORMATS)}{already}")
    try:
        storage, meta = Storage.for_uri(bookkeeping_dir(output_dir))
        record_path = storage.join(meta, JOB_RECORD_NAME)
        if not storage.exists(record_path):
            raise ExportError(no_job_message(output_dir))
        parts = committed_parts(output_dir)
    except OutputDirError as err:
        raise ExportError(str(err)) from None
    record_bytes = storage.read_bytes(record_path)
    columns: tuple[str, ...] | None = None
    to_line: Callable[[dict[str, Any]], dict[str, Any]] = dict
    if format == "openai_batch":
        _check_columns(storage, parts, output_dir)
        columns = EXPORT_COLUMNS
        to_line = functools.partial(
            batch_output_line,
            model=model or _model_name(json.loads(record_bytes)),
            # Ids unique to this job and stable across exports of it.
            id_prefix=hashlib.sha256(record_bytes).hexdigest()[:12] + "-",
            created=int(time.time()),
        )
    fs, target = fsspec.core.url_to_fs(path)
    partial = f"{target}.partial"
    lines = errors = 0
    with fs.open(partial, "w", encoding="utf-8") as out:
        for batch in _batches(storage, parts, columns):
            for row in batch.to_pylist():
                out.write(json.dumps(to_line(row), ensure_ascii=False, default=_json_value) + "\n")
                lines += 1
                errors += row["error"] is not None
    fs.mv(partial, target)
    complete = all(s["success"] for s in shard_status(output_dir))
    return Exported(lines, errors, complete)


def _model_name(record: dict[str, Any]) -> str:
    model = record.get("model") or {}
    where = record.get("provenance") or {}
    return str(model.get("hub_id") or where.get("model_path") or model.get("path") or "unknown")


def _check_columns(storage: Storage, parts: list[str], output_dir: str) -> None:
    if not parts:
        return
    with storage.pyarrow_fs().open_input_file(parts[0]) as f:
        names = pq.ParquetFile(f).schema_arrow.names
    missing = [c for c in EXPORT_COLUMNS if c not in names]
    if missing:
        raise ExportError(
            f"{output_dir} has no {', '.join(missing)} column(s): format=openai_batch exports jobs that read an "
            "OpenAI batch file (data.format=openai_batch, with the default data.passthrough_columns); "
            "use format=jsonl for other jobs"
        )


def _batches(storage: Storage, parts: list[str], columns: tuple[str, ...] | None) -> Iterator[pa.RecordBatch]:
    filesystem = storage.pyarrow_fs()
    for part in parts:
        with filesystem.open_input_file(part) as f:
            reader = pq.ParquetFile(f)
            yield from reader.iter_batches(batch_size=_BATCH_ROWS, columns=list(columns) if columns else None)


def _json_value(value: Any) -> Any:
    """JSON for the Python values Arrow gives that json cannot write itself."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, (decimal.Decimal, datetime.timedelta)):
        return str(value)
    raise TypeError(f"cannot write a {type(value).__name__} as JSON")


def _parse(argv: list[str]) -> dict[str, str]:
    values = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    unknown = [a for a in argv if "=" not in a or a.split("=", 1)[0] not in {"output.dir", "format", "path", "model"}]
    if unknown:
        raise ExportError(f"{USAGE}\n(unrecognised: {' '.join(unknown)})")
    missing = [k for k in ("output.dir", "format", "path") if not values.get(k)]
    if missing:
        raise ExportError(f"{USAGE}\n(missing: {', '.join(missing)})")
    return values


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(sys.argv[1:] if argv is None else argv)
        with access_reported((args["output.dir"], args["path"])):
            done = export(args["output.dir"], args["format"], args["path"], args.get("model"))
    except (ExportError, StorageAccessError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {done.lines} lines ({done.errors} errors) to {args['path']}", file=sys.stderr)
    if not done.complete:
        print(
            "warning: the job is not complete: these are the rows committed so far (rerun the job to finish it)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
