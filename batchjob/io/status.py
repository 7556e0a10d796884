"""Progress of every shard of an output directory, read from its listing, manifests, reports and markers."""

from __future__ import annotations

import json
from typing import Any

import pyarrow.parquet as pq

from batchjob.io import manifest
from batchjob.io.layout import (
    BOOKKEEPING_SUFFIX,
    JOB_RECORD_NAME,
    LOCK_RE,
    LOCKS_DIR_NAME,
    MANIFESTS_DIR_NAME,
    OLD_LAYOUT_RE,
    PART_RE,
    SHARD_DIR_RE,
    SHARD_SUCCESS_RE,
    OutputDirError,
    ShardOutput,
    no_job_message,
    old_layout_message,
)
from batchjob.io.storage import Storage


def shard_status(output_dir: str) -> list[dict[str, Any]]:
    """One dict per shard seen (started, or expected from the job record's shard_count), by shard index:
    `shard`, `parts`, `rows` (committed), `success`, `locked` (lock file present), `report` (or None).

    Reads no part file (except a part committed just before a crash, whose row count is in its footer) and
    takes no lock, so it is safe to run while shards are writing.
    """
    storage, path = Storage.for_uri(output_dir)
    parts = storage.list_files(path)
    _check_layout(output_dir, parts)
    meta = path.rstrip("/") + BOOKKEEPING_SUFFIX
    names = storage.list_files(meta)
    locks = {int(m.group(1)) for n in storage.list_files(storage.join(meta, LOCKS_DIR_NAME)) if (m := LOCK_RE.match(n))}
    manifests = storage.join(meta, MANIFESTS_DIR_NAME)
    seen = {int(m.group(1)) for n in storage.list_dirs(manifests) if (m := SHARD_DIR_RE.match(n))}
    seen |= {int(m.group(1)) for n in names if (m := SHARD_SUCCESS_RE.match(n))} | locks
    seen |= {int(m.group(1)) for n in parts if (m := PART_RE.match(n))}
    shard_count = _recorded_shard_count(storage, storage.join(meta, JOB_RECORD_NAME))
    if shard_count is None:
        shard_count = max(seen, default=0) + 1
    statuses = []
    for index in sorted(seen | set(range(shard_count))):
        shard = ShardOutput(output_dir, index, max(shard_count, index + 1))
        entries, _ = manifest.read_entries(storage, storage.join(meta, *shard.manifest_dir.split("/")))
        visible = [n for n in parts if shard.owns_part(n)]
        rows = sum(entries[n].rows if n in entries else _footer_rows(storage, storage.join(path, n)) for n in visible)
        report_name = shard.report_name
        statuses.append(
            {
                "shard": index,
                "parts": len(visible),
                "rows": rows,
                "success": shard.success_name in names,
                "locked": index in locks,
                "report": json.loads(storage.read_bytes(storage.join(meta, report_name)))
                if report_name in names
                else None,
            }
        )
    return statuses


def _footer_rows(storage: Storage, part: str) -> int:
    return pq.read_metadata(part, filesystem=storage.pyarrow_fs()).num_rows


def committed_parts(output_dir: str) -> list[str]:
    """Paths of the committed part files of every shard, by shard then commit order: `output.dir` holds
    committed parts only (a part is committed when it appears there under its final name)."""
    storage, path = Storage.for_uri(output_dir)
    names = storage.list_files(path)
    _check_layout(output_dir, names)
    return [storage.join(path, name) for name in sorted(names) if PART_RE.match(name)]


def _check_layout(output_dir: str, names: list[str]) -> None:
    """`OutputDirError` for a folder holding a job record: a job's bookkeeping folder given for its output, or an
    output of the older layout (its record inside)."""
    if JOB_RECORD_NAME in names and output_dir.rstrip("/").endswith(BOOKKEEPING_SUFFIX):
        raise OutputDirError(no_job_message(output_dir))
    if any(OLD_LAYOUT_RE.match(name) for name in names):
        raise OutputDirError(old_layout_message(output_dir))


def _recorded_shard_count(storage: Storage, record_path: str) -> int | None:
    if not storage.exists(record_path):
        return None
    count = json.loads(storage.read_bytes(record_path)).get("shard_count")
    return count if isinstance(count, int) and count >= 1 else None
