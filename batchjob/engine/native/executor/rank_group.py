"""The job-process side of a tensor-parallel engine: N rank processes hold the model; this process schedules.

Design: the scheduler, the block manager, the output processing (and the tokenizer) run once, here, exactly as
in a single-device engine; `RankGroup` stands in for its `ModelRunner`. `launch` lays out and fills the step
into host buffers of its own and sends the packed inputs to every rank (`packed_step.py`), `collect` asks
every rank to wait for the step and receives rank 0's sampled tokens. The ranks (`rank_process.py`) are plain
executors: each runs the same step from the same bytes through its own `ModelRunner`, so the asynchronous
double-slot loop, carry-over and CUDA graphs (the collectives captured with them) work unchanged on every
rank, and no rank can take a decision the others do not. Every rank samples from the same gathered logits with
the same counter-based seeds, hence the same tokens, which is what its carry-over reads.

The links to the ranks and the watchdog on every wait on them (a dead rank ends the engine instead of hanging
it, with the error it reported) are `rank_links.py`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

import batchjob
from batchjob.engine.native.executor.messages import RankReady, RankSetup
from batchjob.engine.native.executor.rank_links import STEP_TIMEOUT_S, RankLinks
from batchjob.engine.native.runtime.io_slot import IOSlot
from batchjob.engine.native.runtime.packed_step import PackedStep
from batchjob.engine.native.runtime.step_handle import StepHandle, StepResult
from batchjob.engine.native.runtime.step_layout import GraphBuckets, layout_step
from batchjob.engine.native.scheduling.plan import StepPlan


@dataclass
class ClockSnapshot:
    """Rank 0's GPU-busy accounting as of the last `finish` (what the engine's statistics read)."""

    busy_fraction: float | None = None
    timeline: list[tuple[float, float]] = field(default_factory=list)

    def fraction(self) -> float | None:
        return self.busy_fraction


class RankGroup:
    def __init__(self, model_path: str, options: dict[str, Any], size: int, cuda: bool) -> None:
        self.size = size
        self.links = RankLinks()
        # Results asked of rank 0 and not read yet: an interrupted wait leaves one in the pipe.
        self._awaiting = 0
        self._store_dir = tempfile.mkdtemp(prefix="batchjob-tp-")
        # Counters the engine's statistics read, as of a ModelRunner (here: this process's share of a step).
        self.steps = self.graph_steps = self.mixed_graph_steps = self.tokens_fed = 0
        self.prep_s = self.fill_s = 0.0
        self.collect_wait_s = 0.0  # waiting for rank 0's tokens
        # Always zero: the engine refuses constrained requests under tensor parallelism, so no step is split.
        self.masked_steps = 0
        self.mask_s = 0.0
        self.launch_s = [0.0, 0.0]
        self.clock = ClockSnapshot()
        self.rank_stats: list[dict[str, Any]] = []
        setup = RankSetup(
            model_path=model_path,
            options={k: v for k, v in options.items() if k != "device"},
            size=size,
            store_path=os.path.join(self._store_dir, "store"),
            cuda=cuda,
            timeout_s=STEP_TIMEOUT_S,
        )
        # The ranks import the same batchjob as this process, wherever it comes from (a checkout, an install).
        root = os.path.dirname(os.path.dirname(os.path.abspath(batchjob.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        try:
            for rank in range(size):
                self.links.start(rank, env, setup)
            ready: list[RankReady] = [self.links.receive(rank, "ready", timeout_s=None) for rank in range(size)]
            self.links.starting = False
        except BaseException:
            self.links.kill_all()
            self.close()
            raise
        first = ready[0]
        self.num_blocks = first.num_blocks
        self.graphs = first.graphs
        self.startup_stats = first.stats
        self.block_size = int(options.get("block_size", 16))
        self._slot = IOSlot(0, first.limits, torch.device("cpu"))

    # ---- the runner interface the engine's loop uses ----

    @property
    def graph_buckets(self) -> GraphBuckets:
        """The shapes of the graphs every rank captured."""
        return self.graphs

    def launch(self, plan: StepPlan) -> StepHandle:
        began = time.perf_counter()
        layout = layout_step(plan, self.graphs)
        self._slot.fill(plan, layout.shape, self.block_size)
        width = max(len(seq.block_table) for seq in plan.seqs)
        message = ForkingPickler.dumps(("step", PackedStep.pack(self._slot, layout, width)))
        filled = time.perf_counter()
        self.links.send_all(message)
        done = time.perf_counter()
        self.fill_s += filled - began
        self.prep_s += done - began
        self.launch_s[0 if layout.bucket else 1] += done - filled
        self.steps += 1
        self.graph_steps += 1 if layout.bucket else 0
        self.mixed_graph_steps += 1 if layout.mixed else 0
        self.tokens_fed += layout.tokens
        return StepHandle(plan=plan, slot=None, shape=layout.shape, rows=layout.rows, mode=layout.mode)

    def collect(self, step: StepHandle) -> StepResult:
        self.links.send_all(ForkingPickler.dumps(("collect", None)))
        self._awaiting += 1
        began = time.perf_counter()
        result = self._receive_result()
        self.collect_wait_s += time.perf_counter() - began
        return result

    def finish(self) -> None:
        """Wait for every rank's device; steps launched but not collected are dropped."""
        if self.links.failed is not None:
            return
        if self.links.torn:
            self.links.kill_all()  # they are no use any more; close() cleans up
            self.links.failed = "the job was interrupted while a message to or from a rank was half sent"
            return
        while self._awaiting:
            self._receive_result()
        self.links.send_all(ForkingPickler.dumps(("finish", None)))
        self.rank_stats = [self.links.receive(rank, "stats") for rank in range(self.size)]
        first = self.rank_stats[0]
        self.clock = ClockSnapshot(first.get("gpu_busy_fraction"), first.get("busy_timeline", []))

    def stats(self) -> dict[str, float]:
        stats: dict[str, float] = {"tensor_parallel": self.size}
        for rank, ranks in enumerate(self.rank_stats):
            if ranks.get("gpu_busy_fraction") is not None:
                stats[f"gpu_busy_fraction_rank{rank}"] = ranks["gpu_busy_fraction"]
        return stats

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove the group's rendezvous files."""
        self.links.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def _receive_result(self) -> StepResult:
        result = self.links.receive(0, "result")
        self._awaiting -= 1
        return result
