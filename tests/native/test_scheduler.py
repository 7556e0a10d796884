"""Steps that carry prefill chunks fill the mixed CUDA graphs' token buckets: a step that would overshoot a
bucket takes smaller chunks to fill the one below, if they keep a quarter of its prefill, instead of being padded,
decodes are never cut for a chunk, and the engine's greedy output does not change; `scripts/dev/profile_host_loop.py`
times the loop's host work without a model."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.engine.native.scheduling.block_manager import KVBlockManager
from batchjob.engine.native.scheduling.scheduler import Scheduler, SchedulerConfig
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence
from batchjob.job.tiny_model import default_tiny_model

BUCKETS = (256, 512, 1024, 2048, 4096, 8192)
BLOCK = 16


def _sequence(seq_id: int, prompt_len: int) -> Sequence:
    request = Request(seq_id, tuple(range(3, 3 + prompt_len)), SamplingParams(64))
    return Sequence.create(seq_id, RequestGroup(request, prompt_len), 0, prompt_len + 64, seq_id, BLOCK)


def _scheduler(buckets: tuple[int, ...], max_num_seqs: int = 1024) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, token_buckets=buckets)
    return Scheduler(config, KVBlockManager(20_000, BLOCK, enable_prefix_caching=False))


def _step_done(plan) -> None:
    """What the engine does when a step's tokens are back: each sampled sequence gets its token."""
    for seq, sampled in zip(plan.seqs, plan.samples, strict=True):
        seq.inflight -= 1
        if sampled:
            seq.resolve_oldest(7)


def _decoding(scheduler: Scheduler, count: int, first_id: int = 0) -> None:
    """`count` sequences past their 8-token prompts, each with one token to feed (a decode); their prompts run
    as one step, whatever the buckets."""
    config = scheduler.config
    scheduler.config = dataclasses.replace(config, token_buckets=())
    for i in range(count):
        scheduler.add(_sequence(first_id + i, 8))
    _step_done(scheduler.schedule())
    scheduler.config = config


@pytest.mark.parametrize(
    ("decodes", "prompt", "want"),
    [
        (250, 300, 512),  # 550 tokens: 262 of the prompt fill the 512 bucket (padded to 1024 otherwise)
        (250, 1000, 1024),  # 1,250: 774 of 1,000 prompt tokens fill 1,024
        (100, 2500, 2048),  # 2,600: 1,948 of 2,500 fill 2,048
        (700, 1000, 1024),  # 1,700: 324 of 1,000 fill 1,024 (a third: cut, not padded to 2,048)
        (1000, 100, 1100),  # 24 of 100 prompt tokens would fill 1,024: under a quarter, so padded instead
        (250, 262, 512),  # exactly a bucket: nothing to cut
    ],
)
def test_a_mixed_step_fills_the_bucket_below_it_when_a_quarter_of_its_prefill_fits(decodes, prompt, want):
    scheduler = _scheduler(BUCKETS)
    _decoding(scheduler, decodes)
    scheduler.add(_sequence(10_000, prompt))
    plan = scheduler.schedule()
    assert plan.num_tokens == want
    assert int((plan.counts == 1).sum()) == decodes  # every decode runs
    chunk = plan.counts[-1]
    assert chunk == want - decodes and bool(plan.samples[-1]) == (chunk == prompt)
    # The rest of the prompt continues next step, with the decodes again: all of it, or a bucket's worth.
    _step_done(plan)
    rest = scheduler.schedule()
    if chunk < prompt:
        assert rest.seqs[-1].seq_id == 10_000 and (rest.counts[-1] == prompt - chunk or rest.num_tokens in BUCKETS)


def test_without_buckets_the_whole_prompt_comes_at_once():
    scheduler = _scheduler(())
    _decoding(scheduler, 250)
    scheduler.add(_sequence(10_000, 300))
    assert scheduler.schedule().num_tokens == 550


def test_a_chunk_of_an_earlier_sequence_leaves_a_token_for_every_later_decode():
    # 300 decodes, and a sequence admitted before them (older, so first in the running order) with 20,000 prompt
    # tokens still to feed, more than the step's whole budget.
    scheduler = _scheduler(())
    _decoding(scheduler, 300, first_id=1)
    scheduler.add(_sequence(0, 28_192))
    _step_done(scheduler.schedule())  # its first 8,192 - 300 tokens, beside the decodes
    long = scheduler.running.pop()
    scheduler.running.insert(0, long)
    plan = scheduler.schedule()
    assert plan.seqs[0] is long and plan.counts[0] == 8192 - 300
    assert len(plan.seqs) == 301 and (plan.counts[1:] == 1).all()


