"""The job record: what produced an output directory, so a rerun never mixes outputs of different jobs.

The caller decides what goes in (model, sampling, prompt settings, input fingerprint, version...); this
module stores, reads and compares records; `record_guard` decides when one may be replaced. A record's
`provenance` (where its files were found: a copy staged elsewhere holds the same bytes) is kept for people and
never compared.
"""

from __future__ import annotations

import json
from typing import Any

from batchjob.io.storage import Storage

_MISSING = "<absent>"
NOT_COMPARED = "provenance"  # a top-level key


class JobRecordMismatch(ValueError):
    """The output directory was produced by a different job configuration."""


def normalise(record: dict[str, Any]) -> dict[str, Any]:
    """The record as it reads back from JSON (tuples become lists, keys strings), so comparisons are fair."""
    try:
        return json.loads(json.dumps(record, sort_keys=True))
    except TypeError as exc:
        raise TypeError(f"the job record must be JSON-serialisable: {exc}") from exc


def encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, indent=2).encode()


def differences(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs between two records (`NOT_COMPARED` aside)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new)):
            if not prefix and key == NOT_COMPARED:
                continue
            name = f"{prefix}.{key}" if prefix else str(key)
            found += differences(old.get(key, _MISSING), new.get(key, _MISSING), name)
        return found
    return [] if old == new else [(prefix or "<record>", old, new)]


def read(storage: Storage, path: str) -> dict[str, Any] | None:
    """The stored record, or None when the directory has none yet."""
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        return None


def overwrite(storage: Storage, path: str, record: dict[str, Any], tmp_dir: str) -> None:
    storage.write_atomic(path, encode(normalise(record)), tmp_dir)
