"""Row → prompt text → token ids, for the three prompt kinds.

- `raw`: a text column used as is;
- `template`: a Python format string over row fields (`"Q: {question}\\nA:"`);
- `chat`: a messages column (list of {role, content}, or its JSON text), or the prompt column plus an
  optional system prompt, rendered with the tokenizer's chat template.

A row that cannot become a prompt (null, empty, wrong type, not UTF-8) gets an error message instead of
token ids; the job decides what to do with it (`on_error`).

With `data.json_schema_column`, a row's own JSON schema constrains its output in place of the job's
`sampling.*` constraint (a null or blank schema: the job's settings alone); a schema that is not a JSON object makes
the row an error row. The column holds JSON text, or structs (dicts written as they are: their null fields,
which Parquet adds for the fields of other rows, are dropped).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
from batchjob.pipelines.rows import RowLayout
from batchjob.pipelines.sampling import json_schema_override, row_sampling, without_struct_nulls

from batchjob.engine.api import SamplingParams
from batchjob.errors import ConfigError

PROMPT_KINDS = ("raw", "template", "chat")
# Not chosen by pipeline.kind: an OpenAI batch input file (data.format=openai_batch) brings its own prompts.
OPENAI_BATCH = "openai_batch"


@dataclass(frozen=True)
class PromptSpec:
    kind: str
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    template: str | None = None
    system_prompt: str | None = None
    add_special_tokens: bool = True

    @property
    def input_columns(self) -> tuple[str, ...]:
        """The input columns prompts are built from."""
        if self.kind == OPENAI_BATCH:
            return OPENAI_BATCH_INPUT
        if self.kind == "template":
            return _template_fields(self.template or "")
        if self.kind == "chat" and self.messages_column:
            return (self.messages_column,)
        return (self.prompt_column,) if self.prompt_column else ()

    @property
    def consumed_columns(self) -> tuple[str, ...]:
        """The input columns not passed through to the output by default: what the prompt is made of."""
        if self.kind == OPENAI_BATCH:
            return OPENAI_BATCH_CONSUMED
        return self.input_columns


def check_columns(spec: PromptSpec, columns: list[str], schema_column: str | None = None) -> None:
    """Raise `ConfigError` if the input lacks a column the prompts are built from. Needs no tokenizer, so a
    job runs it before the tokenizer and the model load."""
    if spec.kind == OPENAI_BATCH:
        if schema_column is not None:
            raise ConfigError(
                "data.json_schema_column does not apply to an OpenAI batch input: give a line its schema in its "
                "body's response_format, and unset data.json_schema_column"
            )
        missing = [c for c in OPENAI_BATCH_INPUT if c not in columns]
        if missing:
            raise ConfigError(f"an OpenAI batch input needs the columns {', '.join(missing)}; it has {columns}")
        return
    if not spec.input_columns:
        raise ConfigError("no prompt source: set data.prompt_column, data.messages_column or pipeline.template")
    missing = [c for c in spec.input_columns if c not in columns]
    if missing:
        near = {c: n for c in missing for n in columns if n.strip().casefold() == c.strip().casefold()}
        hint = "".join(f"; {n!r} differs from {c!r} only in case or spaces" for c, n in near.items())
        raise ConfigError(
            f"input has no column {', '.join(map(repr, missing))}; its columns are {', '.join(columns)}{hint} "
            "(set data.prompt_column / data.messages_column / pipeline.template accordingly)"
        )
    if schema_column is not None and schema_column not in columns:
        raise ConfigError(
            f"data.json_schema_column={schema_column!r} is not in the input; its columns are {', '.join(columns)}"
        )


def check_column_types(spec: PromptSpec, types: pa.Schema | None) -> None:
    """Raise `ConfigError` if the column a prompt is read from holds values that can never be one (numbers,
    lists, structs): every row would fail. `types`: the input's types of `spec.input_columns`, when known."""
    if types is None or spec.kind in (OPENAI_BATCH, "template"):
        return
    if spec.kind == "chat" and spec.messages_column:
        type_ = types.field(spec.messages_column).type
        if not (_holds_text(type_) or _holds_messages(type_)):
            raise ConfigError(
                f"data.messages_column={spec.messages_column!r} holds {type_}, not a list of {{role, content}} or "
                "its JSON text: choose the column of conversations, or data.prompt_column for a column of text"
            )
        return
    type_ = types.field(spec.prompt_column).type
    if _holds_text(type_):
        return
    if _holds_messages(type_):
        fix = f"it looks like chat messages: set data.messages_column={spec.prompt_column}"
    else:
        fix = f"choose a text column, or make the prompt from it with pipeline.template='{{{spec.prompt_column}}}'"
    raise ConfigError(f"data.prompt_column={spec.prompt_column!r} holds {type_}, not text: {fix}")


