"""Turning sampled tokens into finished requests: stop conditions, stop strings, logprobs, text.

With the asynchronous loop a step's tokens arrive while the next step already runs; a sequence that stops
here was scheduled once more, and that extra row is counted as wasted and dropped.
"""

from __future__ import annotations

from collections.abc import Iterator

from batchjob.engine.api import FINISH_LENGTH, FINISH_STOP, Completion, Sample
from batchjob.engine.native.detokenizer import StopStringMatcher
from batchjob.engine.native.model_runner import StepHandle, StepResult
from batchjob.engine.native.scheduler import Scheduler
from batchjob.engine.native.sequence import Sequence, Status


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], detokenize: bool) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.tokens_out = 0
        self.wasted = 0

    def process(self, step: StepHandle, result: StepResult, scheduler: Scheduler) -> Iterator[Completion]:
        """Apply one collected step: resolve each sampled row's pending token, stop what must stop, and
        yield the requests whose samples have all finished."""
        row = 0
        tokens = result.tokens.tolist()  # Python ints once, not a numpy scalar per row
        for seq, samples in zip(step.plan.seqs, step.plan.samples.tolist(), strict=True):
            seq.inflight -= 1
            if samples:
                if seq.status is Status.FINISHED:
                    self.wasted += 1
                else:
                    finished = self._append(seq, tokens[row], result, row, scheduler)
                    if finished is not None:
                        yield finished
                row += 1
            scheduler.release_if_idle(seq)

    def _append(
        self, seq: Sequence, token: int, result: StepResult, row: int, scheduler: Scheduler
    ) -> Completion | None:
        position = seq.resolve_oldest(token)
        self.tokens_out += 1
        sampling = seq.sampling
        if result.logprobs is not None:
            seq.logprobs.append(float(result.logprobs[row]))
            if result.top_ids is not None:
                ids, values = result.top_ids[row], result.top_logprobs[row]
                seq.top_logprobs.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
        reason = None
        if (not sampling.ignore_eos and token in self.eos_token_ids) or token in sampling.stop_token_ids:
            reason = FINISH_STOP
        elif sampling.stop:
            matcher = seq.stop_matcher
            if matcher is None:
                matcher = seq.stop_matcher = StopStringMatcher(self.tokenizer, sampling.stop)
            index = matcher.feed(seq.tokens[seq.prompt_len : position + 1].tolist())
            if index is not None:
                seq.stop_text = matcher.text[:index]
                reason = FINISH_STOP
        if reason is None and position + 1 >= seq.max_len:
            reason = FINISH_LENGTH
        if reason is None:
            return None
        seq.truncate_after(position)
        scheduler.finish(seq, reason)
        group = seq.group
        group.num_finished += 1
        if group.num_finished < len(group.sequences):
            return None
        return Completion(
            id=group.request.id,
            samples=tuple(self._sample(s) for s in group.sequences),
            prompt_tokens=group.prompt_len,
        )

    def _sample(self, seq: Sequence) -> Sample:
        ids = seq.output_ids.tolist()
        if seq.stop_text is not None:
            text = seq.stop_text
        elif self.detokenize:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        else:
            text = ""
        logprobs = tuple(seq.logprobs[: len(ids)]) if seq.sampling.logprobs is not None else None
        top = tuple(seq.top_logprobs[: len(ids)]) if seq.sampling.logprobs else None
        return Sample(
            token_ids=tuple(ids), text=text, finish_reason=seq.finish_reason, logprobs=logprobs, top_logprobs=top
        )
