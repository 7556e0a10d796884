"""Run by test_compile_pool.py in a process of its own (Triton compiling, not interpreting): this process stands in
for an engine on an H100 (sm_90) that has no GPU. It lists the variants of two fused kernels that steps launch
without launching them, has a pool of worker processes compile them, then launches the same steps for real:
each launch must find its binary in the cache (Triton's own key) instead of compiling. Prints one JSON report.

    python compile_pool_scenario.py WORKERS [EXTRA_VARIANT_JSON ...]
    python compile_pool_scenario.py --workers-killed WORKERS
    python compile_pool_scenario.py --stalled (a worker that never answers)
    python compile_pool_scenario.py --plan (twice: the first start-up lists, the second follows the plan)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from batchjob.engine.native.runtime.compile_pool import CompilePool
from batchjob.engine.native.runtime.compile_worker import use_target
from batchjob.engine.native.runtime.kernel_variants import (
    KernelVariant,
    cached,
    recording_compiles,
    skipping_launches,
    zeroed_allocations,
)
from batchjob.processes import descendants

TARGET = ("cuda", 90, 32)


def steps() -> list[Callable[[], Any]]:
    """Three launches of two fused kernels (three variants), each its own call."""
    from batchjob.engine.native.kernels import fused_ops

    x = torch.randn(37, 2048, dtype=torch.bfloat16)
    w = torch.randn(2048, dtype=torch.bfloat16)
    gate_up = torch.randn(5, 2 * 1408, dtype=torch.bfloat16)
    return [
        lambda: fused_ops.rms_norm(x, w, 1e-5),
        lambda: fused_ops.rms_norm(x, w, 1e-5, residual=torch.randn_like(x))[0],
        lambda: fused_ops.silu_and_mul(gate_up),
    ]


def launched_for_real() -> tuple[list[KernelVariant], list[str]]:
    """The steps again, each launch compiling (or finding) its variant; launching it then fails here, where
    there is no GPU to launch on. Returns the variants and the launch errors."""
    errors = []
    with recording_compiles() as variants:
        for step in steps():
            try:
                step()
            except Exception as exc:  # the launch, after the compile or the cache hit
                errors.append(type(exc).__name__)
    return variants, errors


def entries() -> set[str]:
    folder = os.environ["TRITON_CACHE_DIR"]
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def workers_killed(workers: int) -> None:
    """A pool whose workers are all killed before it gets work: every variant fails, and `wait` returns."""
    pool = CompilePool(workers, TARGET)
    for pid in descendants(os.getpid()):
        os.kill(pid, signal.SIGKILL)
    variant = KernelVariant("batchjob.engine.native.kernels.fused_ops", "_silu_and_mul_kernel", "{}")
    pool.submit([variant] * 3)
    started = time.perf_counter()
    done = pool.wait(timeout_s=600)
    print(
        json.dumps(
            {"failed": len(done.failed), "compiled": len(done.compiled), "wait_s": time.perf_counter() - started}
        )
    )


def start_up_with_plan() -> None:
    """One start-up through `KernelPrecompile`: listing the variants or following the plan the one before kept."""
    from batchjob.engine.native.runtime.precompile import KernelPrecompile, _load_plan

    use_target(*TARGET)
    plan = _load_plan("scenario")
    was_cached = bool(plan) and cached(plan)
    kernels = KernelPrecompile("scenario", plan, None if was_cached else CompilePool(2, TARGET))
    if kernels.pool is not None:
        kernels.pool.submit(plan)

    compiled_while_listing = 0

    def listed(on_found: Callable[[KernelVariant], None]) -> list[KernelVariant]:
        """The steps' variants, each handed on as found; the listing then lasts until a worker has compiled one
        (at most a minute), as a longer listing would, to show the workers do not wait for its end."""
        nonlocal compiled_while_listing
        with zeroed_allocations(), skipping_launches(on_found) as found:
            for step in steps():
                step()
            deadline = time.perf_counter() + 60
            while kernels.pool is not None and time.perf_counter() < deadline:
                if compiled_while_listing := kernels.pool.compiled_so_far():
                    break
                time.sleep(0.05)
        return found

    kernels.compile_before_start(listed)
    before = entries()
    with kernels.recording():
        for step in steps():
            with contextlib.suppress(AttributeError):  # the launch itself: no GPU here
                step()
    print(
        json.dumps(
            {
                "had_plan": bool(plan),
                "compiled_while_listing": compiled_while_listing,
                "plan_cached": was_cached,
                "stats": kernels.stats,
                "new_cache_entries": len(entries() - before),
                "kept": len(_load_plan("scenario")),
            }
        )
    )


class Hang:
    """A "kernel" whose compile never ends, as a worker stuck in the compiler would be."""

    @staticmethod
    def preload(data: str) -> None:
        time.sleep(3600)


def stalled() -> None:
    """A pool with a worker stuck in a compile: `wait` gives up `STALL_S` after the last progress, the stuck
    variant fails and the others are compiled."""
    from batchjob.engine.native.runtime import compile_pool

    compile_pool.STALL_S = 3.0
    here = os.path.dirname(os.path.abspath(__file__))  # where the workers find this module's `Hang`
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    use_target(*TARGET)
    with zeroed_allocations(), skipping_launches() as found:
        for step in steps():
            step()
    pool = CompilePool(2, TARGET)
    pool.submit([KernelVariant("compile_pool_scenario", "Hang", "{}"), *found])
    started = time.perf_counter()
    done = pool.wait(timeout_s=600)
    waited = time.perf_counter() - started
    failed = [v.qualname for v, _ in done.failed]
    print(json.dumps({"compiled": len(done.compiled), "failed": failed, "wait_s": waited}))


def main() -> None:
    if sys.argv[1] == "--stalled":
        return stalled()
    if sys.argv[1] == "--workers-killed":
        return workers_killed(int(sys.argv[2]))
    if sys.argv[1] == "--plan":
        return start_up_with_plan()
    use_target(*TARGET)
    with zeroed_allocations(), skipping_launches() as found:
        outputs = [step() for step in steps()]
    report: dict = {
        "found": [v.qualname for v in found],
        "outputs_zero": all(bool((out == 0).all()) for out in outputs),
        "cache_entries_after_listing": len(entries()),
    }
    extra = [KernelVariant.from_json(json.loads(arg)) for arg in sys.argv[2:]]
    pool = CompilePool(int(sys.argv[1]), TARGET)
    pool.submit(found + extra)
    done = pool.wait(timeout_s=600)
    report["compiled"] = sorted(v.qualname for v in done.compiled)
    report["failed"] = [(v.qualname, why) for v, why in done.failed]
    report["cached"] = cached(done.compiled)
    before = entries()
    started = time.perf_counter()
    variants, errors = launched_for_real()
    report["relaunch_s"] = time.perf_counter() - started
    report["new_cache_entries"] = len(entries() - before)
    report["relaunch_hashes_match"] = {v.cache_hash for v in variants} == {v.cache_hash for v in done.compiled}
    report["relaunch_errors"] = errors
    print(json.dumps(report))


if __name__ == "__main__":
    main()
