"""One rank of a tensor-parallel engine: `python -m batchjob.engine.native.executor.rank_process FD RANK`,
started by `rank_group.py` with one end of a socket pair as file descriptor FD.

The rank joins its group (`parallel.join`) and builds a model runner on its GPU, as a single-device engine's
start-up does (`runtime/device_start.py`): under the group's `parallel.current()` the model loads only this
rank's slices and the KV cache is sized to what every rank can hold. It has no scheduler, no tokenizer and no
output processing (the job process runs those once, for all ranks). Then it serves the job process's messages
in order:

- `("step", PackedStep)`: launch the step (its inputs are exactly the job process's, see `packed_step.py`);
- `("collect", None)`: wait for the oldest launched step; rank 0 sends its `StepResult` back (all ranks
  sampled the same tokens from the same gathered logits; the others' results are not needed);
- `("finish", None)`: wait for the device, drop steps never collected, send this rank's statistics;
- `("close", None)`, or the job process gone (end of file): exit, without the interpreter's teardown (`quick_exit.py`).

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
from multiprocessing.connection import Connection
from typing import Any

from batchjob.engine.native.executor.messages import RankReady, RankSetup
from batchjob.processes import on_parent_death
from batchjob.quick_exit import exit_now

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _start(setup: RankSetup, rank: int) -> tuple[Any, int, dict[str, float]]:
    """This rank's runner, the blocks of its KV cache and its start-up's stats: the model loaded under the
    group's `parallel.current()` (only this rank's slices), the cache sized to what every rank can hold."""
    import time

    import torch

    from batchjob.engine.native.layers import parallel
    from batchjob.engine.native.options import NativeOptions
    from batchjob.engine.native.runtime.device_start import load_on_device, short_thread_switches, start_runner
    from batchjob.engine.native.runtime.precompile import compiling_ahead

    device = torch.device(f"cuda:{rank}" if setup.cuda else "cpu")
    opts = NativeOptions.from_mapping({**setup.options, "device": str(device)})
    parallel.join(rank, setup.size, setup.store_path, device, setup.timeout_s, ordered_sums=opts.deterministic)
    started = time.perf_counter()
    with short_thread_switches(), compiling_ahead(setup.model_path, opts, device) as kernels:
        model, spec = load_on_device(setup.model_path, opts, device)
        loaded = time.perf_counter()
        ready = start_runner(model, spec, opts, device, opts.sampler_gates, kernels)
    stats = {**ready.stats, "load_s": loaded - started, "startup_s": time.perf_counter() - started}
    return ready.runner, ready.num_blocks, stats


def _rank_stats(runner) -> dict[str, Any]:
    stats: dict[str, Any] = {"steps": runner.steps}
    if runner.clock is not None:
        stats["gpu_busy_fraction"] = runner.clock.fraction()
        stats["busy_timeline"] = list(runner.clock.timeline)
    return stats


def serve(conn: Connection, runner: Any, rank: int) -> None:
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


def main(argv: list[str]) -> int:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # A rank stuck in a collective with a peer that exited with the job would otherwise hold its GPU forever.
    on_parent_death(signal.SIGKILL)
    fd, rank = int(argv[0]), int(argv[1])
    conn = Connection(fd)
    setup: RankSetup = conn.recv()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[tensor-parallel rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        runner, num_blocks, stats = _start(setup, rank)
        conn.send(("ready", RankReady(num_blocks, runner.slots[0].limits, runner.graphs.buckets, stats)))
        serve(conn, runner, rank)
    except (BrokenPipeError, ConnectionResetError):
        return 1  # the job process is gone
    except BaseException:
        # The job process reports it (and stops the other ranks); the traceback is also in this rank's stderr,
        # written second: a stderr whose reader is gone must not keep the cause from the job process.
        text = traceback.format_exc()
        with contextlib.suppress(OSError):
            conn.send(("error", text))
        with contextlib.suppress(OSError, ValueError):  # ValueError: a closed stderr
            print(text, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    # The job process waits for its ranks in `close`: no teardown of torch, NCCL or the CUDA context to wait for.
    exit_now(main(sys.argv[1:]))
