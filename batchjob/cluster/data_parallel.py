"""Local multi-GPU: `python -m batchjob engine.data_parallel=N ...` runs N processes, one GPU and one shard each
(with `engine.tensor_parallel=T`, T GPUs each: N x T in all).

The parent does no generation. It splits its own shard (from shard.index/count, or Slurm's variables)
N ways, exactly as Slurm tasks of one step would (`index * N + i` of `count * N`), and starts
`python -m batchjob` once per GPU (per group of T GPUs) with CUDA_VISIBLE_DEVICES set to it. So an 8-GPU node is one
array task with data_parallel=8, and the output is the same as 8 Slurm tasks would write. Signals to
the parent (Ctrl-C, Slurm's USR1/TERM) are passed to every child, which commits and exits resumable;
rerunning the same command resumes every child shard.

A child often hears of one stop twice: from whoever signalled (a terminal signals its whole process group, Slurm
every process of a step) and from the parent. And when the parent dies, the kernel sends the child its death
signal once for every thread of the parent it is handed to as they exit. So the parent relays each stop signal as
a signal of its own (`RELAYED`) and dies with another (`PARENT_GONE`), and the child (`job/signals.py`) counts a
second stop only when one route brings it twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchjob.errors import EXIT_TOO_MANY_FAILED, ConfigError
from batchjob.processes import dies_with_us

# Overrides the parent rewrites for each child; everything else is passed through unchanged.
_OWN_KEYS = ("engine.data_parallel", "shard.index", "shard.count")
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# Real-time signals, which nothing else sends a job (Linux); elsewhere the stop signals themselves.
if hasattr(signal, "SIGRTMIN"):
    RELAYED = {sig: signal.SIGRTMIN + i for i, sig in enumerate(_FORWARDED)}
    PARENT_GONE = signal.SIGRTMIN + len(_FORWARDED)
else:
    RELAYED = {sig: sig for sig in _FORWARDED}
    PARENT_GONE = signal.SIGTERM


@dataclass(frozen=True)
class ChildShard:
    gpu: str  # CUDA_VISIBLE_DEVICES of the child: one GPU, or a comma-separated tensor-parallel group
    shard_index: int
    shard_count: int


def plan_children(
    data_parallel: int,
    shard_index: int,
    shard_count: int,
    env: Mapping[str, str] | None = None,
    tensor_parallel: int = 1,
) -> list[ChildShard]:
    """One child per GPU, or per `tensor_parallel` consecutive GPUs: of the GPUs visible to this process
    (CUDA_VISIBLE_DEVICES, e.g. from Slurm), or 0..N-1."""
    env = os.environ if env is None else env
    if data_parallel < 1:
        raise ConfigError(f"engine.data_parallel={data_parallel}: must be >= 1 (the number of GPUs to use)")
    needed = data_parallel * tensor_parallel
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    gpus = visible or [str(i) for i in range(needed)]
    if len(gpus) < needed:
        asked = f"engine.data_parallel={data_parallel}" + (
            f" x engine.tensor_parallel={tensor_parallel}" if tensor_parallel > 1 else ""
        )
        raise ConfigError(
            f"{asked} needs {needed} GPUs but only {len(gpus)} GPU{' is' if len(gpus) == 1 else 's are'} visible "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')}): lower it or request more GPUs"
        )
    return [
        ChildShard(
            ",".join(gpus[i * tensor_parallel : (i + 1) * tensor_parallel]),
            shard_index * data_parallel + i,
            shard_count * data_parallel,
        )
        for i in range(data_parallel)
    ]


def child_command(overrides: Sequence[str], child: ChildShard, python: str = sys.executable) -> list[str]:
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in _OWN_KEYS]
    return [
        python,
        "-m",
        "batchjob",
        *kept,
        f"shard.index={child.shard_index}",
        f"shard.count={child.shard_count}",
        "++engine.data_parallel=1",
    ]


def run_data_parallel(
    overrides: Sequence[str], data_parallel: int, shard_index: int, shard_count: int, tensor_parallel: int = 1
) -> int:
    """Run the children to the end; returns 0 when all shards are complete, else the first failure's status: the
    first of a child that did not complete, else EXIT_TOO_MANY_FAILED (every shard is complete, one has too many
    failed rows), so that the status says whether a rerun has anything left to do."""
    children = plan_children(data_parallel, shard_index, shard_count, tensor_parallel=tensor_parallel)
    # A child stops as on preemption (it commits and exits) when this process dies, SIGKILL included: it would
    # otherwise keep its GPU and write its shard beside the rerun's.
    tie = dies_with_us(PARENT_GONE)
    procs = [
        subprocess.Popen(child_command(overrides, c), env={**os.environ, "CUDA_VISIBLE_DEVICES": c.gpu}, preexec_fn=tie)
        for c in children
    ]

    def forward(signum: int, frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(RELAYED[signum])

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        statuses = [proc.wait() for proc in procs]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # Popen reports death by signal N as -N; the shell convention 128+N keeps the cause visible (a relayed
    # signal's, as the signal it relays: a child still starting dies of it).
    relayed_as = {relay: sig for sig, relay in RELAYED.items()}
    statuses = [128 + relayed_as.get(-s, -s) if s < 0 else s for s in statuses]
    failed = [(c, s) for c, s in zip(children, statuses, strict=True) if s != 0]
    for child, status in failed:
        print(
            f"data_parallel: shard {child.shard_index}/{child.shard_count} on GPU {child.gpu} exited {status}",
            file=sys.stderr,
        )
    incomplete = [status for _, status in failed if status != EXIT_TOO_MANY_FAILED]
    return (incomplete or [status for _, status in failed] or [0])[0]
