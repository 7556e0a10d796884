"""Kernels compiled ahead by worker processes (runtime/compile_pool.py, runtime/kernel_variants.py), with Triton's
real compiler: a process without a GPU stands in for an engine on an H100 and compiles for sm_90, as a GPU node's
workers do. Each case runs compile_pool_scenario.py in a process of its own, where Triton compiles instead of
interpreting (the suite's own processes interpret)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCENARIO = Path(__file__).with_name("compile_pool_scenario.py")
MISSING = {"module": "batchjob.engine.native.kernels.fused_ops", "qualname": "no_such_kernel", "data": "{}"}


def run_scenario(tmp_path: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["BATCHJOB_CACHE"] = str(tmp_path / "batchjob")
    done = subprocess.run(
        [sys.executable, str(SCENARIO), *args], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_scenario(tmp_path_factory.mktemp("pool"), "2", json.dumps(MISSING))


def test_listing_the_variants_launches_and_compiles_nothing(compiled: dict) -> None:
    assert compiled["found"] == ["_rms_norm_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel"]
    assert compiled["cache_entries_after_listing"] == 0
    assert compiled["outputs_zero"], "a skipped launch's output must read as zeros, never stale memory"


def test_workers_compile_every_listed_variant_into_the_cache(compiled: dict) -> None:
    assert compiled["compiled"] == ["_rms_norm_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel"]
    assert compiled["cached"]


def test_a_variant_that_cannot_compile_is_reported_and_the_rest_compile(compiled: dict) -> None:
    [(name, why)] = compiled["failed"]
    assert name == "no_such_kernel" and "no attribute 'no_such_kernel'" in why


def test_the_real_launches_find_the_workers_binaries(compiled: dict) -> None:
    """Triton's launch path computes the same cache key as the workers' compile: no entry is added, and each
    launch stops at launching (no GPU here), not at compiling."""
    assert compiled["new_cache_entries"] == 0
    assert compiled["relaunch_hashes_match"]
    assert compiled["relaunch_errors"] == ["AttributeError"] * 3


def test_a_pool_whose_workers_died_fails_its_variants_at_once(tmp_path: Path) -> None:
    report = run_scenario(tmp_path, "--workers-killed", "2")
    assert report == {"failed": 3, "compiled": 0, "wait_s": pytest.approx(0, abs=5)}


def test_a_start_up_keeps_its_launches_as_the_next_ones_plan(tmp_path: Path) -> None:
    first = run_scenario(tmp_path, "--plan")
    assert not first["had_plan"] and first["stats"]["kernels_compiled"] == 3 and "kernel_listing_s" in first["stats"]
    assert first["new_cache_entries"] == 0 and first["kept"] == 3
    assert first["stats"]["kernels_missed"] == 0, "the start-up's launches compiled nothing the workers had not"
    assert first["compiled_while_listing"] >= 1, "each variant goes to the workers as the listing finds it"
    second = run_scenario(tmp_path, "--plan")
    assert second["had_plan"] and second["plan_cached"], "every binary of the plan is in the cache: no workers"
    assert second["stats"] == {} and second["new_cache_entries"] == 0 and second["kept"] == 3


def test_a_plan_whose_binaries_are_gone_is_compiled_by_the_workers_without_listing(tmp_path: Path) -> None:
    run_scenario(tmp_path, "--plan")
    shutil.rmtree(tmp_path / "triton")
    again = run_scenario(tmp_path, "--plan")
    assert again["had_plan"] and not again["plan_cached"]
    assert again["stats"]["kernels_compiled"] == 3 and "kernel_listing_s" not in again["stats"]
    assert again["new_cache_entries"] == 0


def test_a_worker_stuck_in_a_compile_holds_the_start_up_only_until_progress_stalls(tmp_path: Path) -> None:
    report = run_scenario(tmp_path, "--stalled")
    assert report["failed"] == ["Hang"] and report["compiled"] == 3
    assert report["wait_s"] < 120, "gave up on the stuck worker soon after the others finished, not at the timeout"


def test_compile_workers_is_checked_with_the_engine_options() -> None:
    from batchjob.engine.native.options import NativeOptions

    with pytest.raises(ValueError, match=r"engine.compile_workers=-1: must be >= 0 \(0: the start-up compiles"):
        NativeOptions.from_mapping({"compile_workers": -1})
    assert NativeOptions.from_mapping({"compile_workers": 0}).compile_workers == 0


def test_auto_compile_workers_leave_a_cpu_to_the_start_up_and_share_among_ranks() -> None:
    from batchjob.engine.native.options import NativeOptions
    from batchjob.engine.native.runtime.precompile import MAX_AUTO_WORKERS, compile_workers

    cpus = len(os.sched_getaffinity(0))
    expected = min(MAX_AUTO_WORKERS, cpus - 1)
    assert compile_workers(NativeOptions()) == (expected if expected >= 2 else 0)
    assert compile_workers(NativeOptions(tensor_parallel=cpus)) == 0
    assert compile_workers(NativeOptions(compile_workers=5)) == 5


def test_only_a_single_device_start_up_lists_its_variants() -> None:
    """Without a plan, tensor-parallel ranks compile as they launch (the plan they leave is followed by the next
    start-up's workers); every single-GPU engine lists, `engine.deterministic` included."""
    from batchjob.engine.native.options import NativeOptions
    from batchjob.engine.native.runtime.precompile import lists_variants

    assert lists_variants(NativeOptions())
    assert lists_variants(NativeOptions(deterministic=True))
    assert not lists_variants(NativeOptions(tensor_parallel=2))
