"""Each row's sampling settings: the job's, with the row's own seed.

A row samples with `seed + row_id`, so its samples depend neither on which batch it lands in nor on a
resume; rows that bring their own settings (OpenAI batch lines, a row's JSON schema) start from the job's
and replace some.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from batchjob.engine.api import SamplingParams

_SEED_RANGE = 2**63


def row_sampling(base: SamplingParams, row_id: int) -> SamplingParams:
    """The job's settings for row `row_id`: its seed is `base.seed + row_id` (unchanged when greedy or unseeded)."""
    if base.greedy or base.seed is None:
        return base
    return dataclasses.replace(base, seed=(base.seed + row_id) % _SEED_RANGE)


def overridden(base: SamplingParams, row_id: int, overrides: dict[str, Any]) -> SamplingParams:
    """`base` with a row's own settings. A row's own `seed` is used as is; otherwise the row is seeded like
    every other (`row_sampling`). Raises ValueError for settings SamplingParams refuses."""
    params = dataclasses.replace(base, **overrides)
    if "seed" in overrides:
        return params
    return row_sampling(params, row_id)


def json_schema_override(schema: Any) -> dict[str, Any]:
    """The overrides that constrain a row by its own JSON schema (JSON text, UTF-8 bytes or a parsed JSON value)
    in place of any job-level constraint. `dataclasses.replace` with them raises ValueError for a schema that
    is not a JSON object."""
    if isinstance(schema, bytes):
        schema = schema.decode("utf-8", errors="replace")
    if not isinstance(schema, str):
        schema = json.dumps(schema)
    return {"json_schema": schema, "regex": None, "choice": None, "grammar": None}


def without_struct_nulls(value: Any) -> Any:
    """A schema read from a struct column (the dicts pandas, polars or pyarrow write) as the schema it was
    written from. Parquet gives every row of a struct column every field of every row, null where the row had
    none, and a null where a schema is expected makes it invalid: null fields are dropped, at any depth. (A
    schema that needs a null value, as `"const": null`, must be stored as JSON text, as must schemas written by
    polars, which gives a struct only the fields of the first rows it sees.)"""
    if isinstance(value, dict):
        return {key: without_struct_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_struct_nulls(item) for item in value]
    return value
