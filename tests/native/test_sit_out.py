"""Decodes sitting a step out: where the decode graphs' replay times say a smaller bucket runs more tokens a second
than padding a step's rows up (an FP8 matmul takes rows in blocks of 128), a decode step runs that bucket's rows and
the latest admitted wait a step. Output is unchanged; only steps of output tokens alone are cut."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from engine_cases import hf_greedy, mixed_requests

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.engine.native.runtime.step_layout import SIT_OUT_GAIN, decode_rows
from batchjob.engine.native.scheduling.block_manager import KVBlockManager
from batchjob.engine.native.scheduling.scheduler import Scheduler, SchedulerConfig
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence
from batchjob.job.tiny_model import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))

from simulate_admission import step_done  # noqa: E402

BLOCK = 16


def test_a_count_runs_a_smaller_bucket_where_its_rows_go_faster_by_more_than_the_margin():
    # An FP8-like step time: 256 rows in the time of 128, 257-384 in half as much again.
    rows = decode_rows({128: 1.0, 256: 1.0, 384: 1.5, 512: 1.9})
    assert len(rows) == 513 and rows[0] == 0
    assert rows[100] == 100 and rows[256] == 256  # padded up to their buckets
    assert rows[264] == 256 and rows[300] == 256  # 256 / 1.0 beats 264 / 1.5 and 300 / 1.5
    assert rows[380] == 380  # 380 / 1.5 = 253 tokens a second: 256 / 1.0 is not 5% more
    assert rows[400] == 256  # 400 / 1.9 = 211
    assert rows[500] == 500  # 500 / 1.9 = 263
    assert SIT_OUT_GAIN == 0.05


def test_memory_bound_steps_never_sit_any_out():
    seconds = {b: 1.0 + b / 1e4 for b in (1, 2, 4, 8, *range(16, 513, 16))}  # near flat: the weights' read
    rows = decode_rows(seconds)
    assert all(rows[count] == count for count in range(len(rows)))


def _decode(seq_id: int) -> Sequence:
    request = Request(seq_id, tuple(range(3, 11)), SamplingParams(20, ignore_eos=True))
    return Sequence.create(seq_id, RequestGroup(request, 8), 0, 28, seq_id, BLOCK)


def _step(scheduler: Scheduler):
    plan = scheduler.schedule()
    step_done(scheduler, plan)
    return plan


def test_a_decode_step_runs_the_rows_its_count_runs_and_the_latest_admitted_wait():
    rows = (0, 1, 2, 3, 4, 4, 4, 4, 8, 8)  # 5-7 decodes run 4
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, decode_rows=rows)
    scheduler = Scheduler(config, KVBlockManager(200, BLOCK, enable_prefix_caching=False))
    for i in range(6):
        scheduler.add(_decode(i))
    first = _step(scheduler)  # the prompts: a mixed step, never cut
    assert len(first.seqs) == 6 and scheduler.sat_out == 0
    plan = _step(scheduler)
    assert [seq.seq_id for seq in plan.seqs] == [0, 1, 2, 3] and scheduler.sat_out == 2
    waiting = [seq for seq in scheduler.running if seq.seq_id >= 4]
    assert all(seq.num_computed == seq.num_tokens - 1 and not seq.inflight for seq in waiting)
    steps = 2
    while scheduler.has_unfinished:
        _step(scheduler)
        steps += 1
    # the prompts' step gives each its first token; 0-3 decode their other 19 in 19 steps, 4 and 5 theirs after
    assert steps == 1 + 19 + 19


def test_a_step_carrying_a_prompt_token_is_never_cut():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=15, decode_rows=(0, 1, 1))  # 2 decodes run 1
    scheduler = Scheduler(config, KVBlockManager(100, BLOCK, enable_prefix_caching=False))
    scheduler.add(_decode(0))
    scheduler.add(_decode(1))
    _step(scheduler)  # 15 tokens: 0's prompt of 8 and 7 of 1's
    plan = _step(scheduler)  # 0's first decode and 1's last prompt token: one token each, and not cut
    assert plan.counts.tolist() == [1, 1] and plan.starts.tolist() == [8, 7]
    assert scheduler.sat_out == 0
    plan = _step(scheduler)  # two decodes: cut to one
    assert [seq.seq_id for seq in plan.seqs] == [0] and scheduler.sat_out == 1


@pytest.mark.parametrize("engine", ["native", "native_sync"])
def test_decodes_sitting_steps_out_do_not_change_greedy_output(tmp_path, engine):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    requests = mixed_requests(12, seed=3, max_prompt=20, max_new=16)
    expected = hf_greedy(model_dir, requests)
    eng = create_engine(engine, str(model_dir), {"dtype": "float32"})
    try:
        rows = tuple(min(count, 3) if count > 4 else count for count in range(17))  # 5-16 decodes run 3
        eng.scheduler.config = dataclasses.replace(eng.scheduler.config, decode_rows=rows)
        got = {c.id: c.token_ids for c in eng.generate(requests)}
        stats = eng.stats()
    finally:
        eng.close()
    assert got == expected
    assert stats["decodes_sat_out"] > 0
