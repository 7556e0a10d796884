"""What each common Parquet reader, given the plain output directory, reads of it (the README's list)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def _pyarrow(out: Path) -> list[int]:
    import pyarrow.dataset as pads

    return pads.dataset(str(out), format="parquet").to_table(columns=["row_id"]).column("row_id").to_pylist()


def _pandas(out: Path) -> list[int]:
    import pandas

    return pandas.read_parquet(out, columns=["row_id"])["row_id"].tolist()


def _polars(out: Path) -> list[int]:
    import polars

    return polars.read_parquet(out, columns=["row_id"])["row_id"].to_list()


def _duckdb(out: Path) -> list[int]:
    import duckdb

    return [row[0] for row in duckdb.sql(f"SELECT row_id FROM read_parquet('{out}')").fetchall()]


READERS: dict[str, Callable[[Path], list[int]]] = {
    "pyarrow.dataset": _pyarrow,
    "pandas": _pandas,
    "polars": _polars,
    "duckdb": _duckdb,
}


def row_ids_by_reader(out: Path) -> dict[str, list[int] | str]:
    """Reader name -> the sorted row ids it reads from `out`, or the error it raises, as text."""
    seen: dict[str, list[int] | str] = {}
    for name, read in READERS.items():
        try:
            seen[name] = sorted(read(out))
        except Exception as err:  # a reader's refusal is the finding, shown by the assertion
            seen[name] = f"{type(err).__name__}: {err}"
    return seen


def every_reader_reads(out: Path, row_ids: list[int]) -> bool:
    return row_ids_by_reader(out) == dict.fromkeys(READERS, sorted(row_ids))
