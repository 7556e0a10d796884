"""Hugging Face `datasets` input: `save_to_disk` directories and `load_dataset` names.

A map-style `Dataset` is memory-mapped Arrow: a shard slices its contiguous row range in `batch_rows`
pieces as Arrow tables, never building Python objects per row. A streaming `IterableDataset` has no
known length, so shard i of k keeps the rows whose index is i modulo k (every shard reads the whole
stream) and its fingerprint can only name the dataset, not detect changes to its content.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
import pyarrow as pa

from batchjob.io.inputs import PATH_HELP, InputError, InputSource, InputSpec
from batchjob.io.sharding import all_skipped, shard_range

# A batch job's log gets no per-file progress bars or advisory messages from `datasets`.
datasets.utils.logging.disable_progress_bar()
datasets.utils.logging.set_verbosity_error()


def open_hf_dataset(spec: InputSpec, fmt: str) -> InputSource:
    if fmt == "hf_disk":
        return ArrowDatasetSource(spec, _pick_split(_load_from_disk(spec), spec))
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


def _load_dataset(spec: InputSpec) -> datasets.Dataset | datasets.IterableDataset:
    try:
        return datasets.load_dataset(
            spec.path, name=spec.name, data_files=spec.data_files, split=spec.split, streaming=spec.streaming
        )
    except Exception as exc:  # datasets raises many types here; the user needs one clear message
        raise InputError(
            f"datasets.load_dataset({spec.path!r}, split={spec.split!r}) failed: {exc}; {PATH_HELP}"
        ) from exc


def _is_integer(feature: Any) -> bool:
    return isinstance(feature, datasets.Value) and pa.types.is_integer(feature.pa_type)


class ArrowDatasetSource(InputSource):
    def __init__(self, spec: InputSpec, dataset: datasets.Dataset) -> None:
        super().__init__(spec, list(dataset.column_names))
        self.dataset = dataset
        feature = dataset.features.get(spec.id_column) if spec.id_column else None
        self._check_id_column(_is_integer(feature), str(feature))
        self.limited_rows = len(dataset) if spec.limit is None else min(spec.limit, len(dataset))
        self.start, self.stop = shard_range(self.limited_rows, spec.shard_index, spec.shard_count)

    def fingerprint(self) -> dict[str, Any]:
        files = []
        for cache in self.dataset.cache_files:
            stat = os.stat(cache["filename"])
            files.append({"path": cache["filename"], "size": stat.st_size, "version": str(stat.st_mtime)})
        # `_fingerprint` is datasets' own content identity (hash of its source and transforms).
        return {
            "format": "hf_dataset",
            "fingerprint": self.dataset._fingerprint,
            "rows": len(self.dataset),
            "files": files,
        }

    def num_rows(self) -> int:
        return self.stop - self.start

    def column_types(self, columns: list[str]) -> pa.Schema:
        schema = self.dataset.features.arrow_schema
        return pa.schema([schema.field(c) for c in columns])

    def job_rows(self) -> int:
        return self.limited_rows

    def iter_batches(self, columns: list[str], skip_row_ids: np.ndarray | None = None) -> Iterator[pa.RecordBatch]:
        arrow = self.dataset.select_columns(self._columns_to_read(columns)).with_format("arrow")
        for first in range(self.start, self.stop, self.spec.batch_rows):
            last = min(first + self.spec.batch_rows, self.stop)
            if self.spec.id_column is None and all_skipped(skip_row_ids, first, last):
                continue
            made = self._make_batch(arrow[first:last], np.arange(first, last), columns, skip_row_ids)
            if made is not None:
                yield made


class StreamingDatasetSource(InputSource):
    def __init__(self, spec: InputSpec, dataset: datasets.IterableDataset) -> None:
        names = dataset.column_names
        if names is None:  # features unknown until the first row is read
            names = list(next(iter(dataset.take(1)), {}).keys())
        super().__init__(spec, list(names))
        self.dataset = dataset
        features = dataset.features or {}
        feature = features.get(spec.id_column) if spec.id_column else None
        self._check_id_column(feature is None or _is_integer(feature), str(feature))

    def fingerprint(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "format": "hf_streaming",
            "path": spec.path,
            "name": spec.name,
            "data_files": spec.data_files,
            "split": spec.split,
        }

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
        for table in stream.iter(batch_size=self.spec.batch_rows):
            positions = np.arange(position, position + table.num_rows)
            position += table.num_rows
            mine = positions % self.spec.shard_count == self.spec.shard_index
            if mine.any():
                made = self._make_batch(table.filter(pa.array(mine)), positions[mine], columns, skip_row_ids)
                if made is not None:
                    yield made
