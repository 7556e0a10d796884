"""Where a job's start-up goes: seconds by phase, from process start to "ready to generate".

Phases on the critical path are timed one after the other (`lap`) and add up to the total. Checks that run
in a thread beside the engine while it loads (`timed(..., beside_engine=True)`) report their own seconds but
add nothing to the total; what they cost the critical path is `wait_s`, the time the ready engine waited for
them. Only the standard library here (and `batchjob.caches`, which needs no more): `python -m batchjob` starts
this clock, and `keep_bytecode` decides where compiled Python goes, before importing anything else.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from batchjob.caches import cache_root

# Critical path, in order, with the words of the log line.
CRITICAL_PHASES = {
    "imports_s": "imports",
    "config_s": "config and model files",
    "checks_s": "input and output checks",
    "engine_s": "engine",
    "wait_s": "waiting for the checks beside it",
}
# Checks run in a thread while the engine loads (job.py says which and why).
BESIDE_ENGINE_PHASES = {
    "tokenizer_s": "tokenizer",
    "ids_s": "duplicate-id scan",
    "output_s": "output lock and record",
    "resume_s": "committed row ids",
}
# The engine's own start-up, when its stats() report it: copied into the report as `engine_<key>`.
ENGINE_PHASES = {
    "cuda_context_s": "CUDA context",
    "load_s": "weights",
    "kernel_listing_s": "kernel listing",
    "kernel_compile_s": "waiting for kernel compiles",
    "kv_sizing_s": "KV sizing",
    "graph_capture_s": "CUDA graphs",
    "warmup_s": "warm-up",
}


class StartupClock:
    """Seconds by phase; a phase timed twice (imports before and after the config is composed) adds up."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.phases: dict[str, float] = {}
        self.beside_engine: set[str] = set()
        self._last = self.started
        self._lock = threading.Lock()  # `timed` phases are written from the checks' thread

    def __reduce__(self):
        # A clock sent to another process (submitit pickles the Hydra task for each Slurm task) starts there:
        # perf_counter readings of two processes do not compare, and a lock does not pickle.
        return (StartupClock, ())

    def lap(self, phase: str) -> None:
        """The seconds since the previous lap (or the start) go to `phase`."""
        now = time.perf_counter()
        self._add(phase, now - self._last)
        self._last = now

    @contextlib.contextmanager
    def timed(self, phase: str, beside_engine: bool = False) -> Iterator[None]:
        """Time the block as `phase`; `beside_engine`: it runs in a thread while the engine loads."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._add(phase, time.perf_counter() - started, beside_engine)

    def _add(self, phase: str, seconds: float, beside_engine: bool = False) -> None:
        with self._lock:
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds
            if beside_engine:
                self.beside_engine.add(phase)

    def summary(self, engine_stats: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Every phase's seconds, the engine's own phases as `engine_<key>`, and `total_s`: the wall time from
        process start to now."""
        stats = engine_stats or {}
        with self._lock:
            phases = dict(self.phases)
        engine = {f"engine_{key}": float(stats[key]) for key in ENGINE_PHASES if key in stats}
        return {**phases, **engine, "total_s": time.perf_counter() - self.started}

    def ready_line(self, summary: Mapping[str, float], moment: str = "ready to generate") -> str:
        """The log line of the moment the engine can take requests (`moment`: how the line names it)."""
        with self._lock:
            beside = set(self.beside_engine)
        return phases_line(summary, beside, moment)


def phases_line(
    summary: Mapping[str, float], beside_engine: set[str] | None = None, moment: str = "ready to generate"
) -> str:
    """A start-up's `StartupClock.summary` (a job report's `startup_s`) as one line: the critical path's phases,
    the engine's own inside its phase, and the checks that ran beside it (`beside_engine`; by default every check
    the summary holds)."""
    beside_keys = set(BESIDE_ENGINE_PHASES) if beside_engine is None else beside_engine
    critical = ", ".join(
        f"{label} {summary[key]:.2f} s{_engine_detail(summary) if key == 'engine_s' else ''}"
        for key, label in CRITICAL_PHASES.items()
        if key in summary
    )
    beside = ", ".join(
        f"{label} {summary[key]:.2f} s"
        for key, label in BESIDE_ENGINE_PHASES.items()
        if key in summary and key in beside_keys
    )
    return f"{moment} {summary['total_s']:.1f} s after start: {critical}" + (
        f"; beside the engine: {beside}" if beside else ""
    )


