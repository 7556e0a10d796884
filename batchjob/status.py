"""`python -m batchjob.status output.dir=DIR [data.path=PATH data.id_column=COL ...]`: how far a job is.

Prints one line per shard (rows done/total, output tokens, tokens/s, complete) and checks that the
committed rows of all shards together are the input exactly once: row ids committed twice, missing, or
not in the input are listed. With `data.path` (and the same `data.*` keys the job ran with) the check is
against the input's own row ids; without, against the job record's row count (after `data.limit`) and,
unless the job took its ids from an integer `data.id_column`, ids 0..N-1. A string id column's values in the
output are checked to be unique too.
Reads manifests, reports and the `row_id`/`completion_tokens` columns of committed parts; takes no lock,
so it is safe while shards are still writing. Exit status: 0 when complete and exactly once, 1 otherwise,
2 for bad arguments.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np
import pyarrow.dataset as pads

from batchjob.io.inputs import InputError, InputSpec
from batchjob.io.layout import JOB_RECORD_NAME, ShardOutput
from batchjob.io.manifest import read_manifest
from batchjob.io.readers import open_input
from batchjob.io.sharding import shard_range
from batchjob.io.status import shard_status
from batchjob.io.storage import Storage
from batchjob.io.unique_ids import PARTITION_ROWS, find_duplicates

USAGE = (
    "usage: python -m batchjob.status output.dir=DIR [data.path=PATH data.id_column=COL data.limit=N "
    "data.format=FMT data.split=SPLIT] (the data.* keys the job ran with)"
)
_DATA_KEYS = {"data.path": "path", "data.format": "format", "data.split": "split", "data.id_column": "id_column"}
_LISTED = 20  # ids shown per problem; the counts are always complete


@dataclass(frozen=True)
class ShardProgress:
    index: int
    rows_done: int
    rows_total: int | None
    completion_tokens: int
    tokens_per_s: float | None  # of the shard's last run, from its report
    complete: bool
    locked: bool


@dataclass(frozen=True)
class RowIds:
    """How many row ids have a problem, and the first few of them (a 50M-row job can miss millions)."""

    count: int
    first: tuple[int, ...]

    @classmethod
    def of(cls, ids: np.ndarray) -> RowIds:
        return cls(len(ids), tuple(int(i) for i in ids[:_LISTED]))


@dataclass(frozen=True)
class Validation:
    rows_expected: int | None
    rows_committed: int
    ids_checked: bool  # False: the expected row ids are unknown, so missing/unexpected could not be listed
    duplicates: RowIds  # committed more than once (by one shard or several)
    missing: RowIds  # in the input, committed by no shard
    unexpected: RowIds  # committed but not in the input
    id_column: str | None = None  # a string id column carried by the output rows
    repeated_ids: tuple = ()  # a few of its values found in more than one output row

    @property
    def exactly_once(self) -> bool:
        return not (self.duplicates.count or self.missing.count or self.unexpected.count or self.repeated_ids)


@dataclass(frozen=True)
class JobStatus:
    shards: tuple[ShardProgress, ...]
    validation: Validation

    @property
    def complete(self) -> bool:
        return all(s.complete for s in self.shards) and self.validation.exactly_once


def _record(storage: Storage, path: str, output_dir: str) -> dict:
    record_path = storage.join(path, JOB_RECORD_NAME)
    if not storage.exists(record_path):
        # Every shard writes the record before anything else, so without it there is no job to report.
        raise ValueError(f"{output_dir} holds no batchjob output (no {JOB_RECORD_NAME}): set output.dir to a job's")
    return json.loads(storage.read_bytes(record_path))


def _committed(storage: Storage, path: str, shard: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(row ids, completion tokens) of the parts this shard's manifest commits: the manifest, not the
    directory listing, decides what is committed."""
    layout = ShardOutput(path, shard, count)
    parts = read_manifest(storage, storage.join(path, layout.manifest_name)).parts
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    files = [storage.join(path, name) for name in parts]
    dataset = pads.dataset(files, format="parquet", filesystem=storage.pyarrow_fs())
    columns = ["row_id"] + (["completion_tokens"] if "completion_tokens" in dataset.schema.names else [])
    table = dataset.to_table(columns=columns)
    ids = table.column("row_id").to_numpy().astype(np.int64, copy=False)
    tokens = table.column(columns[-1]).to_numpy() if len(columns) == 2 else np.zeros(len(ids), np.int64)
    return ids, tokens


def _input_ids(spec: InputSpec) -> np.ndarray:
    source = open_input(spec)
    batches = source.iter_batches([])
    return np.concatenate([b.column("row_id").to_numpy() for b in batches] or [np.empty(0, np.int64)])


