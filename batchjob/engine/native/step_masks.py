"""The bitmasks of steps with constrained rows, filled on the host: in the loop's own thread (the synchronous
loop), or by one worker thread while the loop goes on (the asynchronous loop). llguidance computes the rows in
its own threads, off the GIL.

A step with constrained rows is launched as its forward only; `StepMasks` fills its bitmask rows from the rows'
matchers and then enqueues its masked sampler (`ModelRunner.enqueue_masked_sampler`). While the worker fills a
step's masks, the loop touches none of that step's matchers.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from batchjob.engine.native.sequence import Status
from batchjob.engine.native.token_mask import one_hot_bitmask_

if TYPE_CHECKING:
    import torch

    from batchjob.engine.grammar import GrammarCompiler
    from batchjob.engine.native.model_runner import StepHandle


class StepMasks:
    def __init__(self, runner: Any, grammars: GrammarCompiler) -> None:
        self.runner = runner
        self.grammars = grammars
        self._worker: ThreadPoolExecutor | None = None  # started with the first step it fills
        self._job: tuple[StepHandle, Future] | None = None
        self.fill_s = 0.0  # filling bitmasks, wherever it ran
        self.wait_s = 0.0  # the loop waiting for the worker's bitmasks
        self.started_at_launch = 0  # steps whose masks began filling at their launch (engine.constrained_lag)

    @property
    def busy(self) -> bool:
        """True while the worker holds a step (until `finish`)."""
        return self._job is not None

    def holds(self, step: StepHandle) -> bool:
        return self._job is not None and self._job[0] is step

    def fill_now(self, step: StepHandle) -> None:
        """Fill `step`'s bitmask in this thread and enqueue its sampler (the synchronous loop)."""
        bitmask = self.runner.bitmask_rows(step)
        self._fill(self._rows(step, bitmask), bitmask)
        self.runner.enqueue_masked_sampler(step)

    def start(self, step: StepHandle, at_launch: bool = False) -> None:
        """Have the worker fill `step`'s bitmask; `finish` enqueues its sampler."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchjob-masks")
        bitmask = self.runner.bitmask_rows(step)
        rows = self._rows(step, bitmask)
        self._job = (step, self._worker.submit(self._fill, rows, bitmask))
        self.started_at_launch += at_launch

    def finish(self) -> None:
        """Wait for the worker's bitmask, if one is being filled, and enqueue that step's masked sampler."""
        if self._job is None:
            return
        step, job = self._job
        self._job = None
        began = time.perf_counter()
        job.result()
        self.wait_s += time.perf_counter() - began
        self.runner.enqueue_masked_sampler(step)

    def abandon(self) -> None:
        """The loop stopped early: let the worker finish with the matchers before they are dropped."""
        if self._job is not None:
            self._job[1].exception()
            self._job = None

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self.runner = None  # the runner holds the KV cache: nothing here may keep it past the engine's close

    @staticmethod
    def matchers_settled(step: StepHandle) -> bool:
        """True when `step` needs masks and each of its constrained rows has every earlier token consumed by its
        matcher (no other step of that row in flight)."""
        plan = step.plan
        rows = [seq for seq, sampled in zip(plan.seqs, plan.samples.tolist(), strict=True) if sampled and seq.matcher]
        return not step.sampled and bool(rows) and all(len(seq.pending) == 1 for seq in rows)

    def _rows(self, step: StepHandle, bitmask: torch.Tensor) -> list:
        """Row k of `bitmask` is what the k-th constrained sampled row of `step` may sample. Writes the rows that
        need no matcher (a stopped row, a token jump-forward already chose) and returns `(matcher, k)` for the
        others."""
        by_matcher, k = [], 0
        for seq, sampled in zip(step.plan.seqs, step.plan.samples.tolist(), strict=True):
            if not sampled or seq.matcher is None:
                continue
            if seq.status is Status.FINISHED:
                bitmask[k].fill_(-1)  # stopped at the previous step: this row is discarded
            else:
                _, position = seq.pending[-1]
                if position < seq.forced_until:
                    one_hot_bitmask_(bitmask[k], int(seq.tokens[position]))  # jump-forward already chose it
                else:
                    by_matcher.append((seq.matcher, k))
            k += 1
        return by_matcher

    def _fill(self, rows: list, bitmask: torch.Tensor) -> None:
        began = time.perf_counter()
        self.grammars.fill_bitmasks(rows, bitmask)
        self.fill_s += time.perf_counter() - began
