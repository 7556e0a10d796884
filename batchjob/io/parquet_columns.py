"""The columns of a Parquet input of many files, as every Parquet reader (pyarrow, pandas, polars, duckdb) sees them.

- One schema for all files: files written at different times or by different tools may store a column as int32
  in one and int64 in another, as string and large_string, or dictionary-encoded in some; every batch is cast to
  the widened type, so each output part has the same schema whatever file its rows came from. Files that differ
  in their column names, or in types no cast reconciles (int and string), are refused before any model work.
- Hive partitions: `partition_cols` in pandas and pyarrow, `partition_by` in polars and duckdb move a column's
  values into directory names (`lang=en/part-0.parquet`); below a directory input, those become columns again.
"""

from __future__ import annotations

import posixpath
import re
from collections import Counter
from dataclasses import dataclass
from urllib.parse import unquote

import pyarrow as pa

from batchjob.io.inputs import InputError

# Spark, Hive and pyarrow write a null partition value as this name.
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
_INTEGER = re.compile(r"-?[0-9]+")


def common_schema(files: list[str], schemas: list[pa.Schema]) -> pa.Schema:
    """The schema every file's batches are cast to: the first file's column order, each column's type widened
    to hold every file's values; `InputError` naming the files when no such schema exists."""
    for file, schema in zip(files, schemas, strict=True):
        repeated = [name for name, count in Counter(schema.names).items() if count > 1]
        if repeated:
            raise InputError(
                f"{file} has more than one column named {', '.join(map(repr, repeated))}, which no reader can tell "
                "apart: rename them (e.g. pyarrow's Table.rename_columns) and write the file again"
            )
    first = schemas[0]
    for file, schema in zip(files[1:], schemas[1:], strict=True):
        missing = [name for name in first.names if name not in schema.names]
        extra = [name for name in schema.names if name not in first.names]
        if missing or extra:
            difference = "; ".join(
                f"{label} {', '.join(map(repr, names))}"
                for label, names in (("lacks", missing), ("adds", extra))
                if names
            )
            raise InputError(
                f"{file} {difference} beside the columns of {files[0]}: all Parquet files of one input must have "
                "the same columns; write them with one schema, or point data.path at one kind of file"
            )
    if all(schema.equals(first) for schema in schemas[1:]):
        return first
    decoded = [pa.schema([pa.field(f.name, _plain(f.type), f.nullable) for f in s]) for s in schemas]
    try:
        unified = pa.unify_schemas(decoded, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        raise _type_clash(files, decoded) from None
    return pa.schema([unified.field(name) for name in first.names])


def _plain(type_: pa.DataType) -> pa.DataType:
    """A dictionary-encoded or view type as its plain type, which every file's values can be cast to."""
    if pa.types.is_dictionary(type_):
        return _plain(type_.value_type)
    # By name: the view types have no pyarrow objects before pyarrow 16.
    plain = {"string_view": pa.large_string(), "binary_view": pa.large_binary()}
    return plain.get(str(type_), type_)


def _type_clash(files: list[str], schemas: list[pa.Schema]) -> InputError:
    for name in schemas[0].names:
        for file, schema in zip(files[1:], schemas[1:], strict=True):
            ours, theirs = schemas[0].field(name), schema.field(name)
            try:
                pa.unify_schemas([pa.schema([ours]), pa.schema([theirs])], promote_options="permissive")
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                return InputError(
                    f"column {name!r} is {ours.type} in {files[0]} but {theirs.type} in {file}: write it with one "
                    "type in every file (e.g. cast it before writing), or point data.path at one kind of file"
                )
    return InputError(f"the Parquet files of {posixpath.dirname(files[0])} have types no one schema holds")


@dataclass(frozen=True)
class HivePartitions:
    """Columns held in directory names below the input's root: their fields, and each file's values."""

    fields: list[pa.Field]
    values: dict[str, dict[str, str | int | None]]  # file -> column -> value

    def add_to(self, data: pa.Table | pa.RecordBatch, file: str, columns: list[str]) -> pa.Table | pa.RecordBatch:
        """`data`, read from `file`, with the partition columns among `columns` appended."""
        for field in self.fields:
            if field.name in columns:
                value = pa.scalar(self.values[file][field.name], field.type)
                data = data.append_column(field, pa.repeat(value, data.num_rows))
        return data


def hive_partitions(root: str, files: list[str], file_columns: list[str]) -> HivePartitions:
    """The `key=value` directories between `root` and each file, as pyarrow reads them: a value is URL-decoded,
    an integer when every file's value for that key is one, else a string; a key the files hold as a column
    themselves stays theirs."""
    values: dict[str, dict[str, str | None]] = {}
    keys: list[str] = []
    for file in files:
        directories = posixpath.dirname(posixpath.relpath(file, root)).split("/")
        found = dict(part.split("=", 1) for part in directories if "=" in part)
        values[file] = {key: None if value == _HIVE_NULL else unquote(value) for key, value in found.items()}
        keys.extend(key for key in found if key not in keys and key not in file_columns)
    fields = []
    typed: dict[str, dict[str, str | int | None]] = {file: {} for file in files}
    for key in keys:
        column = [values[file].get(key) for file in files]
        integers = all(value is None or _is_integer(value) for value in column)
        fields.append(pa.field(key, pa.int64() if integers else pa.string()))
        for file, value in zip(files, column, strict=True):
            typed[file][key] = int(value) if integers and value is not None else value
    return HivePartitions(fields, typed)


def _is_integer(text: str) -> bool:
    return _INTEGER.fullmatch(text) is not None and -(2**63) <= int(text) < 2**63
