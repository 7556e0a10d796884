"""The bitmasks of steps with constrained rows, filled on the host.

A step with constrained rows is launched as its forward only; its bitmask rows are filled from the rows' matchers,
then its masked sampler is enqueued (`ModelRunner.enqueue_masked_sampler`).

The synchronous loop fills a step's rows in its own thread, through llguidance's parallel call (`fill_now`). The
asynchronous loop hands the rows to a few threads in groups (`start`), each group one parallel call into a buffer of
its own (llguidance runs off the GIL; a group needs the GIL only once, when it is done, so the loop's own Python
work does not hold back the masks), and the group's rows are copied into the step's bitmask while the step is open.
`finish` waits for them until the step's forward has run on the GPU. From then on the GPU would wait for the
slowest masks, and one row can take milliseconds (a JSON string near its maxLength) where a typical row takes
~0.15 ms, so the rows still being computed then are *late*: their bitmask rows allow every token, their sampled
tokens are dropped, and they feed their last token again at a later step (`Sequence.sit_out`), when their mask,
still the right one since their matcher has not moved, is ready. A row that was late, or alone took long, is
computed in a group of its own next time, so that it holds back no other row. While a matcher's mask is being
computed the loop does not touch that matcher.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from batchjob.engine.native.sequence import Sequence, Status
from batchjob.engine.native.token_mask import one_hot_bitmask_

if TYPE_CHECKING:
    import torch

    from batchjob.engine.grammar import GrammarCompiler, Matcher
    from batchjob.engine.native.model_runner import StepHandle

# A step is cut at the end of its forward only once no more than this share of its rows is still being computed:
# cutting a large share would leave the step with few rows to sample.
LATE_SHARE = 1 / 8
GROUPS = 8  # groups of the rows with no history of slow masks
SLOW_S = 1e-3  # a row alone in its group that took longer stays alone


class _OpenStep:
    """A step whose bitmask rows the threads may still write (those `StepMasks._watch` names)."""

    def __init__(self, step: StepHandle, rows: np.ndarray) -> None:
        self.step = step
        self.rows = rows
        self.fresh: list[tuple[int, int]] = []  # (sequence id, row) of the rows whose masks were being computed
        self.waiting = 0
        self.started = time.perf_counter()


class StepMasks:
    def __init__(self, runner: Any, grammars: GrammarCompiler, late_masks: bool = True, debug_late_every: int = 0):
        """`late_masks`: on a GPU, rows whose masks are not ready when their step's forward has run sit the step out
        (else the step waits for all). `debug_late_every=n`: declare every n-th freshly computed row late, whatever
        the timing (tests of the sit-out path on CPU)."""
        self.runner = runner
        self.grammars = grammars
        self.late_masks = late_masks
        self.debug_late_every = debug_late_every
        self._threads: list[threading.Thread] = []
        self._queue: queue.SimpleQueue[list[Matcher] | None] = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._job: _OpenStep | None = None
        # matcher -> (open step, bitmask row, sequence id) for each row a thread is computing
        self._watch: dict[Matcher, tuple[_OpenStep, int, int]] = {}
        self._filling = 0
        self._fresh = 0  # rows computed for the asynchronous loop (counts `debug_late_every`)
        self.fill_s = 0.0  # from a step's masks starting to its bitmask being complete or cut
        self.thread_s = 0.0  # computing groups of masks, summed over the groups
        self.wait_s = 0.0  # the loop waiting for masks
        self.late_rows = 0
        self.started_at_launch = 0  # steps whose masks began filling at their launch (engine.constrained_lag)

    @property
    def busy(self) -> bool:
        """True while a step is open (until `finish`)."""
        return self._job is not None

    def holds(self, step: StepHandle) -> bool:
        return self._job is not None and self._job.step is step

    def fill_now(self, step: StepHandle) -> None:
        """Fill `step`'s bitmask in this thread and enqueue its sampler (the synchronous loop)."""
        began = time.perf_counter()
        bitmask = self.runner.bitmask_rows(step)
        rows = self._rows(step, bitmask)
        self.grammars.fill_bitmasks([(seq.matcher, k) for seq, k in rows], bitmask)
        self.fill_s += time.perf_counter() - began
        self.runner.enqueue_masked_sampler(step)

    def start(self, step: StepHandle, at_launch: bool = False) -> None:
        """Have the threads fill `step`'s bitmask; `finish` enqueues its sampler."""
        bitmask = self.runner.bitmask_rows(step)
        rows = self._rows(step, bitmask)
        job = _OpenStep(step, bitmask.numpy())
        fresh: list[Matcher] = []
        with self._changed:
            for seq, k in rows:
                matcher = seq.matcher
                if matcher.mask_ready:  # computed while the row sat out
                    job.rows[k] = matcher.mask
                    continue
                self._watch[matcher] = (job, k, seq.seq_id)
                job.fresh.append((seq.seq_id, k))
                job.waiting += 1
                if not matcher.mask_filling:
                    matcher.mask_filling = True
                    fresh.append(matcher)
            self._filling += len(fresh)
        self._job = job
        self.started_at_launch += at_launch
        if fresh and not self._threads:
            self._start_threads()
        for group in self._groups(fresh):
            self._queue.put(group)

    @staticmethod
    def _groups(matchers: list[Matcher]) -> list[list[Matcher]]:
        """Slow rows one to a group, first; the others split evenly into `GROUPS` groups."""
        alone = [[m] for m in matchers if m.slow]
        rest = [m for m in matchers if not m.slow]
        size = max(1, -(-len(rest) // GROUPS))
        return alone + [rest[i : i + size] for i in range(0, len(rest), size)]

    def finish(self) -> None:
        """Close the open step, if any: wait for its masks (on a GPU, until its forward has run and few are left),
        mark the rows still being computed late, and enqueue its masked sampler."""
        job = self._job
        if job is None:
            return
        self._job = None
        began = time.perf_counter()
        cut_at = max(1, int(len(job.fresh) * LATE_SHARE))
        deadline = self.late_masks and self.runner.cuda and not self.debug_late_every
        with self._changed:
            while job.waiting and not (deadline and job.waiting <= cut_at and self.runner.forward_finished(job.step)):
                self._changed.wait(timeout=0.0002)
            late = {}
            for matcher, (job_of, k, seq_id) in list(self._watch.items()):
                if job_of is job:
                    late[seq_id] = k
                    matcher.slow = True
                    del self._watch[matcher]
        if self.debug_late_every:
            late.update(self._debug_late(job))
        for k in late.values():
            job.rows[k] = -1  # anything: the token is dropped
        job.step.late = frozenset(late)
        self.late_rows += len(late)
        now = time.perf_counter()
        self.wait_s += now - began
        self.fill_s += now - job.started
        self.runner.enqueue_masked_sampler(job.step)

    def abandon(self) -> None:
        """The loop stopped early: let the threads finish with the matchers before they are dropped."""
        with self._changed:
            self._changed.wait_for(lambda: self._filling == 0)
            self._watch.clear()
        self._job = None

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        self.runner = None  # the runner holds the KV cache: nothing here may keep it past the engine's close

    @staticmethod
    def matchers_settled(step: StepHandle) -> bool:
        """True when `step` needs masks and each of its constrained rows has every earlier token consumed by its
        matcher (no other step of that row in flight)."""
        plan = step.plan
        rows = [seq for seq, sampled in zip(plan.seqs, plan.samples.tolist(), strict=True) if sampled and seq.matcher]
        return not step.sampled and bool(rows) and all(len(seq.pending) == 1 for seq in rows)

    def _rows(self, step: StepHandle, bitmask: torch.Tensor) -> list[tuple[Sequence, int]]:
        """Row k of `bitmask` is what the k-th constrained sampled row of `step` may sample. Writes the rows that
        need no matcher (a stopped row, a row whose token will be dropped, a token jump-forward already chose) and
        returns `(sequence, k)` for the others."""
        by_matcher, k = [], 0
        for seq, sampled in zip(step.plan.seqs, step.plan.samples.tolist(), strict=True):
            if not sampled or seq.matcher is None:
                continue
            if seq.status is Status.FINISHED or seq.stale:
                bitmask[k].fill_(-1)  # stopped at the previous step, or fed a dropped token: this row is discarded
            else:
                _, position = seq.pending[-1]
                if position < seq.forced_until:
                    one_hot_bitmask_(bitmask[k], int(seq.tokens[position]))  # jump-forward already chose it
                else:
                    by_matcher.append((seq, k))
            k += 1
        return by_matcher

    def _debug_late(self, job: _OpenStep) -> dict[int, int]:
        late = {}
        for seq_id, k in job.fresh:
            self._fresh += 1
            if self._fresh % self.debug_late_every == 0:
                late[seq_id] = k
        return late

    def _start_threads(self) -> None:
        count = min(32, max(2, int(0.8 * (os.cpu_count() or 2))))
        for index in range(count):
            thread = threading.Thread(target=self._work, name=f"batchjob-masks-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while (group := self._queue.get()) is not None:
            masks = np.empty((len(group), self.grammars.words), dtype=np.int32)
            began = time.perf_counter()
            try:
                self.grammars.fill_bitmasks([(m, i) for i, m in enumerate(group)], masks)
            except Exception:  # noqa: BLE001 - allow everything: the matchers refuse what they must and the rows error
                masks.fill(-1)
            spent = time.perf_counter() - began
            with self._changed:
                self.thread_s += spent
                for i, matcher in enumerate(group):
                    matcher.mask = masks[i]
                    matcher.mask_ready = True
                    matcher.mask_filling = False
                    if len(group) == 1:
                        matcher.slow = spent > SLOW_S
                    watch = self._watch.pop(matcher, None)
                    if watch is not None:
                        job, k, _ = watch
                        job.rows[k] = masks[i]
                        job.waiting -= 1
                self._filling -= len(group)
                self._changed.notify_all()
