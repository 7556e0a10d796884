"""Each measurement in its own fresh process, so no system inherits another's compiled kernels, allocator
state or warm imports. The parent never touches the GPU: it writes a task as JSON (measure the `hardware`, build
a `model`, or run one `system` on one workload), starts `python -m bench_lib.isolation TASK OUT` and reads OUT.
`run_cache_env` gives a cold run empty caches; the warm run reuses the ones its cold run filled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parents[1]
REPO = SCRIPTS.parent


# Functions listed per ordering in a `--profile` file.
PROFILE_LINES = 45
# `python -m bench_lib.isolation`, less the working directory that `-m` and `-c` put first on the path: started
# from a checkout's root it would import that checkout's `batchjob` before the one PYTHONPATH names (`repo`).
# Then, as `python -m batchjob` does first, `keep_bytecode`: in an environment that cannot keep bytecode beside
# its sources (PYTHONDONTWRITEBYTECODE, read-only folders) a cold run compiles the imports into its cache and the
# warm run reads them there, as a job's would (a checkout from before it, under `--against`, goes without).
CHILD = (
    "import runpy, sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "try:\n"
    "    from batchjob.job.startup import keep_bytecode\n"
    "except ImportError:\n"
    "    pass\n"
    "else:\n"
    "    keep_bytecode()\n"
    "runpy.run_module('bench_lib.isolation', run_name='__main__', alter_sys=True)"
)


class ChildFailed(RuntimeError):
    pass


def run_cache_env(directory: Path) -> dict[str, str]:
    """Every cache a run fills, inside `directory`: Triton's, torch inductor's, the CUDA driver's JIT, vLLM's and
    batchjob's start-up caches (shared between systems, only the first cold run would read the model's config)."""
    return {
        "TRITON_CACHE_DIR": str(directory / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(directory / "inductor"),
        "CUDA_CACHE_PATH": str(directory / "cuda"),
        "BATCHJOB_CACHE": str(directory / "batchjob"),
        "VLLM_CACHE_ROOT": str(directory / "vllm"),  # vLLM's torch.compile artefacts
    }


def run_child(
    task: dict[str, Any], env: dict[str, str] | None = None, timeout_s: float | None = None, repo: Path | None = None
) -> dict:
    """Run `task` in a fresh Python process (its output streams to ours) and return what it reported; with `repo`,
    the `batchjob` it imports is that checkout's (the harness stays this one's). Raises ChildFailed with the
    reason if it raised, crashed or ran past `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix="bench-task-") as scratch:
        task_path, out_path = Path(scratch) / "task.json", Path(scratch) / "out.json"
        task_path.write_text(json.dumps(task))
        path = os.pathsep.join([str(SCRIPTS), str(repo or REPO), os.environ.get("PYTHONPATH", "")])
        child_env = {**os.environ, **(env or {}), "PYTHONPATH": path}
        command = [sys.executable, "-c", CHILD, str(task_path), str(out_path)]
        from batchjob.processes import dies_with_us

        tie = dies_with_us(signal.SIGKILL)  # a harness stopped by SIGKILL takes its run, and its GPU memory, with it
        try:
            code = subprocess.run(command, env=child_env, timeout=timeout_s, preexec_fn=tie).returncode
        except subprocess.TimeoutExpired:
            raise ChildFailed(f"still running after {timeout_s:.0f} s, stopped") from None
        result = json.loads(out_path.read_text()) if out_path.exists() else None
        if result is None:
            raise ChildFailed(f"the process exited with status {code} without a result")
        if "error" in result:
            raise ChildFailed(result["error"])
        return result


def model_dir(architecture: str | None, cache: Path, dummy: bool = False, tokenizer: str | None = None) -> Path:
    """The model a run measures, built on first use: the tiny llama (no `architecture`), the config alone (`dummy`
    weights), or seeded random weights (with a BPE `tokenizer` for structured outputs), built in a child process so
    that this one never holds a CUDA context: it would shrink the measured runs' KV cache."""
    from bench_lib.models import config_model_dir, tiny_model_dir

    if architecture is None:
        return tiny_model_dir(cache)
    if dummy and tokenizer is None:
        return config_model_dir(architecture, cache)
    task = {"kind": "model", "architecture": architecture, "cache": str(cache), "tokenizer": tokenizer}
    return Path(run_child(task)["model_dir"])


def _hardware() -> dict[str, Any]:
    import torch

    from bench_lib.hardware import measure_hardware

    rates = measure_hardware()
    return {**dataclasses.asdict(rates), "total_memory": torch.cuda.get_device_properties(0).total_memory}


def _model(task: dict[str, Any]) -> dict[str, Any]:
    from bench_lib.models import bpe_model_dir, random_model_dir

    if task.get("tokenizer"):
        return {"model_dir": str(bpe_model_dir(task["architecture"], Path(task["cache"]), task["tokenizer"]))}
    return {"model_dir": str(random_model_dir(task["architecture"], Path(task["cache"])))}


def _system(task: dict[str, Any]) -> dict[str, Any]:
    from bench_lib.systems import RunSettings, run_system
    from bench_lib.workloads import draw_requests, workload

    spec = workload(task["workload"], task.get("greedy", False))
    requests = draw_requests(spec, task["vocab"], task["special_ids"])
    settings = RunSettings(**task["settings"])
    args = (task["system"], Path(task["model_dir"]), requests, settings)
    result = _profiled(task["profile"], run_system, *args) if task.get("profile") else run_system(*args)
    # The native engine's package sets TRITON_CACHE_DIR on import when the environment did not.
    kernel_cache = os.environ.get("TRITON_CACHE_DIR")
    import batchjob
    from batchjob.caches import cache_root

    source = str(Path(batchjob.__file__).resolve().parents[1])
    result = dataclasses.replace(
        result, run=task["run"], kernel_cache=kernel_cache, startup_cache=str(cache_root()), engine_source=source
    )
    return dataclasses.asdict(result)


def _profiled(path: str, function, *args):
    """`function(*args)` under cProfile; its top functions by own and by cumulative time go to `path`."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    result = profile.runcall(function, *args)
    with open(path, "w") as out:
        stats = pstats.Stats(profile, stream=out)
        for order in ("tottime", "cumulative"):
            stats.sort_stats(order).print_stats(PROFILE_LINES)
    return result


def child_main(task_path: str, out_path: str) -> int:
    task = json.loads(Path(task_path).read_text())
    runners = {"hardware": lambda: _hardware(), "model": lambda: _model(task), "system": lambda: _system(task)}
    try:
        result = runners[task["kind"]]()
        code = 0
    except Exception as error:  # reported to the parent, which records it and goes on with the next system
        import traceback

        traceback.print_exc()
        result, code = {"error": f"{type(error).__name__}: {error}"}, 1
    Path(out_path).write_text(json.dumps(result, default=float))
    return code


if __name__ == "__main__":
    sys.exit(child_main(*sys.argv[1:]))