# By name: the view types have no pyarrow objects before pyarrow 16.
_TEXT_TYPES = frozenset({"string", "large_string", "string_view", "binary", "large_binary", "binary_view"})


def _holds_text(type_: pa.DataType) -> bool:
    if pa.types.is_dictionary(type_):
        return _holds_text(type_.value_type)
    return pa.types.is_null(type_) or str(type_) in _TEXT_TYPES


def _holds_messages(type_: pa.DataType) -> bool:
    return (pa.types.is_list(type_) or pa.types.is_large_list(type_)) and pa.types.is_struct(type_.value_type)


def _template_fields(template: str) -> tuple[str, ...]:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ConfigError(f"pipeline.template is not a valid format string ({err}); use {{column}}") from err
    names = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        name = field.split(".")[0].split("[")[0]
        if not name:
            raise ConfigError("pipeline.template uses a positional {} field: name a column, e.g. {question}")
        if name not in names:
            names.append(name)
    return tuple(names)


# What batchjob.io's OpenAI batch reader gives; `url` is read to build the prompt and also kept in the output.
OPENAI_BATCH_INPUT = ("method", "url", "body")
OPENAI_BATCH_CONSUMED = ("method", "body")


@dataclass(frozen=True)
class EncodedRows:
    """A batch of rows as the engine takes them: `errors[i]` says why row i cannot run (None: it can), and
    `prompt_ids[i]` is None when no prompt could be built (a row with a prompt but bad settings keeps its ids,
    for its token count); `sampling[i]` is row i's settings (seeded for that row)."""

    prompt_ids: list[list[int] | None]
    errors: list[str | None]
    sampling: list[SamplingParams]


