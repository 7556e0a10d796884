"""scripts/bench.py: the CPU smoke run, and the roofline arithmetic the GPU run reports against."""

from __future__ import annotations

import json
import re
import shutil
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


def test_tiny_run_measures_each_system_cold_and_warm_in_fresh_processes_on_identical_work(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "bench.py"),
            "--tiny",
            "--systems",
            "native,hf_batch_sync",
            "--out",
            str(out),
            "--model-cache",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    (workload,) = report["workloads"]
    systems = workload["systems"]
    assert set(systems) == {"native", "hf_batch_sync"} and report["run"]["runs"] == ["cold", "warm"]
    for name, runs in systems.items():
        assert set(runs) == {"cold", "warm"}, name
        for result in runs.values():
            assert result["tok_per_s"] > 0, name
            assert result["output_tokens"] == workload["output_tokens"] == 8 * 16, name
            assert not result["cut"], name
        # The warm run reuses the kernel and start-up caches its cold run started empty, and no other system's.
        assert runs["cold"]["kernel_cache"] == runs["warm"]["kernel_cache"]
        assert runs["cold"]["startup_cache"] == runs["warm"]["startup_cache"]
    assert systems["native"]["cold"]["kernel_cache"] != systems["hf_batch_sync"]["cold"]["kernel_cache"]
    assert systems["native"]["cold"]["startup_cache"] != systems["hf_batch_sync"]["cold"]["startup_cache"]
    # Both in the system's own directory, not the user's caches: nothing a first system reads is there for the next.
    for name, runs in systems.items():
        cold = runs["cold"]
        assert Path(cold["startup_cache"]).parent == Path(cold["kernel_cache"]).parent, name
        assert Path(cold["startup_cache"]).parent.name.startswith(f"bench-caches-tiny-{name}-"), name
    # The native loop's host work a step, from its statistics; transformers reports none.
    native = systems["native"]["cold"]
    stats = native["engine_stats"]
    loop = ("admit", "schedule", "process", "prep")
    expected = sum(stats[f"{part}_ms_per_step"] for part in loop) - stats["collect_wait_ms_per_step"]
    assert native["host_ms_per_step"] == pytest.approx(expected) and native["host_ms_per_step"] > 0
    assert systems["hf_batch_sync"]["cold"]["host_ms_per_step"] is None
    assert "host ms" in run.stdout
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
    assert floor.decode_s == pytest.approx(4.5, abs=0.05)  # 4.27 TB/s: W1's floor is about 4.5 s (docs/benchmarks.md)
    assert floor.prefill_s < 0.1 * floor.decode_s


def test_a_workload_on_its_first_layers_keeps_its_requests_and_layer_shapes_and_scales_its_floor(bench_lib):
    workloads, roofline = bench_lib.workloads, bench_lib.roofline
    whole, part = workloads.workload("W8"), workloads.workload("W8", layers=40)
    assert part.architecture == "llama-3.1-70b-fp8-40-layers"
    assert workloads.draw_requests(part, 128256).prompts == workloads.draw_requests(whole, 128256).prompts
    fields = workloads.ARCHITECTURES[part.architecture]
    assert fields == {**workloads.ARCHITECTURES[whole.architecture], "num_hidden_layers": 40}
    full, half = (roofline.model_shape(workloads.ARCHITECTURES[s.architecture]) for s in (whole, part))
    assert (full.layers, half.layers) == (80, 40) and half.kv_bytes_per_token * 2 == full.kv_bytes_per_token
    assert half.fp8_parameters * 2 == full.fp8_parameters  # every projection is a layer's
    with pytest.raises(KeyError, match="has 16 layers"):
        workloads.workload("W2", layers=17)
    with pytest.raises(KeyError):
        workloads.ARCHITECTURES["llama-3.1-8b-0-layers"]


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


def test_constrained_prompts_stay_below_each_tokenizers_special_ids(bench_lib):
    from bench_lib.models import text_tokens

    workloads = bench_lib.workloads
    # The generated BPE: 128,000 ordinary ids, then 256 special ones; cl100k_base: its 100,256 tokens first.
    assert text_tokens("llama-3.2-1b", "bpe") == 128_000 and text_tokens("llama-3.2-1b", "cl100k") == 100_256
    for name in ("bpe", "cl100k"):
        requests = workloads.draw_requests(workloads.WORKLOADS["W2"], text_tokens("llama-3.2-1b", name) + 1)
        assert max(max(p) for p in requests.prompts) < text_tokens("llama-3.2-1b", name)


