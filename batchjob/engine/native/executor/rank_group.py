"""The job-process side of a tensor-parallel engine: N rank processes hold the model; this process schedules.

Design: the scheduler, the block manager, the output processing (and the tokenizer) run once, here, exactly as
in a single-device engine; `RankGroup` stands in for its `ModelRunner`. `launch` lays out and fills the step
into host buffers of its own and sends the packed inputs to every rank (`packed_step.py`), `collect` asks
every rank to wait for the step and receives rank 0's sampled tokens. The ranks (`rank_process.py`) are plain
executors: each runs the same step from the same bytes through its own `ModelRunner`, so the asynchronous
double-slot loop, carry-over and CUDA graphs (the collectives captured with them) work unchanged on every
rank, and no rank can take a decision the others do not. Every rank samples from the same gathered logits with
the same counter-based seeds, hence the same tokens, which is what its carry-over reads.

A watchdog makes a dead rank end the engine instead of hanging it: every wait on a rank polls its process,
and a rank that exits, closes its connection or stays silent past `STEP_TIMEOUT_S` has every rank killed and
raises `EngineFailure`, which the job turns into a resumable exit (finished rows committed). This process
never touches a GPU, so nothing here can block on a collective a dead peer will never join.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

import batchjob
from batchjob.engine.api import EngineFailure
from batchjob.engine.native.executor.messages import RankReady, RankSetup
from batchjob.engine.native.runtime.io_slot import IOSlot
from batchjob.engine.native.runtime.packed_step import PackedStep
from batchjob.engine.native.runtime.step_handle import StepHandle, StepResult
from batchjob.engine.native.runtime.step_layout import GraphBuckets, layout_step
from batchjob.engine.native.scheduling.plan import StepPlan
from batchjob.processes import popen_for_life

log = logging.getLogger("batchjob.engine.native")

# The longest a step may take before the ranks are presumed hung (a collective whose peer is stuck). Generous:
# a first step may compile kernels.
STEP_TIMEOUT_S = 900.0
POLL_S = 0.5


@dataclass
class ClockSnapshot:
    """Rank 0's GPU-busy accounting as of the last `finish` (what the engine's statistics read)."""

    busy_fraction: float | None = None
    timeline: list[tuple[float, float]] = field(default_factory=list)

    def fraction(self) -> float | None:
        return self.busy_fraction


def _describe_exit(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


class RankGroup:
    def __init__(self, model_path: str, options: dict[str, Any], size: int, cuda: bool) -> None:
        self.size = size
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.failed: str | None = None
        # Results asked of rank 0 and not read yet: an interrupted wait leaves one in the pipe.
        self._awaiting = 0
        # A signal raised while a message was half written or half read: the streams can no longer be trusted.
        self._torn = False
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
                ours, theirs = Pipe(duplex=True)
                command = [
                    sys.executable,
                    "-m",
                    "batchjob.engine.native.executor.rank_process",
                    str(theirs.fileno()),
                    str(rank),
                ]
                # The kernel kills a rank when the thread that started it ends (`on_parent_death`), not the process.
                self.procs.append(popen_for_life(command, pass_fds=(theirs.fileno(),), env=env))
                theirs.close()  # the rank's end lives in the rank only, so its exit is an end of file here
                _limit_send_wait(ours, STEP_TIMEOUT_S)
                self.conns.append(ours)
                ours.send(setup)
            ready: list[RankReady] = [self._receive(rank, "ready", timeout_s=None) for rank in range(size)]
        except BaseException:
            self._kill_all()
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
        self._send_all(message)
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
        self._send_all(ForkingPickler.dumps(("collect", None)))
        self._awaiting += 1
        began = time.perf_counter()
        result = self._receive(0, "result")
        self.collect_wait_s += time.perf_counter() - began
        return result

    def finish(self) -> None:
        """Wait for every rank's device; steps launched but not collected are dropped."""
        if self.failed is not None:
            return
        if self._torn:
            self._kill_all()  # they are no use any more; close() cleans up
            self.failed = "the job was interrupted while a message to or from a rank was half sent"
            return
        while self._awaiting:
            self._receive(0, "result")
        self._send_all(ForkingPickler.dumps(("finish", None)))
        self.rank_stats = [self._receive(rank, "stats") for rank in range(self.size)]
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
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("close", None))
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        shutil.rmtree(self._store_dir, ignore_errors=True)

    # ---- messages and the watchdog ----

    def _send_all(self, message: bytes) -> None:
        self._raise_if_failed()
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError:
                self._check_alive(grace_s=5.0)
                self._fail(f"tensor-parallel rank {rank} stopped reading its messages")
            except BaseException:  # a signal (the job stopping) in the middle of a message
                self._torn = True
                raise

    def _receive(self, rank: int, kind: str, timeout_s: float | None = STEP_TIMEOUT_S) -> Any:
        self._raise_if_failed()
        conn = self.conns[rank]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not conn.poll(POLL_S):
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"tensor-parallel rank {rank} gave no {kind} for {timeout_s:.0f} s (a hung collective?)")
        try:
            got, payload = conn.recv()
        except (EOFError, OSError):
            self._check_alive(grace_s=5.0)
            self._fail(f"tensor-parallel rank {rank} closed its connection")
        except BaseException:
            self._torn = True
            raise
        if got == "result":
            self._awaiting -= 1
        if got == "error":
            # The rank printed its traceback; its last line says what went wrong.
            message = f"tensor-parallel rank {rank} failed: {payload.strip().splitlines()[-1]}"
            if kind == "ready":  # a start-up error (a bad option, no memory): not worth a rerun
                self._kill_all()
                raise RuntimeError(message)
            # A collective fails on every rank when one rank dies: that death is the cause to report.
            self._check_alive(grace_s=2.0)
            self._fail(message)
        if got != kind:
            self._fail(f"tensor-parallel rank {rank} sent {got!r} where {kind!r} was due")
        return payload

    def _check_alive(self, grace_s: float = 0.0) -> None:
        """`EngineFailure` if a rank has exited (waiting up to `grace_s` for one that is exiting)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self.procs):
                status = proc.poll()
                if status is not None:
                    self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) {_describe_exit(status)}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _fail(self, reason: str) -> None:
        """Kill every rank (a survivor may be stuck in a collective with the dead one) and raise."""
        self.failed = reason
        self._kill_all()
        log.error("tensor-parallel engine stopped: %s", reason)
        raise EngineFailure(reason)

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise EngineFailure(self.failed)


def _limit_send_wait(conn: Connection, seconds: float) -> None:
    """A send to a rank that stopped reading (hung) fails after `seconds` instead of blocking forever once
    the socket's buffer is full."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), 0))
    sock.close()
