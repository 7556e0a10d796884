"""A shard's view of the output directory: exactly-once Parquet part commits, resume, success markers.

Commit protocol (why each step): on a local disk the part is written to the temp folder beside output.dir
and fsynced, so a crash never exposes a torn Parquet file; it is renamed into output.dir, the commit point,
and output.dir is fsynced (where output.dir is another mount than the temp folder, a rename cannot reach it:
the part is written inside output.dir instead, unnamed or under a staged name, see staging.py); then its
manifest object (size, sha256, row ids) is created and its folder fsynced. On an object store the part is PUT
under its final name (atomic: the commit point), then its manifest object. Each commit costs a constant
number of requests, however long the job.

So output.dir always holds exactly the committed parts, even right after a kill -9: every reader of the
plain directory sees exactly the committed rows, and a rerun skips exactly those row ids. The next open
checks every part against its manifest object and repairs what a crash left (batchjob/io/recovery.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchjob.io import manifest, recovery
from batchjob.io.crash_points import crash_point
from batchjob.io.layout import (
    BOOKKEEPING_SUFFIX,
    LOCKS_DIR_NAME,
    REPORT_NAME,
    TMP_DIR_NAME,
    ShardOutput,
    bookkeeping_dir,
    part_seq,
)
from batchjob.io.lock import DEFAULT_TIMEOUT_S, ShardLock
from batchjob.io.manifest import PartEntry, Rewrite
from batchjob.io.output_dir import check_output_dir
from batchjob.io.record_guard import RecordChange, record_is_stored, settle_job_record, settling
from batchjob.io.recovery import ShardFiles
from batchjob.io.staging import PartStaging
from batchjob.io.storage import Storage, full_disk_reported

if TYPE_CHECKING:
    import pyarrow.dataset as pads


class OutputDataset:
    def __init__(
        self, dir: str, shard_index: int = 0, shard_count: int = 1, lock_timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.shard = ShardOutput(dir, shard_index, shard_count)
        self.bookkeeping_dir = bookkeeping_dir(dir)
        self.storage, self.path = Storage.for_uri(dir)
        self.meta = self.path.rstrip("/") + BOOKKEEPING_SUFFIX
        self.tmp_dir = self._meta(TMP_DIR_NAME)
        self.files = ShardFiles(self.storage, self.shard, self.path, self._meta(self.shard.manifest_dir), self.tmp_dir)
        self._lock = ShardLock(self.storage, self._meta(self.shard.lock_name), self.tmp_dir, lock_timeout_s)
        self._parts: dict[str, PartEntry] = {}
        self._next_seq = 0
        self._is_open = False
        self._staging = PartStaging(self.storage, self.shard, self.path, self.tmp_dir, self.files)

    def _meta(self, name: str) -> str:
        return self.storage.join(self.meta, *name.split("/"))

    def _part(self, name: str) -> str:
        return self.storage.join(self.path, name)

    def open(self, job_record: dict[str, Any], resume: bool = True, overwrite: bool = False) -> None:
        """Lock the shard, settle the job record (batchjob/io/record_guard.py), and recover from any crash
        of a previous run.

        The stored record is `job_record` plus `shard_count` (unless given): changing the shard
        count moves shard boundaries, so outputs of different shard counts must never be mixed.
        With `resume=False` this shard's parts, manifest, reports and success marker are deleted first;
        other shards' outputs are left alone, and a different record is refused while they hold rows of
        it, unless `overwrite=True`, which deletes every shard's output under their locks.
        """
        record = self._stored_record(job_record)
        self.check_dir()
        with full_disk_reported(self.shard.dir):
            for directory in (self.path, self.tmp_dir, self._meta(LOCKS_DIR_NAME), self.files.manifest_dir):
                self.storage.makedirs(directory)
            if self.storage.is_local:
                self._staging.choose()
        change = RecordChange(
            self.storage, self.path, self.meta, self.tmp_dir, self.shard, record, self._lock.timeout_s
        )
        with full_disk_reported(self.shard.dir), settling(change):
            if self._lock.holder is None:  # reopening after a failed write keeps the lock it holds
                self._lock.acquire()
            try:
                settle_job_record(change, resume=resume, overwrite=overwrite)
            except BaseException:
                self._lock.release()
                raise
        try:
            with full_disk_reported(self.shard.dir):
                self._parts = recovery.recover(self.files, self._meta(self.shard.success_name))
        except BaseException:
            self._lock.release()
            raise
        self._next_seq = 1 + max((part_seq(name) for name in self._parts), default=-1)
        self._is_open = True

    def check_dir(self) -> None:
        """`OutputDirError` where output.dir may not take this job's parts (`output_dir.check_output_dir`)."""
        check_output_dir(self.storage, self.path, self.shard.dir)

    def _stored_record(self, job_record: dict[str, Any]) -> dict[str, Any]:
        return {"shard_count": self.shard.shard_count, **job_record}

    def is_complete_for(self, job_record: dict[str, Any]) -> bool:
        """Whether this shard is complete (success marker present), the directory records this same job, and
        output.dir holds the parts its manifest objects name (a part deleted since makes the shard incomplete, and
        open() recomputes its rows). Takes no lock and writes nothing: a complete shard is never written again
        unless reset."""
        return (
            self.is_success()
            and record_is_stored(self.shard.dir, self._stored_record(job_record))
            and manifest.recorded_names(self.storage, self.files.manifest_dir) == set(self.files.visible_parts())
        )

    def _require_open(self) -> None:
        if not self._is_open:
            raise RuntimeError(
                f"{self.shard.dir} shard {self.shard.shard_index} is not open (never opened, closed, or a "
                "write failed midway): call open() to (re)start it"
            )

    @property
    def writable(self) -> bool:
        """False once closed, or after a write failed past its commit point (only open() may go on)."""
        return self._is_open

    @property
    def committed_rows(self) -> int:
        return sum(p.rows for p in self._parts.values())

    @property
    def part_names(self) -> tuple[str, ...]:
        """This shard's committed parts, by name."""
        return tuple(self._parts)

    def committed_errors(self, names: Iterable[str]) -> Iterator[tuple[int, str]]:
        """`(row_id, error)` of every error row in the committed parts `names`, a batch of rows at a time."""
        self._require_open()
        names = list(names)
        if not names:
            return
        rows = self._parts_dataset(names).to_batches(columns=["row_id", "error"], filter=pc.field("error").is_valid())
        for batch in rows:
            yield from zip(batch.column("row_id").to_pylist(), batch.column("error").to_pylist(), strict=True)

    def committed_row_ids(self) -> np.ndarray:
        """Sorted unique int64 row ids of every row this shard has committed."""
        self._require_open()
        if not self._parts:
            return np.empty(0, dtype=np.int64)
        table = self._parts_dataset(list(self._parts)).to_table(columns=["row_id"])
        ids = table.column("row_id").to_numpy()
        return np.unique(ids.astype(np.int64, copy=False))

    def _parts_dataset(self, names: list[str]) -> pads.Dataset:
        # Imported here: a first run never reads its parts back, and the module (with pandas) costs start-up time.
        import pyarrow.dataset as pads

        return pads.dataset([self._part(n) for n in names], format="parquet", filesystem=self.storage.pyarrow_fs())

    def commit(self, table: pa.Table) -> None:
        """Commit `table` (which must hold an int64 `row_id` column) as one new part, atomically.

        A failure before the commit point leaves the shard as it was (the call may be retried); past it the
        part is committed but its manifest object may be missing, and the shard refuses writes until open().
        """
        self._require_open()
        _check_row_ids(table)
        if table.num_rows:
            self._commit_part(table)

    def commit_empty(self, schema: pa.Schema) -> None:
        """Commit a zero-row part with `schema` (which must hold an int64 `row_id`): a shard without rows
        still shows readers its columns, where a directory with no part file at all is an error to them."""
        self._require_open()
        table = schema.empty_table()
        _check_row_ids(table)
        self._commit_part(table)

    def _commit_part(self, table: pa.Table) -> None:
        self._lock.ensure_held()
        name = self.shard.part_name(self._next_seq)
        data = _parquet_bytes(table)
        entry = PartEntry.of_table(name, table, data)
        final = self._part(name)
        with full_disk_reported(self.shard.dir):
            if self.storage.is_local:
                self._staging.commit(name, data, final)
            else:
                self.storage.write_durable(final, data)
            self._parts[name] = entry  # committed: visible under its final name
            self._next_seq += 1
            with self._writing():
                crash_point("part-committed")
                self.storage.fsync_dir(self.path)
                crash_point("part-synced")
                manifest.write_entry(self.storage, self.files.manifest_dir, entry, self.tmp_dir, sync=False)
                crash_point("manifest-written")
                self.storage.fsync_dir(self.files.manifest_dir)
                crash_point("manifest-synced")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A write that fails past its commit point may leave a part without its manifest object or half an
        ordered rewrite, which only open()'s recovery may continue from: until then writes are refused."""
        try:
            yield
        except BaseException:
            self._is_open = False
            raise

    def rewrite_ordered(self, rows_per_part: int | None = None) -> None:
        """Rewrite this shard's parts so that reading them in name order yields rows in `row_id` order.

        Memory holds one output part (`rows_per_part`, default: the largest existing part) plus one input
        part at a time. New parts are made durable in the temp folder, then one rewrite record (the commit
        point) names old and new parts, then old parts are deleted and new ones moved in: a crash leaves the
        old set, or a record the next open finishes. While the files move, a reader of output.dir may miss
        rows; a job is complete (its success marker written) only after the move.
        """
        self._require_open()
        if not self.committed_rows:
            return
        self._lock.ensure_held()
        rows_per_part = rows_per_part or max(p.rows for p in self._parts.values())
        ids = self.committed_row_ids()
        old = list(self._parts.values())
        new: list[PartEntry] = []
        with full_disk_reported(self.shard.dir), self._writing():
            for start in range(0, len(ids), rows_per_part):
                lo, hi = int(ids[start]), int(ids[min(start + rows_per_part, len(ids)) - 1])
                sources = [p.name for p in old if p.rows and p.row_id_max >= lo and p.row_id_min <= hi]
                in_range = (pc.field("row_id") >= lo) & (pc.field("row_id") <= hi)
                chunk = self._parts_dataset(sources).to_table(filter=in_range).sort_by("row_id")
                name = self.shard.part_name(self._next_seq + len(new))
                data = _parquet_bytes(chunk)
                self.storage.write_durable(self._staging.staged(name), data)
                new.append(PartEntry.of_table(name, chunk, data))
            rewrite = Rewrite(tuple(p.name for p in old), tuple(new))
            manifest.write_rewrite(self.storage, self.files.manifest_dir, rewrite, self.tmp_dir)
            recovery.roll_forward(self.files, rewrite)
        self._parts = {e.name: e for e in new}
        self._next_seq += len(new)

    def write_report(self, report: dict[str, Any]) -> None:
        """`_report-sNNNNN.json`, and for single-shard jobs also the job-wide `_report.json`."""
        self._require_open()
        data = json.dumps(report, indent=2, default=_plain).encode()
        with full_disk_reported(self.bookkeeping_dir):
            self.storage.write_atomic(self._meta(self.shard.report_name), data, self.tmp_dir)
            if self.shard.shard_count == 1:
                self.storage.write_atomic(self._meta(REPORT_NAME), data, self.tmp_dir)

    def read_report(self) -> dict[str, Any] | None:
        """This shard's report (`write_report`), or None when there is none (the shard never completed)."""
        try:
            return json.loads(self.storage.read_bytes(self._meta(self.shard.report_name)))
        except FileNotFoundError:
            return None

    def mark_success(self) -> None:
        self._require_open()
        self._lock.ensure_held()
        with full_disk_reported(self.bookkeeping_dir):
            self.storage.write_atomic(self._meta(self.shard.success_name), b"", self.tmp_dir)

    def is_success(self) -> bool:
        return self.storage.exists(self._meta(self.shard.success_name))

    def close(self) -> None:
        self._lock.release()
        self._is_open = False

    def __enter__(self) -> OutputDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _plain(value: object) -> object:
    """JSON for numpy scalars and arrays, which reports naturally contain."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"report value {value!r} of type {type(value).__name__} is not JSON-serialisable")


def _check_row_ids(table: pa.Table) -> None:
    if "row_id" not in table.column_names:
        raise ValueError(f"output table has no row_id column (columns: {table.column_names})")
    column = table.column("row_id")
    if column.type != pa.int64() or column.null_count:
        raise ValueError(f"output row_id must be non-null int64, got {column.type} with {column.null_count} nulls")
