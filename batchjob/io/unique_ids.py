"""Refuse an input whose id column repeats a value, before the model loads, in memory bounded for any size.

Ids are read in pieces (only the id column). Up to `partition_rows` ids are checked in memory at once; more are
hash-partitioned into temporary Arrow files first (equal ids always share a partition), and each partition
is checked alone, by sorting. Memory then holds one piece plus one sorted partition, whatever the input size.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchjob.io.inputs import InputError, InputSource, check_row_id_range

PARTITION_ROWS = 2_000_000
_HASH_ROWS = 1 << 18  # strings are hashed as Python objects: a slice at a time bounds them
_SHOWN = 5


def check_unique_ids(source: InputSource, partition_rows: int = PARTITION_ROWS) -> None:
    """Raise InputError naming the id column and a few repeated values (or its nulls); a no-op without an
    id column or when ids cannot be read up front (streaming readers find duplicates as they go)."""
    id_column = source.spec.id_column
    chunks = source.id_chunks() if id_column is not None else None
    if chunks is None:
        return
    total = source.job_rows()
    nulls, repeated = find_duplicates(_in_row_id_range(chunks, id_column), total or 0, partition_rows)
    if nulls:
        raise InputError(
            f"data.id_column={id_column!r} has {nulls} null values: every row needs an id; fill them, or "
            "set data.id_column=null to number rows by position"
        )
    if repeated:
        shown = ", ".join(repr(v) for v in repeated)
        raise InputError(
            f"data.id_column={id_column!r} repeats values ({shown}{', ...' if len(repeated) == _SHOWN else ''}): "
            "ids must be unique, or resume could not tell the rows apart; deduplicate the input, or set "
            "data.id_column=null to number rows by position"
        )


def _in_row_id_range(
    chunks: Iterable[pa.Array | pa.ChunkedArray], id_column: str
) -> Iterator[pa.Array | pa.ChunkedArray]:
    for chunk in chunks:
        check_row_id_range(chunk, id_column)
        yield chunk


def find_duplicates(
    chunks: Iterable[pa.Array | pa.ChunkedArray], total_rows: int, partition_rows: int
) -> tuple[int, list[Any]]:
    """(null count, up to a few values occurring more than once) over all `chunks`."""
    chunks = (c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in chunks)
    partitions = max(1, -(-total_rows // partition_rows))
    nulls = 0
    if partitions == 1:
        values = []
        for chunk in chunks:
            nulls += chunk.null_count
            values.append(chunk.drop_null())
        return nulls, _repeated(pa.chunked_array(values), _SHOWN) if values else []
    with tempfile.TemporaryDirectory(prefix="batchjob-ids-") as tmp:
        paths = [Path(tmp) / f"{p}.arrow" for p in range(partitions)]
        writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
        try:
            for chunk in chunks:
                nulls += chunk.null_count
                values = chunk.drop_null()
                if not len(values):
                    continue
                where = _partition_of(values, partitions)
                order = np.argsort(where, kind="stable")
                bounds = np.searchsorted(where[order], np.arange(partitions + 1))
                for p in np.flatnonzero(np.diff(bounds)):
                    piece = values.take(pa.array(order[bounds[p] : bounds[p + 1]]))
                    if p not in writers:
                        schema = pa.schema([("id", values.type)])
                        writers[p] = pa.ipc.new_stream(str(paths[p]), schema)
                    writers[p].write_batch(pa.record_batch([piece], names=["id"]))
        finally:
            for writer in writers.values():
                writer.close()
        found: list[Any] = []
        for p in sorted(writers):
            with pa.memory_map(str(paths[p])) as source:
                column = pa.ipc.open_stream(source).read_all().column("id")
            found += _repeated(column, _SHOWN - len(found))
            if len(found) >= _SHOWN:
                break
        return nulls, found


def _partition_of(values: pa.Array, partitions: int) -> np.ndarray:
    # pandas' vectorised SipHash with its fixed key: the same value lands in the same partition in every piece.
    # Imported here: only inputs too large for one partition need it, and it costs start-up time.
    import pandas as pd

    hashed = np.concatenate(
        [
            pd.util.hash_array(values.slice(start, _HASH_ROWS).to_numpy(zero_copy_only=False), categorize=False)
            for start in range(0, len(values), _HASH_ROWS)
        ]
    )
    return (hashed % np.uint64(partitions)).astype(np.int64)


def _repeated(values: pa.ChunkedArray, limit: int) -> list[Any]:
    """The smallest few values occurring more than once. Sorting, not a hash table: about a third of the
    memory of `value_counts` on millions of ids."""
    if limit <= 0 or len(values) < 2:
        return []
    if pa.types.is_integer(values.type):
        ordered = np.sort(values.to_numpy())
        return np.unique(ordered[1:][ordered[1:] == ordered[:-1]])[:limit].tolist()
    ordered = values.take(pc.sort_indices(values)).combine_chunks()
    later = ordered.slice(1)
    repeats = later.filter(pc.equal(later, ordered.slice(0, len(ordered) - 1)))
    return pc.unique(repeats).slice(0, limit).to_pylist()
