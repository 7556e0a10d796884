"""Exactly-once output across crashes, signals, reruns and concurrent writers."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
from jobtools import (
    HUNG_S,
    bookkeeping,
    read_output,
    run_cli,
    run_in_process,
    start_cli,
    wait_for,
    wait_for_line,
    write_prompts,
)

from batchjob.io.job_status import job_status
from batchjob.io.output import OutputDataset

ROWS = 100
# One row at a time makes every generation bit-identical however rows are grouped across restarts
# (padding a batch changes float rounding, which can flip a greedy choice); what is under test here is
# the checkpoint, not the engine's batching. The default engine, the transformers one, and the default one with
# every row under a JSON schema.
ENGINES = {
    "native": ("engine=native", "engine.max_num_seqs=1"),
    "hf": ("engine=hf", "engine.max_batch_size=1"),
    # Constrained rows: a grammar matcher per row, masks filled beside the loop, all of it rebuilt on resume.
    "native, JSON schema": (
        "engine=native",
        "engine.max_num_seqs=1",
        "sampling.json_schema={type:object,properties:{n:{type:integer},ok:{type:boolean}},required:[n,ok]}",
    ),
}
CHECKPOINTED = ("output.commit_every_rows=8", "output.commit_every_s=1000", "sampling.max_new_tokens=6")


def committed_parts(out: Path) -> int:
    return len(list(out.glob("part-*.parquet")))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.parquet", ROWS)


@pytest.fixture(scope="module", params=ENGINES)
def crashable(request) -> tuple[str, ...]:
    """The job settings of the crash tests, for one engine."""
    return (*ENGINES[request.param], *CHECKPOINTED)


@pytest.fixture(scope="module")
def reference(prompts: Path, crashable: tuple[str, ...], tmp_path_factory) -> dict[int, str]:
    out = tmp_path_factory.mktemp("reference") / "out"
    assert run_in_process(f"data.path={prompts}", f"output.dir={out}", *crashable) == 0
    table = read_output(out)
    return dict(zip(table.column("row_id").to_pylist(), table.column("generation").to_pylist(), strict=True))


def assert_exactly_once(out: Path, reference: dict[int, str]) -> None:
    table = read_output(out)
    row_ids = table.column("row_id").to_pylist()
    assert row_ids == sorted(reference), "every input row exactly once"
    got = dict(zip(row_ids, table.column("generation").to_pylist(), strict=True))
    assert got == reference


def test_sigkill_at_random_points_then_rerun_yields_every_row_once_identically(
    prompts: Path, crashable: tuple[str, ...], reference: dict[int, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = (f"data.path={prompts}", f"output.dir={out}", *crashable)
    rng = random.Random(7)
    for _ in range(3):
        before = committed_parts(out)
        job = start_cli(*args)
        target = before + rng.randint(1, 3)
        wait_for(lambda target=target: committed_parts(out) >= target, job, f"{target} committed parts")
        time.sleep(rng.uniform(0.0, 0.05))  # land anywhere: mid-batch, mid-commit, between commits
        job.kill()
        job.wait()
        assert job.returncode == -signal.SIGKILL
        assert not (bookkeeping(out) / "_SUCCESS").exists()
    finished = run_cli(*args)
    assert finished.returncode == 0, finished.stderr
    assert "resuming:" in finished.stderr
    assert_exactly_once(out, reference)


def test_sigterm_commits_finished_rows_and_exits_resumable(
    prompts: Path, crashable: tuple[str, ...], reference: dict[int, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # Nothing is committed by size or time, and every finished row logs a progress line, so any
    # rows found after the signal were committed by the graceful path.
    args = (
        f"data.path={prompts}",
        f"output.dir={out}",
        *crashable,
        "output.commit_every_rows=100000",
        "progress.log_every_s=0",
    )
    job = start_cli(*args)
    wait_for_line(job, "progress:")  # a row has finished
    job.send_signal(signal.SIGTERM)
    # How soon it exits is no measure (a loaded machine takes many times as long); that it stopped rather
    # than finishing the shard is: it says so, and committed only part of the rows.
    _, stderr = job.communicate(timeout=HUNG_S)
    assert job.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    committed = read_output(out).num_rows
    assert 0 < committed < ROWS
    assert f"interrupted: {committed} rows committed; resumable: rerun the same command" in stderr
    assert not (bookkeeping(out) / "_SUCCESS").exists()
    assert run_cli(*args).returncode == 0
    assert_exactly_once(out, reference)


def test_rerun_with_a_different_config_is_refused_with_the_difference(prompts: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    base = (f"data.path={prompts}", f"output.dir={out}", "data.limit=4")
    assert run_in_process(*base) == 0
    capsys.readouterr()
    assert run_in_process(*base, "sampling.max_new_tokens=5") == 2
    message = capsys.readouterr().err
    assert "sampling.max_new_tokens: 4 -> 5" in message
    assert "resume=false" in message
    assert run_in_process(*base, "sampling.max_new_tokens=5", "resume=false") == 0
    assert set(read_output(out).column("completion_tokens").to_pylist()) <= {1, 2, 3, 4, 5}


def test_jump_forward_changes_the_outputs_so_a_rerun_that_switches_it_is_refused(
    prompts: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    base = (f"data.path={prompts}", f"output.dir={out}", "data.limit=4", "engine=native", "sampling.choice=[yes,no]")
    assert run_in_process(*base) == 0
    capsys.readouterr()
    assert run_in_process(*base, "engine.jump_forward=true") == 2
    assert "engine.jump_forward" in capsys.readouterr().err
    assert run_in_process(*base, "engine.jump_forward=false") == 0  # the default, as the first run had


def test_a_second_writer_of_the_same_shard_is_refused(prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = OutputDataset(str(out))
    holder.open({"held": "by this test"})
    try:
        refused = run_cli(f"data.path={prompts}", f"output.dir={out}", "data.limit=4")
    finally:
        holder.close()
    assert refused.returncode == 2
    assert "error:" in refused.stderr and "lock" in refused.stderr.lower()
    assert not list(out.glob("*.parquet"))


def test_status_of_a_limited_job_expects_only_the_limited_rows(prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    base = (f"data.path={prompts}", f"output.dir={out}", "data.limit=3", "shard.count=2")
    assert run_in_process(*base, "shard.index=0") == 0
    assert run_in_process(*base, "shard.index=1") == 0
    status = job_status(str(out))
    assert [(s.rows_done, s.rows_total) for s in status.shards] == [(1, 1), (2, 2)]
    assert (status.validation.rows_expected, status.validation.missing.count) == (3, 0)
    assert status.complete


def test_rerun_with_a_different_limit_is_refused(prompts: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert run_in_process(f"data.path={prompts}", f"output.dir={out}", "data.limit=3") == 0
    capsys.readouterr()
    assert run_in_process(f"data.path={prompts}", f"output.dir={out}", "data.limit=4") == 2
    assert "rows.count: 3 -> 4" in capsys.readouterr().err
