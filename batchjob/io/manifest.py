"""A shard's manifest: the append-only log that decides which part files are committed.

Each line is one JSON record, appended and fsynced as the commit point:

    {"op": "add", "part": {...PartEntry}}                        a new part is committed
    {"op": "replace", "remove": [names], "add": [{...}, ...]}    parts swapped in one step (ordered rewrite)

A part file is committed if and only if replaying the log leaves it in the set. A crash can only tear the
last line (it is written in one append), so a torn tail is dropped: that commit did not happen.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from batchjob.io.storage import Storage


class ManifestCorrupt(RuntimeError):
    """A manifest line other than the last is unreadable: not a crash artefact, so never repaired silently."""


@dataclass(frozen=True)
class PartEntry:
    name: str
    rows: int
    row_id_min: int | None  # None for a zero-row part (a shard without rows)
    row_id_max: int | None
    size: int
    sha256: str


@dataclass(frozen=True)
class ManifestState:
    parts: dict[str, PartEntry]  # committed parts in commit order
    valid_bytes: int  # length of the readable prefix; anything after it is a torn tail
    total_bytes: int

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts.values())


def _entry(raw: dict) -> PartEntry:
    return PartEntry(**raw)


def read_manifest(storage: Storage, path: str) -> ManifestState:
    """Replay the manifest at `path` (absent = nothing committed)."""
    data = storage.read_bytes(path) if storage.exists(path) else b""
    parts: dict[str, PartEntry] = {}
    offset = 0
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # `tail` is empty, or an append torn by a crash
    for number, line in enumerate(complete, start=1):
        try:
            _apply(parts, json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            if number == len(complete) and not tail:
                break  # a garbled final line is treated like a torn one: its commit never finished
            raise ManifestCorrupt(
                f"{path} line {number} is unreadable ({exc}); the shard's outputs cannot be trusted: "
                "rerun with resume=false to start this shard over"
            ) from exc
        offset += len(line) + 1
    return ManifestState(parts=parts, valid_bytes=offset, total_bytes=len(data))


def _apply(parts: dict[str, PartEntry], record: dict) -> None:
    if record["op"] == "add":
        entry = _entry(record["part"])
        if entry.name in parts:
            raise ValueError(f"part {entry.name} committed twice")
        parts[entry.name] = entry
    elif record["op"] == "replace":
        # Validate the whole record before touching `parts`: a garbled last line must change nothing.
        added = [_entry(raw) for raw in record["add"]]
        missing = [name for name in record["remove"] if name not in parts]
        if missing:
            raise ValueError(f"replace removes uncommitted parts {missing}")
        for name in record["remove"]:
            del parts[name]
        for entry in added:
            parts[entry.name] = entry
    else:
        raise ValueError(f"unknown op {record['op']!r}")


def repair_torn_tail(storage: Storage, path: str, state: ManifestState) -> bool:
    """Cut a torn last line so the next append starts on a clean line; True if something was cut."""
    if state.valid_bytes == state.total_bytes:
        return False
    storage.truncate(path, state.valid_bytes)
    return True


def append_add(storage: Storage, path: str, entry: PartEntry) -> None:
    storage.append_line(path, json.dumps({"op": "add", "part": asdict(entry)}))


def append_replace(storage: Storage, path: str, remove: list[str], add: list[PartEntry]) -> None:
    record = {"op": "replace", "remove": remove, "add": [asdict(e) for e in add]}
    storage.append_line(path, json.dumps(record))
