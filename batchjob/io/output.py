"""A shard's view of the output directory: exactly-once Parquet part commits, resume, success markers.

Commit protocol (why each step): the part is written under `_tmp/` (invisible to `pyarrow.dataset`) and
fsynced, so a crash never exposes a torn Parquet file; it is renamed into place, then a manifest line is
appended and fsynced. The manifest line is the commit point: on open, a part file the manifest does not
list (a crash between rename and append) is deleted and its rows are recomputed; a listed part is kept and
its rows are skipped. So every row is committed exactly once.

Reading the whole directory with `pyarrow.dataset` / `pandas.read_parquet` yields exactly the committed
rows once each shard has been opened after its last crash (or closed cleanly).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from batchjob.io import manifest
from batchjob.io.layout import PART_RE, REPORT_NAME, TMP_DIR_NAME, ShardOutput
from batchjob.io.lock import ShardLock
from batchjob.io.manifest import PartEntry
from batchjob.io.record_guard import RecordChange, settle_job_record, settling
from batchjob.io.storage import Storage

log = logging.getLogger(__name__)


class OutputDataset:
    def __init__(self, dir: str, shard_index: int = 0, shard_count: int = 1) -> None:
        self.shard = ShardOutput(dir, shard_index, shard_count)
        self.storage, self.path = Storage.for_uri(dir)
        self.tmp_dir = self._file(TMP_DIR_NAME)
        self.manifest_path = self._file(self.shard.manifest_name)
        self._lock = ShardLock(self.storage, self._file(self.shard.lock_name), self.tmp_dir)
        self._parts: dict[str, PartEntry] = {}
        self._next_seq = 0
        self._is_open = False

    def _file(self, name: str) -> str:
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
        record = {"shard_count": self.shard.shard_count, **job_record}
        self.storage.makedirs(self.path)
        self.storage.makedirs(self.tmp_dir)
        with settling(self.storage, self.path, self.tmp_dir):
            if self._lock.holder is None:  # reopening after a failed write keeps the lock it holds
                self._lock.acquire()
            try:
                change = RecordChange(self.storage, self.path, self.tmp_dir, self.shard, record)
                settle_job_record(change, resume=resume, overwrite=overwrite)
            except BaseException:
                self._lock.release()
                raise
        try:
            self._recover()
        except BaseException:
            self._lock.release()
            raise
        self._is_open = True

    def _recover(self) -> None:
        state = manifest.read_manifest(self.storage, self.manifest_path)
        if manifest.repair_torn_tail(self.storage, self.manifest_path, state):
            log.warning("%s: dropped a torn last line (its commit never completed)", self.manifest_path)
        present = self.storage.list_files(self.path)
        in_tmp = self.storage.list_files(self.tmp_dir)
        for name, entry in state.parts.items():
            if name not in present and name in in_tmp:
                # An ordered rewrite committed this part but crashed before moving it into place.
                self.storage.rename(self.storage.join(self.tmp_dir, name), self._file(name))
                present[name] = in_tmp.pop(name)
            if present.get(name) != entry.size:
                found = "missing" if name not in present else f"{present[name]} bytes, expected {entry.size}"
                raise RuntimeError(
                    f"committed part {self._file(name)} is {found}: its rows are lost. "
                    "Rerun with resume=false to start this shard over"
                )
        for name in present:
            if name.startswith(self.shard.part_prefix) and name not in state.parts:
                log.warning("deleting uncommitted part %s (crash before its manifest line)", name)
                self.storage.remove(self._file(name))
        for name in in_tmp:
            if self.shard.owns_tmp(name):
                self.storage.remove(self.storage.join(self.tmp_dir, name))
        self._parts = dict(state.parts)
        self._next_seq = 1 + max((_seq(name) for name in self._parts), default=-1)

    def _require_open(self) -> None:
        if not self._is_open:
            raise RuntimeError(
                f"{self.shard.dir} shard {self.shard.shard_index} is not open (never opened, closed, or a "
                "write failed midway): call open() to (re)start it"
            )

    @property
    def committed_rows(self) -> int:
        return sum(p.rows for p in self._parts.values())

    def committed_row_ids(self) -> np.ndarray:
        """Sorted unique int64 row ids of every row this shard has committed."""
        self._require_open()
        if not self._parts:
            return np.empty(0, dtype=np.int64)
        table = self._parts_dataset(list(self._parts)).to_table(columns=["row_id"])
        ids = table.column("row_id").to_numpy()
        return np.unique(ids.astype(np.int64, copy=False))

    def _parts_dataset(self, names: list[str]) -> pads.Dataset:
        return pads.dataset([self._file(n) for n in names], format="parquet", filesystem=self.storage.pyarrow_fs())

    def commit(self, table: pa.Table) -> None:
        """Commit `table` (which must hold an int64 `row_id` column) as one new part, atomically."""
        self._require_open()
        _check_row_ids(table)
        if table.num_rows == 0:
            return
        with self._writing():
            entry = self._write_part(table, self._next_seq, final_dir=self.path)
            manifest.append_add(self.storage, self.manifest_path, entry)
        self._parts[entry.name] = entry
        self._next_seq += 1

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A write that fails midway may leave a stray part or a torn manifest line, which only open()'s
        recovery may continue from: until then the shard refuses further writes."""
        try:
            yield
        except BaseException:
            self._is_open = False
            raise

    def _write_part(self, table: pa.Table, seq: int, final_dir: str | None) -> PartEntry:
        """Write a durable part under `_tmp/`; move it to `final_dir` if given (else it stays in `_tmp/`)."""
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        name = self.shard.part_name(seq)
        tmp = self.storage.join(self.tmp_dir, name)
        self.storage.write_durable(tmp, data)
        if final_dir is not None:
            self.storage.rename(tmp, self.storage.join(final_dir, name))
        row_ids = table.column("row_id")
        return PartEntry(
            name=name,
            rows=table.num_rows,
            row_id_min=int(pc.min(row_ids).as_py()),
            row_id_max=int(pc.max(row_ids).as_py()),
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )

    def rewrite_ordered(self, rows_per_part: int | None = None) -> None:
        """Rewrite this shard's parts so that reading them in name order yields rows in `row_id` order.

        Memory holds one output part (`rows_per_part`, default: the largest existing part) plus one input
        part at a time. New parts are made durable under `_tmp/`, then one manifest line swaps old for new
        (the commit point), then files are moved: a crash leaves either the old or the new set committed.
        """
        self._require_open()
        if not self._parts:
            return
        rows_per_part = rows_per_part or max(p.rows for p in self._parts.values())
        ids = self.committed_row_ids()
        old = list(self._parts.values())
        new: list[PartEntry] = []
        with self._writing():
            for start in range(0, len(ids), rows_per_part):
                lo, hi = int(ids[start]), int(ids[min(start + rows_per_part, len(ids)) - 1])
                sources = [p.name for p in old if p.row_id_max >= lo and p.row_id_min <= hi]
                in_range = (pads.field("row_id") >= lo) & (pads.field("row_id") <= hi)
                chunk = self._parts_dataset(sources).to_table(filter=in_range).sort_by("row_id")
                new.append(self._write_part(chunk, self._next_seq + len(new), final_dir=None))
            manifest.append_replace(self.storage, self.manifest_path, [p.name for p in old], new)
            for entry in new:
                self.storage.rename(self.storage.join(self.tmp_dir, entry.name), self._file(entry.name))
            for entry in old:
                self.storage.remove(self._file(entry.name))
        self._parts = {e.name: e for e in new}
        self._next_seq += len(new)

    def write_report(self, report: dict[str, Any]) -> None:
        """`_report-sNNNNN.json`, and for single-shard jobs also the job-wide `_report.json`."""
        self._require_open()
        data = json.dumps(report, indent=2, default=_plain).encode()
        self.storage.write_atomic(self._file(self.shard.report_name), data, self.tmp_dir)
        if self.shard.shard_count == 1:
            self.storage.write_atomic(self._file(REPORT_NAME), data, self.tmp_dir)

    def mark_success(self) -> None:
        self._require_open()
        self.storage.write_atomic(self._file(self.shard.success_name), b"", self.tmp_dir)

    def is_success(self) -> bool:
        return self.storage.exists(self._file(self.shard.success_name))

    def close(self) -> None:
        self._lock.release()
        self._is_open = False

    def __enter__(self) -> OutputDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _plain(value: object) -> object:
    """JSON for numpy scalars and arrays, which reports naturally contain."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"report value {value!r} of type {type(value).__name__} is not JSON-serialisable")


def _seq(part_name: str) -> int:
    match = PART_RE.match(part_name)
    if match is None:
        raise RuntimeError(f"manifest lists {part_name!r}, which is not a part file name")
    return int(match.group(2))


def _check_row_ids(table: pa.Table) -> None:
    if "row_id" not in table.column_names:
        raise ValueError(f"output table has no row_id column (columns: {table.column_names})")
    column = table.column("row_id")
    if column.type != pa.int64() or column.null_count:
        raise ValueError(f"output row_id must be non-null int64, got {column.type} with {column.null_count} nulls")