def test_tied_lm_head_changes_the_weight_bytes_but_not_the_compute(bench_lib):
    roofline = bench_lib.roofline
    common = dict(layers=2, attention_heads=2, kv_heads=1, head_dim=4, hidden=8, vocab=100, embedding_parameters=800)
    tied = roofline.ModelShape(parameters=5000 + 800, tied_embeddings=True, **common)
    untied = roofline.ModelShape(parameters=5000 + 1600, tied_embeddings=False, **common)
    prompts = np.array([16, 32])
    assert untied.weight_bytes - tied.weight_bytes == 800 * 2
    assert roofline.prefill_floor(tied, prompts, 0, 1.0) == roofline.prefill_floor(untied, prompts, 0, 1.0)
    assert tied.matmul_parameters_per_token == untied.matmul_parameters_per_token == 5800


def test_w5_samples_and_its_floor_runs_in_waves_when_the_cache_cannot_hold_every_request(bench_lib):
    workloads, roofline = bench_lib.workloads, bench_lib.roofline
    spec = workloads.WORKLOADS["W5"]
    assert (spec.temperature, spec.top_p, spec.architecture) == (0.8, 0.95, "llama-3.1-8b")
    shape = roofline.model_shape(workloads.ARCHITECTURES[spec.architecture])
    requests = workloads.draw_requests(spec, shape.vocab)
    assert len(requests.prompts) == 1024
    assert requests.prompt_lengths.min() >= 128 and requests.prompt_lengths.max() <= 2048
    assert requests.output_lengths.min() >= 128 and requests.output_lengths.max() <= 1024
    # An H200 (143,771 MiB) at the default 0.9 KV budget fraction, less the weights.
    kv_budget = int(0.9 * 143_771 * 2**20) - shape.weight_bytes
    floor = roofline.roofline(shape, requests, 4.27e12, 790e12, kv_budget)
    assert floor.peak_concurrency < 1024  # ~1,700 tokens of 128 KiB each per request: not all fit at once
    assert floor.decode_steps > requests.output_lengths.max()
    assert floor.prefill_s < floor.decode_s


def test_greedy_w5_draws_the_same_requests_and_floor_as_sampled_w5(bench_lib):
    workloads, roofline = bench_lib.workloads, bench_lib.roofline
    sampled, greedy = workloads.workload("W5"), workloads.workload("W5", greedy=True)
    assert not sampled.greedy and greedy.greedy and greedy.top_p == 1.0
    shape = roofline.model_shape(workloads.ARCHITECTURES["llama-3.1-8b"])
    drawn = [workloads.draw_requests(spec, shape.vocab) for spec in (sampled, greedy)]
    assert drawn[0].prompts == drawn[1].prompts and drawn[0].new_tokens == drawn[1].new_tokens
    kv_budget = int(0.9 * 143_771 * 2**20) - shape.weight_bytes
    floors = [roofline.roofline(shape, requests, 4.27e12, 790e12, kv_budget) for requests in drawn]
    assert floors[0].total_s == floors[1].total_s
    assert workloads.workload("tiny") is workloads.TINY_WORKLOAD


def test_w6_shape_counts_the_qwen3_moe_parameters_transformers_builds(bench_lib):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(bench_lib.workloads.ARCHITECTURES["qwen3-30b-a3b"])
    shape = bench_lib.roofline.model_shape(fields)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))

    assert shape.parameters == sum(p.numel() for p in hf.parameters())
    assert (shape.moe_layers, shape.experts, shape.experts_per_token) == (48, 128, 8)
    assert shape.expert_parameters == 3 * 2048 * 768
    # About 3.3B of the 30.5B parameters take part in one token's forward pass (the "A3B").
    assert 3.0e9 < shape.matmul_parameters_per_token < 3.5e9


