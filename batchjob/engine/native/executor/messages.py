"""What the job process and the ranks of a tensor-parallel engine tell each other at start-up.

Both sides import this module and nothing of each other: `rank_group.py` (the job process) sends a `RankSetup`
to every rank it starts, and each rank (`rank_process.py`) answers with a `RankReady` once its runner is
warmed up. The messages of the run itself are `(kind, payload)` pairs, listed in `rank_process.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a rank reads its setup before it imports torch (it ignores stop signals first)
    from batchjob.engine.native.runtime.io_slot import SlotLimits
    from batchjob.engine.native.runtime.step_layout import GraphBuckets


@dataclass(frozen=True)
class RankSetup:
    """What every rank of one engine is told first."""

    model_path: str
    options: dict[str, Any]  # the engine's options, tensor_parallel included, without `device`
    size: int
    store_path: str  # the torch.distributed file store where the ranks meet
    cuda: bool  # rank r runs on the r-th visible GPU; else on the CPU, with gloo
    timeout_s: float  # of every collective


@dataclass(frozen=True)
class RankReady:
    num_blocks: int  # the smallest any rank can hold, which every rank allocated
    limits: SlotLimits  # of the IO slots, so the job process packs steps into buffers of the same size
    graphs: GraphBuckets  # what every rank captured (the same options, so the same graphs)
    stats: dict[str, float]
