"""scripts/bench.py: the CPU smoke run, and the roofline arithmetic the GPU run reports against."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def bench_lib(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_lib.roofline
    import bench_lib.workloads

    return bench_lib


def test_tiny_run_measures_every_available_system_on_identical_work(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench.py"), "--tiny", "--out", str(out), "--model-cache", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    (workload,) = report["workloads"]
    systems = workload["systems"]
    assert set(systems) | set(workload["skipped"]) == {"hf_generate", "hf_batch_sync", "native", "native_sync"}
    assert "hf_generate" in systems and "hf_batch_sync" in systems
    for name, result in systems.items():
        assert result["tok_per_s"] > 0, name
        assert result["output_tokens"] == workload["output_tokens"] == 8 * 16, name
        assert not result["cut"], name
    assert report["hardware"] is None and workload["roofline"] is None
    assert (out / "bench.png").stat().st_size > 0
    assert run.stdout.rstrip().splitlines()[-1].startswith("tiny ")


def test_w1_decode_floor_matches_design_at_the_h200_copy_bandwidth(bench_lib):
    workloads, roofline = bench_lib.workloads, bench_lib.roofline
    shape = roofline.model_shape(workloads.ARCHITECTURES["llama-3.1-8b"])
    requests = workloads.draw_requests(workloads.WORKLOADS["W1"], shape.vocab)
    floor = roofline.roofline(shape, requests, 4.27e12, 800e12, kv_budget_bytes=100 * 2**30)
    assert shape.parameters == 8_030_261_248
    assert floor.decode_steps == 1023 and floor.peak_concurrency == 32
    assert floor.decode_s == pytest.approx(4.5, abs=0.05)  # DESIGN.md: "W1's floor is about 4.5 s"
    assert floor.prefill_s < 0.1 * floor.decode_s


def test_decode_floor_runs_requests_in_waves_when_the_kv_budget_holds_only_some(bench_lib):
    roofline = bench_lib.roofline
    shape = roofline.ModelShape(
        parameters=1000,
        layers=1,
        attention_heads=1,
        kv_heads=1,
        head_dim=1,
        hidden=10,
        vocab=10,
        embedding_parameters=100,
        tied_embeddings=True,
    )
    prompts, outputs = np.array([10, 10, 10, 10]), np.array([11, 11, 11, 11])
    _, steps_all, peak_all = roofline.decode_floor(shape, prompts, outputs, 84, 1e9, 1e12)
    _, steps_waves, peak_waves = roofline.decode_floor(shape, prompts, outputs, 42, 1e9, 1e12)
    assert (steps_all, peak_all) == (10, 4)
    assert (steps_waves, peak_waves) == (20, 2)


def test_workload_draws_are_reproducible_and_within_design_ranges(bench_lib):
    workloads = bench_lib.workloads
    spec = workloads.WORKLOADS["W2"]
    first, second = workloads.draw_requests(spec, 128256), workloads.draw_requests(spec, 128256)
    assert first == second
    assert first.prompt_lengths.min() >= 64 and first.prompt_lengths.max() <= 1024
    assert first.output_lengths.min() >= 64 and first.output_lengths.max() <= 512
    shared = workloads.draw_requests(workloads.WORKLOADS["W3"], 128256)
    assert {p[:1024] for p in shared.prompts} == {shared.prompts[0][:1024]}
    assert set(shared.prompt_lengths.tolist()) == {1088}


def test_tied_lm_head_changes_the_weight_bytes_but_not_the_compute(bench_lib):
    roofline = bench_lib.roofline
    common = dict(layers=2, attention_heads=2, kv_heads=1, head_dim=4, hidden=8, vocab=100, embedding_parameters=800)
    tied = roofline.ModelShape(parameters=5000 + 800, tied_embeddings=True, **common)
    untied = roofline.ModelShape(parameters=5000 + 1600, tied_embeddings=False, **common)
    prompts = np.array([16, 32])
    assert untied.weight_bytes - tied.weight_bytes == 800 * 2
    assert roofline.prefill_floor(tied, prompts, 0, 1.0) == roofline.prefill_floor(untied, prompts, 0, 1.0)
    assert tied.matmul_parameters_per_token == untied.matmul_parameters_per_token == 5800


def test_tiny_constrained_run_measures_json_rows_on_the_same_work(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPTS / "bench.py"), "--tiny", "--constrained", "--systems", "native_json"]
    run = subprocess.run(
        [*command, "--out", str(out), "--model-cache", str(tmp_path)], capture_output=True, text=True, timeout=110
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (workload,) = json.loads((out / "bench.json").read_text())["workloads"]
    result = workload["systems"]["native_json"]
    # The schema's minItems cannot be met in 16 tokens: every request runs to its length, as unconstrained ones do.
    assert result["output_tokens"] == workload["output_tokens"] and not result["cut"]
    assert result["engine_stats"]["constrained_steps"] > 0
