"""Per-row decode state and token choice for the hf backend.

Each row (one sample of one request) owns its random generator, seeded from the request's seed, so a
request samples the same tokens whatever batch it lands in: that is what lets a resumed job reproduce
an uninterrupted one. Filtering (temperature, top-k, top-p, min-p) is vectorised over the batch; only
the final draw is per row, because each row has its own generator.

Structured outputs: a constrained row carries a grammar matcher; its forbidden tokens get -inf before the
choice (the same bitmask and kernel as the native engine), and it stops once its constraint is complete.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from batchjob.engine.api import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Request, Sample, SamplingParams
from batchjob.engine.grammar import GrammarCompiler, Matcher
from batchjob.engine.native.sampling.token_mask import TokenMask

# Stop strings are searched in the decoded tail; this many extra tokens covers multi-token characters.
STOP_TAIL_SLACK = 8


@dataclass
class RowState:
    request: Request
    prompt_ids: list[int]
    limit: int
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stopped_by_token: bool = False
    matcher: Matcher | None = None
    error: str | None = None

    @classmethod
    def start(cls, request: Request, sample_index: int, max_model_len: int, device: torch.device) -> RowState:
        sampling = request.sampling
        generator = None
        if not sampling.greedy:
            base = sampling.seed if sampling.seed is not None else random.randrange(2**63)
            generator = torch.Generator(device=device)
            # Mixing in the sample index gives each of the n samples its own stream.
            generator.manual_seed(hash((base, sample_index)) & (2**63 - 1))
        prompt = list(request.prompt_ids)
        limit = min(sampling.max_new_tokens, max_model_len - len(prompt))
        return cls(request=request, prompt_ids=prompt, limit=limit, generator=generator)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def append(
        self,
        token: int,
        logprobs: tuple[float, dict[int, float]] | None,
        stop_ids: set[int],
        eos_ids: frozenset[int],
        tokenizer,
    ) -> None:
        self.token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs[0])
            self.top_logprobs.append(logprobs[1])
        stop = self.request.sampling.stop
        if self.matcher is not None:
            # A constrained row ends where its constraint is complete (EOS was its only allowed token, or it
            # allows nothing more); stop strings and stop token ids would only cut it short of that.
            if not self.matcher.consume(token):
                self.error = f"constrained decoding failed: {self.matcher.error or f'token {token} not allowed'}"
                self.finish_reason = FINISH_ERROR
            elif token in eos_ids or self.matcher.is_stopped:
                self.finish_reason, self.stopped_by_token = FINISH_STOP, token in eos_ids
            elif len(self.token_ids) >= self.limit:
                self.finish_reason = FINISH_LENGTH
        elif token in stop_ids:
            self.finish_reason, self.stopped_by_token = FINISH_STOP, True
        elif stop and self._tail_has_stop(tokenizer, stop):
            self.finish_reason = FINISH_STOP
        elif len(self.token_ids) >= self.limit:
            self.finish_reason = FINISH_LENGTH

    def _tail_has_stop(self, tokenizer, stop: tuple[str, ...]) -> bool:
        tail_tokens = max(len(s) for s in stop) + STOP_TAIL_SLACK
        tail = tokenizer.decode(self.token_ids[-tail_tokens:], skip_special_tokens=True)
        return any(s in tail for s in stop)

    def to_sample(self, tokenizer) -> Sample:
        text_ids = self.token_ids[:-1] if self.stopped_by_token else self.token_ids
        text = tokenizer.decode(text_ids, skip_special_tokens=True)
        stop = self.request.sampling.stop if self.matcher is None else ()
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            text = text[: min(hits)]
        with_logprobs = self.request.sampling.logprobs is not None
        return Sample(
            token_ids=tuple(self.token_ids),
            text=text,
            finish_reason=self.finish_reason or FINISH_LENGTH,
            logprobs=tuple(self.logprobs) if with_logprobs else None,
            top_logprobs=tuple(self.top_logprobs) if with_logprobs else None,
        )


def constraint_mask(rows: list[RowState], grammars: GrammarCompiler, device: torch.device) -> TokenMask | None:
    """The bitmask of the constrained rows still running (row i's bitmask is row i), or None if there are none."""
    active = [(row.matcher, i) for i, row in enumerate(rows) if row.matcher is not None and not row.done]
    if not active:
        return None
    bitmask = torch.full((len(rows), grammars.words), -1, dtype=torch.int32)
    grammars.fill_bitmasks(active, bitmask)
    mask_rows = torch.full((len(rows),), -1, dtype=torch.int64)
    mask_rows[[i for _, i in active]] = torch.tensor([i for _, i in active])
    return TokenMask(bitmask.to(device), mask_rows.to(device))


def choose_tokens(
    logits: torch.Tensor, rows: list[RowState], sampling: SamplingParams, mask: TokenMask | None = None
) -> tuple[list[int], list[tuple[float, dict[int, float]]] | None]:
    """The next token of every row, and (when asked) its log-probability and the top alternatives,
    both from the model's unmodified distribution (`mask` forbids tokens only for the choice)."""
    raw = logits
    if mask is not None:
        logits = mask.apply_(logits.clone())
    if sampling.greedy:
        chosen = logits.argmax(dim=-1)
    else:
        scores = logits / sampling.temperature
        if sampling.top_k > 0:
            kth = torch.topk(scores, min(sampling.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if sampling.min_p > 0:
            floor = sampling.min_p * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        if sampling.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        chosen = torch.stack([torch.multinomial(probs[i], 1, generator=row.generator)[0] for i, row in enumerate(rows)])
    tokens = chosen.tolist()
    if sampling.logprobs is None:
        return tokens, None
    logp = torch.log_softmax(raw, dim=-1)
    picked = logp.gather(-1, chosen[:, None])[:, 0].tolist()
    if sampling.logprobs > 0:
        top = torch.topk(logp, sampling.logprobs, dim=-1)
        tops = [dict(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
    else:
        tops = [{} for _ in tokens]
    return tokens, list(zip(picked, tops, strict=True))
