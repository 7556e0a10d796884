"""Hugging Face `datasets` input: `save_to_disk` directories and `load_dataset` names.

A map-style `Dataset` is memory-mapped Arrow: a shard slices its contiguous row range in `batch_rows`
pieces as Arrow tables, never building Python objects per row.

Streaming (`data.streaming=true`): the dataset's data files are resolved first (on the hub, at one commit,
whose sha goes into the fingerprint: a resume against another commit is refused). When they are all Parquet
(what the hub serves for most datasets), they are read as a Parquet input pinned to that commit: each shard
reads only its own row groups, with the same row numbers as a non-streaming run. Other files go through an
`IterableDataset`, whose length is unknown, so shard i of k keeps the rows whose index is i modulo k.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import datasets
import numpy as np
import pyarrow as pa

from batchjob.io.content_digest import relative_names, sampled_sha256
from batchjob.io.file_errors import BUILDER_KINDS, unreadable_file
from batchjob.io.file_kinds import builder_options
from batchjob.io.inputs import INPUT_ERROR_COLUMN, PATH_HELP, InputError, InputSource, InputSpec
from batchjob.io.parquet_reader import open_parquet_files
from batchjob.io.sharding import all_skipped, shard_range
from batchjob.io.storage import Storage

# A batch job's log gets no per-file progress bars or advisory messages from `datasets`.
datasets.utils.logging.disable_progress_bar()
datasets.utils.logging.set_verbosity_error()
_ID_BATCH_ROWS = 1 << 20
log = logging.getLogger(__name__)


def open_hf_dataset(spec: InputSpec, fmt: str) -> InputSource:
    if fmt == "hf_disk":
        return ArrowDatasetSource(spec, _pick_split(_load_from_disk(spec), spec))
    if spec.streaming:
        files, revision = _resolve_data_files(spec)
        if files and all(f.endswith(".parquet") for f in files):
            return open_parquet_files(spec, files, revision)
        return StreamingDatasetSource(spec, _load_dataset(spec), files, revision)
    loaded = _load_dataset(spec)
    if isinstance(loaded, datasets.IterableDataset):
        return StreamingDatasetSource(spec, loaded)
    return ArrowDatasetSource(spec, loaded)


def _load_from_disk(spec: InputSpec) -> datasets.Dataset | datasets.DatasetDict:
    try:
        return datasets.load_from_disk(spec.path)
    except FileNotFoundError as exc:
        raise InputError(f"{spec.path} is not a save_to_disk dataset directory ({exc}); {PATH_HELP}") from exc


def _pick_split(loaded: datasets.Dataset | datasets.DatasetDict, spec: InputSpec) -> datasets.Dataset:
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if spec.split not in loaded:
        raise InputError(
            f"{spec.path} has no split {spec.split!r}; its splits are: {', '.join(loaded)}. Set data.split"
        )
    return loaded[spec.split]


@contextmanager
def _builder_errors_unlogged() -> Iterator[None]:
    """A builder logs the error it then raises: the user gets it once, in the `InputError` made of it."""
    builder_logger = datasets.utils.logging.get_logger()
    level = builder_logger.level
    builder_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        builder_logger.setLevel(level)


def _load_dataset(spec: InputSpec) -> datasets.Dataset | datasets.IterableDataset:
    try:
        with _builder_errors_unlogged():
            options = builder_options(spec.data_files) if isinstance(spec.data_files, str) else {}
            return datasets.load_dataset(
                spec.path, name=spec.name, data_files=spec.data_files, split=spec.split, streaming=spec.streaming,
                **options,
            )  # fmt: skip
    except Exception as exc:  # datasets raises many types here; the user needs one clear message
        raise _load_error(spec, exc) from exc


def _load_error(spec: InputSpec, exc: Exception) -> InputError:
    if spec.path in BUILDER_KINDS and isinstance(spec.data_files, str):
        return unreadable_file(spec.path, spec.data_files, exc)
    return InputError(f"datasets.load_dataset({spec.path!r}, split={spec.split!r}) failed: {exc}; {PATH_HELP}")


def _read_as_loaded(spec: InputSpec, items: Iterator[Any]) -> Iterator[Any]:
    """`items` of a streaming dataset, whose files are read (and can fail) only now, failing as loading does."""
    while True:
        try:
            with _builder_errors_unlogged():
                item = next(items)
        except StopIteration:
            return
        except Exception as exc:  # as in _load_dataset
            raise _load_error(spec, exc) from exc
        yield item


def _resolve_data_files(spec: InputSpec) -> tuple[list[str], str | None]:
    """The split's data files (local paths or URLs, in the dataset's order) and the hub commit they were
    resolved at (None off the hub); no files when the dataset is built by code rather than from files."""
    try:
        builder = datasets.load_dataset_builder(spec.path, name=spec.name, data_files=spec.data_files)
    except Exception as exc:  # datasets raises many types here; the user needs one clear message
        raise InputError(f"datasets.load_dataset_builder({spec.path!r}) failed: {exc}; {PATH_HELP}") from exc
    data_files = builder.config.data_files
    if not data_files or spec.split not in data_files:
        return [], None
    files = data_files[spec.split]
    # Hub files carry (repo id, commit sha); local and object-store files an mtime or ETag, not used here.
    commits = {meta[1] for meta in getattr(files, "origin_metadata", []) if len(meta) == 2}
    if len(commits) > 1:
        raise InputError(f"{spec.path} resolved its data files at several commits ({sorted(commits)}); rerun")
    return list(files), next(iter(commits), None)


def _file_identities(uris: list[str]) -> list[dict[str, Any]]:
    """Names, sizes and sampled content hashes: no mtimes, so a copied input keeps its identity."""
    identities = []
    for uri, name in zip(uris, relative_names(uris), strict=True):
        storage, path = Storage.for_uri(uri)
        with storage.pyarrow_fs().open_input_file(path) as f:
            identities.append({"name": name, "size": f.size(), "sampled_sha256": sampled_sha256(f)})
    return identities


def _arrow_type(feature: Any) -> pa.DataType | None:
    return feature.pa_type if isinstance(feature, datasets.Value) else None


class ArrowDatasetSource(InputSource):
    def __init__(self, spec: InputSpec, dataset: datasets.Dataset) -> None:
        super().__init__(spec, list(dataset.column_names))
        self.dataset = dataset
        feature = dataset.features.get(spec.id_column) if spec.id_column else None
        self._check_id_column(_arrow_type(feature), str(feature))
        self.limited_rows = len(dataset) if spec.limit is None else min(spec.limit, len(dataset))
        self.start, self.stop = shard_range(self.limited_rows, spec.shard_index, spec.shard_count)

    def fingerprint(self) -> dict[str, Any]:
        # Not datasets' own `_fingerprint`: for local data files it hashes their mtimes.
        files = _file_identities([cache["filename"] for cache in self.dataset.cache_files])
        return {"format": "hf_dataset", "rows": len(self.dataset), "files": files}

    def num_rows(self) -> int:
        return self.stop - self.start

    def column_types(self, columns: list[str]) -> pa.Schema:
        schema = self.dataset.features.arrow_schema
        return pa.schema([schema.field(c) for c in columns])

    def job_rows(self) -> int:
        return self.limited_rows

    def id_chunks(self) -> Iterator[pa.ChunkedArray]:
        ids = self.dataset.select_columns([self.spec.id_column]).with_format("arrow")
        for first in range(0, self.limited_rows, _ID_BATCH_ROWS):
            yield ids[first : min(first + _ID_BATCH_ROWS, self.limited_rows)].column(0)

    def iter_batches(self, columns: list[str], skip_row_ids: np.ndarray | None = None) -> Iterator[pa.RecordBatch]:
        arrow = self.dataset.select_columns(self._columns_to_read(columns)).with_format("arrow")
        for first in range(self.start, self.stop, self.spec.batch_rows):
            last = min(first + self.spec.batch_rows, self.stop)
            if self.ids_are_positions and all_skipped(skip_row_ids, first, last):
                continue
            made = self._make_batch(arrow[first:last], np.arange(first, last), columns, skip_row_ids)
            if made is not None:
                yield made


class StreamingDatasetSource(InputSource):
    def __init__(
        self, spec: InputSpec, dataset: datasets.IterableDataset, files: list[str], revision: str | None
    ) -> None:
        if dataset.features is not None:
            schema = dataset.features.arrow_schema
        else:  # features unknown until the first row is read
            first = next(_read_as_loaded(spec, iter(dataset.with_format("arrow").iter(batch_size=1))), None)
            schema = pa.schema([]) if first is None else first.schema
        super().__init__(spec, list(schema.names))
        self.dataset = dataset
        self.files = files
        self.revision = revision
        id_type = schema.field(spec.id_column).type if spec.id_column in schema.names else None
        self._check_id_column(id_type, str(id_type))

    def fingerprint(self) -> dict[str, Any]:
        spec = self.spec
        identity: dict[str, Any] = {"format": "hf_streaming", "path": spec.path, "name": spec.name, "split": spec.split}
        if self.revision is not None:  # a hub commit is immutable: its files need no reading
            return {**identity, "revision": self.revision, "files": relative_names(self.files) if self.files else []}
        return {**identity, "files": _file_identities(self.files) if self.files else []}

    def num_rows(self) -> None:
        return None

    def column_types(self, columns: list[str]) -> pa.Schema | None:
        if self.dataset.features is None:
            return None
        schema = self.dataset.features.arrow_schema
        return pa.schema([schema.field(c) for c in columns])

    def job_rows(self) -> None:
        return None

    def iter_batches(self, columns: list[str], skip_row_ids: np.ndarray | None = None) -> Iterator[pa.RecordBatch]:
        stream = self.dataset if self.spec.limit is None else self.dataset.take(self.spec.limit)
        read_columns = self._columns_to_read(columns)
        if read_columns:  # with no columns selected, batches would lose their row count
            stream = stream.select_columns(read_columns)
        stream = stream.with_format("arrow")
        position = 0
        # Every shard reads the whole stream, so each sees every id: the later occurrence of an id is the
        # duplicate, in every shard and on every rerun alike.
        seen: set = set()
        for table in _read_as_loaded(self.spec, iter(stream.iter(batch_size=self.spec.batch_rows))):
            positions = np.arange(position, position + table.num_rows)
            position += table.num_rows
            mine = positions % self.spec.shard_count == self.spec.shard_index
            if self.spec.id_column is not None:
                table = self._flag_duplicates(table, positions, mine, seen)
            if mine.any():
                made = self._make_batch(table.filter(pa.array(mine)), positions[mine], columns, skip_row_ids)
                if made is not None:
                    yield made

    def _flag_duplicates(self, table: pa.Table, positions: np.ndarray, mine: np.ndarray, seen: set) -> pa.Table:
        """Mark rows whose id appeared earlier in the stream: a string id's row becomes an error row (its id
        nulled, so the output never holds the id twice); an integer id is the row_id of the earlier row, so
        the later one is dropped (`mine` cleared) and logged."""
        id_column = self.spec.id_column
        ids = table.column(id_column).to_pylist()
        repeated = []
        for index, value in enumerate(ids):
            if value in seen:
                repeated.append(index)
            elif value is not None:
                seen.add(value)
        if not repeated:
            return table
        if not self.string_ids:
            for index in repeated:
                if mine[index]:
                    log.warning(
                        "input row %d dropped: its data.id_column=%r value %r belongs to an earlier row",
                        positions[index],
                        id_column,
                        ids[index],
                    )
            mine[repeated] = False
            return table
        errors: list[str | None] = [None] * len(ids)
        for index in repeated:
            errors[index] = f"duplicate id: data.id_column={id_column!r} value {ids[index]!r} belongs to an earlier row"
            ids[index] = None
        column = table.schema.get_field_index(id_column)
        table = table.set_column(column, id_column, pa.array(ids, table.schema.field(id_column).type))
        return table.append_column(INPUT_ERROR_COLUMN, pa.array(errors, pa.string()))
