"""Names of everything a job writes: part files in `output.dir`, bookkeeping in the folder beside it.

`output.dir` holds committed Parquet parts and nothing else, so every Parquet reader given the plain
directory reads exactly the committed rows. Readers disagree on what they skip: pyarrow and pandas skip
names starting with `_` or `.`; `datasets` skips only `.`-hidden names; polars reads every non-empty file
in the whole tree, hidden folders included, and refuses mixed extensions; duckdb reads every `*.parquet` in
the tree. A bookkeeping folder inside `output.dir` cannot satisfy polars, so it lives beside it:

    output.dir/                      part-sNNNNN-NNNNNN.parquet (committed parts only)
    output.dir.batchjob/             _job.json, _SUCCESS[-sNNNNN], _report[-sNNNNN].json, _hydra/,
                                     locks/sNNNNN.json, manifests/sNNNNN/<part>.json, tmp/

A part is committed when it appears under its final name in `output.dir` (an atomic rename on local disks,
an atomic PUT on object stores); its manifest object records its size and checksum just after. A local part is
written in `tmp/` first, under its staged name (below: not `*.parquet`, so a glob over a folder of runs,
`runs/**/*.parquet`, reads no part before its commit), unless a rename from there cannot reach `output.dir` (it
is another mount: a mount point, a bind mount, a container volume); it is then written inside `output.dir` as a
file without a name (O_TMPFILE) that the commit links under its final name, or where the filesystem has no such
files (and for an ordered rewrite) under its staged name, `.part-sNNNNN-NNNNNN.parquet.tmp`: hidden and not
`*.parquet`, so pyarrow, pandas, duckdb and datasets skip it, though polars refuses a directory holding one.

Since every reader reads the whole of `output.dir`, a job writes only into an empty or new folder or its own
output: anything in `output.dir` but parts, staged parts and an NFS client's temporary names is refused, and so
is an `output.dir` inside another job's `output.dir` (its reads would take this job's files in) or bookkeeping folder.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass

BOOKKEEPING_SUFFIX = ".batchjob"
JOB_RECORD_NAME = "_job.json"
# The whole-job report and success marker of single-shard runs (the names Spark and Hadoop users expect).
REPORT_NAME = "_report.json"
SUCCESS_NAME = "_SUCCESS"
TMP_DIR_NAME = "tmp"
LOCKS_DIR_NAME = "locks"
MANIFESTS_DIR_NAME = "manifests"
HYDRA_DIR_NAME = "_hydra"
# An ordered rewrite in progress: old parts out, new parts in, rolled forward by the next open.
REWRITE_NAME = "rewrite.json"

PART_RE = re.compile(r"^part-s(\d{5})-(\d{6})\.parquet$")
SHARD_DIR_RE = re.compile(r"^s(\d{5})$")
SHARD_SUCCESS_RE = re.compile(r"^_SUCCESS-s(\d{5})$")
LOCK_RE = re.compile(r"^s(\d{5})\.json$")
# What batchjob versions that kept their bookkeeping inside output.dir left there.
OLD_LAYOUT_RE = re.compile(r"^(_job\.json|_manifest-s\d{5}\.jsonl)$")
# A part being written inside output.dir, or a layout probe (`staged_name`), of any shard.
STAGED_RE = re.compile(r"^\.part-s\d{5}-[\w.-]+\.tmp$")
# What an NFS client renames a file to when it is deleted while open (a part a reader still holds); it goes
# when the reader closes it.
NFS_SILLY_RENAME_RE = re.compile(r"^\.nfs[0-9a-f]+$")
_FOREIGN_SHOWN = 5


class OutputDirError(ValueError):
    """output.dir cannot hold a job's output: written by an older layout, a bucket's root, a mount point."""


def local_dir(output_dir: str) -> str | None:
    """A local `output_dir` (a path or a `file://` URL) as an absolute path without `~`, `.`, `..` or a trailing
    `/`, as the storage layer (fsspec) opens it: the folder beside `run1/.` is `run1.batchjob`, never
    `run1/..batchjob` inside it, and the one beside `~/run1` is in the home folder, not in a `~` folder here.
    None for an object store's URL."""
    scheme, sep, path = output_dir.partition("://")
    if sep and scheme != "file":
        return None
    path = path if sep else output_dir
    return os.path.abspath(os.path.expanduser(path)) if path else ""


def bookkeeping_dir(output_dir: str) -> str:
    """The folder beside `output_dir` that holds its job record, manifests, locks, reports and logs."""
    local = local_dir(output_dir)
    trimmed = output_dir.rstrip("/") if local is None else local.rstrip("/")
    _, scheme_sep, path = trimmed.rpartition("://")
    at_root = "/" not in path.strip("/") if scheme_sep else not trimmed
    if at_root:
        where = "a bucket's root" if scheme_sep else "the filesystem root"
        raise OutputDirError(
            f"output.dir={output_dir!r} is {where}: batchjob keeps its bookkeeping in a folder beside "
            f"output.dir, so set output.dir to a folder inside it (e.g. {trimmed}/run1)"
        )
    return trimmed + BOOKKEEPING_SUFFIX


def staged_name(name: str) -> str:
    """The name under which part `name` (or a probe, `part-sNNNNN-probe-...`) is written inside output.dir."""
    return f".{name}.tmp"


def enclosing_folders(path: str) -> list[str]:
    """The folders holding `path` (a storage path: absolute on a local disk, `bucket/key` on an object store),
    nearest first, down to (not including) the filesystem root or the bucket."""
    folders = []
    parent = posixpath.dirname(path.rstrip("/"))
    while parent.strip("/") and (parent.startswith("/") or "/" in parent):
        folders.append(parent)
        parent = posixpath.dirname(parent)
    return folders


