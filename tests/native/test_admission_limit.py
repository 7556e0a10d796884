"""Admission on a KV cache too small for `max_num_seqs` sequences: a sequence is admitted only while the running
ones keep room to grow, a preemption caps admission at the sequences the cache was seen to hold, and the cap goes
once the cache has room to spare; over a whole workload preemption becomes rare (scripts/dev/simulate_admission.py).
The sequences here may end at EOS, so their growth is unknown (known lengths: test_growth_projection.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from batchjob.engine import Request, SamplingParams
from batchjob.engine.native.scheduling.block_manager import KVBlockManager
from batchjob.engine.native.scheduling.scheduler import RESERVE, SPARE, Scheduler, SchedulerConfig
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))

from simulate_admission import simulate  # noqa: E402

BLOCK = 16


def _sequence(seq_id: int, prompt_len: int, new: int = 64) -> Sequence:
    request = Request(seq_id, tuple(range(3, 3 + prompt_len)), SamplingParams(new))
    return Sequence.create(seq_id, RequestGroup(request, prompt_len), 0, prompt_len + new, seq_id, BLOCK)


def _scheduler(blocks: int, max_num_seqs: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096)
    return Scheduler(config, KVBlockManager(blocks, BLOCK, enable_prefix_caching=False))


def _run(scheduler: Scheduler) -> None:
    """One step, its sampled tokens back at once."""
    plan = scheduler.schedule()
    for seq, sampled in zip(plan.seqs, plan.samples.tolist(), strict=True):
        seq.inflight -= 1
        if sampled:
            seq.resolve_oldest(7)


def test_a_sequence_is_admitted_only_while_every_running_one_keeps_room_to_grow():
    # 10 one-block prompts on 1 scratch + 20 blocks: the k-th admission needs 1 + RESERVE * (k - 1) free blocks.
    scheduler = _scheduler(21)
    for i in range(10):
        scheduler.add(_sequence(i, 15))
    _run(scheduler)
    admitted = len(scheduler.running)
    assert admitted == 1 + (20 - 1) // (1 + RESERVE)  # each admission takes its block and RESERVE more stay free
    assert scheduler.blocks.num_free >= RESERVE * (admitted - 1)
    assert len(scheduler.waiting) == 10 - admitted


def test_a_preemption_caps_admission_at_the_running_count_until_the_cache_has_room_to_spare():
    scheduler = _scheduler(200)
    for i in range(8):
        scheduler.add(_sequence(i, 16 * 20 - 1, new=400))  # 20 blocks each, growing past their 25 blocks apiece
    while not scheduler.num_preemptions:
        _run(scheduler)
    running = len(scheduler.running)
    assert scheduler.admit_limit == running < 8
    short = _sequence(99, 15)
    scheduler.add(short)
    scheduler.finish(scheduler.running[0], "length")  # a place and 20+ blocks come free: one waiting one may go in
    _run(scheduler)
    assert len(scheduler.running) == running and short in scheduler.waiting
    for seq in list(scheduler.running):  # the long ones finish: the cache empties past the spare share
        scheduler.finish(seq, "length")
    assert scheduler.blocks.num_free >= SPARE * scheduler.blocks.num_blocks
    _run(scheduler)
    assert scheduler.admit_limit == scheduler.config.max_num_seqs
    assert short in scheduler.running and not scheduler.waiting


def test_a_workload_twice_the_cache_runs_with_few_preemptions():
    # 300 requests of U(64, 512) prompt and output tokens, a cache holding about a third of them at their longest.
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(64, 513, 300), rng.integers(64, 513, 300)
    blocks = int(np.mean(prompts + outputs) * 100 / BLOCK)
    result = simulate(prompts, outputs, blocks, max_num_seqs=256, max_num_batched_tokens=4096)
    assert result["preemptions"] <= 3
    assert result["recomputed_share"] < 0.01
    assert result["rows_per_decode_step"] > 60  # the cache still runs full: no admission starved


def test_the_replay_refuses_a_request_longer_than_the_cache():
    with pytest.raises(ValueError, match="needs more than the cache's 9 usable blocks"):
        simulate(np.array([100, 10]), np.array([100, 10]), kv_blocks=10, max_num_seqs=4)
