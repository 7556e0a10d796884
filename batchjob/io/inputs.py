"""Input datasets as a stream of Arrow record batches with stable row ids, one shard at a time.

Readers (`parquet_reader`, `hf_reader`) subclass `InputSource`; `readers.open_input(spec)` picks one and
validates the spec before any data is read, so a bad `data.*` setting fails before the model loads.

Row ids (`row_id`, int64): an integer `id_column`'s value when given, else the row's index in the input's
deterministic order (sorted file paths, then file order). A string `id_column` (UUIDs, URLs, `custom_id`s)
keeps `row_id` the row's index and rides along in every batch under its own name, so it reaches the output.
Either way ids must be unique: readers that can read the id column up front offer it (`id_chunks`) for
`unique_ids.check_unique_ids`; a streaming reader finds duplicates as it goes (`INPUT_ERROR_COLUMN`).
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchjob.io.sharding import keep_mask

if TYPE_CHECKING:
    from batchjob.io.storage import Storage

FORMATS = ("auto", "parquet", "openai_batch", "hf_disk", "hf_hub")
# A batch column a reader may add: why a row cannot be generated (e.g. a duplicate id found while
# streaming), or null. The feeder turns it into an error row.
INPUT_ERROR_COLUMN = "__batchjob_input_error"
PATH_HELP = (
    "data.path must be a Parquet file, directory or glob, an OpenAI batch .jsonl file, a JSON Lines, JSON, CSV or "
    "text file (.jsonl, .json, .csv, .tsv, .txt, also compressed), a directory written by datasets' save_to_disk, or a "
    "dataset name for datasets.load_dataset"
)


class InputError(ValueError):
    """The input settings do not match the data: the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class InputSpec:
    path: str
    format: str = "auto"  # auto | parquet | openai_batch | hf_disk | hf_hub
    split: str = "train"
    streaming: bool = False  # for load_dataset
    id_column: str | None = None
    limit: int | None = None  # first N rows of the whole input, before sharding
    shard_index: int = 0
    shard_count: int = 1
    batch_rows: int = 1024
    name: str | None = None  # load_dataset's configuration name
    data_files: str | list[str] | None = None  # load_dataset's data_files, e.g. path="parquet"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InputError(f"data.format={self.format!r} is unknown: use one of {', '.join(FORMATS)}")
        if self.shard_count < 1 or not 0 <= self.shard_index < self.shard_count:
            raise InputError(
                f"shard.index={self.shard_index} is not in [0, shard.count={self.shard_count}): "
                "set shard.index to 0..shard.count-1"
            )
        if self.limit is not None and self.limit < 0:
            raise InputError(f"data.limit={self.limit} is negative: use a row count >= 0, or null for all rows")
        if self.batch_rows < 1:
            raise InputError(f"data.batch_rows={self.batch_rows} must be >= 1")