class PromptBuilder:
    """Rows of a Parquet or Hugging Face input (kinds raw, template, chat); every row samples with the job's
    settings and its own seed, constrained by its own JSON schema from `schema_column` when that is set."""

    def __init__(
        self, spec: PromptSpec, tokenizer: Any, sampling: SamplingParams, schema_column: str | None = None
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.schema_column = schema_column

    @property
    def columns(self) -> tuple[str, ...]:
        """The input columns `encode` reads."""
        return tuple(dict.fromkeys([*self.spec.input_columns, *([self.schema_column] if self.schema_column else [])]))

    def layout(self, token_ids: bool) -> RowLayout:
        return RowLayout(n=self.sampling.n, token_ids=token_ids, logprobs=self.sampling.logprobs is not None)

    def check(self, columns: list[str]) -> None:
        """Raise `ConfigError` if the input lacks a needed column or the tokenizer cannot render chats."""
        check_columns(self.spec, columns, self.schema_column)
        if self.spec.kind == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                "pipeline.kind=chat but the model's tokenizer has no chat template: use a chat/instruct model "
                "or pipeline.kind=raw / template"
            )

    def encode(self, batch: pa.RecordBatch) -> EncodedRows:
        """Token ids (or None), an error message (or None) and sampling settings for every row of `batch`
        (which holds `row_id` and the input columns)."""
        texts: list[str | None] = []
        errors: list[str | None] = []
        for row in batch.select(list(self.spec.input_columns)).to_pylist():
            try:
                texts.append(self._text(row))
                errors.append(None)
            except BadRow as bad:
                texts.append(None)
                errors.append(str(bad))
        good = [i for i, t in enumerate(texts) if t is not None]
        ids: list[list[int] | None] = [None] * len(texts)
        if good:
            # Chat templates write their own special tokens; adding more would double the BOS.
            special = self.spec.add_special_tokens and self.spec.kind != "chat"
            encoded = self.tokenizer([texts[i] for i in good], add_special_tokens=special)["input_ids"]
            for i, row_ids in zip(good, encoded, strict=True):
                ids[i] = row_ids
        sampling = [row_sampling(self.sampling, row_id) for row_id in batch.column("row_id").to_pylist()]
        if self.schema_column is not None:
            self._apply_schemas(batch.column(self.schema_column).to_pylist(), sampling, errors)
        return EncodedRows(ids, errors, sampling)

    def _apply_schemas(self, schemas: list[Any], sampling: list[SamplingParams], errors: list[str | None]) -> None:
        """Constrain each row that has a schema (and a prompt) by it, in place; a bad schema is the row's error."""
        for i, schema in enumerate(schemas):
            blank = isinstance(schema, (str, bytes)) and not schema.strip()  # an empty cell, as a spreadsheet has
            if schema is None or blank or errors[i] is not None:
                continue
            try:
                # A column of dicts is a struct column: its rows carry other rows' fields as nulls.
                sampling[i] = replace(sampling[i], **json_schema_override(without_struct_nulls(schema)))
            except ValueError as err:
                errors[i] = f"{self.schema_column}: {err}"

    def _text(self, row: dict[str, Any]) -> str:
        spec = self.spec
        if spec.kind == "template":
            values = {}
            for name in spec.input_columns:
                if row[name] is None:
                    raise BadRow(f"template field {name!r} is null")
                values[name] = _as_text(row[name], name) if isinstance(row[name], bytes) else row[name]
            return _non_empty(spec.template.format(**values), "rendered template")
        if spec.kind == "chat":
            if spec.messages_column:
                messages = _messages(row[spec.messages_column], spec.messages_column)
            else:
                prompt = _non_empty(_as_text(row[spec.prompt_column], spec.prompt_column), spec.prompt_column)
                messages = [{"role": "user", "content": prompt}]
                if spec.system_prompt:
                    messages.insert(0, {"role": "system", "content": spec.system_prompt})
            return render_chat(self.tokenizer, messages)
        return _non_empty(_as_text(row[spec.prompt_column], spec.prompt_column), spec.prompt_column)


class BadRow(ValueError):
    """This row cannot become a prompt."""


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text of a conversation, through the model's chat template, ending where the reply begins."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # a template raising on this row's content is this row's problem
        raise BadRow(f"chat template failed on this row: {err}") from err


def _as_text(value: Any, column: str) -> str:
    if value is None:
        raise BadRow(f"{column} is null")
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadRow(f"{column} is not valid UTF-8 text ({err.reason} at byte {err.start})") from err
    if not isinstance(value, str):
        raise BadRow(f"{column} must be text, got {type(value).__name__}")
    return value


def _non_empty(text: str, what: str) -> str:
    if not text.strip():
        raise BadRow(f"{what} is empty")
    return text


def _messages(value: Any, column: str) -> list[dict[str, str]]:
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(_as_text(value, column))
        except json.JSONDecodeError as err:
            raise BadRow(f"{column} is text but not JSON messages ({err.msg})") from err
    if value is None:
        raise BadRow(f"{column} is null")
    if not isinstance(value, list) or not value:
        raise BadRow(f"{column} must be a non-empty list of {{role, content}}, got {type(value).__name__}")
    for message in value:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise BadRow(f"{column} must be a list of {{role: str, content: str}}, got an item {message!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in value]
