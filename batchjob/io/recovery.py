"""Checking a shard's committed parts against their manifest objects, and repairing what a crash left.

A part is committed when it is visible under its final name in output.dir. Its manifest object, written
just after, is what lets the part be checked: on every open each part is read back and compared (size and
sha256). What a crash or a damaged disk can leave, and what recovery does:
- a part without a manifest object (a crash between the two): it was durable before it became visible,
  so it is decoded, recorded and kept;
- a part whose bytes differ from its manifest, or that does not decode: damaged, so it is deleted and its
  rows recomputed (logged);
- a manifest object whose part is gone: its rows are recomputed (logged);
- an ordered rewrite whose record exists: rolled forward (old parts out, new parts in);
- this shard's files in the temp folder: deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from batchjob.io import manifest
from batchjob.io.layout import ShardOutput, part_seq
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


def recover(files: ShardFiles) -> dict[str, PartEntry]:
    """Repair the shard after whatever stopped its last writer; returns the committed parts by name."""
    storage = files.storage
    rewrite = manifest.read_rewrite(storage, files.manifest_dir)
    if rewrite is not None:
        log.warning("%s: finishing an ordered rewrite that was interrupted", files.manifest_dir)
        roll_forward(files, rewrite)
    found = check_parts(files)
    for name in found.unreadable:
        manifest.remove_entry(storage, files.manifest_dir, name)
    for name in found.missing:
        log.warning("committed part %s is missing: its rows are recomputed", files.part_path(name))
        manifest.remove_entry(storage, files.manifest_dir, name)
    parts: dict[str, PartEntry] = {}
    for check in found.parts:
        if check.problem is not None:
            log.warning("damaged part %s: %s; it is deleted and its rows recomputed", check.name, check.problem)
            storage.remove(files.part_path(check.name))
            manifest.remove_entry(storage, files.manifest_dir, check.name)
            continue
        assert check.entry is not None
        if not check.recorded:
            log.warning("part %s was committed just before a crash; recording it", check.name)
            manifest.write_entry(storage, files.manifest_dir, check.entry, files.tmp_dir)
        parts[check.name] = check.entry
    for name in storage.list_files(files.tmp_dir):
        if files.shard.owns_tmp(name):
            storage.remove(storage.join(files.tmp_dir, name))
    if storage.is_local:
        storage.fsync_dir(files.out_dir)
        storage.fsync_dir(files.manifest_dir)
    return dict(sorted(parts.items(), key=lambda item: part_seq(item[0])))


def roll_forward(files: ShardFiles, rewrite: Rewrite) -> None:
    """Finish an ordered rewrite whose record is written: old parts out, new parts (from the temp folder)
    in, each recorded; idempotent, so a crash in the middle is finished by the next open."""
    storage = files.storage
    for name in rewrite.remove:
        storage.remove(files.part_path(name))
        manifest.remove_entry(storage, files.manifest_dir, name)
    storage.fsync_dir(files.out_dir)
    in_tmp = storage.list_files(files.tmp_dir)
    present = files.visible_parts()
    recorded, _ = manifest.read_entries(storage, files.manifest_dir)
    for entry in rewrite.add:
        if entry.name not in present:
            if entry.name not in in_tmp:
                log.warning("new part %s of the ordered rewrite is lost: its rows are recomputed", entry.name)
                continue
            storage.rename(storage.join(files.tmp_dir, entry.name), files.part_path(entry.name))
        if entry.name not in recorded:
            manifest.write_entry(storage, files.manifest_dir, entry, files.tmp_dir)
    manifest.clear_rewrite(storage, files.manifest_dir)
    storage.fsync_dir(files.manifest_dir)
