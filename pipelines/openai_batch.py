"""OpenAI batch lines → prompts and each line's own sampling settings.

A line's `url` says what its `body` is: `/v1/chat/completions` (`messages`, rendered with the model's chat
template) or `/v1/completions` (`prompt`: one string or one list of token ids). The body's settings
replace the job's `sampling.*` for that line only; a line without a `seed` is seeded like every row (job
seed + row), and a JSON `response_format` constrains its output (structured outputs). Settings batchjob
cannot honour (penalties, logit bias, tools, streaming) fail the line with an error naming them, rather
than being silently ignored; informational fields (`model`, `user`, `metadata`, ...) are ignored. Every
problem with a line is that line's error row, never the job's.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from batchjob.pipelines.openai_output import CHAT_URL, COMPLETIONS_URL, OpenAIRowLayout
from batchjob.pipelines.prompts import (
    OPENAI_BATCH,
    OPENAI_BATCH_INPUT,
    BadRow,
    EncodedRows,
    PromptSpec,
    check_columns,
    render_chat,
)
from batchjob.pipelines.sampling import json_schema_override, overridden, row_sampling

from batchjob.engine.api import SamplingParams

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
# Body fields whose other values would change the output in a way batchjob cannot reproduce, with the
# values that change nothing (files written by tools often spell out the defaults).
_NO_EFFECT: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "stream": (None, False),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}
# response_format json_object: any JSON object.
JSON_OBJECT = '{"type":"object"}'
# OpenAI's roles; `developer` is the newer name of `system`, which chat templates know.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class OpenAIBatchBuilder:
    """Rows of an OpenAI batch file (`method`, `url`, `body` from batchjob.io's reader; a line the reader found
    malformed is already an error row, whatever this builder makes of it)."""

    def __init__(self, tokenizer: Any, sampling: SamplingParams, add_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.add_special_tokens = add_special_tokens

    @property
    def columns(self) -> tuple[str, ...]:
        return OPENAI_BATCH_INPUT

    def check(self, columns: list[str]) -> None:
        check_columns(PromptSpec(kind=OPENAI_BATCH), columns)

    def layout(self, token_ids: bool) -> OpenAIRowLayout:
        return OpenAIRowLayout(self.tokenizer, token_ids)

    def encode(self, batch: pa.RecordBatch) -> EncodedRows:
        ids: list[list[int] | None] = [None] * batch.num_rows
        errors: list[str | None] = [None] * batch.num_rows
        sampling: list[SamplingParams] = []
        texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}  # by add_special_tokens
        for i, row in enumerate(batch.select(["row_id", *OPENAI_BATCH_INPUT]).to_pylist()):
            try:
                prompt, special, overrides = self._request(row)
                sampling.append(_sampling(self.sampling, row["row_id"], overrides))
            except BadRow as bad:
                errors[i] = str(bad)
                sampling.append(row_sampling(self.sampling, row["row_id"]))
                continue
            if isinstance(prompt, str):
                texts[special].append((i, prompt))
            else:
                ids[i] = prompt
        for special, items in texts.items():
            if items:
                encoded = self.tokenizer([t for _, t in items], add_special_tokens=special)["input_ids"]
                for (i, _), row_ids in zip(items, encoded, strict=True):
                    ids[i] = row_ids
        return EncodedRows(ids, errors, sampling)

    def _request(self, row: dict[str, Any]) -> tuple[str | list[int], bool, dict[str, Any]]:
        """(prompt text or token ids, whether the tokenizer adds special tokens, sampling overrides)."""
        if row["body"] is None:
            raise BadRow("the line has no request body")
        if row["method"] != "POST":
            raise BadRow(f"method {row['method']!r} is not supported: batch requests are POST")
        body = json.loads(row["body"])
        url = row["url"]
        if url not in ENDPOINTS:
            raise BadRow(f"url {url!r} is not supported: use {' or '.join(ENDPOINTS)}")
        used = [k for k, harmless in _NO_EFFECT.items() if k in body and body[k] not in harmless]
        if used:
            raise BadRow(f"body sets {', '.join(used)}, which batchjob does not support: remove them from the line")
        if url == CHAT_URL:
            return render_chat(self._chat_tokenizer(), _messages(body.get("messages"))), False, chat_sampling(body)
        return _completion_prompt(body.get("prompt")), self.add_special_tokens, completion_sampling(body)

    def _chat_tokenizer(self) -> Any:
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRow(f"the model's tokenizer has no chat template: send this line to {COMPLETIONS_URL}")
        return self.tokenizer


def _sampling(base: SamplingParams, row_id: int, overrides: dict[str, Any]) -> SamplingParams:
    try:
        return overridden(base, row_id, overrides)
    except ValueError as err:
        raise BadRow(f"body settings: {err}") from err


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRow("body.messages must be a non-empty list of {role, content}")
    messages = []
    for message in value:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise BadRow(f"body.messages: each message needs a role ({', '.join(_ROLES)}), got {message!r:.80}")
        messages.append({"role": _ROLES[role], "content": _content(message.get("content"))})
    return messages


def _content(value: Any) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines, as OpenAI-compatible servers do)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRow(f"body.messages: only text content is supported, got a {kind!r} part")
            parts.append(part["text"])
        return "\n".join(parts)
    raise BadRow(f"body.messages: content must be a string or a list of text parts, got {value!r:.80}")


def _completion_prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value.strip():
            raise BadRow("body.prompt is empty")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise BadRow(
        "body.prompt must be one string or one list of token ids (a line with several prompts must be split "
        "into one line each)"
    )


def chat_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams overrides of a chat completions body; `max_completion_tokens` wins over `max_tokens`."""
    overrides = _common(body)
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    if limit is not None:
        overrides["max_new_tokens"] = _int(limit, "max_completion_tokens")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not isinstance(logprobs, bool):
            raise BadRow(f"body.logprobs must be true or false for chat completions, got {logprobs!r}")
        top = body.get("top_logprobs")
        overrides["logprobs"] = (0 if top is None else _int(top, "top_logprobs")) if logprobs else None
    return overrides


