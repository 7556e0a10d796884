"""`LLM`: an engine in this process, for notebooks and pipelines.

    from batchjob import LLM, SamplingParams
    llm = LLM(model="Qwen/Qwen2.5-0.5B-Instruct", engine="hf", max_batch_size=16)
    chat = [{"role": "user", "content": "Hi!"}]
    outputs = llm.generate(["Hello", chat, [9906, 0]], SamplingParams(max_new_tokens=32))
    print(outputs[0].outputs[0].text)

The same parts as a job: prompts are built by the job's prompt pipeline (a string as is, with the
tokenizer's special tokens; a message list through the chat template; a list of token ids is used as it is),
prompt `i` samples with seed
`seed + i` as row `i` of a job does, and the engine is the one `engine=` names. So `generate` on a job's
prompts, in input order, gives the job's generations.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchjob.engine import Completion, Request, SamplingParams, check_engine_options, create_engine
from batchjob.job.fingerprint import resolve_model_path
from batchjob.pipelines.prompts import PromptBuilder, PromptSpec
from batchjob.pipelines.sampling import row_sampling

Message = dict[str, str]
Prompt = str | list[Message] | list[int]  # text, a conversation, or token ids (used as they are)
_BUILD_ROWS = 256  # prompts tokenised per call, as the job's pipeline.tokenize_batch_rows


@dataclass(frozen=True)
class CompletionOutput:
    """One sample: `logprobs[i]` is the log-probability of `token_ids[i]` (when asked for)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[float, ...] | None


@dataclass(frozen=True)
class RequestOutput:
    """All samples of one prompt; `error` (and no outputs) when the prompt could not run, e.g. too long."""

    index: int
    prompt: Prompt
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    error: str | None = None

    @property
    def text(self) -> str:
        """The first sample's text ("" for an error)."""
        return self.outputs[0].text if self.outputs else ""


class LLM:
    """`LLM(model=None, engine="native", **engine options)`: `model` is a Hugging Face model directory or hub id
    (None: the tiny random model of the default job); engine options are those of `engine.*` in a job."""

    def __init__(self, model: str | None = None, engine: str = "native", **engine_options: Any) -> None:
        check_engine_options(engine, engine_options)
        self.model_path = resolve_model_path(model)
        self.engine = create_engine(engine, self.model_path, engine_options)
        self.tokenizer = self.engine.tokenizer
        self._closed = False

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs for `prompts` (a string, a message list, or a list of them), in input order. One
        `SamplingParams` for all prompts or one per prompt; default: greedy, 256 new tokens."""
        if self._closed:
            raise RuntimeError("this LLM was closed (its engine is gone): make a new one")
        prompts = _as_list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else None
        if per_prompt is not None and len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts: give one, or one each")
        encoded: dict[int, tuple[tuple[int, ...], str | None]] = {}

        def requests() -> Iterator[Request]:
            for start in range(0, len(prompts), _BUILD_ROWS):
                chunk = prompts[start : start + _BUILD_ROWS]
                rows = self._encode(chunk, start, per_prompt[start : start + _BUILD_ROWS] if per_prompt else params)
                for offset, (ids, error, sampling) in enumerate(rows):
                    index = start + offset
                    encoded[index] = (tuple(ids or ()), error)
                    if error is None:
                        yield Request(index, ids, sampling)

        completions = {c.id: c for c in self.engine.generate(requests())}
        return [_output(i, prompts[i], *encoded[i], completions.get(i)) for i in range(len(prompts))]

    def _encode(
        self, chunk: list[Prompt], start: int, params: SamplingParams | list[SamplingParams]
    ) -> list[tuple[list[int] | None, str | None, SamplingParams]]:
        """Token ids, error and row-seeded settings of prompts `start...`, through the job's prompt builder
        (kind raw for strings, chat for message lists)."""
        result: list[Any] = [None] * len(chunk)
        vocab = len(self.tokenizer)
        for i, prompt in enumerate(chunk):
            if _token_ids(prompt):
                own = params if isinstance(params, SamplingParams) else params[i]
                bad = [t for t in prompt if not 0 <= t < vocab]
                error = f"token id {bad[0]} is not in the tokenizer's 0..{vocab - 1}" if bad else None
                result[i] = (None if bad else list(prompt), error, row_sampling(own, start + i))
        for kind in ("raw", "chat"):
            positions = [
                i for i, p in enumerate(chunk) if result[i] is None and isinstance(p, list) == (kind == "chat")
            ]
            if not positions:
                continue
            column = "messages" if kind == "chat" else "prompt"
            values = [json.dumps(chunk[i]) if kind == "chat" else chunk[i] for i in positions]
            row_ids = [start + i for i in positions]
            batch = pa.record_batch({"row_id": pa.array(row_ids, pa.int64()), column: pa.array(values, pa.string())})
            spec = PromptSpec(kind=kind, prompt_column="prompt", messages_column="messages" if kind == "chat" else None)
            base = params if isinstance(params, SamplingParams) else SamplingParams()
            rows = PromptBuilder(spec, self.tokenizer, base).encode(batch)
            for i, row_id, ids, error, sampling in zip(
                positions, row_ids, rows.prompt_ids, rows.errors, rows.sampling, strict=True
            ):
                own = sampling if isinstance(params, SamplingParams) else row_sampling(params[i], row_id)
                result[i] = (ids, error, own)
        return result

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], dict):  # one conversation
        return [prompts]
    for p in prompts:
        if not isinstance(p, (str, list)):
            raise TypeError(
                f"a prompt is a string, a list of {{role, content}} messages or a list of token ids, got "
                f"{type(p).__name__}"
            )
    return prompts


def _token_ids(prompt: Prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def _output(
    index: int, prompt: Prompt, ids: tuple[int, ...], error: str | None, completion: Completion | None
) -> RequestOutput:
    if error is None and completion is not None:
        error = completion.error
    samples = () if completion is None or error is not None else completion.samples
    outputs = tuple(
        CompletionOutput(i, s.text, s.token_ids, s.finish_reason, s.logprobs) for i, s in enumerate(samples)
    )
    return RequestOutput(index, prompt, ids, outputs, error)