def test_a_decode_step_reads_only_the_experts_its_tokens_hit(bench_lib):
    roofline = bench_lib.roofline
    common = dict(layers=2, attention_heads=2, kv_heads=1, head_dim=4, hidden=8, vocab=100, embedding_parameters=800)
    shape = roofline.ModelShape(
        parameters=10_000 + 2 * 16 * 100,
        tied_embeddings=True,
        moe_layers=2,
        experts=16,
        experts_per_token=2,
        expert_parameters=100,
        **common,
    )
    dense_bytes = 10_000 * 2

    assert roofline.expected_experts_hit(1, 16, 2) == pytest.approx(2.0)
    assert roofline.expected_experts_hit(10_000, 16, 2) == pytest.approx(16.0)
    assert shape.step_weight_bytes(1) == pytest.approx(dense_bytes + 2 * 2 * 100 * 2)
    assert shape.step_weight_bytes(10_000) == pytest.approx(shape.weight_bytes)
    # Two tokens hit 16 * (1 - (14/16)^2) = 3.75 distinct experts on average, not 4.
    assert shape.step_weight_bytes(2) == pytest.approx(dense_bytes + 2 * 3.75 * 100 * 2)


def test_w6_floor_is_between_the_active_and_the_total_weights_per_step(bench_lib):
    workloads, roofline = bench_lib.workloads, bench_lib.roofline
    shape = roofline.model_shape(workloads.ARCHITECTURES["qwen3-30b-a3b"])
    requests = workloads.draw_requests(workloads.WORKLOADS["W6"], shape.vocab)

    floor = roofline.roofline(shape, requests, 4.27e12, 800e12, kv_budget_bytes=60 * 2**30)

    assert len(requests.prompts) == 512
    assert requests.prompt_lengths.min() >= 100 and requests.output_lengths.max() <= 1024
    assert floor.decode_steps * shape.step_weight_bytes(1) / 4.27e12 < floor.decode_s
    assert floor.decode_s < floor.decode_steps * (shape.weight_bytes + 60 * 2**30) / 4.27e12


def test_tiny_run_with_dummy_weights_runs_the_native_engine_and_transformers_from_the_config(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "bench.py"),
            "--tiny",
            "--load-format",
            "dummy",
            "--systems",
            "native,hf_generate",
            "--runs",
            "warm",
            "--kernel-profile",
        ]
        + ["--out", str(out), "--model-cache", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (workload,) = json.loads((out / "bench.json").read_text())["workloads"]
    assert list(workload["systems"]) == ["native", "hf_generate"] and not workload["skipped"]
    for system in ("native", "hf_generate"):
        assert workload["systems"][system]["warm"]["output_tokens"] == 8 * 16
    logged = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["workload"], r["system"], r["output_tokens"]) for r in logged] == [
        ("tiny", "native", 128),
        ("tiny", "hf_generate", 128),
    ]
    assert "steps" in logged[0]["engine_stats"]
    # --kernel-profile: the engine's generation by operator (kernels on a GPU; torch's CPU ops here)
    assert "aten::" in (out / "kernels-tiny-native-warm.txt").read_text()


def test_w7_model_directory_is_config_and_tokenizer_only_and_the_engine_reads_its_70b_spec(bench_lib, tmp_path):
    from bench_lib.models import config_model_dir

    from batchjob.engine.native.loading.model_loader import read_model_spec

    model_dir = config_model_dir(bench_lib.workloads.WORKLOADS["W7"].architecture, tmp_path)
    spec = read_model_spec(model_dir, "bfloat16")
    assert not list(model_dir.glob("*.safetensors"))
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (80, 8192, 64, 8)
    assert bench_lib.roofline.model_shape(bench_lib.workloads.ARCHITECTURES["llama-3.1-70b"]).parameters > 70e9


