"""One rank of a tensor-parallel engine: `python -m batchjob.engine.native.executor.rank_process FD RANK`, started by
`rank_group.py` with one end of a socket pair as file descriptor FD.

The rank joins its group (`parallel.join`), builds an ordinary `NativeEngine` on its GPU, which under the
group's `parallel.current()` loads only this rank's slices and sizes its KV cache to what every rank can hold,
then serves the job process's messages in order:

- `("step", PackedStep)`: launch the step (its inputs are exactly the job process's, see `packed_step.py`);
- `("collect", None)`: wait for the oldest launched step; rank 0 sends its `StepResult` back (all ranks
  sampled the same tokens from the same gathered logits; the others' results are not needed);
- `("finish", None)`: wait for the device, drop steps never collected, send this rank's statistics;
- `("close", None)`, or the job process gone (end of file): exit.

Signals that stop a job (SIGINT, SIGTERM, SIGUSR1) are ignored here: the job process gets them too, commits,
and closes its ranks, so a rank never dies halfway through a collective its peers wait in.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import sys
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily at run time: a rank ignores stop signals before it loads torch
    from batchjob.engine.native.runtime.io_slot import SlotLimits
    from batchjob.engine.native.runtime.step_layout import GraphBuckets

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


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


def _start(setup: RankSetup, rank: int):
    import torch

    from batchjob.engine.native.engine import NativeEngine
    from batchjob.engine.native.layers import parallel

    device = torch.device(f"cuda:{rank}" if setup.cuda else "cpu")
    parallel.join(rank, setup.size, setup.store_path, device, setup.timeout_s)
    return NativeEngine(setup.model_path, **setup.options, device=str(device))


def _rank_stats(runner) -> dict[str, Any]:
    stats: dict[str, Any] = {"steps": runner.steps}
    if runner.clock is not None:
        stats["gpu_busy_fraction"] = runner.clock.fraction()
        stats["busy_timeline"] = list(runner.clock.timeline)
    return stats


def serve(conn: Connection, engine, rank: int) -> None:
    runner = engine.runner
    launched = deque()
    gc.freeze()  # this process's objects live as long as it does: no full collection mid-run scans them
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return  # the job process is gone
        if kind == "step":
            launched.append(runner.launch_packed(payload))
        elif kind == "collect":
            result = runner.collect(launched.popleft())
            if rank == 0:
                conn.send(("result", result))
        elif kind == "finish":
            runner.finish()
            launched.clear()
            conn.send(("stats", _rank_stats(runner)))
        elif kind == "close":
            return
        else:
            raise ValueError(f"tensor-parallel rank {rank}: unknown message {kind!r}")


def _die_with_parent() -> None:
    """SIGKILL this rank when the job process dies (Linux): a rank stuck in a collective with a peer that
    exited with the job would otherwise hold its GPU forever."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the job process died before the line above
        os._exit(1)


def main(argv: list[str]) -> int:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    fd, rank = int(argv[0]), int(argv[1])
    conn = Connection(fd)
    setup: RankSetup = conn.recv()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[tensor-parallel rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        engine = _start(setup, rank)
        runner = engine.runner
        conn.send(
            (
                "ready",
                RankReady(
                    engine.blocks.num_blocks,
                    runner.slots[0].limits,
                    runner.graphs.buckets,
                    dict(engine.stats()),
                ),
            )
        )
        serve(conn, engine, rank)
    except (BrokenPipeError, ConnectionResetError):
        return 1  # the job process is gone
    except BaseException:
        # The job process reports it (and stops the other ranks); the traceback is also in this rank's stderr.
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            conn.send(("error", text))
        return 1
    return 0


if __name__ == "__main__":
    # Through the module's own name, so what it pickles (RankReady) unpickles in the job process.
    from batchjob.engine.native.executor import rank_process

    sys.exit(rank_process.main(sys.argv[1:]))
