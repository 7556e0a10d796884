"""scripts/bench_data_parallel.py: the CPU smoke run of the multi-GPU scaling benchmark.

On a CPU, engine.data_parallel=2 starts two CPU children (one sub-shard each), so the whole path the GPU run
takes (input file, launcher, per-shard reports, exactly-once check, JSON) is exercised without a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_data_parallel.py"
# A run that has not ended after this long is hung: ten times the longest below on an idle 2-core machine (about
# 20 s), as the suite may share its cores with other work that makes everything 5-10 times as slow.
HUNG_S = 300


def _bench(argv: list[str], out: Path, models: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), *argv, "--out", str(out), "--model-cache", str(models)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=HUNG_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_tiny_run_measures_one_and_two_processes_with_every_row_exactly_once(tmp_path):
    out = tmp_path / "out"
    argv = ["--tiny", "--gpus", "1,2", "--rows", "24", "--max-new-tokens", "8"]
    run = _bench(argv, out, tmp_path / "models")
    report = json.loads((out / "data_parallel.json").read_text())
    assert pq.ParquetFile(out / "prompts.parquet").metadata.num_rows == 24
    assert 64 <= report["prompt_tokens"]["min"] <= report["prompt_tokens"]["max"] <= 512 + 1
    one, two = report["results"]
    assert (one["gpus"], two["gpus"]) == (1, 2)
    for result in (one, two):
        assert result["returncode"] == 0
        assert result["exactly_once"] and result["complete"]
        assert result["rows_committed"] == result["rows_expected"] == 24
        assert result["completion_tokens"] == 24 * 8  # EOS ignored: every row generates max_new_tokens
        assert result["tok_per_s"] > 0 and result["generation_tok_per_s"] > 0
        assert len(result["shards"]) == result["gpus"]
        assert sum(s["completion_tokens"] for s in result["shards"]) == 24 * 8
        assert all(s["process_startup_s"] > s["engine_startup_s"] > 0 for s in result["shards"])
    assert one["scaling_efficiency"] == 1.0 and two["scaling_efficiency"] > 0
    assert one["generation_scaling_efficiency"] == 1.0 and two["generation_scaling_efficiency"] > 0
    lines = run.stdout.rstrip().splitlines()
    assert lines[-3].lstrip().startswith("2 ")  # the table's last row, then each layout's start-up by phase
    for layout, line in zip(("1x1", "2x1"), lines[-2:], strict=True):
        assert line.startswith(f"{layout} shard ") and " s after start: imports " in line, line
        assert "engine " in line and "weights " in line and "beside the engine: tokenizer " in line, line

    # The same command again measures a whole new run: nothing of the first is resumed.
    argv[2] = "1"
    _bench(argv, out, tmp_path / "models")
    (rerun,) = json.loads((out / "data_parallel.json").read_text())["results"]
    assert rerun["exactly_once"] and rerun["completion_tokens"] == 24 * 8


def test_tiny_run_of_a_tensor_parallel_layout_reports_tokens_per_gpu(tmp_path):
    out = tmp_path / "out"
    argv = ["--tiny", "--layouts", "1x2", "--rows", "12", "--max-new-tokens", "4"]
    _bench(argv, out, tmp_path / "models")
    (result,) = json.loads((out / "data_parallel.json").read_text())["results"]
    assert (result["gpus"], result["data_parallel"], result["tensor_parallel"]) == (2, 1, 2)
    assert result["exactly_once"] and result["completion_tokens"] == 12 * 4
    assert result["tok_per_s_per_gpu"] == result["tok_per_s"] / 2
