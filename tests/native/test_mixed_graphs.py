"""Steps laid out for CUDA graphs: which graph bucket a step pads to (mixed prefill+decode steps by token count,
up to the sequence limit), which steps stay eager, and that padded steps, run eagerly through the real runner
(the work a graph records), generate exactly what unpadded steps do, for a dense, a sliding-window and an MoE
family."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_cases import mixed_requests

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.engine.native.runtime.io_slot import StepShape
from batchjob.engine.native.runtime.step_layout import (
    FILTERING,
    GRAPH_MODES,
    GREEDY,
    SAMPLING,
    GraphBuckets,
    decode_buckets,
    fastest_buckets,
    layout_step,
    mixed_buckets,
    sampler_mode,
)
from batchjob.engine.native.sampling.sampler import SamplerMode
from batchjob.engine.native.scheduling.plan import StepPlan
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence
from batchjob.job.tiny_model import make_tiny_model

EVERY_MODE = frozenset(GRAPH_MODES)
CAPTURED = GraphBuckets(
    decode=(1, 2, 4, 8),
    modes=EVERY_MODE,
    masked_modes=EVERY_MODE,
    mixed=(256, 512, 1000),
    mixed_modes=EVERY_MODE,
    mixed_seqs=16,
)
GREEDY_PARAMS = SamplingParams(max_new_tokens=4)


def _plan(counts: tuple[int, ...], sampling: SamplingParams = GREEDY_PARAMS, constrained: bool = False) -> StepPlan:
    """A step of one fresh sequence per chunk of `counts` tokens (a count of 1: a decode after 3 cached tokens);
    every chunk samples."""
    seqs = []
    starts = np.array([3 if c == 1 else 0 for c in counts], dtype=np.int64)
    for i, (start, count) in enumerate(zip(starts.tolist(), counts, strict=True)):
        request = Request(i, (5,) * (start + count), sampling)
        seq = Sequence.create(i, RequestGroup(request, start + count), 0, start + count + 4, 0, 16)
        seq.matcher = "a grammar" if constrained and i == 0 else None
        seqs.append(seq)
    n = len(counts)
    return StepPlan(seqs, starts, np.array(counts), np.ones(n, dtype=bool), np.full(n, -1, dtype=np.int64))


def test_mixed_buckets_double_from_256_up_to_the_token_budget_which_is_the_last():
    assert mixed_buckets(8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert mixed_buckets(3000) == [256, 512, 1024, 2048, 3000]
    assert mixed_buckets(100) == [100]
    assert mixed_buckets(1) == []  # no step can carry a two-token chunk


def test_a_full_batch_of_decodes_with_a_quarter_or_half_batch_chunk_has_buckets_of_its_own():
    # A saturated run's usual mixed step: 511 decodes and a new prompt's chunk, which 1,024 would pad by up to 512.
    assert mixed_buckets(8192, 512) == [256, 512, 640, 768, 1024, 2048, 4096, 8192]
    assert mixed_buckets(8192, 256) == [256, 320, 384, 512, 1024, 2048, 4096, 8192]
    assert mixed_buckets(8192, 300) == [256, 384, 512, 1024, 2048, 4096, 8192]  # 375, 450 rounded up to 64
    assert mixed_buckets(8192, 1024) == [256, 512, 1024, 1280, 1536, 2048, 4096, 8192]
    assert mixed_buckets(8192, 128) == mixed_buckets(8192)  # small batches: the powers of two pad little
    assert mixed_buckets(700, 512) == [256, 512, 640, 700]  # none at or past the token budget


def test_the_default_limits_add_few_graphs_beside_the_decode_graphs():
    # 256 sequences and 8192 tokens: per sampler mode and IO slot, 6 mixed graphs beside 20 decode graphs.
    assert len(mixed_buckets(8192)) == 6 and len(decode_buckets(256)) == 20


def test_a_decode_bucket_that_a_larger_one_replays_faster_is_dropped_and_its_steps_pad_up():
    # 448 rows replaying slower than 512 (tile and wave quantization of the matmuls): 448 goes, 512 takes its
    # steps; 16 and 32 within 2% of each other both stay; the largest bucket always stays.
    seconds = {16: 1.00, 32: 0.99, 448: 5.0, 512: 4.0}
    assert fastest_buckets(seconds) == (16, 32, 512)
    assert fastest_buckets({16: 1.0, 32: 0.5, 64: 2.0}) == (32, 64)
    assert fastest_buckets({8: 3.0}) == (8,)
    captured = dataclasses.replace(CAPTURED, decode=fastest_buckets({1: 1.0, 2: 0.5, 4: 1.0, 8: 1.0}))
    assert captured.decode == (2, 4, 8)
    layout = layout_step(_plan((1,)), captured)
    assert not layout.mixed and layout.bucket == 2 and layout.shape == StepShape(tokens=2, seqs=2, rows=2)


def test_a_step_with_a_chunk_pads_its_tokens_to_the_next_bucket_and_its_sequences_to_the_limit():
    layout = layout_step(_plan((1, 1, 1, 300)), CAPTURED)
    assert layout.mixed and layout.bucket == 512 and layout.mode == GREEDY
    assert layout.shape == StepShape(tokens=512, seqs=16, rows=16)
    assert (layout.rows, layout.tokens, layout.max_query_len, layout.max_seq_len) == (4, 303, 300, 300)
    assert layout_step(_plan((256,)), CAPTURED).shape.tokens == 256
    assert layout_step(_plan((1, 1000)), CAPTURED).bucket is None  # past the largest bucket


def test_a_mixed_step_replays_the_graph_of_its_sampler_mode():
    cases = [(dict(temperature=0.7), SAMPLING), (dict(temperature=0.7, top_p=0.9), FILTERING)]
    for params, mode in cases:
        layout = layout_step(_plan((1, 40), SamplingParams(max_new_tokens=4, **params)), CAPTURED)
        assert layout.mixed and layout.mode == mode
    greedy_only = dataclasses.replace(CAPTURED, mixed_modes=frozenset({GREEDY}))
    assert layout_step(_plan((1, 40), SamplingParams(max_new_tokens=4, temperature=0.7)), greedy_only).bucket is None


def test_a_step_replays_the_cheapest_captured_mode_that_covers_its_rows():
    temperature = SamplingParams(max_new_tokens=4, temperature=0.7)
    filtering = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9)
    only = {m: dataclasses.replace(CAPTURED, modes=frozenset({m}), mixed_modes=frozenset({m})) for m in GRAPH_MODES}
    for counts in ((1, 1), (1, 40)):  # a decode step and a mixed one
        assert layout_step(_plan(counts), only[FILTERING]).mode == FILTERING
        assert layout_step(_plan(counts, temperature), only[FILTERING]).mode == FILTERING
        assert layout_step(_plan(counts), only[SAMPLING]).mode == SAMPLING
        assert layout_step(_plan(counts, filtering), only[SAMPLING]).bucket is None
        assert layout_step(_plan(counts, temperature), only[GREEDY]).bucket is None
    no_greedy = dataclasses.replace(CAPTURED, modes=frozenset({SAMPLING, FILTERING}))
    assert layout_step(_plan((1, 1)), no_greedy).mode == SAMPLING  # the cheaper of the two
    assert layout_step(_plan((1, 1)), CAPTURED).mode == GREEDY


def test_a_steps_sampler_mode_is_what_its_sampled_rows_ask_for_together():
    def mode(*rows: tuple[dict, bool]) -> SamplerMode:
        """The sampler mode of a decode step of one sequence per (params, sampled) row."""
        seqs = []
        for i, (params, _) in enumerate(rows):
            request = Request(i, (5,) * 4, SamplingParams(max_new_tokens=4, **params))
            seqs.append(Sequence.create(i, RequestGroup(request, 4), 0, 8, 0, 16))
        ones = np.ones(len(rows), dtype=np.int64)
        samples = np.array([sampled for _, sampled in rows])
        return sampler_mode(StepPlan(seqs, ones * 3, ones, samples, -ones))

    greedy, hot, nucleus = {}, dict(temperature=0.7), dict(temperature=0.7, top_p=0.9)
    assert mode((greedy, True), (greedy, True)) == GREEDY
    assert mode((greedy, True), (hot, True)) == SAMPLING
    assert mode((greedy, True), (hot, True), (nucleus, True)) == FILTERING
    assert mode((greedy, True), (nucleus, False)) == GREEDY  # a chunk that samples nothing asks for nothing
    assert (
        mode(
            (dict(top_p=0.5, top_k=3, min_p=0.1), True),
        )
        == GREEDY
    )  # filters of a greedy row never apply
    assert (
        mode(
            (dict(temperature=0.7, min_p=0.1), True),
        )
        == FILTERING
    )
    assert (
        mode(
            (dict(temperature=0.7, top_k=5), True),
        )
        == FILTERING
    )
    most = mode((dict(logprobs=0), True), (dict(logprobs=5, temperature=0.7), True), (greedy, True))
    assert most == SamplerMode(sampling=True, logprobs=5)
    assert mode((dict(logprobs=0), True), (greedy, True)) == SamplerMode(logprobs=0)


def test_decodes_keep_their_batch_buckets_and_wider_decodes_take_a_mixed_graph():
    narrow = layout_step(_plan((1,) * 3), CAPTURED)
    assert not narrow.mixed and narrow.shape == StepShape(4, 4, 4)
    wide = layout_step(_plan((1,) * 12), CAPTURED)
    assert wide.mixed and wide.shape == StepShape(256, 16, 16)


def test_log_probabilities_uncaptured_constrained_chunks_and_too_many_sequences_run_eagerly():
    logprobs = SamplingParams(max_new_tokens=4, logprobs=0)
    assert layout_step(_plan((1, 40), logprobs), CAPTURED).bucket is None
    assert layout_step(_plan((1, 40), constrained=True), CAPTURED).bucket is None  # no split mixed graphs
    assert layout_step(_plan((1,) * 16 + (2,)), CAPTURED).bucket is None  # 17 sequences, graphs hold 16
    eager = layout_step(_plan((1, 40)), GraphBuckets())
    assert eager.bucket is None and eager.shape == StepShape(41, 2, 2)
    # A constrained decode still replays its split halves.
    assert layout_step(_plan((1, 1), constrained=True), CAPTURED).shape == StepShape(2, 2, 2)


def test_a_constrained_step_with_chunks_replays_the_split_halves_of_its_mixed_bucket():
    # Jump-forward feeds forced tokens as chunks: such steps must not fall back to eager launches.
    split = dataclasses.replace(CAPTURED, mixed_masked_modes=frozenset({SAMPLING}))
    sampled = SamplingParams(max_new_tokens=4, temperature=1.0)
    layout = layout_step(_plan((1, 3, 1, 2), sampled, constrained=True), split)
    assert layout.mixed and layout.mode == SAMPLING and layout.shape == StepShape(256, 16, 16)
    assert layout_step(_plan((1, 3), constrained=True), split).mode == SAMPLING  # greedy rows replay them too
    filtered = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9)
    assert layout_step(_plan((1, 3), filtered, constrained=True), split).bucket is None  # not captured


def _requests() -> list[Request]:
    """Greedy requests and sampled ones (temperature only, and filtered), prompts longer than the token budget."""
    greedy = mixed_requests(16, seed=4, max_prompt=40, max_new=10)
    sampled = [
        Request(100 + i, tuple(range(7, 7 + 3 * i + 2)), SamplingParams(max_new_tokens=8, seed=i, **params))
        for i, params in enumerate([dict(temperature=0.9), dict(temperature=0.8, top_p=0.9, top_k=30)] * 3)
    ]
    return greedy + sampled


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_steps_padded_to_graph_shapes_generate_exactly_what_unpadded_steps_do(tmp_path, arch):
    model_dir = make_tiny_model(tmp_path / arch, arch=arch)
    options = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 32}
    plain = create_engine("native", str(model_dir), options)
    expected = {c.id: c.token_ids for c in plain.generate(_requests())}

    padded = create_engine("native", str(model_dir), options)
    runner = padded.runner
    # Buckets as a GPU runner would have captured them; on the CPU the padded steps run eagerly.
    runner.graphs.buckets = GraphBuckets(
        decode=(2, 4), modes=EVERY_MODE, mixed=(16, 32), mixed_modes=EVERY_MODE, mixed_seqs=8
    )
    launched = []
    prepare = runner.prepare

    def prepare_and_record(plan):
        prepared = prepare(plan)
        launched.append((len(plan.seqs), plan.num_tokens, prepared.layout.shape))
        return prepared

    runner.prepare = prepare_and_record
    got = {c.id: c.token_ids for c in padded.generate(_requests())}

    assert got == expected
    mixed = [(n, t, shape) for n, t, shape in launched if shape.seqs == 8 and shape.tokens in (16, 32)]
    # Both kinds of padding ran: sequences left without a token, and tokens left without a sequence.
    assert any(shape.tokens - t < shape.seqs - n for n, t, shape in mixed)
    assert any(shape.tokens - t > shape.seqs - n for n, t, shape in mixed)
    assert any(shape == StepShape(4, 4, 4) for _, _, shape in launched)  # a padded decode
