"""How far a job is, read from its output directory: every shard's progress and state (complete, running with the
lock holder's pid and host, stale, incomplete), and whether the committed rows of all shards together are the input
exactly once (row ids committed twice, missing, or not in the input; a string id column's values repeated), and,
verified, whether every committed part is what its manifest recorded. `python -m batchjob.status` prints it.

Reads the output listing, manifests, reports and the `row_id`/`completion_tokens` columns of committed parts; takes
no lock, so it is safe while shards are still writing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads

from batchjob.io import manifest
from batchjob.io.inputs import InputSpec
from batchjob.io.layout import BOOKKEEPING_SUFFIX, JOB_RECORD_NAME, TMP_DIR_NAME, ShardOutput, no_job_message
from batchjob.io.lock import DEFAULT_TIMEOUT_S, LockError, ShardLock
from batchjob.io.readers import open_input
from batchjob.io.recovery import ShardFiles, check_parts
from batchjob.io.sharding import shard_range
from batchjob.io.status import shard_status
from batchjob.io.storage import Storage
from batchjob.io.unique_ids import PARTITION_ROWS, find_duplicates

_LISTED = 20  # ids kept per problem; the counts are always complete


@dataclass(frozen=True)
class ShardProgress:
    index: int
    rows_done: int
    rows_total: int | None
    completion_tokens: int
    tokens_per_s: float | None  # of the shard's last run, from its report
    complete: bool
    locked: bool
    state: str  # complete | running (pid, host) | stale (pid, host, why it is gone) | incomplete


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
class PartProblem:
    shard: int
    part: str
    problem: str


@dataclass(frozen=True)
class JobStatus:
    shards: tuple[ShardProgress, ...]
    validation: Validation
    damaged: tuple[PartProblem, ...] = ()  # parts that do not read (or, when verified, differ from the manifest)
    verified: bool = False  # every committed part was read whole and checked (--verify)

    @property
    def complete(self) -> bool:
        return all(s.complete for s in self.shards) and self.validation.exactly_once and not self.damaged


def _record(storage: Storage, path: str, output_dir: str) -> dict:
    record_path = storage.join(path.rstrip("/") + BOOKKEEPING_SUFFIX, JOB_RECORD_NAME)
    if not storage.exists(record_path):
        # Every shard writes the record before anything else, so without it there is no job to report.
        raise ValueError(no_job_message(output_dir))
    return json.loads(storage.read_bytes(record_path))


def _shard_files(storage: Storage, path: str, shard: int, count: int) -> ShardFiles:
    layout = ShardOutput(path, shard, count)
    meta = path.rstrip("/") + BOOKKEEPING_SUFFIX
    manifests = storage.join(meta, *layout.manifest_dir.split("/"))
    return ShardFiles(storage, layout, path, manifests, storage.join(meta, TMP_DIR_NAME))


def _committed(files: ShardFiles) -> tuple[np.ndarray, np.ndarray, list[PartProblem]]:
    """(row ids, completion tokens) of the shard's committed parts (those visible in output.dir), and the
    parts that do not read (their rows are left out: the shard's next run recomputes them)."""
    parts = sorted(files.visible_parts())
    try:
        return (*_read_ids(files, parts), [])
    except (OSError, pa.ArrowException):
        pass
    readable, problems = [], []
    for name in parts:  # one of them is damaged: find which, one part at a time
        try:
            _read_ids(files, [name])
            readable.append(name)
        except (OSError, pa.ArrowException) as err:
            problems.append(PartProblem(files.shard.shard_index, name, f"does not read as Parquet ({err})"))
    return (*_read_ids(files, readable), problems)


def _read_ids(files: ShardFiles, parts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    paths = [files.part_path(name) for name in parts]
    dataset = pads.dataset(paths, format="parquet", filesystem=files.storage.pyarrow_fs())
    columns = ["row_id"] + (["completion_tokens"] if "completion_tokens" in dataset.schema.names else [])
    table = dataset.to_table(columns=columns)
    ids = table.column("row_id").to_numpy().astype(np.int64, copy=False)
    tokens = table.column(columns[-1]).to_numpy() if len(columns) == 2 else np.zeros(len(ids), np.int64)
    return ids, tokens


def _state(storage: Storage, path: str, shard: int, count: int, complete: bool, locked: bool) -> str:
    """The shard's state; a lock left by a killed process reads `stale`, not `running`. The job's own
    output.lock_timeout_s is not recorded, so a lock counts as abandoned after the default timeout; the
    time since its last refresh is shown to judge by."""
    if complete:
        return "complete"
    if not locked:
        return "incomplete"
    meta = path.rstrip("/") + BOOKKEEPING_SUFFIX
    layout = ShardOutput(path, shard, count)
    lock = ShardLock(storage, storage.join(meta, *layout.lock_name.split("/")), storage.join(meta, TMP_DIR_NAME))
    try:
        found = lock.read()
    except LockError:
        return "stale (unreadable lock file; rerun the shard)"
    if found is None:  # released since the directory was listed
        return "incomplete"
    holder = found.holder
    who = f"pid {holder.pid} on {holder.host}"
    gone = holder.stale_reason(found.age_s, DEFAULT_TIMEOUT_S)
    if gone is not None:
        return f"stale ({who}: {gone}; rerun the shard)"
    return f"running ({who}, since {holder.since}; lock refreshed {found.age_s:.0f} s ago)"


def _input_ids(spec: InputSpec) -> np.ndarray:
    source = open_input(spec)
    batches = source.iter_batches([])
    return np.concatenate([b.column("row_id").to_numpy() for b in batches] or [np.empty(0, np.int64)])


def job_status(output_dir: str, input_spec: InputSpec | None = None, verify: bool = False) -> JobStatus:
    """Progress of every shard of `output_dir`, and the exactly-once check against `input_spec` (or,
    when None, against the job record's row count: ids 0..N-1 unless the ids came from an id column).
    With `verify`, every committed part is also checked against its manifest object."""
    storage, path = Storage.for_uri(output_dir)
    statuses = shard_status(output_dir)  # first: it says clearly when output_dir has an older layout
    record = _record(storage, path, output_dir)
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
    shards, all_ids, damaged = [], [], []
    for st in statuses:
        files = _shard_files(storage, path, st["shard"], count)
        ids, tokens, unreadable = _committed(files)
        damaged += _damaged(files) if verify else unreadable
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
                state=_state(storage, path, st["shard"], count, st["success"], st["locked"]),
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
        _repeated_string_ids(storage, path, [st["shard"] for st in statuses], count, id_column, damaged),
    )
    return JobStatus(tuple(shards), validation, tuple(damaged), verify)


def _damaged(files: ShardFiles) -> list[PartProblem]:
    index = files.shard.shard_index
    found = check_parts(files)
    problems = [PartProblem(index, c.name, c.problem) for c in found.parts if c.problem is not None]
    missing = "recorded in the manifest, but the part is gone"
    return problems + [PartProblem(index, name, missing) for name in found.missing]


def _repeated_string_ids(
    storage: Storage, path: str, shards: list[int], count: int, column: str | None, damaged: list[PartProblem]
) -> tuple:
    """A few values of the string id column held by more than one committed row (error rows hold none).
    Zero-row parts are left out: one written before any row was read may lack the pass-through columns."""
    if column is None:
        return ()
    skip = {p.part for p in damaged}
    files = []
    for shard in shards:
        parts = _shard_files(storage, path, shard, count)
        entries, _ = manifest.read_entries(storage, parts.manifest_dir)
        empty = {name for name, entry in entries.items() if entry.rows == 0}
        files += [parts.part_path(name) for name in sorted(parts.visible_parts()) if name not in skip | empty]
    if not files:
        return ()
    dataset = pads.dataset(files, format="parquet", filesystem=storage.pyarrow_fs())
    chunks = (batch.column(0) for batch in dataset.to_batches(columns=[column]))
    _, repeated = find_duplicates(chunks, dataset.count_rows(), PARTITION_ROWS)
    return tuple(repeated)
