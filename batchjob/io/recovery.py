"""Checking a shard's committed parts against their manifest objects, and repairing what a crash left.

A part is committed when it is visible under its final name in output.dir. Its manifest object, written
just after, is what lets the part be checked: on every open each part is read back and compared (size and
sha256). What a crash or a damaged disk can leave, and what recovery does:
- a part without a manifest object (a crash between the two): it was durable before it became visible,
  so it is decoded, recorded and kept; unless it holds rows that other parts committed, which no crash leaves
  (a copy of a part, or one a user put back after its rows were recomputed): it is deleted, so no row is read twice;
- a part whose bytes differ from its manifest, or that does not decode: damaged, so it is deleted and its
  rows recomputed (logged);
- a manifest object whose part is gone: its rows are recomputed (logged);
- an ordered rewrite whose record exists: rolled forward (old parts out, new parts in);
- this shard's files in the temp folder, and its staged parts inside output.dir (batchjob/io/layout.py):
  deleted, once a rewrite that names them is rolled forward.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.io import manifest
from batchjob.io.layout import ShardOutput, part_seq, staged_name
from batchjob.io.manifest import DamagedPart, PartEntry, Rewrite
from batchjob.io.storage import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardFiles:
    """Where one shard's files live: parts in `out_dir`, manifest objects in `manifest_dir`."""

    storage: Storage
    shard: ShardOutput
    out_dir: str
    manifest_dir: str
    tmp_dir: str

    def part_path(self, name: str) -> str:
        return self.storage.join(self.out_dir, name)

    def visible_parts(self) -> dict[str, int]:
        return {n: s for n, s in self.storage.list_files(self.out_dir).items() if self.shard.owns_part(n)}

    def staged_path(self, name: str) -> str:
        """Where part `name` is written inside output.dir when the temp folder is another mount."""
        return self.storage.join(self.out_dir, staged_name(name))

    def staged_files(self) -> list[str]:
        """Paths of this shard's parts (and probes) that were being written inside output.dir."""
        names = self.storage.list_files(self.out_dir) if self.storage.is_local else {}
        return [self.storage.join(self.out_dir, n) for n in sorted(names) if self.shard.owns_staged(n)]

    def move_in(self, src: str, name: str) -> None:
        """Move durable part `src` (in the temp folder) to its final name: a rename, or where output.dir is
        another mount, a copy under its staged name renamed into place (`src` goes last, so a crash midway
        leaves it for the next try)."""
        try:
            self.storage.rename(src, self.part_path(name))
        except OSError as err:
            if err.errno != errno.EXDEV:
                raise
            staged = self.staged_path(name)
            self.storage.write_durable(staged, self.storage.read_bytes(src))
            self.storage.rename(staged, self.part_path(name))
            self.storage.remove(src)


@dataclass(frozen=True)
class PartCheck:
    name: str
    entry: PartEntry | None  # what the part holds (None when damaged)
    recorded: bool  # it had a readable manifest object
    problem: str | None  # why it is damaged


@dataclass(frozen=True)
class ShardCheck:
    parts: list[PartCheck]  # every visible part of the shard
    missing: list[str]  # parts whose manifest object exists but which are gone
    unreadable: list[str]  # parts whose manifest object does not decode (checked as if unrecorded)


def check_parts(files: ShardFiles) -> ShardCheck:
    """Every visible part of the shard checked against its manifest object, reading each part once.
    Changes nothing."""
    entries, unreadable = manifest.read_entries(files.storage, files.manifest_dir)
    present = files.visible_parts()
    missing = sorted(set(entries) - set(present))
    return ShardCheck(list(_checks(files, entries, present)), missing, unreadable)


def _checks(files: ShardFiles, entries: dict[str, PartEntry], present: dict[str, int]) -> Iterator[PartCheck]:
    to_read = []
    for name in sorted(present):
        entry = entries.get(name)
        if entry is not None and present[name] != entry.size:
            yield PartCheck(name, None, True, f"{name} is {present[name]} bytes, {entry.size} were committed")
        else:
            to_read.append(name)
    paths = [files.part_path(n) for n in to_read]
    for name, (_, data) in zip(to_read, files.storage.read_many(paths), strict=True):
        entry = entries.get(name)
        try:
            if entry is None:
                yield PartCheck(name, PartEntry.of_bytes(name, data), False, None)
            else:
                entry.check(data)
                yield PartCheck(name, entry, True, None)
        except DamagedPart as err:
            yield PartCheck(name, None, entry is not None, str(err))


