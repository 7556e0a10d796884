"""The second half of a split step: the masked sampler of a step with constrained rows, with or without gates.

Structured outputs split a step with constrained rows in two. `launch` enqueues the forward, which writes the
logits to a shared buffer; the bitmask of a constrained row depends on the token the previous step sampled,
which the host learns only after this launch (one step behind). `sample_masked` then fills the bitmask on the
host, copies it on the H2D stream (`bitmask_done`), and enqueues the masked sampler and the D2H copy; compute
waits for `bitmask_done`. The GPU runs the forward meanwhile, so it waits only if the host's masks take longer than a
forward, and a step without constrained rows is launched whole, exactly as before. A CUDA stream can only wait
for an event already recorded, which is why, without gates, the sampler is enqueued after the bitmask copy.

With gates (`engine.gate_masked_sampler`, host_gate.py), the masked sampler is enqueued as soon as a worker
thread starts filling the bitmask: on a fourth stream, a wait for a word in pinned host memory, then the bitmask
copy (`bitmask_done`). The worker opens that gate (a store) when the bitmask is filled, so the GPU samples as
soon as the masks exist and runs the next step's forward right after, which the engine enqueues without waiting
for the masks: the sampler it carries tokens from is already ahead of it on the compute stream.

`SplitStepSampling` is a part of `model_runner.ModelRunner` (its base class), kept apart because it is a second
idea: what happens between a split step's forward and its tokens. It uses the runner's streams, slots, graphs,
busy clock and counters, and its `_sample` and `_enqueue_d2h`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from batchjob.engine.native.runtime.host_gate import HostGates

if TYPE_CHECKING:
    from batchjob.engine.native.runtime.io_slot import IOSlot, StepShape
    from batchjob.engine.native.runtime.step_handle import StepHandle
    from batchjob.engine.native.sampling.sampler import SamplerMode


class SplitStepSampling:
    """The masked-sampler methods of `ModelRunner` (see the module docstring)."""

    def run_masked_sampler(self, slot: IOSlot, shape: StepShape, mode: SamplerMode) -> None:
        """The second half of a split step: the sampler, over `self.split_logits` under the step's bitmask."""
        logits = self.split_logits[: shape.rows]
        if (mode.sampling or mode.logprobs is not None) and logits.dtype != torch.float32:
            logits = self.logits[: shape.rows].copy_(logits)
        self._sample(slot, shape, mode, logits, masked=True)

    def sample_masked(self, step: StepHandle, fill_bitmask: Callable[[torch.Tensor], None]) -> None:
        """Enqueue the masked sampler of a split step: `fill_bitmask(rows)` writes its bitmask rows on the host
        (the caller has applied every token they depend on), then copy, sample and copy the tokens out."""
        fill_bitmask(self.bitmask_rows(step))
        self.enqueue_masked_sampler(step)

    def bitmask_rows(self, step: StepHandle) -> torch.Tensor:
        """The host bitmask rows of a split step's constrained rows, free to be written (their slot's previous
        copy has finished); `enqueue_masked_sampler` once they are."""
        if self.cuda:
            step.slot.events.bitmask_done.synchronize()
        return step.slot.host_bitmask[: step.masked_rows]

    def enqueue_masked_sampler(self, step: StepHandle) -> None:
        """A split step's bitmask rows are filled: copy them, enqueue its masked sampler and the copy of its tokens
        (or, enqueued already behind its gate, open it)."""
        if step.gate is not None:
            self.open_gate(step)
        else:
            began = time.perf_counter()
            with self._stream(self.h2d if self.cuda else None):
                step.slot.copy_bitmask(step.masked_rows)
                if self.cuda:
                    step.slot.events.bitmask_done.record(self.h2d)
            self._enqueue_sampler(step)
            self.sampler_launch_s += time.perf_counter() - began
        step.sampled = True
        self.masked_steps += 1

    def use_gates(self) -> bool:
        """Let `arm_gate` gate masked samplers from now on (host_gate.py); True if this device can. Only once every
        kernel the run launches has been loaded (the warm-up ran), and only for masks that a thread other than
        the one launching steps fills: that thread may block on a closed gate."""
        if self.cuda and self.gates is None:
            # A word per slot. The bitmask copies behind the gates get a stream of their own, so that the next
            # step's input copy never queues behind a closed one.
            self.gates = HostGates.create(len(self.slots), self.device)
            if self.gates is not None:
                self.bitmask_h2d = torch.cuda.Stream(self.device)
        return self.gates is not None

    def arm_gate(self, step: StepHandle) -> bool:
        """Give a split step whose bitmask rows are about to be filled (`bitmask_rows` was called) a gate, before
        its filler starts: the filler may open it before `enqueue_gated_sampler` enqueues it. False without
        gates."""
        if self.gates is None:
            return False
        step.gate = self.gates.arm(step.slot.index)
        return True

    def open_gate(self, step: StepHandle) -> None:
        """Let a gated step's masked sampler run once its bitmask rows are filled; any thread may call it."""
        if step.gate is not None:
            self.gates.open(step.gate)

    def enqueue_gated_sampler(self, step: StepHandle) -> None:
        """The bitmask copy of an armed step behind its gate, then its masked sampler and the copy of its tokens,
        while its bitmask rows may still be filling."""
        began = time.perf_counter()
        slot = step.slot
        with torch.cuda.stream(self.bitmask_h2d):
            # The device rows were last read by the slot's previous sampler.
            self.bitmask_h2d.wait_event(slot.events.compute_done)
            self.gates.wait(self.bitmask_h2d, step.gate)
            slot.copy_bitmask(step.masked_rows)
            slot.events.bitmask_done.record(self.bitmask_h2d)
        self._enqueue_sampler(step)
        self.gated_steps += 1
        self.sampler_launch_s += time.perf_counter() - began

    def _enqueue_sampler(self, step: StepHandle) -> None:
        """The masked sampler of a split step, after its bitmask copy (`bitmask_done`), and the copy of its
        tokens."""
        slot, shape = step.slot, step.shape
        with self._stream(self.compute if self.cuda else None):
            if self.cuda:
                self.compute.wait_event(slot.events.bitmask_done)
                timing = self.clock.pair()
                timing[0].record(self.compute)
            if step.graphed:
                self.graphs.masked_sampler(slot.index, step.graph_layout).replay()
            else:
                self.run_masked_sampler(slot, shape, step.mode)
            if self.cuda:
                timing[1].record(self.compute)
                slot.events.compute_done.record(self.compute)
        self._enqueue_d2h(step)
