"""The CUDA graphs of a runner's steps: what is captured, how, and which graph replays a laid-out step.

Per IO slot (a graph is bound to the addresses of its slot's buffers) and per sampler mode: a decode graph per
batch-size bucket, a mixed graph per token-count bucket, and for steps with constrained rows the two halves of
a split step (the forward per bucket, the masked sampler per bucket and mode), of decode and of mixed steps:
with jump-forward (`engine.jump_forward`) a constrained row's forced tokens come as one chunk, so most of its steps
are mixed.
step_layout.py says how a step is padded to a graph's shape. All graphs share one memory pool
(`torch.cuda.graph_pool_handle()`), which is safe because they only ever replay one at a time, on the compute
stream; the largest steps are captured first, so the smaller ones reuse their memory.

A capture runs its step once eagerly (lazy initialisation, autotuning), then records it, from inputs whose
every token is padding in the scratch block. Once captured, each decode graph is replayed and timed: a bucket
that a larger one beats is dropped from the buckets steps pad to (`step_layout.fastest_buckets`), and a count of
decodes that a smaller bucket runs at more tokens a second runs that bucket's rows (`step_layout.decode_rows`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Protocol

import torch

from batchjob.engine.native.models.decoder import CausalLM
from batchjob.engine.native.runtime.io_slot import IOSlot, StepShape
from batchjob.engine.native.runtime.step_layout import GraphBuckets, StepLayout, decode_rows, fastest_buckets
from batchjob.engine.native.sampling.sampler import SamplerMode


class StepRunner(Protocol):
    """What capturing a runner's graphs needs of it (`model_runner.ModelRunner` is the one implementation): its
    two IO slots, its compute stream, and the three launches a graph records."""

    device: torch.device
    cuda: bool
    model: CausalLM
    slots: list[IOSlot]
    compute: torch.cuda.Stream  # on a CUDA device
    max_model_len: int

    def run_step(
        self, slot: IOSlot, prev: IOSlot, shape: StepShape, max_query_len: int, max_seq_len: int, mode: SamplerMode
    ) -> None: ...

    def run_forward(
        self, slot: IOSlot, prev: IOSlot, shape: StepShape, max_query_len: int, max_seq_len: int
    ) -> None: ...

    def run_masked_sampler(self, slot: IOSlot, shape: StepShape, mode: SamplerMode) -> None: ...


log = logging.getLogger("batchjob.engine.native")

# Replays of each decode graph timed to choose the buckets, after one untimed.
TIMED_REPLAYS = 1


@contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream) -> Iterator[None]:
    """`torch.cuda.graph` without its `empty_cache()` on entry: that would hand back the blocks the KV-sizing
    profile and the warm-up left cached for eager steps, which would then cudaMalloc next to a nearly full
    card, blocking the CPU until the step in flight ends (measured on W2: eager launches 33 ms instead of 9)."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        finally:
            graph.capture_end()