def recover(files: ShardFiles, success_marker: str) -> dict[str, PartEntry]:
    """Repair the shard after whatever stopped its last writer (or whatever a user deleted); returns the committed
    parts by name. Where a committed part's rows are to be recomputed, the shard's `success_marker` goes first: a
    crash midway must not leave a shard called complete without those rows."""
    storage = files.storage
    rewrite = manifest.read_rewrite(storage, files.manifest_dir)
    if rewrite is not None:
        log.warning("%s: finishing an ordered rewrite that was interrupted", files.manifest_dir)
        roll_forward(files, rewrite)
    found = check_parts(files)
    if found.missing or any(check.problem is not None for check in found.parts):
        storage.remove(success_marker)
    for name in found.unreadable:
        manifest.remove_entry(storage, files.manifest_dir, name)
    for name in found.missing:
        log.warning("committed part %s is missing: its rows are recomputed", files.part_path(name))
        manifest.remove_entry(storage, files.manifest_dir, name)
    parts: dict[str, PartEntry] = {}
    unrecorded: list[PartEntry] = []
    for check in found.parts:
        if check.problem is not None:
            log.warning("damaged part %s: %s; it is deleted and its rows recomputed", check.name, check.problem)
            storage.remove(files.part_path(check.name))
            manifest.remove_entry(storage, files.manifest_dir, check.name)
            continue
        assert check.entry is not None
        if check.recorded:
            parts[check.name] = check.entry
        else:
            unrecorded.append(check.entry)
    for entry in sorted(unrecorded, key=lambda e: part_seq(e.name)):
        if _holds_committed_rows(files, entry, list(parts.values())):
            log.warning(
                "part %s holds rows that other parts committed (a copy of a part, or one put back after its rows "
                "were recomputed): it is deleted, so that no row is read twice",
                files.part_path(entry.name),
            )
            storage.remove(files.part_path(entry.name))
            continue
        log.warning("part %s was committed just before a crash; recording it", entry.name)
        manifest.write_entry(storage, files.manifest_dir, entry, files.tmp_dir)
        parts[entry.name] = entry
    for name in storage.list_files(files.tmp_dir):
        if files.shard.owns_tmp(name):
            storage.remove(storage.join(files.tmp_dir, name))
    for path in files.staged_files():
        storage.remove(path)
    if storage.is_local:
        storage.fsync_dir(files.out_dir)
        storage.fsync_dir(files.manifest_dir)
    return dict(sorted(parts.items(), key=lambda item: part_seq(item[0])))


def _holds_committed_rows(files: ShardFiles, entry: PartEntry, committed: list[PartEntry]) -> bool:
    """Whether unrecorded part `entry` holds a row id of the `committed` parts. A crash leaves unrecorded only the
    part it was committing, whose rows no other part holds; reads only the parts whose row id ranges overlap."""
    lo, hi = entry.row_id_min, entry.row_id_max
    if lo is None or hi is None:  # a zero-row part
        return False
    near = [p.name for p in committed if p.row_id_min is not None and p.row_id_min <= hi and p.row_id_max >= lo]
    if not near:
        return False
    return bool(np.intersect1d(_row_ids(files, [entry.name]), _row_ids(files, near)).size)


def _row_ids(files: ShardFiles, names: list[str]) -> np.ndarray:
    paths = [files.part_path(n) for n in names]
    columns = [
        pq.read_table(pa.BufferReader(data), columns=["row_id"]).column("row_id").to_numpy()
        for _, data in files.storage.read_many(paths)
    ]
    return np.concatenate(columns)


def roll_forward(files: ShardFiles, rewrite: Rewrite) -> None:
    """Finish an ordered rewrite whose record is written: old parts out, new parts (from the temp folder, or
    staged inside output.dir) in, each recorded; idempotent, so a crash in the middle is finished by the next
    open."""
    storage = files.storage
    for name in rewrite.remove:
        storage.remove(files.part_path(name))
        manifest.remove_entry(storage, files.manifest_dir, name)
    storage.fsync_dir(files.out_dir)
    in_tmp = storage.list_files(files.tmp_dir)
    staged = set(files.staged_files())
    present = files.visible_parts()
    recorded, _ = manifest.read_entries(storage, files.manifest_dir)
    for entry in rewrite.add:
        if entry.name not in present:
            # The temp folder's copy first: a staged one may be a copy that a crash cut short. There it has its
            # staged name, or its own where an earlier batchjob wrote it.
            in_tmp_as = next((n for n in (staged_name(entry.name), entry.name) if n in in_tmp), None)
            if in_tmp_as is not None:
                files.move_in(storage.join(files.tmp_dir, in_tmp_as), entry.name)
            elif files.staged_path(entry.name) in staged:
                storage.rename(files.staged_path(entry.name), files.part_path(entry.name))
            else:
                log.warning("new part %s of the ordered rewrite is lost: its rows are recomputed", entry.name)
                continue
        if entry.name not in recorded:
            manifest.write_entry(storage, files.manifest_dir, entry, files.tmp_dir)
    manifest.clear_rewrite(storage, files.manifest_dir)
    storage.fsync_dir(files.manifest_dir)