def test_filling_buckets_does_not_change_greedy_output():
    requests = [
        Request(i, tuple(3 + (7 * i + j) % 400 for j in range(20 + (37 * i) % 90)), SamplingParams(24))
        for i in range(40)
    ]

    def run(buckets: tuple[int, ...]) -> tuple[dict[int, tuple[int, ...]], list[int]]:
        engine = create_engine(
            "native", str(default_tiny_model()), {"dtype": "float32", "max_num_seqs": 16, "max_num_batched_tokens": 256}
        )
        try:
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config, token_buckets=buckets)
            steps: list[int] = []
            schedule = engine.scheduler.schedule

            def counted():
                plan = schedule()
                if plan is not None:
                    steps.append(plan.num_tokens)
                return plan

            engine.scheduler.schedule = counted
            return {c.id: tuple(c.samples[0].token_ids) for c in engine.generate(requests)}, steps
        finally:
            engine.close()

    plain, plain_steps = run(())
    filled, filled_steps = run((32, 64, 128, 256))
    assert filled == plain
    # Mixed steps now land on a bucket far more often than before.
    on_bucket = [np.isin(s, (32, 64, 128, 256)).mean() for s in (plain_steps, filled_steps)]
    mixed = [t for t in filled_steps if t > 16]
    assert on_bucket[1] > on_bucket[0] and mixed


def test_the_host_loop_profile_script_times_scheduling_fill_and_processing():
    script = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "profile_host_loop.py"
    command = [sys.executable, str(script), "--seqs", "24", "--context", "100", "--steps", "30", "--sampling"]
    run = subprocess.run([*command, "--processes", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    # Two fresh processes: each part's median of their medians, and their range
    assert "24 sequences at 100 tokens of context, sampling, 30 steps (medians of 2 processes' medians" in run.stdout
    for part in ("scheduling", "layout and slot fill", "processing the tokens", "host work a step"):
        assert float(run.stdout.split(part)[1].split("ms")[0]) > 0, part
    low, high = map(float, run.stdout.split("scheduling")[1].split("[")[1].split("]")[0].split("-"))
    assert 0 < low <= float(run.stdout.split("scheduling")[1].split("ms")[0]) <= high
    # Every sequence decodes every steady-state step (one finishes and one is admitted every third step).
    assert float(run.stdout.split("sequences a step")[1].split()[0]) == 24


def test_the_host_loop_profile_script_compares_two_versions_in_alternating_processes(tmp_path):
    root = Path(__file__).resolve().parents[2]
    other = tmp_path / "other"
    shutil.copytree(root / "batchjob", other / "batchjob", ignore=shutil.ignore_patterns("__pycache__"))
    script = root / "scripts" / "dev" / "profile_host_loop.py"
    (other / "scripts" / "dev").mkdir(parents=True)
    shutil.copy(script, other / "scripts" / "dev")
    # The other version schedules 3 ms slower a step, so the comparison shows which tree each process ran.
    scheduler = other / "batchjob" / "engine" / "native" / "scheduling" / "scheduler.py"
    slow = "    def schedule(self) -> StepPlan | None:\n        __import__('time').sleep(0.003)\n"
    scheduler.write_text(scheduler.read_text().replace("    def schedule(self) -> StepPlan | None:\n", slow))
    command = [sys.executable, str(script), "--seqs", "16", "--context", "40"]
    command += ["--steps", "20", "--processes", "2", "--against", str(other)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"2 pairs of processes, this version ({root}) against {other}" in run.stdout
    for part in ("scheduling", "layout and slot fill", "processing the tokens", "host work a step"):
        mine, theirs, ratio = run.stdout.split(part)[1].split()[:3]
        assert float(mine) > 0 and float(theirs) > 0 and float(ratio.rstrip("x")) > 0, part
    mine, theirs, ratio = run.stdout.split("scheduling")[1].split()[:3]
    assert float(theirs) > 3.0 > float(mine) and float(ratio.rstrip("x")) < 0.5
    refused = subprocess.run([*command[:-1], str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "no batchjob/ and scripts/dev/profile_host_loop.py there" in refused.stderr


def test_the_host_loop_profile_script_times_the_masks_hand_over_with_constrained_rows(tmp_path):
    # Every other sequence under the records schema over the generated 128k BPE (trained into tmp_path).
    script = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "profile_host_loop.py"
    command = [sys.executable, str(script), "--seqs", "16", "--context", "40", "--steps", "20"]
    command += ["--constrained-every", "2", "--cache", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "16 sequences at 40 tokens of context, greedy, every 2 under a JSON schema, 20 steps" in run.stdout
    for part in ("handing masks over", "processing the tokens", "(masks, the worker's)"):
        assert float(run.stdout.split(part)[1].split("ms")[0]) > 0, part
