"""Processing a step whose constrained rows' matchers the mask worker is advancing: the unconstrained rows are
applied first, then the constrained ones from the worker's answer (accepted and going on, complete, refused, at
its length), each finishing as the synchronous path finishes it."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from batchjob.engine import Request, SamplingParams
from batchjob.engine.native.output import OutputProcessor
from batchjob.engine.native.runtime.step_handle import StepHandle, StepResult
from batchjob.engine.native.scheduling.block_manager import KVBlockManager
from batchjob.engine.native.scheduling.scheduler import Scheduler, SchedulerConfig
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence

EOS = 2


class Recorder:
    """Stands in for the grammar library: what it is asked to advance, and its answers by token."""

    def __init__(self, answers: dict[int, tuple[bool, bool, str]]) -> None:
        self.answers = answers
        self.asked: list = []

    def advance(self, pairs):
        self.asked.append(pairs)
        return [self.answers[token] for _, token in pairs]


def _step(constrained: list[bool], max_new: list[int]):
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVBlockManager(64, 16, False))
    for i, (c, n) in enumerate(zip(constrained, max_new, strict=True)):
        params = SamplingParams(n, regex="[a-z]+") if c else SamplingParams(n, ignore_eos=True)
        group = RequestGroup(Request(i, (5, 6, 7), params), 3)
        seq = Sequence.create(i, group, 0, 3 + n, i, 16)
        group.sequences.append(seq)
        seq.matcher = f"matcher {i}" if c else None
        scheduler.add(seq)
    plan = scheduler.schedule()
    return scheduler, plan, StepHandle(plan, None, None, len(plan.seqs), None)


def _process(constrained, max_new, tokens, answers, deferred: bool):
    scheduler, plan, step = _step(constrained, max_new)
    library = Recorder(answers)
    output = OutputProcessor(None, (EOS,), detokenize=False, grammars=library)
    handed = []

    def advanced(pairs):
        handed.append(pairs)
        future = Future()
        future.set_result(library.advance(pairs))
        return future

    result = StepResult(np.array(tokens), None, None, None)
    done = list(output.process(step, result, scheduler, advanced=advanced if deferred else None))
    return done, handed, library.asked, plan


def test_constrained_rows_finish_from_the_workers_answer_after_the_unconstrained_rows():
    # rows: unconstrained at its length; constrained going on; complete; refused; unconstrained at its length;
    # constrained at its length
    constrained = [False, True, True, True, False, True]
    max_new = [1, 5, 5, 5, 1, 1]
    tokens = [40, 41, 42, 43, 44, 45]
    answers = {41: (True, False, ""), 42: (True, True, ""), 43: (False, False, "no such token"), 45: (True, False, "")}
    done, handed, asked, plan = _process(constrained, max_new, tokens, answers, deferred=True)
    assert [pairs for pairs in handed] == [[("matcher 1", 41), ("matcher 2", 42), ("matcher 3", 43), ("matcher 5", 45)]]
    assert [(c.id, c.finish_reason) for c in done] == [
        (0, "length"),
        (4, "length"),  # before the constrained rows above it
        (2, "stop"),
        (3, "error"),
        (5, "length"),
    ]
    assert "constrained decoding failed: no such token" in done[3].error
    assert [seq.num_tokens for seq in plan.seqs] == [4, 4, 4, 4, 4, 4]
    # The synchronous path (the loop advances the matchers itself) finishes the same rows the same way.
    same, _, asked_sync, _ = _process(constrained, max_new, tokens, answers, deferred=False)
    assert sorted((c.id, c.finish_reason, c.error) for c in same) == sorted(
        (c.id, c.finish_reason, c.error) for c in done
    )
    assert asked_sync == handed