def completion_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams overrides of a completions body (`logprobs` is the number of top alternatives there)."""
    overrides = _common(body)
    if body.get("max_tokens") is not None:
        overrides["max_new_tokens"] = _int(body["max_tokens"], "max_tokens")
    if body.get("logprobs") is not None:
        overrides["logprobs"] = _int(body["logprobs"], "logprobs")
    return overrides


def _common(body: dict[str, Any]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p"):
        if body.get(key) is not None:
            overrides[key] = _float(body[key], key)
    for key in ("seed", "n"):
        if body.get(key) is not None:
            overrides[key] = _int(body[key], key)
    if body.get("top_k") is not None:  # vLLM's extension; -1 means off there
        overrides["top_k"] = max(_int(body["top_k"], "top_k"), 0)
    if body.get("ignore_eos") is not None:
        overrides["ignore_eos"] = _bool(body["ignore_eos"], "ignore_eos")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise BadRow(f"body.stop must be a string or a list of strings, got {stop!r:.80}")
        overrides["stop"] = tuple(stops)
    overrides.update(response_format_constraint(body.get("response_format")))
    return overrides


def response_format_constraint(response_format: Any) -> dict[str, Any]:
    """SamplingParams overrides for a line's `response_format`: none for plain text (the job's `sampling.*`
    constraint, if any, applies); `json_object` constrains the output to a JSON object, `json_schema` to its
    `json_schema.schema`, either in place of the job's constraint. `strict` changes nothing: a constrained
    output always follows its schema (when it finishes `stop`)."""
    if response_format is None:
        return {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return json_schema_override(JSON_OBJECT)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRow("body.response_format json_schema needs its schema as an object at json_schema.schema")
        return json_schema_override(schema)
    raise BadRow(f"body.response_format must be an object with type text, json_object or json_schema, got {kind!r}")


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRow(f"body.{key} must be an integer, got {value!r:.40}")
    return value


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRow(f"body.{key} must be a number, got {value!r:.40}")
    return float(value)


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise BadRow(f"body.{key} must be true or false, got {value!r:.40}")
    return value
