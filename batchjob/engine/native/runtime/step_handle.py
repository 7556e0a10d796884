"""What the model runner hands back for a step: the handle of a launched step, a step prepared but not yet
enqueued, and a step's sampled tokens (model_runner.py launches and collects them; split_steps.py samples the
constrained rows of a split step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from batchjob.engine.native.runtime.host_gate import Gate
    from batchjob.engine.native.runtime.io_slot import IOSlot, StepShape
    from batchjob.engine.native.runtime.step_layout import StepLayout
    from batchjob.engine.native.sampling.sampler import SamplerMode
    from batchjob.engine.native.scheduling.plan import StepPlan


@dataclass
class StepHandle:
    """A launched step. `masked_rows` constrained rows need a bitmask; until `sampled`, only its forward is
    enqueued (`ModelRunner.sample_masked` enqueues the rest)."""

    plan: StepPlan | None  # None on the ranks of a tensor-parallel engine (the job process has it)
    slot: IOSlot | None  # None in the job process of a tensor-parallel engine
    shape: StepShape
    rows: int
    mode: SamplerMode
    masked_rows: int = 0
    graph_layout: StepLayout | None = None  # the layout of the graph its forward replayed (None: eager)
    sampled: bool = True  # False until its bitmask is filled and its masked sampler enqueued or let through
    gate: Gate | None = None  # its masked sampler was enqueued as its masks began filling, behind this gate

    @property
    def graphed(self) -> bool:
        return self.graph_layout is not None


@dataclass
class PreparedStep:
    """A step written into its slot's host buffers (`fill_s` seconds), not yet enqueued."""

    plan: StepPlan
    slot: IOSlot
    layout: StepLayout
    masked_rows: int
    fill_s: float


@dataclass
class StepResult:
    tokens: np.ndarray
    logprobs: np.ndarray | None
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None
