"""Completions of OpenAI batch lines → output rows, and output rows → Batch API output lines.

An OpenAI batch job's rows carry a `choices` column (each of the line's `n` samples: text, finish reason
and, when the line asked for them, per-token log-probabilities with the token's text), so the Batch API
output file can be written from the Parquet output alone, without the model or its tokenizer
(`python -m batchjob.export`). `generation` and `finish_reason` are the first choice's, as in every job.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from batchjob.pipelines.rows import RowLayout

from batchjob.engine.api import Completion, Sample

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

_TOP = pa.struct([("token", pa.string()), ("logprob", pa.float32())])
_TOKEN = pa.struct([("token", pa.string()), ("logprob", pa.float32()), ("top_logprobs", pa.list_(_TOP))])
CHOICE = pa.struct([("text", pa.string()), ("finish_reason", pa.string()), ("logprobs", pa.list_(_TOKEN))])
CHOICES = pa.field("choices", pa.list_(CHOICE))
# What a row needs for a Batch API output line (`custom_id` and `url` are the input's, passed through).
EXPORT_COLUMNS = ("row_id", "custom_id", "url", "choices", "prompt_tokens", "completion_tokens", "error")


class OpenAIRowLayout:
    """The output rows of an OpenAI batch job: the base columns plus `choices` (null for error rows)."""

    def __init__(self, tokenizer: Any, token_ids: bool) -> None:
        self.tokenizer = tokenizer
        self._base = RowLayout(n=1, token_ids=token_ids)

    def schema(self, passthrough: pa.Schema) -> pa.Schema:
        return pa.schema([*self._base.schema(pa.schema([])), CHOICES, *passthrough])

    def completed(self, row_id: int, completion: Completion, passthrough: dict[str, Any]) -> dict[str, Any]:
        if completion.error is not None:
            return self.failed(row_id, completion.error, completion.prompt_tokens, passthrough)
        row = self._base.completed(row_id, completion, passthrough)
        row["choices"] = [self._choice(sample) for sample in completion.samples]
        return row

    def failed(self, row_id: int, error: str, prompt_tokens: int, passthrough: dict[str, Any]) -> dict[str, Any]:
        return {**self._base.failed(row_id, error, prompt_tokens, passthrough), "choices": None}

    def table(self, rows: list[dict[str, Any]], passthrough: pa.Schema) -> pa.Table:
        return pa.Table.from_pylist(rows, schema=self.schema(passthrough))

    def _choice(self, sample: Sample) -> dict[str, Any]:
        logprobs = None
        if sample.logprobs is not None:
            tops = sample.top_logprobs or ({},) * len(sample.token_ids)
            logprobs = [
                {
                    "token": self._token(token),
                    "logprob": logprob,
                    "top_logprobs": [{"token": self._token(t), "logprob": lp} for t, lp in top.items()],
                }
                for token, logprob, top in zip(sample.token_ids, sample.logprobs, tops, strict=True)
            ]
        return {"text": sample.text, "finish_reason": sample.finish_reason, "logprobs": logprobs}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def batch_output_line(row: dict[str, Any], model: str, id_prefix: str, created: int) -> dict[str, Any]:
    """The Batch API output line of one output row (`EXPORT_COLUMNS`). Ids are `id_prefix` + row id, so an
    export is reproducible; `created` is a Unix time."""
    suffix = f"{id_prefix}{row['row_id']}"
    line: dict[str, Any] = {"id": f"batch_req_{suffix}", "custom_id": row["custom_id"]}
    if row["error"] is not None or not row["choices"]:
        message = row["error"] or "the request produced no output"
        error_body = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        response = {"status_code": 400, "request_id": f"req_{suffix}", "body": {"error": error_body}}
        return {**line, "response": response, "error": {"code": "invalid_request", "message": message}}
    chat = row["url"] == CHAT_URL
    choices = [(_chat_choice if chat else _text_choice)(index, choice) for index, choice in enumerate(row["choices"])]
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{suffix}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
        },
    }
    return {**line, "response": {"status_code": 200, "request_id": f"req_{suffix}", "body": body}, "error": None}


def _chat_choice(index: int, choice: dict[str, Any]) -> dict[str, Any]:
    logprobs = None
    if choice["logprobs"] is not None:
        content = [
            {
                "token": t["token"],
                "logprob": t["logprob"],
                "bytes": list(t["token"].encode()),
                "top_logprobs": [
                    {"token": top["token"], "logprob": top["logprob"], "bytes": list(top["token"].encode())}
                    for top in t["top_logprobs"]
                ],
            }
            for t in choice["logprobs"]
        ]
        logprobs = {"content": content, "refusal": None}
    return {
        "index": index,
        "message": {"role": "assistant", "content": choice["text"], "refusal": None},
        "logprobs": logprobs,
        "finish_reason": choice["finish_reason"],
    }


def _text_choice(index: int, choice: dict[str, Any]) -> dict[str, Any]:
    logprobs = None
    if choice["logprobs"] is not None:
        tokens = [t["token"] for t in choice["logprobs"]]
        offsets = [0]
        for token in tokens[:-1]:
            offsets.append(offsets[-1] + len(token))
        logprobs = {
            "tokens": tokens,
            "token_logprobs": [t["logprob"] for t in choice["logprobs"]],
            "top_logprobs": [{top["token"]: top["logprob"] for top in t["top_logprobs"]} for t in choice["logprobs"]],
            "text_offset": offsets[: len(tokens)],
        }
    return {"index": index, "text": choice["text"], "logprobs": logprobs, "finish_reason": choice["finish_reason"]}
