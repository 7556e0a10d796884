"""`python -m batchjob` as a user runs it: a subprocess, the packaged config, the embedded default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from jobtools import REPO, bookkeeping, cli_env, read_output, read_report, run_cli

from batchjob.job.tiny_model import SAMPLE_PROMPTS


def test_default_job_runs_end_to_end_and_marks_the_shard_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_cli(f"output.dir={out}")
    assert done.returncode == 0, done.stderr
    table = read_output(out)
    bundled = pq.read_table(SAMPLE_PROMPTS)
    assert table.num_rows == bundled.num_rows
    assert table.column("row_id").to_pylist() == list(range(bundled.num_rows))
    assert table.column_names[:6] == [
        "row_id",
        "generation",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "error",
    ]
    # Default pass-through: every input column but the prompt itself.
    assert set(table.column_names[6:]) == {"id", "topic"}
    assert table.column("id").to_pylist() == bundled.column("id").to_pylist()
    assert set(table.column("finish_reason").to_pylist()) <= {"stop", "length"}
    assert all(0 < n <= 4 for n in table.column("completion_tokens").to_pylist())
    assert (bookkeeping(out) / "_SUCCESS").exists()
    report = read_report(out)
    assert report["rows"] == report["ok"] == bundled.num_rows
    assert report["errors"] == 0
    assert report["completion_tokens"] == sum(table.column("completion_tokens").to_pylist())
    assert set(report["stage_s"]) == {"read", "tokenize", "generate", "write"}
    assert report["output_tokens_per_s"] > 0
    assert "gpu_busy_fraction" in report["engine"]
    assert "ready to generate" in done.stderr + done.stdout
    visible = [p.name for p in out.iterdir() if not p.name.startswith(("_", "."))]
    assert all(name.endswith(".parquet") for name in visible)
    assert "done: 300 rows" in done.stderr + done.stdout


def test_the_default_engine_runs_the_default_job(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "batchjob", f"output.dir={tmp_path / 'out'}", "data.limit=8"]
    done = subprocess.run(command, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert read_output(tmp_path / "out").num_rows == 8


def test_rerunning_a_complete_job_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = (f"output.dir={out}", "data.limit=5")
    assert run_cli(*args).returncode == 0
    parts = sorted(p.name for p in out.glob("*.parquet"))
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert "already complete" in again.stderr + again.stdout
    assert sorted(p.name for p in out.glob("*.parquet")) == parts


def test_cfg_job_prints_the_resolved_config_without_running(tmp_path: Path) -> None:
    shown = run_cli(f"output.dir={tmp_path / 'out'}", flags=("--cfg", "job"))
    assert shown.returncode == 0, shown.stderr
    assert "max_new_tokens: 4" in shown.stdout
    assert "prompt_column: prompt" in shown.stdout
    assert not (tmp_path / "out").exists() and not bookkeeping(tmp_path / "out").exists()


def test_help_lists_the_config_groups() -> None:
    shown = run_cli(flags=("--help",))
    assert shown.returncode == 0, shown.stderr
    for group in ("model:", "data:", "engine:", "output:"):
        assert group in shown.stdout


def test_bad_sampling_value_fails_fast_naming_the_key(tmp_path: Path) -> None:
    failed = run_cli(f"output.dir={tmp_path / 'out'}", "sampling.temperature=-1")
    assert failed.returncode == 2
    assert "temperature must be >= 0" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_a_kv_cache_too_small_for_one_sequence_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # Found only once the engine starts (the cache is sized after the weights load), yet the user's to fix.
    out = tmp_path / "out"
    done = run_cli("engine=native", "engine.num_kv_blocks=2", f"output.dir={out}", "data.limit=2")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error = done.stderr[done.stderr.index("error: ") :]
    assert "fewer than one sequence" in error and "engine.max_model_len" in error
    assert not list(out.glob("*.parquet"))


def test_a_json_lines_file_of_prompts_runs_by_its_path_alone(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "question {i}", "topic": "t{i}"}}\n' for i in range(3)))
    done = run_cli(f"data.path={prompts}", f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 0, done.stderr
    table = read_output(tmp_path / "out")
    assert table.column("row_id").to_pylist() == [0, 1, 2]
    assert table.column("topic").to_pylist() == ["t0", "t1", "t2"]


def test_a_cache_folder_that_cannot_be_written_is_named_when_the_bundled_model_needs_it(tmp_path: Path, monkeypatch):
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("BATCHJOB_CACHE", str(blocked))
    done = run_cli(f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"the bundled model cannot be created in {blocked}" in done.stderr and "BATCHJOB_CACHE" in done.stderr
