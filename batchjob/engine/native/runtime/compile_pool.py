"""Triton kernels compiled by worker processes, all at once, into Triton's kernel cache.

Triton compiles on the launching thread, one variant at a time, and most of the work holds the interpreter
lock: a cold start-up spends tens of seconds of one core there while the others idle. A `CompilePool` starts
worker processes (`compile_worker.py`), hands each one variant at a time
(`KernelVariant`: Triton's own record of it) and gets back the hash of the cache entry it wrote; the start-up's
own launches then load those entries instead of compiling. A worker never touches the GPU: it compiles for the
parent's device (its `GPUTarget`, passed on the command line), so it costs no device memory and no CUDA context.

Workers start with the pool, so that their imports overlap the parent's weight loading; they die with the
parent (`processes.dies_with_us`). A variant a worker cannot compile, or that a dead worker held, is reported and
left to the start-up's own launch, which compiles it as it always would: the pool can only save time. The
others' workers take a dead worker's share; with none left, `wait` returns at once.

The protocol is `compile_worker.py`'s.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from batchjob.engine.native.runtime.kernel_variants import KernelVariant
from batchjob.processes import dies_with_us

# `wait` gives up once no worker has finished a variant (or become ready, or been given work) for this long: a
# variant compiles in seconds, and a worker that hangs must not hold the start-up for the whole timeout.
STALL_S = 60.0


@dataclass
class CompileReport:
    """What a pool did: the variants compiled (with their cache hashes), those it could not, and its seconds."""

    compiled: list[KernelVariant] = field(default_factory=list)
    failed: list[tuple[KernelVariant, str]] = field(default_factory=list)
    seconds: float = 0.0


class CompilePool:
    def __init__(self, workers: int, target: tuple[str, int | str, int]) -> None:
        """Start `workers` processes compiling for `target` (backend, arch, warp size: Triton's `GPUTarget`)."""
        self._todo: queue.Queue[KernelVariant | None] = queue.Queue()
        self._report = CompileReport()
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._feeding = workers  # feeding threads still running: with none, nothing waiting will be compiled
        self._progress_at = time.perf_counter()  # the last time a worker became ready or finished a variant
        command = [sys.executable, "-m", "batchjob.engine.native.runtime.compile_worker", json.dumps(list(target))]
        self._procs = [
            subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=dies_with_us(signal.SIGKILL),
            )
            for _ in range(workers)
        ]
        self._threads = [
            threading.Thread(target=self._feed, args=(proc,), name=f"batchjob-compile-{i}", daemon=True)
            for i, proc in enumerate(self._procs)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, variants: list[KernelVariant]) -> None:
        with self._lock:
            self._pending += len(variants)
            self._progress_at = time.perf_counter()  # new work: the stall clock starts again
        for variant in variants:
            self._todo.put(variant)

    def compiled_so_far(self) -> int:
        """How many submitted variants the workers have compiled (or found in the cache) up to now."""
        with self._lock:
            return len(self._report.compiled)

    def wait(self, timeout_s: float) -> CompileReport:
        """Wait until every submitted variant is compiled or failed (at most `timeout_s`), then stop the workers.
        A variant left waiting, or in a worker when it was stopped, counts as failed; so does everything once no
        worker has made progress for `STALL_S`."""
        started = time.perf_counter()
        deadline = started + timeout_s
        with self._idle:
            while self._pending and self._feeding:
                now = time.perf_counter()
                if now >= deadline or now - self._progress_at >= STALL_S:
                    break
                self._idle.wait(min(deadline, self._progress_at + STALL_S) - now)
        self.close()
        while True:
            try:
                variant = self._todo.get_nowait()
            except queue.Empty:
                break
            if variant is not None:
                self._done(variant, {"error": "no compile worker got to it (stopped, stalled or gone)"})
        self._report.seconds += time.perf_counter() - started
        return self._report

    def close(self) -> None:
        """Stop the workers (a variant in a worker's hands fails) and their feeding threads."""
        for _ in self._procs:
            self._todo.put(None)
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for thread in self._threads:
            thread.join()
        for proc in self._procs:
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def _done(self, variant: KernelVariant, answer: dict[str, Any]) -> None:
        with self._idle:
            if "hash" in answer:
                self._report.compiled.append(
                    KernelVariant(variant.module, variant.qualname, variant.data, answer["hash"])
                )
            else:
                self._report.failed.append((variant, str(answer.get("error", "no answer"))))
            self._pending -= 1
            self._progress_at = time.perf_counter()
            self._idle.notify_all()

    def _feed(self, proc: subprocess.Popen) -> None:
        """Hand `proc` one variant at a time until the pool closes or the worker dies."""
        try:
            self._feed_until_done(proc)
        finally:
            with self._idle:
                self._feeding -= 1
                self._idle.notify_all()

    def _feed_until_done(self, proc: subprocess.Popen) -> None:
        stdin, stdout = proc.stdin, proc.stdout
        assert stdin is not None and stdout is not None
        if _answer(stdout) is None:  # the worker died before it was ready
            return
        with self._idle:
            self._progress_at = time.perf_counter()
        while (variant := self._todo.get()) is not None:
            try:
                stdin.write(json.dumps({"module": variant.module, "qualname": variant.qualname, "data": variant.data}))
                stdin.write("\n")
                stdin.flush()
            except (BrokenPipeError, ValueError):
                answer = None
            else:
                answer = _answer(stdout)
            if answer is None:
                self._done(variant, {"error": f"the compile worker exited (code {proc.poll()})"})
                return
            self._done(variant, answer)


def _answer(stdout: IO[str]) -> dict[str, Any] | None:
    try:
        line = stdout.readline()
    except (OSError, ValueError):
        return None
    return json.loads(line) if line else None
