"""Where batchjob keeps what later runs reuse: compiled Triton kernels under BATCHJOB_CACHE unless the user chose
TRITON_CACHE_DIR, and small JSON entries (model specs, tokenizer classes) written whole."""

from __future__ import annotations

import os
import subprocess
import sys

from batchjob.caches import load_entry, store_entry, use_kernel_cache, use_vllm_cache


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


def test_vllms_compiled_graphs_and_kernels_go_under_batchjob_cache_unless_the_user_chose(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path))
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    use_vllm_cache()
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/elsewhere/vllm")
    use_vllm_cache()
    assert os.environ["VLLM_CACHE_ROOT"] == "/elsewhere/vllm"


def test_importing_the_native_engine_sets_it_before_triton_looks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    code = "import batchjob.engine.native, triton; print(triton.knobs.cache.dir)"
    run = subprocess.run(
        [sys.executable, "-c", code], env={**env, "BATCHJOB_CACHE": str(tmp_path)}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(tmp_path / "triton")


def test_an_entry_is_kept_whole_readable_by_others_and_replaced(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path))
    assert load_entry("kind", "key") is None
    store_entry("kind", "key", {"a": [1, 2]})
    store_entry("kind", "key", {"a": [3]})
    (entry,) = (tmp_path / "kind").iterdir()  # no temporary file left beside it
    assert entry.name == "key.json" and load_entry("kind", "key") == {"a": [3]}
    assert entry.stat().st_mode & 0o777 == 0o644
    entry.write_text("{half")
    assert load_entry("kind", "key") is None


def test_a_cache_that_cannot_be_written_keeps_nothing_and_raises_nothing(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "file" / "cache"))
    store_entry("kind", "key", {"a": 1})
    assert load_entry("kind", "key") is None
