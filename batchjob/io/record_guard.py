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

The record, locks, manifests and markers live in the bookkeeping folder beside output.dir
(batchjob/io/layout.py); the parts in output.dir. Shards settle one at a time, under the folder's
`locks/job.json` (held for the seconds settling takes, not for the run): shards launched together with a
new record (an array resubmitted after a failed start, or with `output.overwrite=true`) then see one
replacement, not each other's half-made one.

Deletion runs success markers first (a crash must not leave a "complete" shard), then manifest objects,
then parts, and the new record is written last: a crash midway leaves the old record with fewer rows (a
part whose manifest object went first is re-recorded under it by recovery), which any rerun resumes or
deletes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from batchjob.io import job_record as job_records
from batchjob.io import manifest
from batchjob.io.job_record import JobRecordMismatch
from batchjob.io.layout import (
    BOOKKEEPING_SUFFIX,
    JOB_RECORD_NAME,
    LOCKS_DIR_NAME,
    PART_RE,
    REPORT_NAME,
    SUCCESS_NAME,
    ShardOutput,
)
from batchjob.io.lock import LockError, ShardLock
from batchjob.io.recovery import ShardFiles
from batchjob.io.status import shard_status
from batchjob.io.storage import Storage

log = logging.getLogger(__name__)
_SHOWN_DIFFERENCES = 4
JOB_LOCK_NAME = "job.json"  # in locks/, beside the shards' sNNNNN.json
_JOB_LOCK_WAIT_S = 120.0


@dataclass(frozen=True)
class RecordChange:
    """What this shard needs to settle the record: where, which shard, the record it runs under."""

    storage: Storage
    out_dir: str  # output.dir as a storage path: the parts
    meta: str  # the bookkeeping folder beside it
    tmp_dir: str
    shard: ShardOutput
    record: dict[str, Any]
    lock_timeout_s: float

    def file(self, name: str) -> str:
        """A bookkeeping file by its layout name (`_job.json`, `locks/s00000.json`, ...)."""
        return self.storage.join(self.meta, *name.split("/"))

    def files(self, index: int, shard_count: int) -> ShardFiles:
        shard = ShardOutput(self.shard.dir, index, max(shard_count, index + 1))
        return ShardFiles(self.storage, shard, self.out_dir, self.file(shard.manifest_dir), self.tmp_dir)

    def lock(self, name: str) -> ShardLock:
        return ShardLock(self.storage, self.file(name), self.tmp_dir, self.lock_timeout_s)


@contextlib.contextmanager
def settling(change: RecordChange) -> Iterator[None]:
    """Hold the folder's job lock while one shard settles the record; other shards wait their turn."""
    lock = change.lock(f"{LOCKS_DIR_NAME}/{JOB_LOCK_NAME}")
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
    me = change.shard.shard_index
    stored = job_records.read(change.storage, record_path)
    if stored is None:
        _refuse_orphan_parts(change, record_path, overwrite)
        if change.storage.create_exclusive(record_path, job_records.encode(wanted), change.tmp_dir):
            if not resume:
                delete_shard_outputs(change.files(me, change.shard.shard_count), change.meta)
            return
        stored = job_records.read(change.storage, record_path)  # another shard created it first
    diff = job_records.differences(stored, wanted)
    if not diff:
        if not resume:
            delete_shard_outputs(change.files(me, change.shard.shard_count), change.meta)
        return
    old_count = stored.get("shard_count") if isinstance(stored.get("shard_count"), int) else 1
    held = _outputs(change)
    others = {i: why for i, why in held.items() if i != me and why is not None}
    mine = held.get(me)
    changes = _describe(diff)
    if others and not overwrite:
        listed = ", ".join(f"shard {i} ({why})" for i, why in sorted(others.items()))
        raise JobRecordMismatch(
            f"{change.shard.dir} holds the output of another job ({changes}): {listed}; mixing it with this "
            "run's rows would give one dataset of two configurations. Use a new output.dir, or add "
            "output.overwrite=true to delete every shard's output and start the whole job over"
        )
    if mine and resume and not overwrite:
        raise JobRecordMismatch(
            f"{record_path} records a different job than this run ({changes}); shard {me} holds its {mine}. "
            "Restore the old settings to resume, use a new output.dir, or rerun with resume=false (or "
            "output.overwrite=true) to delete that output and start over"
        )
    if overwrite:
        _delete_every_shard(change, sorted(held), old_count)
        log.warning("output.overwrite=true: deleted every shard's output of the previous job (%s)", changes)
    else:
        delete_shard_outputs(change.files(me, old_count), change.meta)
        delete_shard_outputs(change.files(me, change.shard.shard_count), change.meta)
        if not mine:
            log.warning("replacing %s: no row was committed under it (%s)", record_path, changes)
    for name in (SUCCESS_NAME, REPORT_NAME):  # job-wide markers of a single-shard job
        change.storage.remove(change.file(name))
    job_records.overwrite(change.storage, record_path, wanted, change.tmp_dir)