class InputSource(ABC):
    """One shard of an input dataset."""

    def __init__(self, spec: InputSpec, columns: list[str]) -> None:
        self.spec = spec
        self.columns = columns
        self.string_ids = False  # set by _check_id_column

    @property
    def ids_are_positions(self) -> bool:
        """Whether `row_id` is the row's index in the input (no id column, or a string one)."""
        return self.spec.id_column is None or self.string_ids

    def id_chunks(self) -> Iterator[pa.Array | pa.ChunkedArray] | None:
        """The id column of every row of the job (all shards, after `limit`) in bounded pieces, for the
        uniqueness check before the run; None when it cannot be read up front (streaming)."""
        return None

    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """JSON-able identity of the whole input (not the shard), to refuse resuming on changed data."""

    @abstractmethod
    def num_rows(self) -> int | None:
        """Rows in this shard after `limit`; None when unknown (streaming)."""

    @abstractmethod
    def job_rows(self) -> int | None:
        """Rows of the whole job, every shard together: the input's after `limit`; None when unknown."""

    def column_types(self, columns: list[str]) -> pa.Schema | None:
        """Arrow types of `columns` from the input's metadata, or None when only rows would tell: a shard
        without rows still writes a part with its output columns."""
        return None

    @abstractmethod
    def iter_batches(self, columns: list[str], skip_row_ids: np.ndarray | None = None) -> Iterator[pa.RecordBatch]:
        """Batches of `row_id` (int64) plus `columns`, in deterministic order, minus rows in `skip_row_ids`.

        `skip_row_ids` must be sorted and unique (e.g. `OutputDataset.committed_row_ids()`).
        """

    def _check_id_column(self, id_type: pa.DataType | None, type_name: str) -> None:
        """`id_type`: the id column's Arrow type (None: not a plain column type)."""
        id_column = self.spec.id_column
        if id_column is None:
            return
        if id_column not in self.columns:
            raise InputError(
                f"data.id_column={id_column!r} is not a column of {self.spec.path}; "
                f"columns are: {', '.join(self.columns)}. Set data.id_column to one of them, or null to "
                "number rows by position"
            )
        self.string_ids = id_type is not None and (pa.types.is_string(id_type) or pa.types.is_large_string(id_type))
        if id_type is not None and pa.types.is_floating(id_type):
            raise InputError(
                f"data.id_column={id_column!r} has type {id_type}, but ids must be integers or strings (pandas and "
                "CSV readers make integers with a missing value floats): fill the missing ids and write the column "
                "as integers, or set data.id_column=null to number rows by position"
            )
        if not (self.string_ids or (id_type is not None and pa.types.is_integer(id_type))):
            raise InputError(
                f"data.id_column={id_column!r} has type {type_name}, but ids must be integers or strings: "
                "choose such a column, or null to number rows by position"
            )

    def _columns_to_read(self, columns: list[str]) -> list[str]:
        missing = [c for c in columns if c not in self.columns]
        if missing:
            raise InputError(
                f"column(s) {', '.join(missing)} not found in {self.spec.path}; columns are: {', '.join(self.columns)}"
            )
        if "row_id" in columns and self.spec.id_column != "row_id":
            raise InputError(
                f"{self.spec.path} has its own row_id column, which would clash with batchjob's row_id: "
                "set data.id_column=row_id to use it as the row id, or do not pass it through"
            )
        wanted = [c for c in columns if c != "row_id"]
        id_column = self.spec.id_column
        return wanted + [id_column] if id_column and id_column not in wanted else wanted

    def _batch_columns(self, columns: list[str]) -> list[str]:
        """The columns a batch carries after `row_id`: the requested ones, plus a string id column."""
        wanted = [c for c in columns if c != "row_id"]
        id_column = self.spec.id_column
        return wanted + [id_column] if self.string_ids and id_column not in wanted else wanted

    def _make_batch(
        self, data: pa.Table | pa.RecordBatch, positions: np.ndarray, columns: list[str], skip: np.ndarray | None
    ) -> pa.RecordBatch | None:
        """`row_id` + `columns` (+ a string id column) of `data`, whose rows sit at `positions` in the input;
        None if all skipped. `data` may carry an `INPUT_ERROR_COLUMN`, which is kept."""
        if self.spec.id_column is not None:
            id_values = data.column(self.spec.id_column)
            if INPUT_ERROR_COLUMN in data.schema.names:
                # A streaming duplicate's id is nulled on purpose: it gets an error row, not a second id.
                id_values = id_values.filter(pc.is_null(data.column(INPUT_ERROR_COLUMN)))
            if id_values.null_count:
                raise InputError(
                    f"data.id_column={self.spec.id_column!r} has null values near input row "
                    f"{int(positions[0])}: every row needs an id; fill them or set data.id_column=null"
                )
        if self.ids_are_positions:
            row_ids = positions.astype(np.int64, copy=False)
        else:
            id_values = data.column(self.spec.id_column)
            check_row_id_range(id_values, self.spec.id_column)
            row_ids = np.asarray(id_values.to_numpy(), dtype=np.int64)
        keep = keep_mask(row_ids, skip)
        names = ["row_id", *self._batch_columns(columns)]
        if INPUT_ERROR_COLUMN in data.schema.names:
            names.append(INPUT_ERROR_COLUMN)
        arrays = [pa.array(row_ids, type=pa.int64())] + [data.column(c) for c in names[1:]]
        batch = pa.RecordBatch.from_arrays([_chunked_to_array(a) for a in arrays], names=names)
        if keep is not None:
            batch = batch.filter(pa.array(keep))
        return batch if batch.num_rows else None


def check_row_id_range(ids: pa.Array | pa.ChunkedArray, id_column: str) -> None:
    """Raise `InputError` if integer ids exceed what `row_id` (int64) holds: uint64 ids, such as 64-bit hashes,
    above 2**63-1 would wrap around to negative row ids."""
    if not pa.types.is_uint64(ids.type) or len(ids) == ids.null_count:
        return
    largest = pc.max(ids).as_py()
    if largest > np.iinfo(np.int64).max:
        raise InputError(
            f"data.id_column={id_column!r} holds {largest}, larger than row_id (int64) can hold (2**63-1): store "
            "the ids as strings (a string id column is carried to the output), or set data.id_column=null"
        )


def _chunked_to_array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks()
    return values


def list_input_files(storage: Storage, path: str, shown: str, suffix: str, kind: str, help_text: str) -> list[str]:
    """Sorted `suffix` files of a file, a directory (recursive, skipping `_`/`.` names like pyarrow) or a glob (the
    same); `InputError` naming `shown` and `help_text` when there is none. `kind` names them ("Parquet files")."""
    if storage.isdir(path):
        base = path.rstrip("/")
        found = [p for p in storage.fs.find(path) if p.endswith(suffix)]
        found = [p for p in found if not _is_hidden(posixpath.relpath(p, base))]
    elif any(ch in path for ch in "*?["):
        # fsspec's `*` also matches dot files (Hadoop's .crc) and `_` files (_SUCCESS, Dask's _metadata, whose
        # row groups are the data files' again): they are skipped as in a directory, unless the pattern names them.
        base = path[: min(path.index(ch) for ch in "*?[" if ch in path)].rpartition("/")[0]
        named_hidden = _is_hidden(posixpath.relpath(path, base))
        found = [
            p
            for p in storage.fs.glob(path)
            if storage.fs.isfile(p) and (named_hidden or not _is_hidden(posixpath.relpath(p, base)))
        ]
    elif storage.exists(path):
        found = [path]
    else:
        raise InputError(f"no such file or directory: {shown}; {help_text}")
    if not found:
        raise InputError(f"no {kind} matched {shown}; {help_text}")
    return sorted(found)


def _is_hidden(relative: str) -> bool:
    return any(part.startswith(("_", ".")) for part in relative.split("/"))
