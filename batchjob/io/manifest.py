"""A shard's manifest: one small immutable JSON object per committed part, like a table format's log.

`manifests/sNNNNN/<part name>.json` records the part's row count, row id range, size and sha256. It is
created (exclusively, durably) right after the part became visible, so a commit costs O(1) requests on any
storage, never a rewrite of a growing file; recovery lists the folder and reads the objects concurrently.
`rewrite.json` in the same folder records an ordered rewrite (old parts out, new parts in) until it is done.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchjob.io.layout import REWRITE_NAME
from batchjob.io.storage import Storage

log = logging.getLogger(__name__)
_SUFFIX = ".json"


class DamagedPart(ValueError):
    """A part's bytes are not what was committed (or not a readable part at all)."""


@dataclass(frozen=True)
class PartEntry:
    name: str
    rows: int
    row_id_min: int | None  # None for a zero-row part (a shard without rows)
    row_id_max: int | None
    size: int
    sha256: str

    @classmethod
    def of_table(cls, name: str, table: pa.Table, data: bytes) -> PartEntry:
        """The entry of a part holding `table`, serialised as `data`."""
        row_ids = table.column("row_id")
        return cls(
            name=name,
            rows=table.num_rows,
            row_id_min=pc.min(row_ids).as_py(),  # None for a zero-row part
            row_id_max=pc.max(row_ids).as_py(),
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )

    @classmethod
    def of_bytes(cls, name: str, data: bytes) -> PartEntry:
        """The entry of a part known only by its bytes; `DamagedPart` unless they decode as a part."""
        try:
            table = pq.read_table(pa.BufferReader(data))
        except (pa.ArrowException, OSError) as err:
            raise DamagedPart(f"{name} does not read as Parquet ({err})") from err
        column = table.column("row_id") if "row_id" in table.column_names else None
        if column is None or column.type != pa.int64() or column.null_count:
            raise DamagedPart(f"{name} has no non-null int64 row_id column")
        return cls.of_table(name, table, data)

    def check(self, data: bytes) -> None:
        """`DamagedPart` unless `data` is exactly the committed part (size and sha256)."""
        if len(data) != self.size:
            raise DamagedPart(f"{self.name} is {len(data)} bytes, {self.size} were committed")
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise DamagedPart(f"{self.name} has {self.size} bytes as committed, but not the committed ones (sha256)")


def entry_path(storage: Storage, manifest_dir: str, part_name: str) -> str:
    return storage.join(manifest_dir, part_name + _SUFFIX)


def write_entry(storage: Storage, manifest_dir: str, entry: PartEntry, tmp_dir: str, sync: bool = True) -> None:
    data = json.dumps(asdict(entry), sort_keys=True).encode()
    if not storage.create_exclusive(entry_path(storage, manifest_dir, entry.name), data, tmp_dir, sync=sync):
        raise RuntimeError(f"{entry.name} is recorded twice in {manifest_dir}: two writers on one shard?")


def recorded_names(storage: Storage, manifest_dir: str) -> set[str]:
    """Names of the parts that have a manifest object, from one listing (nothing read)."""
    return {n[: -len(_SUFFIX)] for n in storage.list_files(manifest_dir) if n.endswith(_SUFFIX) and n != REWRITE_NAME}


def read_entries(storage: Storage, manifest_dir: str) -> tuple[dict[str, PartEntry], list[str]]:
    """(part name -> entry, names of parts whose manifest object is unreadable) of every object listed."""
    names = sorted(part + _SUFFIX for part in recorded_names(storage, manifest_dir))
    entries: dict[str, PartEntry] = {}
    unreadable: list[str] = []
    paths = [storage.join(manifest_dir, n) for n in names]
    for name, (_, raw) in zip(names, storage.read_many(paths), strict=True):
        part = name[: -len(_SUFFIX)]
        try:
            entry = PartEntry(**json.loads(raw))
            if entry.name != part:
                raise ValueError(f"it names {entry.name}")
        except (ValueError, TypeError) as err:
            log.warning("manifest object %s is unreadable (%s): its part is checked as if unrecorded", name, err)
            unreadable.append(part)
            continue
        entries[part] = entry
    return entries, unreadable


def remove_entry(storage: Storage, manifest_dir: str, part_name: str) -> None:
    storage.remove(entry_path(storage, manifest_dir, part_name))


@dataclass(frozen=True)
class Rewrite:
    remove: tuple[str, ...]
    add: tuple[PartEntry, ...]


def write_rewrite(storage: Storage, manifest_dir: str, rewrite: Rewrite, tmp_dir: str) -> None:
    """The commit point of an ordered rewrite: from here on the next open rolls it forward."""
    record = {"remove": list(rewrite.remove), "add": [asdict(e) for e in rewrite.add]}
    path = storage.join(manifest_dir, REWRITE_NAME)
    if not storage.create_exclusive(path, json.dumps(record).encode(), tmp_dir):
        raise RuntimeError(f"{path} exists: an earlier ordered rewrite was not rolled forward")


def read_rewrite(storage: Storage, manifest_dir: str) -> Rewrite | None:
    path = storage.join(manifest_dir, REWRITE_NAME)
    try:
        record = json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        return None
    return Rewrite(tuple(record["remove"]), tuple(PartEntry(**raw) for raw in record["add"]))


def clear_rewrite(storage: Storage, manifest_dir: str) -> None:
    storage.remove(storage.join(manifest_dir, REWRITE_NAME))