def _refuse_orphan_parts(change: RecordChange, record_path: str, overwrite: bool) -> None:
    """Parts in output.dir with no job record beside them: the bookkeeping folder was lost (output.dir a volume
    or scratch mount whose sibling lived on a throw-away filesystem, a copy of the parts alone). Whose job
    wrote them is unknown, so adopting them could mix two configurations in one dataset; `overwrite` deletes
    them instead."""
    orphans = sorted(name for name in change.storage.list_files(change.out_dir) if PART_RE.match(name))
    if not orphans:
        return
    if overwrite:
        for name in orphans:
            change.storage.remove(change.storage.join(change.out_dir, name))
        log.warning("output.overwrite=true: deleted %d parts that had no job record", len(orphans))
        return
    raise JobRecordMismatch(
        f"{change.shard.dir} holds {len(orphans)} committed parts ({orphans[0]}, ...) but no job record "
        f"({record_path} is missing: the folder beside output.dir was lost or not copied with it), so which "
        "job wrote them cannot be checked. Restore that folder to resume, use a new output.dir, or add "
        "output.overwrite=true to delete the parts and start over"
    )


def record_is_stored(output_dir: str, record: dict[str, Any]) -> bool:
    """Whether `output_dir` already holds exactly `record` (with `shard_count`, as stored): checks that
    passed before that record was written need not run again."""
    storage, path = Storage.for_uri(output_dir)
    try:
        stored = job_records.read(storage, storage.join(path.rstrip("/") + BOOKKEEPING_SUFFIX, JOB_RECORD_NAME))
    except OSError:  # not readable as a directory: opening the output will say why
        return False
    return stored is not None and not job_records.differences(stored, job_records.normalise(record))


def delete_shard_outputs(files: ShardFiles, meta: str) -> None:
    """Success marker, reports, manifest objects, then the parts of one shard (see the module docstring)."""
    storage, shard = files.storage, files.shard
    for name in (shard.success_name, shard.report_name):
        storage.remove(storage.join(meta, name))
    if shard.shard_count == 1:
        storage.remove(storage.join(meta, REPORT_NAME))
    manifest.clear_rewrite(storage, files.manifest_dir)
    for name in storage.list_files(files.manifest_dir):
        storage.remove(storage.join(files.manifest_dir, name))
    for name in files.visible_parts():
        storage.remove(files.part_path(name))
    for path in files.staged_files():
        storage.remove(path)


def _describe(diff: list[tuple[str, Any, Any]]) -> str:
    shown = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diff[:_SHOWN_DIFFERENCES])
    more = len(diff) - _SHOWN_DIFFERENCES
    return shown + (f"; and {more} more" if more > 0 else "")


def _outputs(change: RecordChange) -> dict[int, str | None]:
    """Every shard the folders name or the stored record's shard count implies, with why it depends on the
    stored record (committed rows or parts, a success marker, a live writer other than this process), or None
    when it holds nothing."""
    held: dict[int, str | None] = {}
    for st in shard_status(change.shard.dir):
        index = st["shard"]
        if st["rows"]:
            held[index] = f"{st['rows']} committed rows"
        elif st["parts"]:
            held[index] = "a committed part without rows"
        elif st["success"]:
            held[index] = "complete"
        elif st["locked"] and index != change.shard.shard_index:
            held[index] = _live_writer(change, ShardOutput(change.shard.dir, index, index + 1).lock_name)
        else:
            held[index] = None
    return held


def _live_writer(change: RecordChange, lock_name: str) -> str | None:
    state = change.lock(lock_name).read()
    if state is None or state.holder.stale_reason(state.age_s, change.lock_timeout_s) is not None:
        return None
    return f"being written by pid {state.holder.pid} on {state.holder.host}"


def _delete_every_shard(change: RecordChange, shards: list[int], shard_count: int) -> None:
    """Take every other shard's lock (a live writer refuses with LockError), then delete all outputs."""
    me = change.shard.shard_index
    locks = []
    try:
        for index in shards:
            if index != me:
                lock = change.lock(change.files(index, shard_count).shard.lock_name)
                lock.acquire()
                locks.append(lock)
        for index in shards:
            delete_shard_outputs(change.files(index, shard_count), change.meta)
        delete_shard_outputs(change.files(me, change.shard.shard_count), change.meta)
    finally:
        for lock in locks:
            lock.release()
