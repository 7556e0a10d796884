"""Completion → output row, and rows → an Arrow table with one fixed schema for every part file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchjob.engine.api import FINISH_ERROR, Completion

BASE_FIELDS = (
    pa.field("row_id", pa.int64(), nullable=False),
    pa.field("generation", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("error", pa.string()),
)
GENERATIONS = pa.field("generations", pa.list_(pa.string()))
TOKEN_IDS = pa.field("token_ids", pa.list_(pa.int32()))
LOGPROBS = pa.field("logprobs", pa.list_(pa.float32()))
RESERVED_COLUMNS = frozenset(f.name for f in (*BASE_FIELDS, GENERATIONS, TOKEN_IDS, LOGPROBS))


@dataclass(frozen=True)
class RowLayout:
    """Which optional columns the output has: `generations` for n > 1, `token_ids`, `logprobs`."""

    n: int = 1
    token_ids: bool = False
    logprobs: bool = False

    def schema(self, passthrough: pa.Schema) -> pa.Schema:
        fields = list(BASE_FIELDS)
        if self.n > 1:
            fields.append(GENERATIONS)
        if self.token_ids:
            fields.append(TOKEN_IDS)
        if self.logprobs:
            fields.append(LOGPROBS)
        return pa.schema(fields + list(passthrough))

    def completed(self, row_id: int, completion: Completion, passthrough: dict[str, Any]) -> dict[str, Any]:
        if completion.error is not None:
            return self.failed(row_id, completion.error, completion.prompt_tokens, passthrough)
        row = {
            "row_id": row_id,
            "generation": completion.text,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "error": None,
        }
        if self.n > 1:
            row["generations"] = [s.text for s in completion.samples]
        if self.token_ids:
            row["token_ids"] = list(completion.token_ids)
        if self.logprobs:
            row["logprobs"] = list(completion.samples[0].logprobs or ())
        return {**row, **passthrough}

    def failed(self, row_id: int, error: str, prompt_tokens: int, passthrough: dict[str, Any]) -> dict[str, Any]:
        row = {
            "row_id": row_id,
            "generation": None,
            "finish_reason": FINISH_ERROR,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "error": error,
        }
        return {**row, **passthrough}

    def table(self, rows: list[dict[str, Any]], passthrough: pa.Schema) -> pa.Table:
        return pa.Table.from_pylist(rows, schema=self.schema(passthrough))
