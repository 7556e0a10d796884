"""Admission of sequences of known length (EOS ignored, no stop, no constraint): one is admitted only if the KV
cache holds every such sequence to its end, counting the blocks each frees at its end, so none is preempted and
recomputed; a sequence that may end early is admitted as before, its blocks counted against the known ones."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from batchjob.engine import Request, SamplingParams
from batchjob.engine.native.scheduling.block_manager import KVBlockManager
from batchjob.engine.native.scheduling.growth import GrowthProjection, runs_to_max_len
from batchjob.engine.native.scheduling.scheduler import Scheduler, SchedulerConfig
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))

from simulate_admission import simulate, step_done  # noqa: E402

BLOCK = 16


def _sequence(seq_id: int, prompt_len: int, new: int, **sampling) -> Sequence:
    params = SamplingParams(new, **({"ignore_eos": True} | sampling))
    request = Request(seq_id, tuple(range(3, 3 + prompt_len)), params)
    return Sequence.create(seq_id, RequestGroup(request, prompt_len), 0, prompt_len + new, seq_id, BLOCK)


def _scheduler(usable_blocks: int, max_num_seqs: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096)
    return Scheduler(config, KVBlockManager(usable_blocks + 1, BLOCK, enable_prefix_caching=False))


def _step(scheduler: Scheduler) -> None:
    """One step, its tokens back at once; a sequence at its max_len finishes."""
    plan = scheduler.schedule()
    assert plan is not None, "nothing planned with sequences left"
    step_done(scheduler, plan)


def _run_to_end(scheduler: Scheduler) -> None:
    while scheduler.has_unfinished:
        _step(scheduler)


def test_only_a_sequence_with_nothing_that_ends_it_early_has_a_known_length():
    assert runs_to_max_len(_sequence(0, 8, 8))
    assert not runs_to_max_len(_sequence(0, 8, 8, ignore_eos=False))
    assert not runs_to_max_len(_sequence(0, 8, 8, stop_token_ids=(5,)))
    assert not runs_to_max_len(_sequence(0, 8, 8, stop=("\n",)))
    constrained = _sequence(0, 8, 8)
    constrained.matcher = object()  # a constraint ends the output when its grammar completes
    assert not runs_to_max_len(constrained)


def test_sequences_of_known_length_are_admitted_as_many_as_the_cache_holds_at_their_ends_and_none_is_preempted():
    # 160-token prompts (10 blocks) growing by 240 tokens to 25 blocks each; 100 usable blocks. The prompts alone
    # would let 7 in (with RESERVE blocks of room each), which the cache cannot hold once they have grown.
    scheduler = _scheduler(100)
    for i in range(8):
        scheduler.add(_sequence(i, 160, 240))
    _step(scheduler)
    assert len(scheduler.running) == 3  # 4 x 25 blocks would fill it exactly: the projection rounds a block up each
    _run_to_end(scheduler)  # the next ones go in as the first ones near their ends
    assert scheduler.num_preemptions == 0
    open_ended = _scheduler(100)
    for i in range(8):
        open_ended.add(_sequence(i, 160, 240, ignore_eos=False))
    _step(open_ended)
    assert len(open_ended.running) == 7
    _run_to_end(open_ended)  # run to their max_len all the same, they outgrow the cache
    assert open_ended.num_preemptions > 0


def test_the_projection_counts_the_blocks_a_sequence_frees_at_its_end():
    # A long sequence (40 blocks at its end) and ten short ones (2 blocks at theirs) on 60 usable blocks: all of
    # them at their ends would need 60 and their rounding more, but the short ones end before the long one grows.
    scheduler = _scheduler(60)
    scheduler.add(_sequence(0, 16, 624))
    for i in range(1, 11):
        scheduler.add(_sequence(i, 16, 16))
    _step(scheduler)
    assert len(scheduler.running) == 11
    _run_to_end(scheduler)
    assert scheduler.num_preemptions == 0


def test_a_sequence_that_may_end_early_is_admitted_only_where_the_known_ones_keep_room_to_end():
    scheduler = _scheduler(60)
    scheduler.add(_sequence(0, 16, 720))  # 46 blocks at its end
    _step(scheduler)
    scheduler.add(_sequence(1, 16 * 14, 64, ignore_eos=False))  # a 14-block prompt: 1 + 14 + 46 > 60
    scheduler.add(_sequence(2, 16 * 5, 64, ignore_eos=False))
    _step(scheduler)
    assert [seq.seq_id for seq in scheduler.running] == [0]  # in arrival order: the first waits, the second too
    open_ended = _scheduler(60)
    open_ended.add(_sequence(0, 16, 720, ignore_eos=False))  # the same, ending unknown: admitted as before
    _step(open_ended)
    open_ended.add(_sequence(1, 16 * 14, 64, ignore_eos=False))
    _step(open_ended)
    assert len(open_ended.running) == 2


@pytest.mark.parametrize("count", [1, 7, 64])
def test_the_peak_is_the_most_blocks_in_use_at_any_step(count):
    rng = np.random.default_rng(count)
    running = [_sequence(i, int(rng.integers(1, 300)), int(rng.integers(1, 300))) for i in range(count)]
    for seq in running:
        seq.num_tokens += int(rng.integers(0, seq.max_len - seq.num_tokens + 1))  # some way into its output
        seq.block_table = list(range(-(-seq.num_tokens // BLOCK)))
    held = sum(len(seq.block_table) for seq in running)
    # Step by step: each sequence holds blocks for its tokens until its last one, then none.
    exact = max(
        sum(-(-(seq.num_tokens + t) // BLOCK) for seq in running if seq.num_tokens + t <= seq.max_len)
        for t in range(0, 600)
    )
    other = _sequence(99, 1, 1, ignore_eos=False)  # its blocks count, its growth does not
    assert not GrowthProjection(running, BLOCK, capacity=exact - 1).fits(held, other, 0)  # never below the peak
    assert GrowthProjection(running, BLOCK, capacity=exact + count).fits(held, other, 0)  # under a block a sequence


def test_a_workload_of_equal_lengths_on_a_cache_holding_two_fifths_of_it_recomputes_nothing():
    # W8's shape: every request of the same length, all arriving at once, a cache holding 40% of them at their end.
    prompts, outputs = np.full(200, 256), np.full(200, 512)
    result = simulate(prompts, outputs, kv_blocks=1 + 80 * 768 // BLOCK, max_num_seqs=200)
    assert result["preemptions"] == 0 and result["recomputed"] == 0
    assert result["rows_per_decode_step"] >= 60  # about 80 at a time, fewer as a wave ends and the next starts


def test_blocks_shared_by_samples_of_one_prompt_count_once():
    # Eight samples of one 160-token prompt (9 blocks shared through the prefix cache; each computes the last one
    # itself), 48 tokens of growth each (3 blocks): 9 + 8 x 4 = 41 blocks hold them all, and the projection's
    # rounding a block each 49; counted whole, each would take 13 blocks, 104 in all.
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096),
        KVBlockManager(1 + 52, BLOCK, enable_prefix_caching=True),
    )
    request = Request(0, tuple(range(3, 163)), SamplingParams(48, ignore_eos=True))
    group = RequestGroup(request, 160)
    for i in range(8):
        scheduler.add(Sequence.create(i, group, i, 208, i, BLOCK))
    _step(scheduler)
    assert len(scheduler.running) == 8
    _run_to_end(scheduler)
    assert scheduler.num_preemptions == 0
