"""The engine's Triton kernels compile for an H100 (sm_90) with Triton's real compiler, and each fits the shared memory
and threads an H100 block may have without spilling registers, checked on a machine without a GPU: a norm, the rotary
step that stores K/V, SiLU-and-mul, decode (one split and several), prefill and mixed attention, the batch-invariant
matmul (K split and serial), FP8 projections (per-row and block weights), the samplers and the fused mixture of experts,
and the benchmark models' own shapes (head_dim 64, Qwen 3's head norms, Gemma's norm, Qwen3-30B-A3B's experts with the
configs the package's table tunes for an H200). The interpreter tests check what the kernels compute; this checks that
the compiler takes them, which only a GPU run showed before. Runs kernels_compile_scenario.py in a process of its own
(the suite's processes interpret)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_every_engine_kernel_compiles_for_an_h100_fits_its_shared_memory_and_spills_no_register(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    scenario = Path(__file__).with_name("kernels_compile_scenario.py")
    done = subprocess.run([sys.executable, str(scenario)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {name: why for name, why in report["results"].items() if why != "ok"}
    assert not failed, "\n\n".join(f"{name}: {why}" for name, why in failed.items())
    assert report["compiled"] >= len(report["results"])
    # No kernel spills its registers to local memory (the invariant matmul's serial launch did, at four parts of K).
    assert report["spilled"] == {}


def test_every_engine_kernel_launches_within_the_shared_memory_of_a_gpu_of_100_kb(tmp_path: Path) -> None:
    """On an L40S (sm_89; an L4, an A10 and an RTX 4090 have as much shared memory a block), every kernel above
    launches: the fused mixture of experts' gate/up GEMM, three tiles a pipeline stage, takes fewer stages there
    than its Hopper-sized tiles ask for (it asked for 110,592 bytes of 101,376)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    scenario = Path(__file__).with_name("kernels_compile_scenario.py")
    done = subprocess.run(
        [sys.executable, str(scenario), "--ada"], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {name: why for name, why in report["results"].items() if why != "ok"}
    assert not failed, "\n\n".join(f"{name}: {why}" for name, why in failed.items())


def test_compile_workers_compile_every_engine_kernel_under_the_key_its_launch_looks_up(tmp_path: Path) -> None:
    """The workers load no torch (a placeholder stands in for it while the kernels' modules import): every kernel
    above, listed, compiled by them and then launched, finds the workers' binary and compiles nothing itself; listed
    again, now that the process holds them all, it launches none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    scenario = Path(__file__).with_name("kernels_compile_scenario.py")
    command = [sys.executable, str(scenario), "--through-workers"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["listing_errors"] == {}
    assert report["failed"] == [] and report["compiled"] == report["listed"] > 20
    assert report["launched"] == report["listed"], "the launches met the variants the listing found"
    assert report["missed"] == [] and report["new_cache_entries"] == 0
    # A listing pass after every kernel ran in the process (a second engine's start-up) runs none of them: one that
    # ran would read what the skipped launches left unwritten (an out-of-range index: an illegal memory access).
    assert report["launches"] > report["listed"]
    assert report["relisted_as_listed"] and report["relisting_errors"] == report["listing_errors"]
    assert report["relisting_launches"] == 0