def foreign_names(names: list[str]) -> list[str]:
    """Of the names directly in output.dir (folders ending in `/`), those batchjob did not write."""
    ours = (PART_RE, STAGED_RE, NFS_SILLY_RENAME_RE)
    return sorted(n for n in names if not any(pattern.match(n) for pattern in ours))


def foreign_content_message(output_dir: str, foreign: list[str], holds_parts: bool) -> str:
    """`holds_parts`: the folder is a job's output with something added (a `.DS_Store`, a notebook's checkpoints),
    which the user resumes by deleting what was added, not by starting over elsewhere."""
    shown = ", ".join(foreign[:_FOREIGN_SHOWN]) + (
        f" and {len(foreign) - _FOREIGN_SHOWN} more" if len(foreign) > _FOREIGN_SHOWN else ""
    )
    fix = (
        "delete them (or move them out) to resume this output, or set output.dir to a new folder"
        if holds_parts
        else "set output.dir to an empty or new folder"
    )
    return (
        f"output.dir={output_dir} holds files batchjob did not write ({shown}); every reader of the output reads "
        f"the whole folder, so batchjob writes only into its own output: {fix}"
    )


def nested_output_message(output_dir: str, enclosing: str, lost_its_parts: bool = False) -> str:
    """`lost_its_parts`: the job whose output is `enclosing` committed parts and none is left there (its output
    deleted by hand): what still claims the folder is the bookkeeping folder beside it."""
    if lost_its_parts:
        record = enclosing + BOOKKEEPING_SUFFIX
        return (
            f"output.dir={output_dir} is inside {enclosing}, the output.dir of the job recorded in {record}, whose "
            f"committed parts are no longer in {enclosing}: if that output was deleted, delete {record} as well (it "
            f"holds only that job's record, manifests and locks); else set output.dir to a folder outside {enclosing}"
        )
    return (
        f"output.dir={output_dir} is inside {enclosing}, another job's output.dir; every reader of that folder reads "
        "all of it, so this job's files would show up there as extra or duplicate rows: set output.dir to a folder "
        f"outside {enclosing}"
    )


def bookkeeping_folder_message(output_dir: str, folder: str, inside: bool) -> str:
    job_output = folder[: -len(BOOKKEEPING_SUFFIX)]
    return (
        f"output.dir={output_dir} is {'inside ' if inside else ''}{folder}, where batchjob keeps the record, manifests "
        f"and locks of the output {job_output}: set output.dir={job_output} to resume that job, or a folder outside "
        f"{folder}"
    )


def no_job_message(output_dir: str) -> str:
    """For a tool reading a job's output (status, export) pointed at a folder no job wrote."""
    stripped = output_dir.rstrip("/")
    if stripped.endswith(BOOKKEEPING_SUFFIX):
        return (
            f"{output_dir} is the folder where batchjob keeps a job's record, manifests and locks: set output.dir to "
            f"the job's output itself, {stripped[: -len(BOOKKEEPING_SUFFIX)]}"
        )
    return (
        f"{output_dir} holds no batchjob output (no {JOB_RECORD_NAME} in {bookkeeping_dir(output_dir)}): set "
        "output.dir to the one the job ran with"
    )


def old_layout_message(output_dir: str) -> str:
    return (
        f"{output_dir} was written by an older batchjob that kept its bookkeeping (_job.json, manifests) "
        "inside output.dir; this version keeps it in a folder beside it and cannot resume that layout. "
        "Finish the job with the batchjob version that started it, or write to a new output.dir"
    )


@dataclass(frozen=True)
class ShardOutput:
    """Names of one shard's files: part names inside output.dir, the rest relative to the bookkeeping folder."""

    dir: str
    shard_index: int = 0
    shard_count: int = 1

    def __post_init__(self) -> None:
        if self.shard_count < 1 or not 0 <= self.shard_index < self.shard_count:
            raise ValueError(
                f"shard.index={self.shard_index} is not in [0, shard.count={self.shard_count}): "
                "set shard.index to 0..shard.count-1"
            )

    @property
    def tag(self) -> str:
        return f"s{self.shard_index:05d}"

    @property
    def part_prefix(self) -> str:
        return f"part-{self.tag}-"

    def part_name(self, seq: int) -> str:
        return f"{self.part_prefix}{seq:06d}.parquet"

    def owns_part(self, name: str) -> bool:
        return name.startswith(self.part_prefix) and PART_RE.match(name) is not None

    @property
    def manifest_dir(self) -> str:
        return posixpath.join(MANIFESTS_DIR_NAME, self.tag)

    @property
    def lock_name(self) -> str:
        return posixpath.join(LOCKS_DIR_NAME, f"{self.tag}.json")

    @property
    def success_name(self) -> str:
        return SUCCESS_NAME if self.shard_count == 1 else f"{SUCCESS_NAME}-{self.tag}"

    @property
    def report_name(self) -> str:
        return f"_report-{self.tag}.json"

    def owns_staged(self, name: str) -> bool:
        """Whether a name in output.dir is a part (or probe) this shard was writing there, not committed."""
        return name.startswith(f".{self.part_prefix}") and STAGED_RE.match(name) is not None

    def owns_tmp(self, name: str) -> bool:
        """Whether a file in the temp dir was left by this shard (other shards' temps are theirs to clean)."""
        own = (self.part_prefix, f".{self.part_prefix}", f"{self.tag}.", self.success_name, self.report_name)
        return name.startswith(own + ((REPORT_NAME,) if self.shard_count == 1 else ()))


def part_seq(part_name: str) -> int:
    match = PART_RE.match(part_name)
    if match is None:
        raise RuntimeError(f"{part_name!r} is not a part file name")
    return int(match.group(2))
