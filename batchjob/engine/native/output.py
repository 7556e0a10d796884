"""Turning sampled tokens into finished requests: stop conditions, stop strings, logprobs, text.

With the asynchronous loop a step's tokens arrive while the next step already runs; a sequence that stops
here was scheduled once more, and that extra row is counted as wasted and dropped.

A constrained sequence's matcher advances by each token here; it stops `stop` when its constraint is complete,
and jumps forward over tokens its constraint forces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from itertools import compress
from typing import Any

from batchjob.engine.api import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Completion, Sample
from batchjob.engine.grammar import GrammarCompiler
from batchjob.engine.native.detokenizer import StopStringMatcher
from batchjob.engine.native.runtime.step_handle import StepHandle, StepResult
from batchjob.engine.native.scheduling.plan import StepPlan
from batchjob.engine.native.scheduling.scheduler import Scheduler
from batchjob.engine.native.scheduling.sequence import NOT_PLAIN, Sequence, Status

# How many sequences `process` applies between two calls of its `poll`: at about 1 us a sequence, a filled
# bitmask waits some 30 us for the loop to see it.
POLL_SEQS = 32


def _refusal(token: int, error: str) -> str:
    """A constrained row's error when its matcher refused its token (a bug: masks allow only what it accepts)."""
    return f"constrained decoding failed: {error or f'token {token} not allowed'}"


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        detokenize: bool,
        grammars: GrammarCompiler,
        jump_forward: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.grammars = grammars
        self.jump_forward = jump_forward
        self.tokens_out = 0
        self.wasted = 0
        self.forced_tokens = 0  # jump-forward: tokens appended without a step of their own

    def process(
        self,
        step: StepHandle,
        result: StepResult,
        scheduler: Scheduler,
        settle: Callable[[list[Sequence]], None] | None = None,
        chunk: int = 0,
        advanced: Callable[[list], Future] | None = None,
        poll: Callable[[], None] | None = None,
    ) -> Iterator[Completion]:
        """Apply one collected step: resolve each sampled row's pending token, stop what must stop, and
        yield the requests whose samples have all finished. With `settle`, every `chunk` sequences done are
        passed to it: their matchers are final for the next step. `poll` is called every `POLL_SEQS` sequences
        (the next step's sampler goes to the GPU once its masks are done).

        `advanced(pairs)`, without jump-forward, hands the step's (matcher, token) pairs over to be consumed
        (`StepMasks.advance_and_start`: the mask worker advances them, then fills the next step's masks)
        and returns the future of what `GrammarCompiler.advance` says of them. The unconstrained rows are then
        processed while the worker consumes, and the constrained rows after them, from that answer: nothing here
        touches a matcher once it is handed over."""
        tokens = result.tokens.tolist()  # Python ints once, not a numpy scalar per row
        samples = step.plan.samples.tolist()
        pairs, ids = self._matcher_tokens(step.plan, tokens)
        consumed = advanced(pairs) if advanced is not None else None
        advanced_by = {}
        if consumed is None and pairs:
            advanced_by = dict(zip(ids, self.grammars.advance(pairs), strict=True))
        row = 0
        done: list[Sequence] = []
        later: list[tuple[Sequence, int]] = []  # constrained rows, while their matchers are being consumed
        plain_step = result.logprobs is None
        for index, (seq, sampled) in enumerate(zip(step.plan.seqs, samples, strict=True)):
            if settle is not None and len(done) == chunk:
                settle(done)
                done = []
            if poll is not None and index % POLL_SEQS == POLL_SEQS - 1:
                poll()
            done.append(seq)
            seq.inflight -= 1
            if sampled:
                if seq.status is Status.FINISHED:
                    self.wasted += 1
                elif plain_step and self._plain_stop_ids(seq) is not NOT_PLAIN:
                    finished = self._append_plain(seq, tokens[row], scheduler)
                    if finished is not None:
                        yield finished
                elif consumed is not None and seq.matcher is not None:
                    later.append((seq, row))
                    row += 1
                    continue
                else:
                    finished = self._append(seq, tokens[row], result, row, scheduler, advanced_by.get(seq.seq_id))
                    if finished is not None:
                        yield finished
                row += 1
            if seq.status is Status.FINISHED:
                scheduler.release_if_idle(seq)
        if settle is not None and done:
            settle(done)
        if later:
            if poll is not None:
                poll()
            advanced_by = dict(zip(ids, consumed.result(), strict=True))
            for seq, row in later:
                advanced_row = advanced_by.get(seq.seq_id)
                if plain_step and advanced_row is not None:
                    finished = self._append_constrained(seq, tokens[row], scheduler, advanced_row)
                else:
                    finished = self._append(seq, tokens[row], result, row, scheduler, advanced_row)
                if finished is not None:
                    yield finished
                if seq.status is Status.FINISHED:
                    scheduler.release_if_idle(seq)

    @staticmethod
    def _matcher_tokens(plan: StepPlan, tokens: list[int]) -> tuple[list[tuple[Any, int]], list[int]]:
        """(matcher, token) for every constrained sequence whose constraint had not already forced (and
        consumed) its new token, and their sequence ids."""
        if not plan.constrained.any():
            return [], []
        finished = Status.FINISHED
        rows = [
            (seq, token)
            for seq, token in compress(zip(plan.sampled, tokens, strict=True), plan.constrained.tolist())
            if seq.status is not finished and (not seq.forced_until or seq.pending[0][1] >= seq.forced_until)
        ]
        return [(seq.matcher, token) for seq, token in rows], [seq.seq_id for seq, _ in rows]

    def _append(
        self,
        seq: Sequence,
        token: int,
        result: StepResult,
        row: int,
        scheduler: Scheduler,
        advanced: tuple[bool, bool, str] | None,
    ) -> Completion | None:
        position, forced = seq.resolve_oldest(token)
        self.tokens_out += 1
        if result.logprobs is not None:
            seq.logprobs.append(float(result.logprobs[row]))
            if result.top_ids is not None:
                ids, values = result.top_ids[row], result.top_logprobs[row]
                seq.top_logprobs.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
        if seq.matcher is not None:
            # A constrained sample ends where its constraint is complete: a stop string or stop token id could
            # only cut it short of that (a JSON text at a "}" inside one of its strings).
            reason = self._constraint_reason(seq, token, position, forced, advanced)
        else:
            reason = self._stop_reason(seq, token, position)
        if reason is None and position + 1 >= seq.max_len:
            reason = FINISH_LENGTH
        if reason is not None:
            return self._finish(seq, position, reason, scheduler)
        if self.jump_forward and seq.matcher is not None and not forced and seq.sampling.logprobs is None:
            # Forced tokens are never sampled, so they would have no log-probabilities: no jump-forward then.
            return self._jump_forward(seq, scheduler)
        return None

    def _plain_stop_ids(self, seq: Sequence) -> frozenset[int]:
        """The token ids that stop `seq`, kept on it, when nothing but a token id and its length can end it (no
        constraint, no stop strings); `NOT_PLAIN` otherwise."""
        if seq.stop_ids is not None:
            return seq.stop_ids
        sampling = seq.sampling
        if seq.matcher is not None or sampling.stop:
            seq.stop_ids = NOT_PLAIN
        else:
            eos = frozenset() if sampling.ignore_eos else self.eos_token_ids
            seq.stop_ids = eos | frozenset(sampling.stop_token_ids)
        return seq.stop_ids

    def _append_plain(self, seq: Sequence, token: int, scheduler: Scheduler) -> Completion | None:
        """`_append` for a step without log-probabilities and a sequence its `_plain_stop_ids` can end: the same
        outcome, without the checks that cannot apply (most rows of most steps take this path)."""
        position, _ = seq.resolve_oldest(token)
        self.tokens_out += 1
        if token in seq.stop_ids:
            return self._finish(seq, position, FINISH_STOP, scheduler)
        if position + 1 >= seq.max_len:
            return self._finish(seq, position, FINISH_LENGTH, scheduler)
        return None

    def _append_constrained(
        self, seq: Sequence, token: int, scheduler: Scheduler, advanced: tuple[bool, bool, str]
    ) -> Completion | None:
        """`_append` for a constrained row of a step without log-probabilities whose token its matcher consumed
        (`advanced`), without jump-forward: the same outcome, without the checks that cannot apply."""
        position, _ = seq.resolve_oldest(token)
        self.tokens_out += 1
        accepted, stopped, error = advanced
        if not accepted:
            seq.error = _refusal(token, error)
            return self._finish(seq, position, FINISH_ERROR, scheduler)
        if stopped or token in self.eos_token_ids:
            return self._finish(seq, position, FINISH_STOP, scheduler)
        if position + 1 >= seq.max_len:
            return self._finish(seq, position, FINISH_LENGTH, scheduler)
        return None

    def _stop_reason(self, seq: Sequence, token: int, position: int) -> str | None:
        sampling = seq.sampling
        if (not sampling.ignore_eos and token in self.eos_token_ids) or token in sampling.stop_token_ids:
            return FINISH_STOP
        if sampling.stop:
            matcher = seq.stop_matcher
            if matcher is None:
                matcher = seq.stop_matcher = StopStringMatcher(self.tokenizer, sampling.stop)
            index = matcher.feed(seq.tokens[seq.prompt_len : position + 1].tolist())
            if index is not None:
                seq.stop_text = matcher.text[:index]
                return FINISH_STOP
        return None

    def _constraint_reason(
        self, seq: Sequence, token: int, position: int, forced: bool, advanced: tuple[bool, bool, str] | None
    ) -> str | None:
        """`stop` once the constraint is complete (EOS sampled, or nothing but EOS may follow), `error` if the
        token broke it (a bug: masks allow only what the matcher accepts); None to go on. `advanced` is what
        `GrammarCompiler.advance` found: the next step's masks may be filling from this matcher already."""
        if forced:
            if int(seq.tokens[position]) != token:
                seq.error = f"constrained decoding sampled token {token} where the constraint forced another"
                return FINISH_ERROR
            return FINISH_STOP if seq.matcher.is_stopped else None
        accepted, stopped, error = advanced
        if not accepted:
            seq.error = _refusal(token, error)
            return FINISH_ERROR
        if token in self.eos_token_ids or stopped:
            return FINISH_STOP
        return None

    def _jump_forward(self, seq: Sequence, scheduler: Scheduler) -> Completion | None:
        """Append the tokens the constraint forces next, leaving room for one sampled token within max_len."""
        forced = seq.matcher.forced_tokens()
        in_flight = bool(seq.pending)
        room = seq.max_len - 1 - seq.num_tokens + in_flight
        forced = [t for t in forced[:room] if t not in self.eos_token_ids]
        if len(forced) <= in_flight:
            return None  # nothing gained: the step in flight samples the one forced token anyway
        if not seq.matcher.consume_forced(forced):
            seq.error = f"constrained decoding failed on forced tokens: {seq.matcher.error}"
            return self._finish(seq, seq.num_tokens - 1, FINISH_ERROR, scheduler)
        self.forced_tokens += seq.append_forced(forced)
        if seq.matcher.is_stopped:
            return self._finish(seq, seq.num_tokens - 1, FINISH_STOP, scheduler)
        return None

    def _finish(self, seq: Sequence, last: int, reason: str, scheduler: Scheduler) -> Completion | None:
        seq.truncate_after(last)
        scheduler.finish(seq, reason)
        group = seq.group
        group.num_finished += 1
        if group.num_finished < len(group.sequences):
            return None
        errors = [s.error for s in group.sequences if s.error is not None]
        if errors:
            return Completion.failed(group.request.id, group.prompt_len, errors[0])
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
