"""Whether a run may use, replace or must refuse an output directory's job record.

One output directory holds the output of one job record, whatever any shard's settings say: a rerun never
mixes rows of two records. Given this shard's lock and the record it wants:

- no record yet: it is created (by exclusive create, so racing shards agree on one);
- the same record: resume, or with `resume=false` start this shard over;
- a different record that no committed row depends on (every shard empty, no other live writer): it is
  replaced, so a start that failed after writing the record (a bad model directory, say) never blocks the
  fixed rerun; with `resume=false` this shard's own rows go first;
- a different record with another shard's rows (or a live writer) behind it: refused, naming the shards and
  the fixes; `overwrite=True` instead takes every shard's lock and deletes every shard's output.

Shards settle one at a time, under the directory's `_lock-job` (held for the seconds settling takes, not for
the run): shards launched together with a new record (an array resubmitted after a failed start, or with
`output.overwrite=true`) then see one replacement, not each other's half-made one.

Deletion runs success markers first (a crash must not leave a "complete" shard), then manifests (after which
nothing is committed), then part files, and the new record is written last: a crash midway leaves the old
record with fewer rows, which any rerun recomputes or deletes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from batchjob.io import job_record as job_records
from batchjob.io.job_record import JobRecordMismatch
from batchjob.io.layout import (
    JOB_RECORD_NAME,
    LOCK_RE,
    MANIFEST_RE,
    PART_RE,
    REPORT_NAME,
    SHARD_SUCCESS_RE,
    SUCCESS_NAME,
    ShardOutput,
)
from batchjob.io.lock import LockError, ShardLock
from batchjob.io.manifest import read_manifest
from batchjob.io.storage import Storage

log = logging.getLogger(__name__)
_SHOWN_DIFFERENCES = 4
JOB_LOCK_NAME = "_lock-job"
_JOB_LOCK_WAIT_S = 120.0


@dataclass(frozen=True)
class RecordChange:
    """What this shard needs to settle the record: where, which shard, the record it runs under."""

    storage: Storage
    path: str
    tmp_dir: str
    shard: ShardOutput
    record: dict[str, Any]

    def file(self, name: str) -> str:
        return self.storage.join(self.path, name)


@contextlib.contextmanager
def settling(storage: Storage, path: str, tmp_dir: str) -> Iterator[None]:
    """Hold the directory's job lock while one shard settles the record; other shards wait their turn."""
    lock = ShardLock(storage, storage.join(path, JOB_LOCK_NAME), tmp_dir)
    deadline = time.monotonic() + _JOB_LOCK_WAIT_S
    while True:
        try:
            lock.acquire()
            break
        except LockError as err:
            if time.monotonic() > deadline:
                raise LockError(f"waited {_JOB_LOCK_WAIT_S:.0f} s for the job record: {err}") from err
            time.sleep(0.2)
    try:
        yield
    finally:
        lock.release()


def settle_job_record(change: RecordChange, resume: bool, overwrite: bool) -> None:
    """Create, keep or replace the job record as the module docstring says; raise JobRecordMismatch (or
    LockError while another shard's writer is alive during an overwrite) when the run must not start.
    The caller holds this shard's lock."""
    record_path = change.file(JOB_RECORD_NAME)
    wanted = job_records.normalise(change.record)
    stored = job_records.read(change.storage, record_path)
    if stored is None:
        if change.storage.create_exclusive(record_path, job_records.encode(wanted), change.tmp_dir):
            if not resume:
                delete_shard_outputs(change.storage, change.path, change.shard)
            return
        stored = job_records.read(change.storage, record_path)  # another shard created it first
    diff = job_records.differences(stored, wanted)
    if not diff:
        if not resume:
            delete_shard_outputs(change.storage, change.path, change.shard)
        return
    old_count = stored.get("shard_count") if isinstance(stored.get("shard_count"), int) else 1
    shards = _shards_in(change, old_count)
    me = change.shard.shard_index
    others = {i: why for i in shards if i != me and (why := _holds_output(change, i, old_count))}
    mine = _holds_output(change, me, old_count, check_lock=False)
    changes = _describe(diff)
    if others and not overwrite:
        listed = ", ".join(f"shard {i} ({why})" for i, why in sorted(others.items()))
        raise JobRecordMismatch(
            f"{change.path} holds the output of another job ({changes}): {listed}; mixing it with this run's "
            "rows would give one dataset of two configurations. Use a new output.dir, or add "
            "output.overwrite=true to delete every shard's output and start the whole job over"
        )
    if mine and resume and not overwrite:
        raise JobRecordMismatch(
            f"{record_path} records a different job than this run ({changes}); shard {me} holds its {mine}. "
            "Restore the old settings to resume, use a new output.dir, or rerun with resume=false (or "
            "output.overwrite=true) to delete that output and start over"
        )
    if overwrite:
        _delete_every_shard(change, shards, old_count)
        log.warning("output.overwrite=true: deleted every shard's output of the previous job (%s)", changes)
    else:
        delete_shard_outputs(change.storage, change.path, ShardOutput(change.path, me, old_count))
        delete_shard_outputs(change.storage, change.path, change.shard)
        if not mine:
            log.warning("replacing %s: no row was committed under it (%s)", record_path, changes)
    for name in (SUCCESS_NAME, REPORT_NAME):  # job-wide markers of a single-shard job
        change.storage.remove(change.file(name))
    job_records.overwrite(change.storage, record_path, wanted, change.tmp_dir)


