"""The engine plug point: what every backend takes and gives.

An engine takes a lazy iterable of `Request`s and yields a `Completion` for each as it finishes, in any
order. It pulls from the iterable only as it has room, so memory stays bounded for any input size.
Nothing here knows about Parquet, Hydra or Slurm.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from batchjob.engine.json_schema import compact_json, schema_problem

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ERROR = "error"


CONSTRAINT_KINDS = ("json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What a constrained request's output must match: `kind` is one of `CONSTRAINT_KINDS`; `text` is the JSON
    schema (canonical JSON text), the regular expression, the JSON list of choices, or the Lark/GBNF grammar.
    `json_whitespace` allows free whitespace between JSON tokens (compact JSON otherwise). Hashable: compiled
    grammars are cached by it."""

    kind: str
    text: str
    json_whitespace: bool = False


@dataclass(frozen=True)
class SamplingParams:
    """How to generate one request. `temperature == 0` means greedy; `top_k == 0` means no top-k.

    At most one of `json_schema` (JSON text of a schema), `regex`, `choice` and `grammar` (Lark or GBNF) constrains
    the output: a sample that finishes `stop` matches it. A constrained sample ends when its constraint is
    complete (EOS is then the only token it allows, and `ignore_eos` does not apply); `stop` and `stop_token_ids`
    do not apply to it, since they could only cut it short of its constraint."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: int | None = None
    ignore_eos: bool = False
    json_schema: str | None = None  # JSON text; a dict is taken as the schema it is
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_whitespace: bool = False

    def __post_init__(self) -> None:
        self._normalise()
        problems = self._constraint_problems()
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p must be in [0, 1), got {self.min_p}")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.logprobs is not None and self.logprobs < 0:
            problems.append(f"logprobs must be None or >= 0, got {self.logprobs}")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    def _normalise(self) -> None:
        """What a caller naturally writes, as the fields hold it: one stop string or token id for a sequence of one
        (a string is a sequence too: `stop="END"` would stop at each of its letters), lists as tuples, and a
        schema given as a parsed JSON value (a dict) as its JSON text."""
        fields = {}
        if isinstance(self.stop, str):
            fields["stop"] = (self.stop,)
        elif isinstance(self.stop, list):
            fields["stop"] = tuple(self.stop)
        if isinstance(self.stop_token_ids, int):
            fields["stop_token_ids"] = (self.stop_token_ids,)
        elif isinstance(self.stop_token_ids, list):
            fields["stop_token_ids"] = tuple(self.stop_token_ids)
        if isinstance(self.choice, list):
            fields["choice"] = tuple(self.choice)
        if isinstance(self.json_schema, (dict, bool)):
            fields["json_schema"] = json.dumps(self.json_schema)
        for name, value in fields.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def _constraint_problems(self) -> list[str]:
        given = [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) is not None]
        problems = []
        if len(given) > 1:
            problems.append(f"{' and '.join(given)} are set: a request takes at most one constraint")
        if self.json_schema is not None:
            if isinstance(self.json_schema, (str, bytes)):
                problem = schema_problem(self.json_schema)
            else:
                problem = f"json_schema must be JSON text or a dict, got {type(self.json_schema).__name__}"
            if problem:
                problems.append(problem)
        if isinstance(self.choice, str):
            # A string is a sequence of one-character strings: it would pass below as choices of one letter each.
            problems.append(f"choice must be a list of strings, not one string ({self.choice!r}): e.g. ('yes', 'no')")
        elif self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            problems.append("choice must be a non-empty list of non-empty strings")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                problems.append(f"{kind} must be a non-empty string")
        return problems

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """True when the draw is filtered (top-k, top-p or min-p), which only a sampled request is."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def constraint(self) -> Constraint | None:
        """The request's output constraint, or None."""
        if self.json_schema is not None:
            return Constraint("json_schema", compact_json(self.json_schema), self.json_whitespace)
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.choice is not None:
            return Constraint("choice", json.dumps(list(self.choice)))
        if self.grammar is not None:
            return Constraint("grammar", self.grammar)
        return None


@dataclass(frozen=True)
class Request:
    id: Hashable
    prompt_ids: tuple[int, ...] | list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class Sample:
    """One generated continuation. `logprobs[i]` is the log-probability of `token_ids[i]`;
    `top_logprobs[i]` maps token id to log-probability for the `SamplingParams.logprobs` best tokens."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[dict[int, float], ...] | None = None


@dataclass(frozen=True)
class Completion:
    """All samples of one request (`n` of them). `error` is set, and `samples` empty, when the
    engine refused the request (for example a prompt longer than the model's context)."""

    id: Hashable
    samples: tuple[Sample, ...]
    prompt_tokens: int
    error: str | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.samples[0].token_ids if self.samples else ()

    @property
    def text(self) -> str:
        return self.samples[0].text if self.samples else ""

    @property
    def finish_reason(self) -> str:
        return self.samples[0].finish_reason if self.samples else FINISH_ERROR

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @classmethod
    def failed(cls, id: Hashable, prompt_tokens: int, error: str) -> Completion:
        return cls(id=id, samples=(), prompt_tokens=prompt_tokens, error=error)


@runtime_checkable
class Engine(Protocol):
    """A generation backend. `generate` may be called more than once; `stats` describes all calls so far
    (keys such as `gpu_busy_fraction`, `steps`, `prep_ms_per_step`: whatever the backend can measure)."""

    tokenizer: Any
    max_model_len: int

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]: ...

    def stats(self) -> dict[str, float]: ...

    def tokens_generated(self) -> int:
        """Output tokens generated so far by every `generate` call, those of requests still running included
        where the backend knows them. Cheap, and safe to call from another thread (progress lines)."""
        ...

    def settle(self) -> None:
        """Wait for what the engine still checks beside its start-up, raising `EngineSetupError` where a check
        failed (the native engine: transformers' reading of a config.json it read itself). `generate` does so
        before its first completion; a caller that starts an engine and generates nothing calls it to have those
        checks end, and what they keep kept."""
        ...

    def close(self) -> None: ...


class EngineSetupError(ValueError):
    """The engine cannot start with its options on this machine (a KV cache too small for one sequence, a
    GPU whose memory another process holds): found while it starts, before any request runs, or by a check
    that ends beside its first steps, in place of its first completion (none of which is handed on). The message
    names what to change; a job reports it like a config error (exit 2, no traceback)."""


class EngineFailure(RuntimeError):
    """The engine lost part of itself mid-run (a tensor-parallel rank died or hung), through no fault of the
    requests: a rerun may well succeed. `generate` raises it; the job commits what had finished and exits with
    a resumable status."""
