"""The bitmasks of steps with constrained rows, filled on the host: in the loop's own thread (the synchronous
loop), or by one worker thread while the loop goes on (the asynchronous loop). llguidance computes the rows in
its own threads, off the GIL.

A step with constrained rows is launched as its forward only; `StepMasks` fills its bitmask rows from the rows'
matchers and then enqueues its masked sampler (`ModelRunner.enqueue_masked_sampler`). While the worker fills a
step's masks, the loop touches none of that step's matchers.

With `engine.mask_chunk_rows` the masks of the step in flight do not wait for the whole previous step to be
processed: `begin` sends the rows whose matchers are already settled (their sequences were not in the step being
processed), and `settle` the rows of each chunk of processed sequences, each chunk one llguidance call from a
worker thread of its own (the calls share llguidance's threads), while the loop processes the next chunk.

Where the runner has gates (`ModelRunner.use_gates`: not with chunked fills), `start` enqueues the step's masked
sampler as it hands the rows to the worker, behind a wait that the worker opens the moment the bitmask is filled.
Without them, in the asynchronous loop the step's masked sampler is enqueued as soon as its bitmask is filled,
so the GPU samples the moment the masks are there instead of when the loop next waits for them: the loop calls
`poll` between pieces of its work (every few dozen rows it processes, after admitting, after scheduling), and
`poll` enqueues the sampler, in the loop's thread, once the fill is done. The worker enqueuing it itself lost:
each of the dozen CUDA calls of an enqueue releases the GIL, and getting it back from the loop's Python work took
up to a switch interval each time (0.5-1.2 ms an enqueue on a GPU host, against 0.24 ms from the loop's thread).

The worker needs the GIL to reach the library's call and again right after it, and the loop's own Python work
would hold it off for up to the interpreter's switch interval (5 ms) each time. So the loop, having handed the
rows over, waits without the GIL until the worker is about to enter the call; and while masks fill, the switch
interval is cut to `SWITCH_INTERVAL_S`, so that the worker gets the GIL back soon after the call to mark its fill
done; it is restored when the run ends.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import compress
from typing import TYPE_CHECKING, Any

from batchjob.engine.native.sampling.token_mask import one_hot_bitmask_
from batchjob.engine.native.scheduling.sequence import Status

if TYPE_CHECKING:
    import torch

    from batchjob.engine.grammar import GrammarCompiler
    from batchjob.engine.native.runtime.step_handle import StepHandle
    from batchjob.engine.native.scheduling.sequence import Sequence

# Worker threads for chunked fills: enough for the chunks of one step to overlap each other's waits.
CHUNK_WORKERS = 8
# How long a thread that wants the GIL waits for the thread holding it, while masks are filling (Python's default
# is 5 ms, more than a GPU step of a small model).
SWITCH_INTERVAL_S = 0.0002


class StepMasks:
    def __init__(self, runner: Any, grammars: GrammarCompiler, chunked: bool = False) -> None:
        self.runner = runner
        self.grammars = grammars
        self._workers = CHUNK_WORKERS if chunked else 1
        self._worker: ThreadPoolExecutor | None = None  # started with the first step it fills
        # The step being filled and its fills.
        self._job: tuple[StepHandle, list[Future]] | None = None
        self._switch_interval: float | None = None  # the interpreter's own, while this has cut it
        # A step being filled chunk by chunk: its bitmask, and its rows not yet sent by sequence id.
        self._bitmask: torch.Tensor | None = None
        self._unsettled: dict[int, tuple[Sequence, int]] = {}
        self._spans: list[tuple[float, float]] = []  # (start, end) of each fill call of the step
        self.fill_s = 0.0  # filling bitmasks, wherever it ran (a chunked step: first call's start to last's end)
        self.wait_s = 0.0  # the loop waiting for the worker's bitmasks
        self.fill_calls = 0  # grammar-library calls that filled bitmask rows
        self.started_at_launch = 0  # steps whose masks began filling at their launch (engine.constrained_lag)
        self.started_early = 0  # steps whose masks began filling before the step ahead was all processed
        self.sampled_at_poll = 0  # steps whose sampler `poll` enqueued (the others: `finish`, which waited)

    @property
    def busy(self) -> bool:
        """True while the worker holds a step (until `finish`)."""
        return self._job is not None

    @property
    def gated(self) -> bool:
        """True while the step the worker fills has its masked sampler on the GPU already, behind its gate."""
        return self._job is not None and self._job[0].gate is not None

    def holds(self, step: StepHandle) -> bool:
        return self._job is not None and self._job[0] is step

    def fill_now(self, step: StepHandle) -> None:
        """Fill `step`'s bitmask in this thread and enqueue its sampler (the synchronous loop)."""
        bitmask = self.runner.bitmask_rows(step)
        rows = self._rows(step, bitmask)
        self.fill_calls += bool(rows)
        self._fill(rows, bitmask)
        self._count_fill_time()
        self.runner.enqueue_masked_sampler(step)

    def start(self, step: StepHandle, at_launch: bool = False, early: bool = False) -> None:
        """Have the worker fill `step`'s bitmask; `poll` or `finish` enqueues its sampler. `early`: the step before
        it is still being processed, its tokens already in the matchers (a row that stops there is filled for
        nothing)."""
        self._start(step, None)
        self.started_at_launch += at_launch
        self.started_early += early

    def advance_and_start(self, step: StepHandle, pairs: list) -> Future:
        """`start` from the step before `step` as it begins being processed: the worker first advances that
        step's matchers by their tokens (`pairs` of (matcher, token)), then fills `step`'s bitmask. Returns the
        future of `GrammarCompiler.advance`'s answer, set before the fill begins."""
        advanced: Future = Future()
        self._start(step, (pairs, advanced))
        self.started_early += 1
        return advanced

    def _start(self, step: StepHandle, advance: tuple[list, Future] | None) -> None:
        bitmask = self.runner.bitmask_rows(step)
        rows = self._rows(step, bitmask)
        gated = self.runner.arm_gate(step)
        self._job = (step, [self._submit(rows, bitmask, step if gated else None, advance)])
        if gated:
            # Enqueued while the worker fills: from here on only the worker opens the gate, and this thread's
            # next launches (which may block on it, host_gate.py) never wait for this thread.
            self.runner.enqueue_gated_sampler(step)

    def begin(self, step: StepHandle, processing: Iterable[Sequence]) -> None:
        """Fill `step`'s bitmask chunk by chunk: the rows of sequences outside `processing` (the step whose tokens
        are being processed) go now, the others as `settle` names them; `settle_rest` sends what is left."""
        self._bitmask = self.runner.bitmask_rows(step)
        self._unsettled = {seq.seq_id: (seq, k) for seq, k in self._constrained_rows(step)}
        self._job = (step, [])
        busy = {seq.seq_id for seq in processing}
        self.settle(seq for seq, _ in list(self._unsettled.values()) if seq.seq_id not in busy)

    def settle(self, seqs: Iterable[Sequence]) -> None:
        """These sequences' matchers are final for the step being filled: send their rows."""
        if self._job is None or not self._unsettled:
            return
        rows = []
        for seq in seqs:
            entry = self._unsettled.pop(seq.seq_id, None)
            if entry is not None and self._row(seq, entry[1], self._bitmask):
                rows.append((seq.matcher, entry[1]))
        if rows:
            self._job[1].append(self._submit(rows, self._bitmask))

    def settle_rest(self) -> None:
        self.settle([seq for seq, _ in list(self._unsettled.values())])

    def poll(self) -> None:
        """Enqueue the masked sampler of the step being filled if its bitmask is done (cheap when it is not, or
        when nothing is filling). A chunked fill is left to `finish`: its rows are sent as the loop settles them."""
        job = self._job
        if job is not None and not self._unsettled and job[1] and all(fill.done() for fill in job[1]):
            self.finish()
            self.sampled_at_poll += 1

    def finish(self) -> None:
        """Wait for the worker's bitmask, if one is being filled, and enqueue that step's masked sampler."""
        if self._job is None:
            return
        self.settle_rest()
        step, jobs = self._job
        self._job = None
        began = time.perf_counter()
        for job in jobs:
            job.result()
        self.wait_s += time.perf_counter() - began
        self._count_fill_time()
        self.runner.enqueue_masked_sampler(step)

    def abandon(self) -> None:
        """The loop ended (early, or with nothing left to fill): let the worker finish with the matchers before they
        are dropped, and give the interpreter its own switch interval back."""
        self._restore_switch_interval()
        if self._job is not None:
            for job in self._job[1]:
                job.exception()
            self._job = None
            self._unsettled = {}
            self._spans = []

    def close(self) -> None:
        self._restore_switch_interval()
        if self._worker is not None:
            self._worker.shutdown()
        self.runner = None  # the runner holds the KV cache: nothing here may keep it past the engine's close

    def _restore_switch_interval(self) -> None:
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    @staticmethod
    def matchers_settled(step: StepHandle) -> bool:
        """True when `step` needs masks and each of its constrained rows has every earlier token consumed by its
        matcher (no other step of that row in flight)."""
        rows = StepMasks._constrained_rows(step)
        return not step.sampled and bool(rows) and all(len(seq.pending) == 1 for seq, _ in rows)

    @staticmethod
    def _constrained_rows(step: StepHandle) -> list[tuple[Sequence, int]]:
        """Each constrained sampled row of `step` with its bitmask row: the k-th such row has row k."""
        return [(seq, k) for k, seq in enumerate(compress(step.plan.sampled, step.plan.constrained.tolist()))]

    @staticmethod
    def _row(seq: Sequence, k: int, bitmask: torch.Tensor) -> bool:
        """Write row `k` of `bitmask` if it needs no matcher (a stopped row, a token jump-forward already chose);
        True when the matcher must fill it."""
        if seq.status is Status.FINISHED:
            bitmask[k].fill_(-1)  # stopped at the previous step: this row is discarded
            return False
        _, position = seq.pending[-1]
        if position < seq.forced_until:
            one_hot_bitmask_(bitmask[k], int(seq.tokens[position]))  # jump-forward already chose it
            return False
        return True

    def _rows(self, step: StepHandle, bitmask: torch.Tensor) -> list:
        """Row k of `bitmask` is what the k-th constrained sampled row of `step` may sample. Writes the rows that
        need no matcher and returns `(matcher, k)` for the others."""
        plan = step.plan
        seqs = compress(plan.sampled, plan.constrained.tolist())
        running = Status.RUNNING
        # Most rows, in one pass: running, nothing forced (jump-forward); `_row` settles the others.
        return [
            (seq.matcher, k)
            for k, seq in enumerate(seqs)
            if (seq.status is running and not seq.forced_until) or self._row(seq, k, bitmask)
        ]

    def _count_fill_time(self) -> None:
        if self._spans:
            self.fill_s += max(end for _, end in self._spans) - min(start for start, _ in self._spans)
            self._spans = []

    def _submit(
        self,
        rows: list,
        bitmask: torch.Tensor,
        opens: StepHandle | None = None,
        advance: tuple[list, Future] | None = None,
    ) -> Future:
        """Fill `rows` of `bitmask` on a worker (having first advanced the matchers of `advance`, and set its
        future); one that fills a whole step (`opens`) opens its gate right after, if its sampler waits behind one
        (split_steps.py), without waiting for the loop's next `poll`."""
        self.fill_calls += bool(rows)  # counted here, in the loop's thread
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="batchjob-masks")
        if self._switch_interval is None:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(SWITCH_INTERVAL_S, self._switch_interval))
        # The worker needs the GIL to reach the library's call, and the loop's Python work would hold it for up
        # to a switch interval first (the masks then started late, measured even with the interval cut). So the
        # loop waits here, without the GIL, until the worker is about to enter the call.
        # A job queued behind busy workers is not waited for: that would hold the loop for a whole fill.
        idle = self._job is None or sum(not job.done() for job in self._job[1]) < self._workers
        entering = threading.Event()
        job = self._worker.submit(self._fill, rows, bitmask, entering.set, opens, advance)
        if idle:
            entering.wait()
        return job

    def _fill(
        self,
        rows: list,
        bitmask: torch.Tensor,
        entering: Callable[[], None] | None = None,
        opens: StepHandle | None = None,
        advance: tuple[list, Future] | None = None,
    ) -> None:
        began = time.perf_counter()
        try:
            if advance is not None:
                pairs, advanced = advance
                if entering is not None:
                    entering()
                    entering = None
                try:
                    advanced.set_result(self.grammars.advance(pairs))
                except BaseException as err:
                    advanced.set_exception(err)  # the loop waiting for it raises it
                    raise
                began = time.perf_counter()  # the fill's own time from here
            self.grammars.fill_bitmasks(rows, bitmask, entering)
        finally:
            if entering is not None:
                entering()  # never leave the loop waiting, whatever the fill raised
            if opens is not None:
                # Never leave the GPU waiting either: a fill that raised lets the sampler run on what it wrote,
                # and `finish` raises its error before the tokens are used.
                self.runner.open_gate(opens)
        self._spans.append((began, time.perf_counter()))  # list.append is atomic: the chunks' threads share it