def record_is_stored(output_dir: str, record: dict[str, Any]) -> bool:
    """Whether `output_dir` already holds exactly `record` (with `shard_count`, as stored): checks that
    passed before that record was written need not run again."""
    storage, path = Storage.for_uri(output_dir)
    try:
        stored = job_records.read(storage, storage.join(path, JOB_RECORD_NAME))
    except OSError:  # not readable as a directory: opening the output will say why
        return False
    return stored is not None and not job_records.differences(stored, job_records.normalise(record))


def delete_shard_outputs(storage: Storage, path: str, shard: ShardOutput) -> None:
    """Success marker, reports, manifest, then the part files of one shard (see the module docstring)."""
    for name in (shard.success_name, shard.report_name, shard.manifest_name):
        storage.remove(storage.join(path, name))
    if shard.shard_count == 1:
        storage.remove(storage.join(path, REPORT_NAME))
    for name in storage.list_files(path):
        if name.startswith(shard.part_prefix):
            storage.remove(storage.join(path, name))


def _describe(diff: list[tuple[str, Any, Any]]) -> str:
    shown = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diff[:_SHOWN_DIFFERENCES])
    more = len(diff) - _SHOWN_DIFFERENCES
    return shown + (f"; and {more} more" if more > 0 else "")


def _shards_in(change: RecordChange, shard_count: int) -> list[int]:
    """Every shard index the directory's files name, and every index of the stored job's shard count."""
    seen = set(range(shard_count))
    for name in change.storage.list_files(change.path):
        for pattern in (PART_RE, MANIFEST_RE, SHARD_SUCCESS_RE, LOCK_RE):
            if match := pattern.match(name):
                seen.add(int(match.group(1)))
    return sorted(seen)


def _holds_output(change: RecordChange, index: int, shard_count: int, check_lock: bool = True) -> str | None:
    """Why shard `index` depends on the stored record (committed rows, a success marker, a live writer);
    None when it holds nothing."""
    layout = ShardOutput(change.path, index, max(shard_count, index + 1))
    rows = read_manifest(change.storage, change.file(layout.manifest_name)).rows
    if rows:
        return f"{rows} committed rows"
    if change.storage.exists(change.file(layout.success_name)):
        return "complete"
    if check_lock:
        holder = ShardLock(change.storage, change.file(layout.lock_name), change.tmp_dir).read_holder()
        if holder is not None and holder.stale_reason() is None:
            return f"being written by pid {holder.pid} on {holder.host}"
    return None


def _delete_every_shard(change: RecordChange, shards: list[int], shard_count: int) -> None:
    """Take every other shard's lock (a live writer refuses with LockError), then delete all outputs."""
    me = change.shard.shard_index
    locks = []
    try:
        for index in shards:
            if index != me:
                layout = ShardOutput(change.path, index, max(shard_count, index + 1))
                lock = ShardLock(change.storage, change.file(layout.lock_name), change.tmp_dir)
                lock.acquire()
                locks.append(lock)
        for index in shards:
            layout = ShardOutput(change.path, index, max(shard_count, index + 1))
            delete_shard_outputs(change.storage, change.path, layout)
        delete_shard_outputs(change.storage, change.path, change.shard)
    finally:
        for lock in locks:
            lock.release()
