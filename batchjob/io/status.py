"""Progress of every shard of an output directory, read from its manifests, reports and markers alone."""

from __future__ import annotations

import json
from typing import Any

from batchjob.io.layout import JOB_RECORD_NAME, LOCK_RE, MANIFEST_RE, SHARD_SUCCESS_RE, ShardOutput
from batchjob.io.manifest import read_manifest
from batchjob.io.storage import Storage


def shard_status(output_dir: str) -> list[dict[str, Any]]:
    """One dict per shard seen (started, or expected from the job record's shard_count), by shard index:
    `shard`, `parts`, `rows` (committed), `success`, `locked` (lock file present), `report` (or None).

    Reads no part file and takes no lock, so it is safe to run while shards are writing.
    """
    storage, path = Storage.for_uri(output_dir)
    names = storage.list_files(path)
    shard_count = _recorded_shard_count(storage, storage.join(path, JOB_RECORD_NAME))
    seen = {int(m.group(1)) for n in names for rx in (MANIFEST_RE, SHARD_SUCCESS_RE, LOCK_RE) if (m := rx.match(n))}
    if shard_count is None:
        shard_count = max(seen, default=0) + 1
    statuses = []
    for index in sorted(seen | set(range(shard_count))):
        shard = ShardOutput(output_dir, index, max(shard_count, index + 1))
        state = read_manifest(storage, storage.join(path, shard.manifest_name))
        report_name = shard.report_name
        statuses.append(
            {
                "shard": index,
                "parts": len(state.parts),
                "rows": state.rows,
                "success": shard.success_name in names,
                "locked": shard.lock_name in names,
                "report": json.loads(storage.read_bytes(storage.join(path, report_name)))
                if report_name in names
                else None,
            }
        )
    return statuses


def committed_parts(output_dir: str) -> list[str]:
    """Paths of the committed part files of every shard, by shard then commit order: what the manifests
    commit, not what the directory holds (a crashed run may have left a part it never committed)."""
    storage, path = Storage.for_uri(output_dir)
    manifests = sorted(name for name in storage.list_files(path) if MANIFEST_RE.match(name))
    return [
        storage.join(path, part)
        for manifest in manifests
        for part in read_manifest(storage, storage.join(path, manifest)).parts
    ]


def _recorded_shard_count(storage: Storage, record_path: str) -> int | None:
    if not storage.exists(record_path):
        return None
    count = json.loads(storage.read_bytes(record_path)).get("shard_count")
    return count if isinstance(count, int) and count >= 1 else None
