"""`engine.deterministic=true`: a row's generation, token ids and log-probabilities are the same bits however the
job batched it (`engine.max_num_seqs` 1, 7 or 64, small prefill chunks, the synchronous loop), however the input
was split into shards, and when the job was killed with SIGKILL and resumed: on the embedded default job and on a
tiny mixture of experts, sampling at T=0.8 with top-p 0.95 and each row's own seed. The log-probabilities are
compared as floats, bit for bit: without the flag they differ between batch sizes on the same machine (the last
test shows the comparison sees it), even where the sampled tokens happen to agree.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pyarrow as pa
import pytest
from engine_cases import open_ended
from jobtools import read_output, read_report, run_cli, run_in_process, start_cli, wait_for, write_prompts

from batchjob.job.tiny_model import make_tiny_model

SAMPLED = (
    "sampling.temperature=0.8",
    "sampling.top_p=0.95",
    "sampling.max_new_tokens=12",
    "sampling.logprobs=1",
    "output.token_ids=true",
)
DETERMINISTIC = ("engine=native", "engine.deterministic=true", *SAMPLED)


def outputs(out: Path) -> dict[int, tuple]:
    """row_id -> (generation, token ids, log-probabilities as float bit patterns), over every shard's parts."""
    table = read_output(out)
    rows = zip(
        table.column("row_id").to_pylist(),
        table.column("generation").to_pylist(),
        table.column("token_ids").to_pylist(),
        table.column("logprobs").to_pylist(),
        strict=True,
    )
    return {row: (text, tuple(ids), _bits(logprobs)) for row, text, ids, logprobs in rows}


def _bits(logprobs: list) -> bytes:
    """The chosen tokens' log-probabilities as their float64 bytes (NaN and -0.0 compare as bits too)."""
    chosen = [entry if isinstance(entry, float) else entry["logprob"] for entry in logprobs]
    return pa.array(chosen, pa.float64()).buffers()[1].to_pybytes()


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3-moe", arch="qwen3_moe")


@pytest.fixture(scope="module")
def moe_prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.parquet", 40)


@pytest.fixture(scope="module", params=["default job", "tiny MoE"])
def job(request, moe_model: Path, moe_prompts: Path) -> tuple[str, ...]:
    """The settings that pick the model and data: the embedded default (bundled prompts, tiny Llama), or a tiny
    Qwen3-MoE over 40 prompts."""
    if request.param == "default job":
        return ("data.limit=48",)
    return (f"model.path={moe_model}", f"data.path={moe_prompts}")


@pytest.fixture(scope="module")
def reference(job: tuple[str, ...], tmp_path_factory) -> dict[int, tuple]:
    out = tmp_path_factory.mktemp("reference") / "out"
    assert run_in_process(*job, *DETERMINISTIC, "engine.max_num_seqs=64", f"output.dir={out}") == 0
    report = read_report(out)
    assert report["engine"]["deterministic"] is True
    return outputs(out)


@pytest.mark.parametrize(
    "layout",
    [
        ("engine.max_num_seqs=1",),
        ("engine.max_num_seqs=7",),
        ("engine.max_num_seqs=7", "engine.max_num_batched_tokens=16"),  # prompts cut into chunks
        ("engine=native_sync", "engine.max_num_seqs=64"),
    ],
    ids=["one row", "seven rows", "small chunks", "synchronous loop"],
)
def test_every_row_is_the_same_bits_whatever_the_batch(job, reference, layout, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_in_process(*job, *DETERMINISTIC, *layout, f"output.dir={out}") == 0
    assert outputs(out) == reference


def test_every_row_is_the_same_bits_whatever_the_shard_count(job, reference, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for index in range(3):
        args = (*job, *DETERMINISTIC, "shard.count=3", f"shard.index={index}", f"output.dir={out}")
        assert run_in_process(*args) == 0
    assert outputs(out) == reference


def test_a_job_killed_and_resumed_writes_the_same_bits_as_one_run_straight_through(
    job, reference, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = (*job, *DETERMINISTIC, "engine.max_num_seqs=7", "output.commit_every_rows=4", f"output.dir={out}")
    victim = start_cli(*args)
    wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 2, victim, "two committed parts")
    time.sleep(random.Random(3).uniform(0.0, 0.05))
    victim.kill()
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming:" in resumed.stderr
    assert outputs(out) == reference


def test_a_resume_that_turns_deterministic_off_is_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    base = ("data.limit=4", "engine=native", "sampling.max_new_tokens=3", f"output.dir={out}")
    assert run_in_process(*base, "engine.deterministic=true") == 0
    capsys.readouterr()
    assert run_in_process(*base) == 2
    assert "engine.deterministic" in capsys.readouterr().err


def test_without_the_flag_the_comparison_sees_the_batch(tmp_path: Path) -> None:
    runs = []
    for seqs in (1, 64):
        out = tmp_path / f"out-{seqs}"
        assert run_in_process("data.limit=48", "engine=native", *SAMPLED, f"engine.max_num_seqs={seqs}",
                              f"output.dir={out}") == 0  # fmt: skip
        runs.append(outputs(out))
    assert runs[0] != runs[1]


def test_hf_runs_rows_one_at_a_time_and_gives_the_same_bits_whatever_its_batch_setting(tmp_path: Path) -> None:
    runs = []
    for batch in (1, 16):
        out = tmp_path / f"out-{batch}"
        args = ("data.limit=12", "engine=hf", "engine.deterministic=true", f"engine.max_batch_size={batch}")
        assert run_in_process(*args, *SAMPLED, f"output.dir={out}") == 0
        runs.append(outputs(out))
    assert runs[0] == runs[1]


def test_tensor_parallel_rows_are_the_same_bits_whatever_the_batch_for_a_fixed_rank_count(tmp_path: Path) -> None:
    # Deterministic for a fixed engine.tensor_parallel: the ranks' partial sums are gathered and added in rank
    # order whatever the message size (another rank count splits the sums otherwise, and is another result).
    runs = []
    for seqs in (1, 16):
        out = tmp_path / f"out-{seqs}"
        args = ("data.limit=16", *DETERMINISTIC, "engine.tensor_parallel=2", "engine.device=cpu",
                "engine.max_model_len=256", "engine.num_kv_blocks=128", f"engine.max_num_seqs={seqs}")  # fmt: skip
        assert run_in_process(*args, f"output.dir={out}") == 0
        runs.append(outputs(out))
    assert runs[0] == runs[1]


def test_rows_preempted_for_cache_and_recomputed_are_the_same_bits(tmp_path: Path, monkeypatch) -> None:
    # The default job in a cache of 22 blocks (352 tokens) for 48 rows of 40 new tokens each: running rows are
    # preempted to make room, and their tokens so far recomputed later as a prompt (a prefill of what was
    # decoded); against one row at a time in a cache that never fills. The scheduler takes the rows for ones
    # that may stop at EOS: rows of known length it would admit only as many as the cache holds to their ends.
    open_ended(monkeypatch)
    longer = ("data.limit=48", *DETERMINISTIC, "sampling.max_new_tokens=40", "sampling.ignore_eos=true")
    runs = []
    for layout in (("engine.max_num_seqs=1",), ("engine.max_model_len=320", "engine.num_kv_blocks=22")):
        out = tmp_path / f"out-{len(runs)}"
        assert run_in_process(*longer, *layout, f"output.dir={out}") == 0
        runs.append((read_report(out)["engine"]["preemptions"], outputs(out)))
    assert runs[1][0] > 0, "the small cache preempted no row"
    assert runs[0][1] == runs[1][1]
