"""Where compiled Triton kernels go: under BATCHJOB_CACHE unless the user chose TRITON_CACHE_DIR."""

from __future__ import annotations

import os
import subprocess
import sys

from batchjob.caches import use_kernel_cache


def test_kernels_go_under_batchjob_cache_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    use_kernel_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")


def test_a_user_chosen_triton_cache_dir_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/shared/kernels")
    use_kernel_cache()
    assert os.environ["TRITON_CACHE_DIR"] == "/shared/kernels"


def test_importing_the_native_engine_sets_it_before_triton_looks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    code = "import batchjob.engine.native, triton; print(triton.knobs.cache.dir)"
    run = subprocess.run(
        [sys.executable, "-c", code], env={**env, "BATCHJOB_CACHE": str(tmp_path)}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(tmp_path / "triton")
