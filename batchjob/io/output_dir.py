"""Whether a job may write its parts into output.dir: the folder is absent, empty or holds only batchjob's parts
(of any shard, any job: the job record decides whose), and is neither a job's bookkeeping folder nor inside
another job's output.dir. Every reader of the output reads the whole folder, so anything else there would show
up as extra or duplicate rows. One listing, and a name or two for each folder above.
"""

from __future__ import annotations

from batchjob.io import manifest
from batchjob.io.access import is_access_error
from batchjob.io.layout import (
    BOOKKEEPING_SUFFIX,
    JOB_RECORD_NAME,
    MANIFESTS_DIR_NAME,
    OLD_LAYOUT_RE,
    PART_RE,
    SHARD_DIR_RE,
    OutputDirError,
    bookkeeping_folder_message,
    enclosing_folders,
    foreign_content_message,
    foreign_names,
    nested_output_message,
    old_layout_message,
)
from batchjob.io.storage import Storage


def check_output_dir(storage: Storage, path: str, shown: str) -> None:
    """`OutputDirError` unless output.dir (`path` on `storage`, `shown` as the user wrote it) may take a job's
    parts."""
    _refuse_other_jobs_folders(storage, path, shown)
    names = storage.list_names(path)
    if any(OLD_LAYOUT_RE.match(name) for name in names):
        raise OutputDirError(old_layout_message(shown))
    foreign = foreign_names(names)
    if foreign:
        holds_parts = any(PART_RE.match(name) for name in names)
        raise OutputDirError(foreign_content_message(shown, foreign, holds_parts))


def _refuse_other_jobs_folders(storage: Storage, path: str, shown: str) -> None:
    """`OutputDirError` where output.dir is or lies inside a job's bookkeeping folder (a job record in it), or
    lies inside another job's output.dir (a job record beside it), whose readers would read this job's files."""
    scheme = shown.partition("://")[0] + "://" if "://" in shown else ""
    for folder in (path, *enclosing_folders(path)):
        inside = folder != path
        if folder.endswith(BOOKKEEPING_SUFFIX) and _holds_job_record(storage, folder):
            raise OutputDirError(bookkeeping_folder_message(shown, scheme + folder, inside))
        if inside and _holds_job_record(storage, folder + BOOKKEEPING_SUFFIX):
            raise OutputDirError(nested_output_message(shown, scheme + folder, _lost_its_parts(storage, folder)))


def _holds_job_record(storage: Storage, folder: str) -> bool:
    """Whether `folder` holds a job record. One this process may not read holds none that matters here: a bucket's
    policy may grant this job nothing but output.dir's prefix and the folder beside it."""
    try:
        return storage.exists(storage.join(folder, JOB_RECORD_NAME))
    except Exception as err:
        if not is_access_error(err):
            raise
        return False


def _lost_its_parts(storage: Storage, folder: str) -> bool:
    """Whether the job whose output is `folder` committed parts that are all gone from it (its output deleted by
    hand, its bookkeeping folder left behind). False where either may not be listed."""
    manifests = storage.join(folder + BOOKKEEPING_SUFFIX, MANIFESTS_DIR_NAME)
    try:
        if any(PART_RE.match(name) for name in storage.list_names(folder)):
            return False
        shards = [name for name in storage.list_dirs(manifests) if SHARD_DIR_RE.match(name)]
        return any(manifest.recorded_names(storage, storage.join(manifests, shard)) for shard in shards)
    except Exception as err:
        if not is_access_error(err):
            raise
        return False
