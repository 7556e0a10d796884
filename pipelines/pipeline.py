"""The prompt pipeline of a job: how its rows become requests (`Builder`) and its completions rows (`Layout`).

Rows of Parquet or Hugging Face inputs go through `PromptBuilder` (kinds raw, template, chat) and sample
with the job's settings; lines of an OpenAI batch file go through `OpenAIBatchBuilder`, each with its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import pyarrow as pa
from batchjob.pipelines.prompts import (
    OPENAI_BATCH,
    EncodedRows,
    PromptBuilder,
    PromptSpec,
)

from batchjob.engine.api import Completion, SamplingParams
from batchjob.errors import ConfigError


class Layout(Protocol):
    """Output rows of one job, all with one schema."""

    def schema(self, passthrough: pa.Schema) -> pa.Schema: ...

    def completed(self, row_id: int, completion: Completion, passthrough: dict[str, Any]) -> dict[str, Any]: ...

    def failed(self, row_id: int, error: str, prompt_tokens: int, passthrough: dict[str, Any]) -> dict[str, Any]: ...

    def table(self, rows: list[dict[str, Any]], passthrough: pa.Schema) -> pa.Table: ...


class Builder(Protocol):
    @property
    def columns(self) -> tuple[str, ...]:
        """The input columns `encode` reads."""

    def check(self, columns: list[str]) -> None:
        """Raise ConfigError if the input cannot feed this pipeline (a missing column, no chat template)."""

    def encode(self, batch: pa.RecordBatch) -> EncodedRows:
        """Token ids or an error, and sampling settings, for every row of `batch` (`row_id` + input columns)."""

    def layout(self, token_ids: bool) -> Layout:
        """The output rows; `token_ids`: with the first sample's token ids (output.token_ids)."""


def for_openai_batch(spec: PromptSpec) -> PromptSpec:
    """The prompt settings of a job over an OpenAI batch file, whose lines bring their own prompts."""
    if spec.kind != "raw" or spec.template or spec.messages_column or spec.system_prompt:
        raise ConfigError(
            "an OpenAI batch input builds each prompt from its line's body: leave pipeline.kind=auto and unset "
            "pipeline.template, pipeline.system_prompt and data.messages_column"
        )
    return dataclasses.replace(spec, kind=OPENAI_BATCH)


def make_builder(
    spec: PromptSpec, tokenizer: Any, sampling: SamplingParams, schema_column: str | None = None
) -> Builder:
    """`schema_column`: data.json_schema_column, a column of per-row JSON schemas (refused for an OpenAI batch
    input by `prompts.check_columns`, which a job runs first)."""
    if spec.kind == OPENAI_BATCH:
        from batchjob.pipelines.openai_batch import OpenAIBatchBuilder

        return OpenAIBatchBuilder(tokenizer, sampling, spec.add_special_tokens)
    return PromptBuilder(spec, tokenizer, sampling, schema_column)