def _engine_detail(summary: Mapping[str, float]) -> str:
    labels = ENGINE_PHASES.items()
    shown = [f"{label} {summary[f'engine_{key}']:.2f} s" for key, label in labels if f"engine_{key}" in summary]
    return f" ({', '.join(shown)})" if shown else ""


PYCACHE_DIR = "pycache"
# Where Python reads and writes bytecode when the prefix is set (PYTHONPYCACHEPREFIX), and what stops it writing.
_PREFIX_VARIABLE, _DONT_WRITE_VARIABLE = "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE"


def keep_bytecode(package: str = "torch") -> Path | None:
    """Where the environment cannot keep its compiled bytecode beside the sources, keep it in
    `cache_root()/pycache` instead, for this process and the processes it starts; returns that folder, or None
    where nothing changes.

    An environment installed without bytecode (uv does not compile by default) in an image that sets
    PYTHONDONTWRITEBYTECODE, or on read-only storage, compiles torch's 2,000-odd modules again in every job
    (`import torch` 4.9 s against 2.0 s with its bytecode, on a 16-core GPU host). Python can keep bytecode in a
    tree of its own (`sys.pycache_prefix`), which leaves the environment as it is: that is used here when
    `package` (the test of the environment) has no bytecode beside it and Python may not write it there, and
    the user chose no prefix (with a prefix Python reads bytecode only from there, so an environment that has
    its own keeps using it). The prefix mirrors the sources' absolute paths, and each file is written whole
    (a temporary file, then a rename), so jobs on nodes sharing the cache share it safely. The processes started
    from here (data-parallel ranks, Slurm tasks, the engine's ranks) inherit the prefix and may write to it: they
    read and write only there, never beside the sources."""
    if sys.pycache_prefix is not None:
        return None
    spec = importlib.util.find_spec(package)
    source = spec.origin if spec is not None else None
    if not source or _has_bytecode(source):
        return None
    if not sys.dont_write_bytecode and os.access(os.path.dirname(source), os.W_OK):
        return None  # the first job writes it beside the sources
    prefix = cache_root() / PYCACHE_DIR
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # compiled_afresh's warning names the fix
    if not os.access(prefix, os.W_OK):
        return None
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False
    os.environ[_PREFIX_VARIABLE] = str(prefix)
    os.environ.pop(_DONT_WRITE_VARIABLE, None)
    return prefix


def compiled_afresh(module: ModuleType) -> str | None:
    """Why every job compiles `module`'s package from its sources (it has no bytecode beside them or under the
    bytecode prefix, and Python may not write it: `keep_bytecode` could not help), with the fix; None when its
    bytecode is there. Installers such as uv leave packages without bytecode, and container images often set
    PYTHONDONTWRITEBYTECODE: torch's 2,141 modules then cost every job about 3 s more (import torch took 4.9 s
    against 2.0 s with its bytecode, on a 16-core GPU host)."""
    source = getattr(module, "__file__", None) or ""
    if _has_bytecode(source):
        return None
    why = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else "its folder is not writable"
    packages = os.path.dirname(os.path.dirname(source)) if source.endswith("__init__.py") else os.path.dirname(source)
    return (
        f"{module.__name__} has no compiled bytecode and {why}, so every job compiles it afresh (seconds of "
        f"start-up); compile the environment once: python -m compileall -q -j 0 {packages}"
    )


def _has_bytecode(source: str) -> bool:
    """Whether Python finds compiled bytecode for the module at `source` (beside it, or under the bytecode
    prefix when one is set); anything but a `.py` source counts as compiled."""
    return not source.endswith(".py") or os.path.exists(importlib.util.cache_from_source(source))