def test_tiny_constrained_run_measures_json_rows_on_the_same_work(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPTS / "bench.py"), "--tiny", "--constrained", "--systems", "native_json,native"]
    command += ["--runs", "warm", "--out", str(out), "--model-cache", str(tmp_path), "--profile", "--repeat", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (workload,) = json.loads((out / "bench.json").read_text())["workloads"]
    result = workload["systems"]["native_json"]["warm"]
    # The schema's minItems cannot be met in 16 tokens: every request runs to its length, as unconstrained ones do.
    assert result["output_tokens"] == workload["output_tokens"] and not result["cut"]
    assert result["engine_stats"]["constrained_steps"] > 0
    # --profile: where the run spent its time, by function, from the system's whole run down
    profile = (out / "profile-tiny-native_json-warm.txt").read_text()
    assert "Ordered by: internal time" in profile and "Ordered by: cumulative time" in profile
    assert "(run_system)" in profile
    # The table gives constrained throughput as a fraction of the same command's unconstrained run.
    native = workload["systems"]["native"]["warm"]
    ratio = result["output_tokens"] / result["wall_s"] / (native["output_tokens"] / native["wall_s"])
    assert re.search(rf"native_json warm .*  {ratio:.2f}x of native warm", run.stdout)
    # --repeat 2: every system again in a second round, each run against its own round's unconstrained run, and
    # each system's median
    rounds = [(r["system"], r["repeat"]) for r in map(json.loads, (out / "runs.jsonl").read_text().splitlines())]
    assert rounds == [("native_json", 0), ("native", 0), ("native_json", 1), ("native", 1)]
    second = workload["systems"]["native_json"]["warm 2"]
    rate = [r["output_tokens"] / r["wall_s"] for r in (second, workload["systems"]["native"]["warm 2"])]
    assert re.search(rf"native_json warm 2 .*  {rate[0] / rate[1]:.2f}x of native warm 2", run.stdout)
    assert re.search(rf"native_json warm median .*median of 2; .*x of native warm \(rounds: {ratio:.2f}, ", run.stdout)
    assert (out / "profile-tiny-native_json-warm-2.txt").exists()


def test_tiny_run_against_another_checkout_alternates_the_two_in_each_round(tmp_path):
    # The other checkout is a copy of this one's engine; started from this checkout's root (where `python -m`
    # would put this checkout's package first on the path), each run must import its own.
    other = tmp_path / "other"
    shutil.copytree(SCRIPTS.parent / "batchjob", other / "batchjob", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPTS / "bench.py"), "--tiny", "--systems", "native", "--runs", "warm"]
    command += ["--against", str(other), "--repeat", "2", "--out", str(out), "--model-cache", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=SCRIPTS.parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["system"], r["repeat"]) for r in rows] == [
        ("native", 0),
        ("native@against", 0),
        ("native", 1),
        ("native@against", 1),
    ]
    assert len({r["output_tokens"] for r in rows}) == 1
    sources = {r["system"]: r["engine_source"] for r in rows}
    assert sources == {"native": str(SCRIPTS.parent.resolve()), "native@against": str(other.resolve())}
    rate = {(r["system"], r["repeat"]): r["output_tokens"] / r["wall_s"] for r in rows}
    ratios = [rate["native", k] / rate["native@against", k] for k in (0, 1)]
    assert re.search(rf"native warm .*  {ratios[0]:.3f}x of native@against warm\n", run.stdout)
    assert re.search(rf"native warm 2 .*  {ratios[1]:.3f}x of native@against warm 2\n", run.stdout)
    assert re.search(
        rf"native warm median .*of native@against warm \(rounds: {ratios[0]:.3f}, {ratios[1]:.3f}\)", run.stdout
    )
    assert json.loads((out / "bench.json").read_text())["run"]["against"] == str(other.resolve())