def job_status(output_dir: str, input_spec: InputSpec | None = None) -> JobStatus:
    """Progress of every shard of `output_dir`, and the exactly-once check against `input_spec` (or,
    when None, against the job record's row count: ids 0..N-1 unless the ids came from an id column)."""
    storage, path = Storage.for_uri(output_dir)
    record = _record(storage, path, output_dir)
    statuses = shard_status(output_dir)
    count = max(record.get("shard_count") or 1, len(statuses))
    if input_spec is not None:
        expected = _input_ids(input_spec)
        total = len(expected)
    else:
        rows = record.get("rows") or {}
        total = rows.get("count")
        # Without the input, the ids are known only when they are the rows' positions.
        by_position = total is not None and (rows.get("id_column") is None or bool(rows.get("string_ids")))
        expected = np.arange(total, dtype=np.int64) if by_position else None
    shards, all_ids = [], []
    for st in statuses:
        ids, tokens = _committed(storage, path, st["shard"], count)
        all_ids.append(ids)
        report = st["report"] or {}
        start, stop = shard_range(total, st["shard"], count) if total is not None else (0, None)
        shards.append(
            ShardProgress(
                index=st["shard"],
                rows_done=len(ids),
                rows_total=None if stop is None else stop - start,
                completion_tokens=int(tokens.sum()),
                tokens_per_s=report.get("output_tokens_per_s"),
                complete=st["success"],
                locked=st["locked"],
            )
        )
    committed = np.sort(np.concatenate(all_ids or [np.empty(0, np.int64)]))
    duplicates = np.unique(committed[1:][committed[1:] == committed[:-1]])
    unique = np.unique(committed)
    if expected is None:
        missing = unexpected = np.empty(0, np.int64)
    else:
        expected = np.unique(expected)
        missing = np.setdiff1d(expected, unique, assume_unique=True)
        unexpected = np.setdiff1d(unique, expected, assume_unique=True)
    id_column = (record.get("rows") or {}).get("id_column") if (record.get("rows") or {}).get("string_ids") else None
    validation = Validation(
        total,
        len(committed),
        expected is not None,
        RowIds.of(duplicates),
        RowIds.of(missing),
        RowIds.of(unexpected),
        id_column,
        _repeated_string_ids(storage, path, [st["shard"] for st in statuses], count, id_column),
    )
    return JobStatus(tuple(shards), validation)


def _repeated_string_ids(storage: Storage, path: str, shards: list[int], count: int, column: str | None) -> tuple:
    """A few values of the string id column held by more than one committed row (error rows hold none)."""
    if column is None:
        return ()
    files = []
    for shard in shards:
        manifest = storage.join(path, ShardOutput(path, shard, count).manifest_name)
        files += [storage.join(path, name) for name in read_manifest(storage, manifest).parts]
    if not files:
        return ()
    dataset = pads.dataset(files, format="parquet", filesystem=storage.pyarrow_fs())
    chunks = (batch.column(0) for batch in dataset.to_batches(columns=[column]))
    _, repeated = find_duplicates(chunks, dataset.count_rows(), PARTITION_ROWS)
    return tuple(repeated)


def format_status(status: JobStatus) -> str:
    lines = [f"{'shard':>6} {'rows':>21} {'tokens':>10} {'tok/s':>9}  state"]
    for s in status.shards:
        total = "?" if s.rows_total is None else str(s.rows_total)
        rate = "-" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}"
        state = "complete" if s.complete else ("running" if s.locked else "incomplete")
        lines.append(f"{s.index:>6} {s.rows_done:>10}/{total:<10} {s.completion_tokens:>10} {rate:>9}  {state}")
    v = status.validation
    expected = "?" if v.rows_expected is None else v.rows_expected
    lines.append(f"committed {v.rows_committed} of {expected} rows")
    for name, ids in (("duplicated", v.duplicates), ("missing", v.missing), ("not in the input", v.unexpected)):
        if ids.count:
            more = ", ..." if ids.count > len(ids.first) else ""
            lines.append(f"{ids.count} row ids {name}: {', '.join(map(str, ids.first))}{more}")
    if v.repeated_ids:
        lines.append(f"{v.id_column} values in more than one row: {', '.join(map(repr, v.repeated_ids))}")
    if v.exactly_once and v.ids_checked:
        lines.append("every row exactly once")
    elif v.exactly_once:
        lines.append("no duplicates (pass the job's data.* keys to check the row ids against the input)")
    lines.append("job COMPLETE" if status.complete else "job INCOMPLETE: rerun the incomplete shards")
    return "\n".join(lines)


def _parse(argv: list[str]) -> tuple[str, InputSpec | None]:
    values = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    unknown = [a for a in argv if "=" not in a or a.split("=", 1)[0] not in {"output.dir", "data.limit", *_DATA_KEYS}]
    if unknown or "output.dir" not in values:
        raise ValueError(f"{USAGE}\n(unrecognised: {' '.join(unknown)})" if unknown else USAGE)
    if "data.path" not in values:
        return values["output.dir"], None
    kwargs = {_DATA_KEYS[k]: v for k, v in values.items() if k in _DATA_KEYS and v not in ("null", "")}
    if values.get("data.limit") not in (None, "null", ""):
        kwargs["limit"] = int(values["data.limit"])
    return values["output.dir"], InputSpec(**kwargs)


def main(argv: list[str] | None = None) -> int:
    try:
        output_dir, spec = _parse(sys.argv[1:] if argv is None else argv)
        status = job_status(output_dir, spec)
    except (ValueError, InputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_status(status))
    return 0 if status.complete else 1


if __name__ == "__main__":
    sys.exit(main())
