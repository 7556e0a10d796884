"""`engine=vllm` on a GPU: the embedded default job's contract (every row once, text and token ids, the report
naming the backend), a job killed with SIGKILL and resumed that writes what one run straight through writes (with
`engine.deterministic=true`, vLLM's batch-invariant mode, so the rows a resume batches differently come out the
same), and a JSON-schema job whose every row parses.

Run on a machine with a CUDA GPU and vLLM installed:  python -m pytest tests/gpu -q
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
    pytest.skip("needs CUDA and vLLM (pip install 'batchjob[vllm]')", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "job"))
from jobtools import read_output, read_report, run_cli, running, start_cli, wait_for  # noqa: E402

from batchjob.processes import descendants  # noqa: E402

pytestmark = pytest.mark.gpu
VLLM = ("engine=vllm", "engine.gpu_memory_utilization=0.5", "sampling.max_new_tokens=16", "output.token_ids=true")


def _rows(out: Path) -> dict[int, tuple[str, tuple[int, ...]]]:
    table = read_output(out)
    columns = (table.column(name).to_pylist() for name in ("row_id", "generation", "token_ids"))
    return {row: (text, tuple(ids)) for row, text, ids in zip(*columns, strict=True)}


def test_the_default_job_runs_on_vllm_every_row_once(tmp_path):
    out = tmp_path / "out"
    done = run_cli(*VLLM, "data.limit=40", f"output.dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(out)
    assert sorted(rows) == list(range(40))
    assert all(ids for _, ids in rows.values())
    assert read_report(out)["engine"]["name"] == "vllm"


def test_a_killed_vllm_job_resumes_to_what_one_run_writes(tmp_path):
    args = (*VLLM, "engine.deterministic=true", "sampling.temperature=0.8", "sampling.top_p=0.95",
            "output.commit_every_rows=8", "data.limit=120")  # fmt: skip
    straight = tmp_path / "straight"
    assert run_cli(*args, f"output.dir={straight}").returncode == 0
    out = tmp_path / "out"
    victim = start_cli(*args, f"output.dir={out}")
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 2, victim, "two committed parts")
    engine_processes = descendants(victim.pid)  # vLLM's engine process (and the watcher that outlives the job)
    victim.kill()
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in engine_processes):  # else they would keep the GPU's memory
        assert time.monotonic() < deadline, "vLLM's processes outlived the killed job"
        time.sleep(0.2)
    resumed = run_cli(*args, f"output.dir={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming:" in resumed.stderr
    assert _rows(out) == _rows(straight)


def test_a_preempted_vllm_job_stops_at_once_and_resumes_every_row_once(tmp_path):
    """SIGTERM (Slurm's preemption notice) mid-run: the job commits what finished and exits 143 within seconds,
    leaving no vLLM process behind; the rerun completes every row exactly once."""
    args = (*VLLM, "sampling.max_new_tokens=64", "sampling.ignore_eos=true", "output.commit_every_rows=8")
    out = tmp_path / "out"
    victim = start_cli(*args, f"output.dir={out}")
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 1, victim, "a committed part")
    engine_processes = descendants(victim.pid)
    victim.send_signal(signal.SIGTERM)
    stderr = victim.communicate(timeout=60)[1]
    assert victim.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "resumable: rerun the same command" in stderr
    assert not any(running(pid) for pid in engine_processes)
    resumed = run_cli(*args, f"output.dir={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_output(out).column("row_id").to_pylist()
    assert sorted(rows) == list(range(len(rows))) and len(rows) == len(set(rows))


def test_json_schema_rows_on_vllm_parse(tmp_path):
    out = tmp_path / "out"
    schema = "sampling.json_schema={type:object,properties:{n:{type:integer}},required:[n]}"
    done = run_cli(*VLLM, "data.limit=16", "sampling.max_new_tokens=32", schema, f"output.dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    for text, _ in _rows(out).values():
        assert isinstance(json.loads(text)["n"], int)
