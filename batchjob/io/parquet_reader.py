"""Parquet input: files, directories or globs on any filesystem, read one row group run at a time.

Opening reads only footers: row counts per row group give N and the shard's row range, so a shard reads
just the row groups overlapping its range (slicing the two edge groups) and only the requested columns.
Memory stays bounded by one row group's requested columns, whatever the input size.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchjob.io.content_digest import parquet_footer_sha256, relative_names
from batchjob.io.inputs import PATH_HELP, InputError, InputSource, InputSpec, list_input_files
from batchjob.io.parquet_columns import common_schema, hive_partitions
from batchjob.io.sharding import all_skipped, shard_range
from batchjob.io.storage import Storage

_DELTA_LOG = "_delta_log"
_HUDI_META = ".hoodie"
_ICEBERG_READER = "pyiceberg's load_table(...).scan().to_arrow()"
# Read column chunks through a buffer instead of whole: bounds memory for inputs with huge row groups.
_READ_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class RowGroup:
    file: str
    index: int  # within its file
    start: int  # first row's index in the whole input
    rows: int


def open_parquet(spec: InputSpec) -> ParquetSource:
    storage, path = Storage.for_uri(spec.path)
    directory = storage.isdir(path)
    if directory:
        _refuse_table_formats(storage, path, spec.path)
    files = list_input_files(storage, path, spec.path, ".parquet", "Parquet files", PATH_HELP)
    return ParquetSource(spec, storage, files, hive_root=path.rstrip("/") if directory else None)


def _refuse_table_formats(storage: Storage, path: str, shown: str) -> None:
    """Refuse a lakehouse table (or its data folder): deleted and replaced rows stay in its Parquet files until a
    vacuum or compaction, only its log or metadata says which files are current, and reading them all would bring
    back old rows or repeat updated ones."""
    folders = storage.list_dirs(path)
    found = None
    if _DELTA_LOG in folders:
        found = ("a Delta Lake table", _DELTA_LOG, "deltalake's DeltaTable(path).to_pyarrow_table()")
    elif _HUDI_META in folders:
        found = ("an Apache Hudi table", _HUDI_META, "Spark's spark.read.format('hudi')")
    elif _is_iceberg(storage, path):
        found = ("an Apache Iceberg table", "metadata/*.metadata.json", _ICEBERG_READER)
    elif posixpath.basename(path.rstrip("/")) == "data" and _is_iceberg(storage, posixpath.dirname(path.rstrip("/"))):
        found = ("the data folder of an Apache Iceberg table", "metadata/*.metadata.json", _ICEBERG_READER)
    if found:
        what, marker, reader = found
        raise InputError(
            f"{shown} is {what} ({marker} beside its Parquet files), whose files may also hold rows its later "
            f"versions deleted or replaced: write its current version to Parquet (e.g. from {reader}) and point "
            "data.path there"
        )


def _is_iceberg(storage: Storage, table: str) -> bool:
    metadata = storage.join(table, "metadata")
    return storage.isdir(metadata) and any(name.endswith(".metadata.json") for name in storage.list_files(metadata))


def open_parquet_files(spec: InputSpec, uris: list[str], revision: str | None) -> ParquetSource:
    """Parquet files named one by one, in this order (a dataset's resolved data files); `revision`: the
    dataset commit they were resolved at, kept in the fingerprint."""
    storage, _ = Storage.for_uri(uris[0])
    return ParquetSource(spec, storage, [Storage.for_uri(uri)[1] for uri in uris], revision)


def _ids_as_read(schema: pa.Schema, id_column: str) -> pa.Schema:
    """`schema` with the id column typed as it is read: pandas' category and polars' Categorical ids as the strings
    (or integers) they encode; integer decimals (Snowflake's NUMBER(38,0), Spark's DECIMAL(p, 0), DuckDB's HUGEINT)
    as int64, a value beyond it refused as it is read."""
    index = schema.get_field_index(id_column)
    field = schema.field(index)
    if pa.types.is_dictionary(field.type):
        return schema.set(index, field.with_type(field.type.value_type))
    if pa.types.is_decimal(field.type) and field.type.scale == 0:
        return schema.set(index, field.with_type(pa.int64()))
    return schema


def _footer(filesystem: pafs.FileSystem, file: str, name: str) -> tuple[pq.FileMetaData, dict[str, Any]]:
    """The file's Parquet metadata and its identity for the fingerprint (name below the input's root, size,
    footer hash)."""
    try:
        with filesystem.open_input_file(file) as f:
            metadata = pq.ParquetFile(f).metadata
            identity = {"name": name, "size": f.size(), "footer_sha256": parquet_footer_sha256(f)}
    except (pa.ArrowException, OSError) as err:  # not Parquet, truncated, unreadable footer or file
        raise InputError(
            f"{file} is not a readable Parquet file ({err}): replace it with a good copy, or move it out of data.path"
        ) from err
    if metadata.num_row_groups and metadata.row_group(0).num_columns and metadata.row_group(0).column(0).file_path:
        # Dask's and Spark's _metadata: every data file's footer gathered in one, its rows in those files.
        raise InputError(
            f"{file} is a summary of other Parquet files' row groups (a _metadata file), not data: point data.path "
            "at the directory holding it, or at the data files"
        )
    return metadata, identity


class ParquetSource(InputSource):
    def __init__(
        self,
        spec: InputSpec,
        storage: Storage,
        files: list[str],
        revision: str | None = None,
        hive_root: str | None = None,
    ) -> None:
        """`hive_root`: the directory below which `key=value` directory names are columns (None: none are)."""
        self.storage = storage
        self.files = files
        self.revision = revision
        self._pafs = storage.pyarrow_fs()
        self.row_groups: list[RowGroup] = []
        self._identities = []
        schemas = []
        for file, name in zip(files, relative_names(files), strict=True):
            metadata, identity = _footer(self._pafs, file, name)
            self._identities.append(identity)
            schemas.append(metadata.schema.to_arrow_schema())
            for index in range(metadata.num_row_groups):
                start = self.row_groups[-1].start + self.row_groups[-1].rows if self.row_groups else 0
                self.row_groups.append(RowGroup(file, index, start, metadata.row_group(index).num_rows))
        schema = common_schema(files, schemas)
        if spec.id_column in schema.names:
            schema = _ids_as_read(schema, spec.id_column)
        # Files whose batches need a cast to `schema` (the rest are read as they are).
        self._cast = {file for file, own in zip(files, schemas, strict=True) if not own.equals(schema)}
        self._file_columns = list(schema.names)
        self.partitions = hive_partitions(hive_root, files, schema.names) if hive_root is not None else None
        if self.partitions is not None:
            schema = pa.schema([*schema, *self.partitions.fields])
        super().__init__(spec, list(schema.names))
        self.schema = schema
        self.total_rows = sum(g.rows for g in self.row_groups)
        id_type = schema.field(spec.id_column).type if spec.id_column in schema.names else None
        self._check_id_column(id_type, str(id_type))
        self.limited_rows = self.total_rows if spec.limit is None else min(spec.limit, self.total_rows)
        self.start, self.stop = shard_range(self.limited_rows, spec.shard_index, spec.shard_count)

    def fingerprint(self) -> dict[str, Any]:
        """Content only (names below the input's root, sizes, footers): a fresh copy of the input resumes."""
        identity = {"format": "parquet", "rows": self.total_rows, "files": self._identities}
        return identity if self.revision is None else {**identity, "revision": self.revision}

    def num_rows(self) -> int:
        return self.stop - self.start

    def id_chunks(self) -> Iterator[pa.ChunkedArray]:
        # One row group at a time: pyarrow's iter_batches keeps buffers of the groups it has read (measured:
        # +260 MiB over 50M int64 ids), read_row_group frees each.
        for file, groups in self._runs(None, 0, self.limited_rows):
            with self._pafs.open_input_file(file) as f:
                reader = pq.ParquetFile(f, buffer_size=_READ_BUFFER_BYTES)
                for group in groups:
                    id_column = [self.spec.id_column]
                    table = reader.read_row_group(group.index, columns=self._in_file(id_column), use_threads=False)
                    ids = self._as_input(table, file, id_column).column(self.spec.id_column)
                    yield ids.slice(0, self.limited_rows - group.start)

    def column_types(self, columns: list[str]) -> pa.Schema:
        return pa.schema([self.schema.field(c) for c in columns])

    def job_rows(self) -> int:
        return self.limited_rows

    def iter_batches(self, columns: list[str], skip_row_ids: np.ndarray | None = None) -> Iterator[pa.RecordBatch]:
        read_columns = self._columns_to_read(columns)
        for file, groups in self._runs(skip_row_ids):
            with self._pafs.open_input_file(file) as f:
                reader = pq.ParquetFile(f, buffer_size=_READ_BUFFER_BYTES)
                position = groups[0].start
                batches = reader.iter_batches(
                    batch_size=self.spec.batch_rows,
                    row_groups=[g.index for g in groups],
                    columns=self._in_file(read_columns),
                    use_threads=False,
                )
                for batch in (self._as_input(b, file, read_columns) for b in batches):
                    first, last = max(position, self.start), min(position + batch.num_rows, self.stop)
                    if first < last:
                        sliced = batch.slice(first - position, last - first)
                        made = self._make_batch(sliced, np.arange(first, last), columns, skip_row_ids)
                        if made is not None:
                            yield made
                    position += batch.num_rows

    def _in_file(self, columns: list[str]) -> list[str]:
        """Those of `columns` stored in the files (not in directory names)."""
        return [c for c in columns if c in self._file_columns]

    def _as_input(self, data: pa.Table | pa.RecordBatch, file: str, columns: list[str]) -> pa.Table | pa.RecordBatch:
        """`data` as read from `file`, typed as the whole input and with its partition columns among `columns`."""
        if file in self._cast:
            for index, field in enumerate(data.schema):
                target = self.schema.field(field.name).type
                if field.type != target:
                    try:
                        data = data.set_column(index, field.name, data.column(index).cast(target))
                    except pa.ArrowInvalid as err:
                        raise self._cast_error(field, target, file, err) from None
        return data if self.partitions is None else self.partitions.add_to(data, file, columns)

    def _cast_error(self, field: pa.Field, target: pa.DataType, file: str, err: Exception) -> InputError:
        if field.name == self.spec.id_column:  # an integer-valued decimal id beyond int64
            return InputError(
                f"data.id_column={field.name!r} ({field.type} in {file}) holds a value that row_id (int64) cannot "
                f"hold ({err}): store the ids as strings (a string id column is carried to the output), or set "
                "data.id_column=null to number rows by position"
            )
        return InputError(
            f"column {field.name!r} ({field.type} in {file}) cannot be read as the other files' {target} ({err}): "
            "write it with one type in every file, or point data.path at one kind of file"
        )

    def _runs(
        self, skip_row_ids: np.ndarray | None, start: int | None = None, stop: int | None = None
    ) -> Iterator[tuple[str, list[RowGroup]]]:
        """Runs of consecutive row groups of one file that overlap rows [start, stop) (default: the shard's)
        and are not fully skipped."""
        start = self.start if start is None else start
        stop = self.stop if stop is None else stop
        run: list[RowGroup] = []
        for group in self.row_groups:
            first, last = max(group.start, start), min(group.start + group.rows, stop)
            # When row ids are positions, a finished row group is skipped unread.
            finished = self.ids_are_positions and all_skipped(skip_row_ids, first, last)
            wanted = first < last and not finished
            if run and (not wanted or group.file != run[-1].file or group.index != run[-1].index + 1):
                yield run[0].file, run
                run = []
            if wanted:
                run.append(group)
        if run:
            yield run[0].file, run
