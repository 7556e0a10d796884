"""`open_input(spec)`: decide what `data.path` is and open the matching reader."""

from __future__ import annotations

import dataclasses
import os
import re

from batchjob.io.file_kinds import file_builder
from batchjob.io.inputs import PATH_HELP, InputError, InputSource, InputSpec
from batchjob.io.openai_batch_reader import looks_like_openai_batch, open_openai_batch
from batchjob.io.storage import Storage

HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_GLOB = re.compile(r"[*?\[]")
# What a hub dataset id looks like ("name" or "org/name"); anything else that does not exist is a typo.
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_PARQUET_MAGIC = b"PAR1"


def open_input(spec: InputSpec) -> InputSource:
    """Open this shard of the input (reads metadata only); raises InputError on a bad spec."""
    fmt = resolve_format(spec)
    if fmt == "parquet":
        from batchjob.io.parquet_reader import open_parquet

        return open_parquet(spec)
    if fmt == "openai_batch":
        return open_openai_batch(spec)
    # Imported only when needed: `datasets` adds about a second to start-up.
    from batchjob.io.hf_reader import open_hf_dataset

    if fmt == "file":
        return open_hf_dataset(dataclasses.replace(spec, path=file_builder(spec.path), data_files=spec.path), "hf_hub")
    return open_hf_dataset(spec, fmt)


def _is_parquet(storage: Storage, path: str) -> bool:
    with storage.fs.open(path, "rb") as f:
        return f.read(4) == _PARQUET_MAGIC


def resolve_format(spec: InputSpec) -> str:
    """auto: .parquet file/dir/glob -> parquet; a .jsonl file of OpenAI batch requests -> openai_batch;
    save_to_disk dir -> hf_disk; another JSON Lines, JSON, CSV or text file -> file (read by datasets' builder
    of its kind); else a load_dataset name."""
    if spec.format != "auto":
        return spec.format
    if spec.data_files is not None:
        return "hf_hub"
    storage, path = Storage.for_uri(spec.path)
    if _GLOB.search(path) or path.endswith(".parquet"):
        return "parquet"
    if storage.isdir(path):
        names = storage.list_files(path)
        if any(marker in names for marker in HF_DISK_MARKERS):
            return "hf_disk"
        if any(name.endswith(".parquet") for name in names) or storage.fs.glob(f"{path}/**/*.parquet"):
            return "parquet"
        return "hf_hub"
    if storage.exists(path):
        if path.endswith(".jsonl") and looks_like_openai_batch(storage, path):
            return "openai_batch"
        if file_builder(path) is not None:
            return "file"
        if _is_parquet(storage, path):  # named otherwise: .PARQUET, .parq, .pq, no suffix
            return "parquet"
        raise InputError(
            f"{spec.path} is neither Parquet, an OpenAI batch file, a JSON Lines, JSON, CSV, TSV or text file nor a "
            f"dataset directory; {PATH_HELP}"
        )
    if "://" in spec.path or spec.path.startswith(("/", ".", "~")) or not _HUB_ID.match(spec.path):
        raise InputError(f"no such file or directory: {spec.path}; {PATH_HELP}")
    if os.sep in spec.path and os.path.exists(os.path.dirname(spec.path)):
        raise InputError(f"no such file or directory: {spec.path}; {PATH_HELP}")
    return "hf_hub"