def test_against_a_directory_without_an_engine_stops_before_any_run(tmp_path):
    command = [sys.executable, str(SCRIPTS / "bench.py"), "--tiny", "--against", str(tmp_path), "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert f"--against {tmp_path.resolve()}: no batchjob/engine there" in run.stderr
    assert not (tmp_path / "runs.jsonl").exists()


def test_mixed_padding_counts_the_tokens_each_step_pads_to_its_bucket(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.syspath_prepend(str(SCRIPTS / "dev"))
    from types import SimpleNamespace

    from simulate_admission import padding

    from batchjob.engine.native.scheduling import scheduler

    requests = SimpleNamespace(prompt_lengths=np.array([100, 100, 100]), output_lengths=np.array([8, 8, 8]))
    # Three prompts of 100 tokens. Cutting them to 256 keeps over a quarter of the 300: 256 tokens, then the 44
    # left with the two decodes of the prompts done (46, padded by 210), then decode steps of 3 rows.
    monkeypatch.setattr(scheduler, "CUT_SHARE", 0.25)
    assert padding(requests, (256, 512, 8192), 1000, 8, 8192) == {
        "steps": 9, "mixed": 2, "padded": 210, "buckets": {256: 2}
    }  # fmt: skip
    # A cut must keep 90%: the 300 run as one step padded to 512, and the run takes a step less.
    monkeypatch.setattr(scheduler, "CUT_SHARE", 0.9)
    assert padding(requests, (256, 512, 8192), 1000, 8, 8192) == {
        "steps": 8, "mixed": 1, "padded": 212, "buckets": {512: 1}
    }  # fmt: skip


def test_step_kinds_splits_a_recorded_w2_run_into_decode_and_prefill_steps_against_their_floors():
    """scripts/dev/step_kinds.py on the W2 runs in docs/bench: the replayed schedule has as many steps as the run's
    GPU timeline, and the long spans are the 8,192-token steps."""
    runs = SCRIPTS.parent / "docs" / "bench" / "deterministic-h100-w1-w2.jsonl"
    command = [
        sys.executable, str(SCRIPTS / "dev" / "step_kinds.py"), str(runs), "--workload", "W2",
        "--copy-tb-s", "3.00", "--matmul-tflops", "771", "--bands-ms", "3,5,8,12,20,40",
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "decode          506 steps" in run.stdout and "mixed 8192       35 steps" in run.stdout
    assert run.stdout.count("GPU spans by duration (544 steps") == 4  # cold and warm, without and with the flag
    assert run.stdout.count("20-40    ms     35 steps") == 2 and run.stdout.count("40-inf   ms     35 steps") == 2
    # W2's floor as the bench's roofline puts it, and higher with a decode step's kernels one after another
    floors = re.search(r"workload floor ([\d.]+) s; its decode steps' kernels one after another ([\d.]+) s", run.stdout)
    overlapped, serial = float(floors[1]), float(floors[2])
    assert overlapped == pytest.approx(2.31, abs=0.01) and 1.0 < serial / overlapped < 1.2


def test_step_kinds_prices_a_model_of_fp8_projections_at_the_fp8_rate():
    """W8 (the 70B with FP8 projections) on one H200, from docs/bench: with its FP8 matmul rate, its floor on the
    run's own KV cache is within 1% of the bench's roofline (50.88 s, on the memory the bench budgets); without it
    the script refuses rather than price those FLOPs at the bf16 rate."""
    runs = SCRIPTS.parent / "docs" / "bench" / "w8-whole-h200.jsonl"
    base = [sys.executable, str(SCRIPTS / "dev" / "step_kinds.py"), str(runs), "--workload", "W8"]
    rates = ["--copy-tb-s", "4.2697", "--matmul-tflops", "782.23", "--bands-ms", "35,60,1000"]
    run = subprocess.run([*base, *rates, "--fp8-tflops", "1393.48"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "decode         1520 steps" in run.stdout and "mixed 8192       16 steps" in run.stdout
    assert "1000-inf   ms     16 steps" in run.stdout  # the 8,192-token prefill steps
    floor = float(re.search(r"workload floor ([\d.]+) s", run.stdout)[1])
    assert floor == pytest.approx(50.88, rel=0.01)
    refused = subprocess.run([*base, *rates], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "FP8 projections: give --bench, or --fp8-tflops" in refused.stderr


def test_a_run_whose_results_waited_for_the_config_check_says_so_beside_its_rate(bench_lib):
    """The engine's stats time its check of the config reading; a run whose results waited for it (its seconds
    include the wait) notes how long, beside any other note."""
    from bench_lib.report import held_for_check
    from bench_lib.systems import SystemResult

    def run(**stats: float) -> SystemResult:
        return SystemResult("native", 3.0, 100, 1, 1, 10.0, False, engine_stats=stats)

    assert held_for_check(run(spec_check_s=13.4, spec_check_wait_s=4.11)) == "results held 4.1 s for the config check"
    assert held_for_check(run(spec_check_s=13.4, spec_check_wait_s=0.0)) == ""
    assert held_for_check(run()) == ""


@pytest.mark.parametrize("option", [["--prefill", "2048"], ["--row-sum-dot"], ["--longest-first", "0,1"]])
def test_the_attention_profiler_refuses_a_deterministic_option_without_deterministic_before_touching_a_gpu(option):
    """scripts/dev/decode_attention_shapes.py: --prefill, --row-sum-dot and --longest-first only shape the
    deterministic mode's launches; without --deterministic the profiler stops at once with exit 2, naming the option
    to add."""
    script = SCRIPTS / "dev" / "decode_attention_shapes.py"
    refused = subprocess.run([sys.executable, str(script), *option], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "add --deterministic" in refused.stderr and "Traceback" not in refused.stderr


def test_the_attention_profiler_refuses_longest_first_at_a_prefill_chunk():
    script = SCRIPTS / "dev" / "decode_attention_shapes.py"
    command = [sys.executable, str(script), "--deterministic", "--prefill", "2048", "--longest-first", "0,1"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "leave it out with --prefill" in refused.stderr, refused.stderr[-3000:]
