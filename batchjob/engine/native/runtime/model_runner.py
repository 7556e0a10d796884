"""Runs steps on the device: two IO slots, three CUDA streams ordered by events, carry-over, CUDA graphs.

A step goes H2D stream -> compute stream -> D2H stream. Ordering is by events only:

- the H2D copy into slot s waits for the compute of the previous step that read slot s (`compute_done`);
- compute waits for its own copy (`h2d_done`) and for the previous D2H out of slot s (`d2h_done`), since it
  overwrites slot s's sampled-token buffer;
- D2H waits for compute; the CPU blocks only on `d2h_done` of the step whose tokens it needs.

Consecutive steps use alternate slots, so the CPU fills slot B while the GPU computes from slot A. The next
step's carry-over reads the previous slot's sampled tokens on the compute stream, after the previous forward.
On CPU the same code runs without streams or events (all work is synchronous there). Which steps replay a
CUDA graph, and how they are padded to its shape: step_layout.py; the graphs themselves: graphs.py. A step
laid out for a graph that was never captured (a CPU runner given buckets, in tests) runs the same work eagerly.

Structured outputs split a step with constrained rows in two: split_steps.py.
A tensor-parallel engine never has constrained rows (the engine refuses them), so `launch_packed` launches whole.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from batchjob.engine.native.runtime import blas
from batchjob.engine.native.runtime.busy_clock import BusyClock
from batchjob.engine.native.runtime.graphs import StepGraphs
from batchjob.engine.native.runtime.host_gate import HostGates
from batchjob.engine.native.runtime.io_slot import IOSlot, SlotLimits, StepShape
from batchjob.engine.native.runtime.split_steps import SplitStepSampling
from batchjob.engine.native.runtime.step_handle import PreparedStep, StepHandle, StepResult
from batchjob.engine.native.runtime.step_layout import GraphBuckets, StepLayout, layout_step
from batchjob.engine.native.sampling.sampler import SamplerMode, sample
from batchjob.engine.native.sampling.token_mask import TokenMask
from batchjob.engine.native.scheduling.plan import StepPlan

if TYPE_CHECKING:
    from batchjob.engine.native.runtime.packed_step import PackedStep


class _SlotEvents:
    def __init__(self) -> None:
        self.h2d_done = torch.cuda.Event()
        self.compute_done = torch.cuda.Event()
        self.d2h_done = torch.cuda.Event()
        self.bitmask_done = torch.cuda.Event()


class ModelRunner(SplitStepSampling):
    def __init__(
        self,
        model,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        limits: SlotLimits,
        device: torch.device,
        max_model_len: int,
        vocab_size: int,
        debug_poison: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.debug_poison = debug_poison
        self.cuda = device.type == "cuda"
        self.slots = [IOSlot(i, limits, device) for i in range(2)]
        # Where a split step's forward leaves its logits for its sampler, in the model's dtype (soft-capped ones in
        # float32: the cap is computed there); a sampler that draws or returns log-probabilities converts them to
        # float32 (`logits`) first, a greedy one takes the argmax of the model's own. One buffer of each serves
        # both slots: nothing runs on the compute stream between a step's forward and its sampler.
        self.logits = torch.zeros((limits.max_rows, vocab_size), dtype=torch.float32, device=device)
        spec = model.spec
        own = spec.dtype if spec.final_softcap <= 0 else torch.float32
        self.split_logits = self.logits if own == torch.float32 else torch.zeros_like(self.logits, dtype=own)
        self.step_index = 0
        self.graphs = StepGraphs(self)
        if self.cuda:
            self.h2d, self.compute, self.d2h = (torch.cuda.Stream(device) for _ in range(3))
            for slot in self.slots:
                slot.events = _SlotEvents()
        self.gates: HostGates | None = None  # see `use_gates`
        self.bitmask_h2d: torch.cuda.Stream | None = None  # the gated bitmask copies' stream
        self.reset_counters()

    def reset_counters(self) -> None:
        """Step counters and the GPU-busy clock from zero (the warm-up's steps are not the run's)."""
        self.prep_s = 0.0
        self.fill_s = 0.0
        self.sampler_launch_s = 0.0  # enqueuing the masked samplers of split steps
        self.collect_wait_s = 0.0  # the loop waiting for a step's tokens
        self.launch_s = [0.0, 0.0]  # graph steps, eager steps
        self.steps = 0
        self.graph_steps = 0  # replayed a graph (decode or mixed); the rest ran eagerly
        self.mixed_graph_steps = 0
        self.masked_steps = 0
        self.gated_steps = 0  # split steps whose masked sampler waited on the GPU behind a gate
        self.tokens_fed = 0
        self.clock = BusyClock() if self.cuda else None

    def _stream(self, stream):
        return torch.cuda.stream(stream) if self.cuda else nullcontext()

    # ---- the work of one step (eager, or recorded into a graph) ----

    def _logits(
        self,
        slot: IOSlot,
        prev: IOSlot,
        shape: StepShape,
        max_query_len: int,
        max_seq_len: int,
        out: torch.Tensor | None = None,
        float32: bool = True,
    ) -> torch.Tensor:
        ints, meta, _ = slot.device_views(shape, max_query_len, max_seq_len)
        # Carry-over: tokens the previous step sampled (still unknown to the CPU) replace their placeholders.
        input_ids = ints["input_ids"]
        input_ids.add_(prev.dev_tokens[ints["carry_idx"]] * ints["carry_mask"])
        with blas.for_rows(shape.tokens, self.device, self.model.spec.dtype):
            hidden = self.model(input_ids, ints["positions"], meta, self.kv_caches)
            return self.model.compute_logits(hidden[ints["logits_indices"]], out, float32)

    def _sample(self, slot: IOSlot, shape: StepShape, mode: SamplerMode, logits: torch.Tensor, masked: bool) -> None:
        mask = TokenMask(slot.dev_bitmask, slot.int_views(shape)["mask_rows"]) if masked else None
        out = sample(logits, slot.sampling_tensors(shape), mode, mask)
        slot.dev_tokens[: shape.rows].copy_(out.tokens)
        if out.logprobs is not None:
            slot.dev_logprobs[: shape.rows].copy_(out.logprobs)
        if out.top_ids is not None:
            k = out.top_ids.shape[1]
            slot.dev_top_ids[: shape.rows, :k].copy_(out.top_ids)
            slot.dev_top_logprobs[: shape.rows, :k].copy_(out.top_logprobs)

    def run_step(
        self, slot: IOSlot, prev: IOSlot, shape: StepShape, max_query_len: int, max_seq_len: int, mode: SamplerMode
    ) -> None:
        """A whole step: forward and sampler. A greedy step without log-probabilities takes the argmax of the
        model's own logits (no float32 copy of them)."""
        greedy = not mode.sampling and mode.logprobs is None
        logits = self._logits(slot, prev, shape, max_query_len, max_seq_len, float32=not greedy)
        self._sample(slot, shape, mode, logits, masked=False)

    def run_forward(self, slot: IOSlot, prev: IOSlot, shape: StepShape, max_query_len: int, max_seq_len: int) -> None:
        """The first half of a split step: the forward, its logits left in `self.split_logits`."""
        self._logits(slot, prev, shape, max_query_len, max_seq_len, out=self.split_logits[: shape.rows])

    # ---- launching, sampling and collecting steps ----

    @property
    def graph_buckets(self) -> GraphBuckets:
        """The shapes of the captured graphs, which steps are padded to (the scheduler fills mixed ones)."""
        return self.graphs.buckets

    def launch(self, plan: StepPlan) -> StepHandle:
        """Enqueue `plan`: the whole step, or for a step with constrained rows only its forward (then
        `sample_masked`)."""
        return self.launch_prepared(self.prepare(plan))

    def prepare(self, plan: StepPlan) -> PreparedStep:
        """Lay `plan` out and write it into the next slot's host buffers, enqueuing nothing yet: the engine
        prepares a step while the bitmask of the step before it is still being computed."""
        began = time.perf_counter()
        layout = layout_step(plan, self.graphs.buckets)
        slot = self._take_slot()
        masked_rows = slot.fill(plan, layout.shape, self.block_size)
        return PreparedStep(plan, slot, layout, masked_rows, time.perf_counter() - began)

    def launch_prepared(self, prepared: PreparedStep) -> StepHandle:
        """Enqueue a prepared step; every earlier step's sampler must be enqueued already (carry-over)."""
        return self._enqueue(prepared.slot, prepared.layout, prepared.plan, prepared.fill_s, prepared.masked_rows)

    def launch_packed(self, packed: PackedStep) -> StepHandle:
        """Launch a step that another process laid out and filled (the job process of a tensor-parallel
        engine, `rank_group.py`); its handle has no plan."""
        began = time.perf_counter()
        slot = self._take_slot()
        packed.unpack_into(slot)
        return self._enqueue(slot, packed.layout, None, time.perf_counter() - began)

    def _take_slot(self) -> IOSlot:
        slot = self.slots[self.step_index % 2]
        self.step_index += 1
        if self.cuda:
            # The host buffers of this slot were last read by the copy two steps ago.
            slot.events.h2d_done.synchronize()
        if self.debug_poison:
            if self.cuda:
                slot.events.bitmask_done.synchronize()
            slot.poison_host_inputs()
        return slot

    def _enqueue(
        self, slot: IOSlot, layout: StepLayout, plan: StepPlan | None, fill_s: float, masked_rows: int = 0
    ) -> StepHandle:
        """H2D copy, forward and sampling, D2H copy of a step whose inputs are in `slot`'s host buffers; with
        `masked_rows`, only the H2D copy and the forward (`sample_masked` enqueues the rest)."""
        prev = self.slots[1 - slot.index]
        shape, mode, rows = layout.shape, layout.mode, layout.rows
        filled = time.perf_counter()
        self.fill_s += fill_s
        graph = self.graphs.for_step(slot.index, layout, split=masked_rows > 0)
        graphed = layout if graph is not None else None
        step = StepHandle(plan, slot, shape, rows, mode, masked_rows=masked_rows, graph_layout=graphed)

        with self._stream(self.h2d if self.cuda else None):
            if self.cuda:
                self.h2d.wait_event(slot.events.compute_done)
                if self.debug_poison:
                    slot.dev_int.fill_(-7777)
                    slot.dev_tables.fill_(-7777)
            slot.copy_inputs(shape)
            if self.cuda:
                slot.events.h2d_done.record(self.h2d)
        with self._stream(self.compute if self.cuda else None):
            if self.cuda:
                self.compute.wait_event(slot.events.h2d_done)
                self.compute.wait_event(slot.events.d2h_done)
                timing = self.clock.pair()
                timing[0].record(self.compute)
            if graph is not None:
                graph.replay()
            elif masked_rows:
                self.run_forward(slot, prev, shape, layout.max_query_len, layout.max_seq_len)
            else:
                self.run_step(slot, prev, shape, layout.max_query_len, layout.max_seq_len, mode)
            if self.cuda:
                timing[1].record(self.compute)
                if not masked_rows:
                    slot.events.compute_done.record(self.compute)
        if masked_rows:
            step.sampled = False
        else:
            self._enqueue_d2h(step)
        done = time.perf_counter()
        self.prep_s += fill_s + done - filled
        self.launch_s[0 if graph is not None else 1] += done - filled
        self.steps += 1
        self.graph_steps += graph is not None
        self.mixed_graph_steps += graph is not None and layout.mixed
        self.tokens_fed += layout.tokens
        return step

    def _enqueue_d2h(self, step: StepHandle) -> None:
        slot, rows = step.slot, step.rows
        with self._stream(self.d2h if self.cuda else None):
            if self.cuda:
                self.d2h.wait_event(slot.events.compute_done)
            slot.host_tokens[:rows].copy_(slot.dev_tokens[:rows], non_blocking=True)
            if step.mode.logprobs is not None:
                slot.host_logprobs[:rows].copy_(slot.dev_logprobs[:rows], non_blocking=True)
                slot.host_top_ids[:rows].copy_(slot.dev_top_ids[:rows], non_blocking=True)
                slot.host_top_logprobs[:rows].copy_(slot.dev_top_logprobs[:rows], non_blocking=True)
            if self.cuda:
                slot.events.d2h_done.record(self.d2h)

    def collect(self, step: StepHandle) -> StepResult:
        """Wait for `step`'s sampled tokens (only this step's: later ones keep running) and copy them out."""
        if not step.sampled:
            raise RuntimeError(
                "collect() of a step whose constrained rows were never sampled: call sample_masked() first"
            )
        slot = step.slot
        if self.cuda:
            began = time.perf_counter()
            slot.events.d2h_done.synchronize()
            self.collect_wait_s += time.perf_counter() - began
            self.clock.resolve()
        rows = step.rows
        tokens = slot.host_tokens[:rows].numpy().copy()
        if step.mode.logprobs is None:
            return StepResult(tokens, None, None, None)
        k = step.mode.logprobs
        return StepResult(
            tokens,
            slot.host_logprobs[:rows].numpy().copy(),
            slot.host_top_ids[:rows, :k].numpy().copy() if k else None,
            slot.host_top_logprobs[:rows, :k].numpy().copy() if k else None,
        )

    def finish(self) -> None:
        if self.cuda:
            if self.gates is not None:
                # A run that stopped early may leave samplers behind closed gates (their tokens are dropped).
                self.gates.open_all()
            torch.cuda.synchronize(self.device)
            self.clock.resolve(keep_last=0)
