"""A job's start-up on a GPU, by phase: the engine's graph capture and warm-up are in the report, and the critical
path adds up to the time from process start to "ready to generate".

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu/test_startup_gpu.py -q -s   (-s prints the phases)

Also: a cold start-up's kernels compiled by worker processes (runtime/precompile.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as pads
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from startup_probe import FIRST_RUN_ONLY, TOKENIZER_MODULE, modules_a_job_imports  # noqa: E402

from batchjob.caches import cache_root  # noqa: E402
from batchjob.job.startup import CRITICAL_PHASES  # noqa: E402
from batchjob.job.tiny_model import default_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


def test_a_gpu_job_reports_every_start_up_phase(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "batchjob", "engine=native", f"output.dir={out}", "data.limit=32"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    startup = json.loads((out.parent / f"{out.name}.batchjob" / "_report.json").read_text())["startup_s"]
    print(json.dumps(startup, indent=1))
    engine_phases = {"engine_cuda_context_s", "engine_load_s", "engine_kv_sizing_s", "engine_graph_capture_s"}
    assert engine_phases | {"engine_warmup_s"} <= set(startup)
    assert (
        startup["engine_graph_capture_s"] > 0
        and startup["engine_warmup_s"] > 0
        and startup["engine_cuda_context_s"] > 0
    )
    assert (
        startup["engine_s"]
        >= startup["engine_cuda_context_s"] + startup["engine_load_s"] + startup["engine_kv_sizing_s"]
    )
    assert sum(startup[key] for key in CRITICAL_PHASES) == pytest.approx(startup["total_s"], abs=0.1)
    assert "tokenizer_s" in startup


def test_a_float32_checkpoint_under_dtype_auto_runs_in_bfloat16_on_the_gpu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config.json that declares no dtype means float32, many times slower than bfloat16 on a GPU: under
    engine.dtype=auto the model runs in bfloat16 there, and the load says so; an explicit float32 stays."""
    from transformers import LlamaConfig

    from batchjob.engine.native.layers.attention import TorchPagedAttention
    from batchjob.engine.native.loading.model_loader import load_model

    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    assert not json.loads((tmp_path / "config.json").read_text()).get("dtype")
    with caplog.at_level("INFO", logger="batchjob.engine.native"):
        model, spec = load_model(tmp_path, "auto", "cuda", TorchPagedAttention(), load_format="dummy")
    assert spec.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert any("bfloat16" in r.message and "engine.dtype=float32" in r.message for r in caplog.records)
    model, spec = load_model(tmp_path, "float32", "cuda", TorchPagedAttention(), load_format="dummy")
    assert spec.dtype == torch.float32 and {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_later_gpu_job_on_a_model_imports_no_config_classes(tmp_path: Path) -> None:
    """As on the CPU (tests/job/test_startup_phases.py), with the GPU's own start-up: Triton kernels, CUDA graphs
    and warm-up import none of them either. The compiled kernels stay in the usual cache."""
    env = {**os.environ, "BATCHJOB_CACHE": str(tmp_path / "cache"), "TRITON_CACHE_DIR": str(cache_root() / "triton")}
    watched = [*FIRST_RUN_ONLY, TOKENIZER_MODULE]

    def imported(run: str) -> set[str]:
        overrides = ["engine=native", f"model.path={default_tiny_model()}", f"output.dir={tmp_path / run}"]
        return modules_a_job_imports([*overrides, "data.limit=8"], env, REPO, watched, timeout=600)

    assert imported("first") == set(watched)
    assert imported("later") == {TOKENIZER_MODULE}


def test_after_batchjob_warmup_a_job_compiles_no_kernel(tmp_path: Path) -> None:
    """`python -m batchjob.warmup` with the job's overrides fills the kernel cache: the job started after it, with
    the same `BATCHJOB_CACHE`, adds no compiled kernel to it."""
    env = {**os.environ, "BATCHJOB_CACHE": str(tmp_path / "cache")}
    env.pop("TRITON_CACHE_DIR", None)
    overrides = ["engine=native", "sampling.temperature=0.8", "sampling.top_p=0.95"]
    warm = subprocess.run(
        [sys.executable, "-m", "batchjob.warmup", *overrides], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert warm.returncode == 0, warm.stderr[-3000:]
    kernels = tmp_path / "cache" / "triton"
    compiled = {path.name for path in kernels.rglob("*") if path.is_file()}
    assert compiled  # the warm-up compiled the engine's kernels into the shared cache
    job = [sys.executable, "-m", "batchjob", *overrides, f"output.dir={tmp_path / 'out'}"]
    done = subprocess.run(job, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {path.name for path in kernels.rglob("*") if path.is_file()} == compiled


def _cold_job(tmp_path: Path, name: str, *overrides: str) -> tuple[list, dict, str]:
    """A job of the default model in its own `BATCHJOB_CACHE` (compile cache inside): its rows, report, log."""
    env = {**os.environ, "BATCHJOB_CACHE": str(tmp_path / f"cache-{name.split('-')[0]}")}
    env.pop("TRITON_CACHE_DIR", None)
    out = tmp_path / name
    job = [sys.executable, "-m", "batchjob", "engine=native", "data.limit=96", f"output.dir={out}", *overrides]
    done = subprocess.run(job, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out.parent / f"{out.name}.batchjob" / "_report.json").read_text())
    table = pads.dataset(str(out), format="parquet").to_table().sort_by("row_id")
    return table.column("generation").to_pylist(), report, done.stderr


def test_a_cold_start_up_has_workers_compile_its_kernels_and_generates_the_same(tmp_path: Path) -> None:
    """Empty caches: the start-up lists its kernel variants, worker processes compile every one (the start-up's
    own launches compile none), and the rows equal those of a start-up that compiled one kernel at a time. The
    next job finds every binary its plan names: no listing, no workers, the same rows."""
    serial, serial_report, _ = _cold_job(tmp_path, "serial", "engine.compile_workers=0")
    workers, report, log = _cold_job(tmp_path, "workers")
    startup = report["startup_s"]
    print(json.dumps({"serial": serial_report["startup_s"], "workers": startup}, indent=1))
    assert workers == serial
    # Its empty cache held no spec: config.json was read natively and checked by transformers' reading beside.
    assert 0 <= report["engine"]["spec_check_wait_s"] <= report["engine"]["spec_check_s"]
    assert "Triton kernel variants compiled or found by worker processes" in log
    assert startup["engine_kernel_listing_s"] > 0 and startup["engine_kernel_compile_s"] > 0
    assert "the workers had not compiled were compiled by the start-up" not in log, log[-3000:]
    again, warm_report, log = _cold_job(tmp_path, "workers-again")
    assert again == serial
    warm_startup = warm_report["startup_s"]
    assert "engine_kernel_listing_s" not in warm_startup and "engine_kernel_compile_s" not in warm_startup
    assert "spec_check_s" not in warm_report["engine"]  # the spec came from the cache
    assert "worker processes" not in log
