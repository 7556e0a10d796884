"""scripts/tune_moe.py end to end on a toy shape: it checks and times its candidates, and writes a table the
kernel's config lookup reads back, plus a report; without --table it leaves the packaged table alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from batchjob.engine.native.kernels import moe_configs
from batchjob.engine.native.kernels.moe_configs import MoEConfigTable

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tune_moe.py"


def test_tiny_tuning_run_writes_a_table_the_lookup_reads(tmp_path):
    packaged = moe_configs.TABLE_PATH.read_text()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "layer us" in run.stdout and "table written" in run.stdout
    assert moe_configs.TABLE_PATH.read_text() == packaged

    table = MoEConfigTable.load(tmp_path / "moe_configs.json")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float16
    device_name = moe_configs.device_name(torch.device(device))
    key = moe_configs.shape_key(4, 32, 64, 2, dtype)
    assert sorted(table.entries[device_name][key]) == [1, 5]
    report = json.loads((tmp_path / "moe_tune_report.json").read_text())
    assert [r["tokens"] for r in report["results"]] == [1, 5]
    assert all(r["correct"] for r in report["results"])