def _ranges(counts: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    runs: list[list[int]] = []
    for count in counts:
        if runs and count == runs[-1][-1] + 1:
            runs[-1].append(count)
        else:
            runs.append([count])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def prepare_dummy(slot: IOSlot, prev: IOSlot, shape: StepShape, max_model_len: int) -> None:
    """Valid inputs for a capture: every token padding in the scratch block (a one-token sequence per token
    while sequences last, as io_slot.py pads), no constrained row, no carry-over."""
    slot.dev_int.zero_()
    slot.dev_tables.zero_()
    slot.dev_float.zero_()
    ints, meta, params = slot.device_views(shape, 1, max_model_len)
    seqs = torch.arange(shape.seqs + 1, dtype=torch.int32, device=slot.dev_meta.device)
    meta.cu_query_lens.copy_(seqs.clamp(max=shape.tokens))
    meta.seq_lens.copy_((seqs[:-1] < shape.tokens).to(torch.int32))
    meta.decode_order.copy_(seqs[:-1])
    ints["mask_rows"].fill_(-1)
    params.top_p.fill_(1.0)
    prev.dev_tokens.zero_()


class StepGraphs:
    """Every captured graph of one runner, and the buckets (`buckets`) that step layouts may use."""

    def __init__(self, runner: StepRunner) -> None:
        # A proxy: the runner holds this object, and a reference cycle would keep the runner's KV cache (most of
        # the card) allocated after the engine closes, until the garbage collector happens to run.
        self.runner = weakref.proxy(runner)
        self.decode: dict[tuple[int, int, SamplerMode], torch.cuda.CUDAGraph] = {}
        self.mixed: dict[tuple[int, int, SamplerMode], torch.cuda.CUDAGraph] = {}
        self.forward: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.masked: dict[tuple[int, int, SamplerMode], torch.cuda.CUDAGraph] = {}
        self.mixed_forward: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.mixed_masked: dict[tuple[int, int, SamplerMode], torch.cuda.CUDAGraph] = {}
        self.errors: list[str] = []
        self.buckets = GraphBuckets()
        self.decode_seconds: dict[int, float] = {}  # a replay of each decode bucket's graph (first mode, slot 0)

    def for_step(self, slot: int, layout: StepLayout, split: bool) -> torch.cuda.CUDAGraph | None:
        """The graph that replays `layout` in `slot` (with `split`, its forward alone), or None: run it
        eagerly (at its padded shape, if its graph was never captured)."""
        if layout.bucket is None:
            return None
        if layout.mixed:
            if split:
                return self.mixed_forward.get((slot, layout.bucket))
            return self.mixed.get((slot, layout.bucket, layout.mode))
        if split:
            return self.forward.get((slot, layout.bucket))
        return self.decode.get((slot, layout.bucket, layout.mode))

    def masked_sampler(self, slot: int, layout: StepLayout) -> torch.cuda.CUDAGraph:
        """The masked-sampler half of a split step whose forward replayed a graph."""
        if layout.mixed:
            return self.mixed_masked[(slot, layout.bucket, layout.mode)]
        return self.masked[(slot, layout.bucket, layout.mode)]

    @property
    def split_count(self) -> int:
        """How many graphs are halves of split steps (steps with constrained rows)."""
        return len(self.forward) + len(self.masked) + len(self.mixed_forward) + len(self.mixed_masked)

    def capture(
        self, decode: list[int], modes: tuple[SamplerMode, ...], split: bool, mixed: list[int]
    ) -> tuple[float, int]:
        """Capture, for both slots and each mode, the largest first: mixed steps of every `mixed` token bucket,
        decode steps of every `decode` bucket (with `split`, also the halves of both kinds of steps with
        constrained rows). Returns the seconds and device bytes it took. The first mode's decode graphs must
        capture; any other graph that fails is logged and its steps left to run eagerly."""
        device = self.runner.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for mode in modes:
            mixed_steps = [partial(self._mixed, b, mode, pool, split) for b in sorted(mixed, reverse=True)]
            self._capture_all(f"mixed steps with {mode}", mode, mixed_steps)
            decode_steps = [partial(self._decode, b, mode, pool, split) for b in sorted(decode, reverse=True)]
            self._capture_all(f"decode steps with {mode}", mode, decode_steps, required=mode == modes[0])
        self.decode_seconds = self._time_decode(sorted(decode), modes[0])
        kept = fastest_buckets(self.decode_seconds)
        if len(kept) < len(decode):
            log.info("decode steps pad to %d of the %d buckets: %s", len(kept), len(decode), self._dropped(kept))
        self.buckets = GraphBuckets(
            decode=kept,
            modes=frozenset(key[2] for key in self.decode),
            masked_modes=frozenset(key[2] for key in self.masked),
            mixed=tuple(sorted(mixed)),
            mixed_modes=frozenset(key[2] for key in self.mixed),
            mixed_masked_modes=frozenset(key[2] for key in self.mixed_masked),
            mixed_seqs=self.runner.slots[0].limits.max_rows,
            decode_rows=decode_rows({b: self.decode_seconds[b] for b in kept}),
        )
        if capped := [count for count, rows in enumerate(self.buckets.decode_rows) if rows < count]:
            log.info("decode steps of %s rows run fewer, the rest sitting a step out", _ranges(capped))
        torch.cuda.synchronize(device)
        return time.perf_counter() - start, torch.cuda.memory_reserved(device) - before

    def _time_decode(self, buckets: list[int], mode: SamplerMode) -> dict[int, float]:
        """Seconds a replay of each bucket's decode graph takes (slot 0, `mode`), from the captures' inputs.
        Every rank of a tensor-parallel engine replays the same graphs in the same order: their collectives
        meet."""
        runner = self.runner
        slot, prev = runner.slots
        seconds = {}
        for bucket in buckets:
            graph = self.decode[(slot.index, bucket, mode)]
            prepare_dummy(slot, prev, StepShape(tokens=bucket, seqs=bucket, rows=bucket), runner.max_model_len)
            runner.compute.wait_stream(torch.cuda.current_stream(runner.device))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(runner.compute):
                graph.replay()
                start.record()
                for _ in range(TIMED_REPLAYS):
                    graph.replay()
                end.record()
            end.synchronize()
            seconds[bucket] = start.elapsed_time(end) / 1e3 / TIMED_REPLAYS
        return seconds

    def _dropped(self, kept: tuple[int, ...]) -> str:
        """Each dropped bucket's replay time beside the one its steps now pad to, for the log."""
        ms = {b: f"{t * 1e3:.2f} ms" for b, t in self.decode_seconds.items()}
        pads_to = {b: next(k for k in kept if k > b) for b in self.decode_seconds if b not in kept}
        return ", ".join(f"{b} ({ms[b]}) to {k} ({ms[k]})" for b, k in pads_to.items())

    def _capture_all(
        self, what: str, mode: SamplerMode, captures: list[Callable[[], None]], required: bool = False
    ) -> None:
        try:
            for capture in captures:
                capture()
        except RuntimeError as exc:
            if required:
                raise
            log.warning("%s run eagerly: capturing them failed (%s)", what, exc)
            self.errors.append(f"{what}: {exc}")
            # A mode that failed drops its split halves too (the forward halves serve every mode).
            mixed = what.startswith("mixed")
            dropped = [self.mixed, self.mixed_masked] if mixed else [self.decode, self.masked]
            for graphs in dropped:
                for key in [key for key in graphs if key[2] == mode]:
                    del graphs[key]
            torch.cuda.synchronize(self.runner.device)

    def _record(self, work: Callable[[], None], pool, warm_up: bool = True) -> torch.cuda.CUDAGraph:
        compute = self.runner.compute
        if warm_up:
            # Autotuning, lazy initialisation, compiles: nothing of the kind may happen mid-capture. One layer of
            # each kind launches every kernel variant the capture will, on the inputs `prepare_dummy` set.
            compute.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(compute), self.runner.model.kernel_layers():
                work()
            compute.synchronize()
        graph = torch.cuda.CUDAGraph()
        # All graphs share one pool: safe because they only ever run one at a time, on `compute`.
        with _capturing(graph, pool, compute):
            work()
        return graph

    def _slots(self, shape: StepShape) -> Iterator[tuple[IOSlot, IOSlot]]:
        """Each slot with the slot before it (whose sampled tokens its carry-over reads), dummy inputs set."""
        runner = self.runner
        for slot in runner.slots:
            prev = runner.slots[1 - slot.index]
            prepare_dummy(slot, prev, shape, runner.max_model_len)
            yield slot, prev

    def launch_uncaptured(
        self, decode: list[int], modes: tuple[SamplerMode, ...], split: bool, mixed: list[int]
    ) -> None:
        """Launch once, eagerly, the work of every graph `capture` would capture, capturing none: the steps that
        list a start-up's kernel variants (`kernel_variants.skipping_launches`). This object's graphs are then
        placeholders: a runner that ran this is thrown away."""
        for mode in modes:
            for bucket in sorted(mixed, reverse=True):
                self._mixed(bucket, mode, None, split, record=self._launch_once)
            for bucket in sorted(decode, reverse=True):
                self._decode(bucket, mode, None, split, record=self._launch_once)

    def _launch_once(self, work: Callable[[], None], pool, warm_up: bool = True) -> None:
        runner = self.runner
        if runner.cuda:
            # `prepare_dummy` set the inputs on the current stream, possibly behind the steps before (the KV
            # sizing's): without this wait the compute stream could read them unset, as indices.
            runner.compute.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(runner.compute) if runner.cuda else nullcontext(), runner.model.kernel_layers():
            work()

    def _decode(self, bucket: int, mode: SamplerMode, pool, split: bool, record: Callable | None = None) -> None:
        record = record or self._record
        runner, shape = self.runner, StepShape(tokens=bucket, seqs=bucket, rows=bucket)
        for slot, prev in self._slots(shape):
            step = partial(runner.run_step, slot, prev, shape, 1, runner.max_model_len, mode)
            self.decode[(slot.index, bucket, mode)] = record(step, pool)
            if not split:
                continue
            if (slot.index, bucket) not in self.forward:
                forward = partial(runner.run_forward, slot, prev, shape, 1, runner.max_model_len)
                self.forward[(slot.index, bucket)] = record(forward, pool)
            sampler = partial(runner.run_masked_sampler, slot, shape, mode)
            self.masked[(slot.index, bucket, mode)] = record(sampler, pool)

    def _mixed(self, bucket: int, mode: SamplerMode, pool, split: bool, record: Callable | None = None) -> None:
        record = record or self._record
        runner = self.runner
        seqs = runner.slots[0].limits.max_rows
        shape = StepShape(tokens=bucket, seqs=seqs, rows=seqs)
        for slot, prev in self._slots(shape):
            # A query bound above 1 selects the varlen prefill kernel, the one that runs every mix of chunks.
            step = partial(runner.run_step, slot, prev, shape, bucket, runner.max_model_len, mode)
            # The second slot's step launches the kernels the first slot's warm-up ran, at the same sizes: a
            # second eager run of thousands of tokens would only lengthen the start-up.
            self.mixed[(slot.index, bucket, mode)] = record(step, pool, warm_up=slot.index == 0)
            if not split:
                continue
            if (slot.index, bucket) not in self.mixed_forward:
                forward = partial(runner.run_forward, slot, prev, shape, bucket, runner.max_model_len)
                self.mixed_forward[(slot.index, bucket)] = record(forward, pool, warm_up=False)
            sampler = partial(runner.run_masked_sampler, slot, shape, mode)
            self.mixed_masked[(slot.index, bucket, mode)] = record(sampler, pool)
