"""A start-up's Triton compiles, done by worker processes beside the rest of the start-up instead of one after
another as the start-up first launches each kernel variant.

With a CUDA device and `engine.compile_workers` (auto: up to 8, from the CPUs this process may use):

1. `KernelPrecompile.begin`, before the weights load, looks up the plan of this start-up in
   `$BATCHJOB_CACHE/kernel-plans`: the variants the last start-up of the same model config, engine options, GPU
   and software versions launched, with their cache hashes. Every binary already in Triton's cache (a warm node):
   nothing to do. Otherwise it starts the workers (`compile_pool.py`), and hands them the plan at once if there is
   one, so the compiles run while the weights load.
2. `compile_before_start`, once the weights are on the device: without a plan, the start-up's steps (the KV
   sizing's largest step, every graph's work, the warm-up) run on a scratch runner under
   `kernel_variants.skipping_launches`, which lists their variants in about a second, and the workers compile
   them. It waits for the workers (`COMPILE_TIMEOUT_S` at most). The ranks of a tensor-parallel engine list
   nothing (the steps' collectives would have to meet on every rank); they follow a plan where there is one.
3. `recording` wraps the start-up proper: its launches load the binaries from the cache. What it launched is kept
   as the next start-up's plan (rewritten only when it changed).

A variant the workers did not compile is compiled by the start-up's own launch, as without workers; so is
everything when the workers cannot start. The key of a plan covers this package's sources: a new version lists
its variants again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchjob.caches import files_key, load_entry, store_entry
from batchjob.engine.api import EngineSetupError
from batchjob.engine.native.options import NativeOptions

if TYPE_CHECKING:
    from batchjob.engine.native.runtime.compile_pool import CompilePool
    from batchjob.engine.native.runtime.kernel_variants import KernelVariant

log = logging.getLogger("batchjob.engine.native")
PLANS = "kernel-plans"
# Workers for `compile_workers` auto: compiles of one start-up rarely keep more busy, and each holds ~300 MB.
MAX_AUTO_WORKERS = 8
# How long the start-up waits for the workers; what they have not compiled by then, its own launches compile.
COMPILE_TIMEOUT_S = 300.0


def compile_workers(opts: NativeOptions) -> int:
    """The worker processes this engine compiles with: `engine.compile_workers`, or for auto the CPUs this
    process may use, shared among its tensor-parallel ranks, less one for the start-up itself, up to
    `MAX_AUTO_WORKERS`; none where fewer than two would be left. (The engines of `data_parallel` each count the
    node's CPUs: their workers run at once only on a cold node, for seconds.)"""
    if opts.compile_workers is not None:
        return opts.compile_workers
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(MAX_AUTO_WORKERS, cpus // max(1, opts.tensor_parallel) - 1)
    return workers if workers >= 2 else 0


@functools.cache
def _engine_digest() -> str:
    """A digest of the native engine's sources: its kernels and what computes their launch arguments."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def plan_key(model_path: str | Path, opts: NativeOptions, device: torch.device) -> str:
    import triton

    options = {k: v for k, v in dataclasses.asdict(opts).items() if k != "compile_workers"}
    return files_key(
        Path(model_path),
        ["config.json"],
        json.dumps(options, sort_keys=True, default=str),
        torch.cuda.get_device_name(device),
        str(torch.cuda.get_device_capability(device)),
        torch.__version__,
        triton.__version__,
        _engine_digest(),
    )


def _load_plan(key: str) -> list[KernelVariant]:
    from batchjob.engine.native.runtime.kernel_variants import KernelVariant

    entry = load_entry(PLANS, key)
    try:
        return [KernelVariant.from_json(v) for v in entry["variants"]] if entry else []
    except (KeyError, TypeError):
        log.debug("kernel plan %s unreadable: listing the variants again", key)
        return []


def lists_variants(opts: NativeOptions) -> bool:
    """Whether a start-up with no plan lists its variants for the workers; otherwise it compiles them itself, and
    what it launched becomes the plan the next start-up's workers follow.

    - The ranks of a tensor-parallel engine list nothing: listing runs steps, whose collectives every rank must
      meet, and one rank could find a plan another did not.
    - `engine.deterministic` lists like the default.
    """
    return opts.tensor_parallel == 1


class KernelPrecompile:
    def __init__(self, key: str, plan: list[KernelVariant], pool: CompilePool | None) -> None:
        self.key, self.plan, self.pool = key, plan, pool
        self.stats: dict[str, float] = {}
        self._compiled: set[tuple[str, str, str]] | None = None  # what the workers compiled, once they ran

    @classmethod
    def begin(cls, model_path: str | Path, opts: NativeOptions, device: torch.device) -> KernelPrecompile | None:
        """None where nothing compiles (no CUDA device, Triton interpreting) or workers are off. Compiling ahead
        only ever saves time: whatever fails here is logged and the start-up compiles its kernels itself."""
        workers = compile_workers(opts)
        if device.type != "cuda" or workers <= 0 or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            return None
        try:
            return cls._begin(model_path, opts, device, workers)
        except Exception as exc:
            log.warning(
                "kernels not compiled ahead (%s: %s): the start-up compiles them itself", type(exc).__name__, exc
            )
            return None

    @classmethod
    def _begin(
        cls, model_path: str | Path, opts: NativeOptions, device: torch.device, workers: int
    ) -> KernelPrecompile:
        from triton.runtime.driver import driver

        from batchjob.engine.native.runtime.compile_pool import CompilePool
        from batchjob.engine.native.runtime.kernel_variants import cached

        key = plan_key(model_path, opts, device)
        plan = _load_plan(key)
        if (plan and cached(plan)) or (not plan and not lists_variants(opts)):
            return cls(key, plan, None)
        with torch.cuda.device(device):
            target = driver.active.get_current_target()
        pool = CompilePool(workers, (target.backend, target.arch, target.warp_size))
        pool.submit(plan)
        return cls(key, plan, pool)

    def compile_before_start(
        self, list_variants: Callable[[Callable[[KernelVariant], None]], list[KernelVariant]]
    ) -> None:
        """Wait for the workers, having given them the start-up's variants where no plan did: `list_variants` lists
        them, handing each to the callable it is given as it finds it, so the workers compile while it lists."""
        if self.pool is None:
            return
        pool = self.pool
        if not self.plan:
            started = time.perf_counter()
            try:
                list_variants(lambda variant: pool.submit([variant]))
            except Exception as exc:  # the start-up proper compiles what is not listed
                log.warning(
                    "kernel variants not listed (%s: %s)",
                    type(exc).__name__,
                    exc,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                _check_device_usable(exc)
            self.stats["kernel_listing_s"] = time.perf_counter() - started
        report = pool.wait(COMPILE_TIMEOUT_S)
        self.pool = None
        self._compiled = {v.key for v in report.compiled}
        self.stats.update(kernels_compiled=len(report.compiled), kernel_compile_s=report.seconds)
        log.info(
            "%d Triton kernel variants compiled or found by worker processes, %.1f s waited for (%s)%s",
            len(report.compiled),
            report.seconds,
            "from the last start-up's plan"
            if self.plan
            else f"listed in {self.stats['kernel_listing_s']:.1f} s, compiled as they were listed",
            f"; {len(report.failed)} left to the start-up, e.g. {report.failed[0][1]}" if report.failed else "",
        )

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Keep what the start-up within launches as the next start-up's plan."""
        from batchjob.engine.native.runtime.kernel_variants import recording_compiles

        with recording_compiles() as launched:
            yield
        if self._compiled is not None:
            missed = [v for v in launched if v.key not in self._compiled]
            self.stats["kernels_missed"] = len(missed)
            if missed:
                log.info(
                    "%d kernel variants the workers had not compiled were compiled by the start-up: %s",
                    len(missed),
                    ", ".join(sorted({v.qualname for v in missed})),
                )
        # Nothing new launched: a second engine of this process, whose kernels the first loaded. Its plan stays.
        if launched and {v.key: v.cache_hash for v in launched} != {v.key: v.cache_hash for v in self.plan}:
            store_entry(PLANS, self.key, {"variants": [v.to_json() for v in launched]})

    def close(self) -> None:
        """Stop workers still running (a start-up that failed before waiting for them)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None


@contextmanager
def compiling_ahead(
    model_path: str | Path, opts: NativeOptions, device: torch.device
) -> Iterator[KernelPrecompile | None]:
    """`KernelPrecompile.begin` for the start-up within (to hand `start_runner`), its workers stopped after it."""
    kernels = KernelPrecompile.begin(model_path, opts, device)
    try:
        yield kernels
    finally:
        if kernels is not None:
            kernels.close()


def _check_device_usable(listing_error: Exception) -> None:
    """Raise where the listing pass left the CUDA context unusable (a device-side assert or a fault is sticky: every
    later call fails), naming the option that starts up without it; otherwise return."""
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").item()
    except Exception as exc:
        raise EngineSetupError(
            f"listing the start-up's kernel variants left this process's GPU unusable ({type(listing_error).__name__}:"
            f" {listing_error}); start with engine.compile_workers=0, which compiles each kernel as the start-up "
            "first launches it"
        ) from exc
