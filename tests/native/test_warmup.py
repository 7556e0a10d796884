"""The start-up warm-up: which steps it launches, and that running them through the real runner changes nothing
about the run that follows (outputs, step counters, KV blocks)."""

from __future__ import annotations

import pytest
from engine_cases import mixed_requests

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.engine.native.runtime.warmup import (
    WarmupLimits,
    batch_sweep,
    largest_step,
    size_sweep,
    warm_up,
    warmup_steps,
)
from batchjob.job.tiny_model import make_tiny_model

DEFAULTS = WarmupLimits(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096, max_top_logprobs=20)


def _mode(sampling: SamplingParams) -> tuple[bool, bool, bool]:
    filtering = sampling.top_k > 0 or sampling.top_p < 1 or sampling.min_p > 0
    return sampling.temperature > 0, filtering, sampling.logprobs is not None


def test_every_sampler_mode_runs_decode_and_mixed_steps():
    steps = warmup_steps(DEFAULTS)
    decodes = {_mode(s.sampling) for s in steps if set(s.counts) == {1}}
    mixed = {_mode(s.sampling) for s in steps if len(s.counts) > 1 and max(s.counts) > 1}
    # Decodes carry log-probabilities so that they run eagerly (captured graphs cover the rest).
    assert decodes == {(False, False, True), (True, False, True), (True, True, True)}
    assert {(False, False, False), (True, False, False), (True, True, False)} <= mixed


def test_batch_sizes_cover_each_integer_class_triton_specialises_on():
    steps = warmup_steps(DEFAULTS)
    decode_batches = {len(s.counts) for s in steps if set(s.counts) == {1}}
    assert decode_batches == {1, 3, 16, 256}
    prefill_tokens = {s.tokens for s in steps if max(s.counts) > 1}
    assert any(t % 16 for t in prefill_tokens) and any(t % 16 == 0 for t in prefill_tokens)
    assert any(len(s.counts) == 1 and s.counts[0] > 1 for s in steps)  # one prefill sequence alone
    assert any(s.last_unsampled for s in steps)  # a chunk that samples nothing (rows < sequences)


def test_token_counts_double_up_to_the_budget_and_the_largest_step_fills_it():
    assert [s.tokens for s in size_sweep(DEFAULTS)] == [32 * 2**k for k in range(8)]
    largest = largest_step(DEFAULTS)
    assert warmup_steps(DEFAULTS)[-1] == largest
    assert largest.tokens == 8192 and len(largest.counts) == 256
    assert largest.sampling.logprobs == 20 and largest.sampling.top_p < 1


def test_mixed_steps_double_their_sequence_count_up_to_the_limit():
    assert [len(s.counts) for s in batch_sweep(DEFAULTS)] == [2, 4, 8, 16, 32, 64, 128, 256]
    limits = WarmupLimits(max_num_seqs=48, max_num_batched_tokens=1024, max_model_len=4096, max_top_logprobs=20)
    steps = batch_sweep(limits)
    assert [len(s.counts) for s in steps] == [2, 4, 8, 16, 32, 48]
    assert all(max(s.counts) == 2 for s in steps)  # mixed: one chunk among decodes, the prefill kernel's path


@pytest.mark.parametrize(
    "limits",
    [
        WarmupLimits(max_num_seqs=1, max_num_batched_tokens=7, max_model_len=80, max_top_logprobs=20),
        WarmupLimits(max_num_seqs=64, max_num_batched_tokens=24, max_model_len=80, max_top_logprobs=20),
        WarmupLimits(max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=10, max_top_logprobs=5),
    ],
    ids=["one sequence, 7 tokens", "small budget", "short context"],
)
def test_every_step_fits_the_engine_limits(limits):
    steps = warmup_steps(limits)
    assert steps
    for step in steps:
        assert step.tokens <= limits.max_num_batched_tokens
        assert len(step.counts) <= limits.max_num_seqs
        context = 0 if max(step.counts) > 1 else 3
        assert max(step.counts) + context + step.last_unsampled <= limits.max_model_len


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama")


def _run(model_dir, requests, **options):
    engine = create_engine("native", str(model_dir), {"dtype": "float32", **options})
    free_before = engine.blocks.num_free
    got = {c.id: c.token_ids for c in engine.generate(requests)}
    return got, engine.stats(), free_before


def test_a_warmed_up_engine_generates_the_same_tokens_and_counts_only_its_own_steps(model_dir):
    greedy = mixed_requests(24, seed=5)
    sampled = [
        Request(100 + i, (7, 8, 9 + i), SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=i))
        for i in range(6)
    ]
    options = dict(max_num_seqs=16, max_num_batched_tokens=64)
    cold, cold_stats, _ = _run(model_dir, greedy + sampled, warmup=False, **options)
    warm, warm_stats, free_before = _run(model_dir, greedy + sampled, warmup=True, **options)
    assert warm == cold
    assert warm_stats["warmup_s"] > 0 and "warmup_s" not in cold_stats
    for counter in ("steps", "tokens_fed", "graph_steps", "output_tokens"):
        assert warm_stats[counter] == cold_stats[counter], counter
    assert free_before == warm_stats["kv_blocks"] - 1  # every block but the scratch block is still free


def test_constrained_split_steps_are_warmed_up_eagerly_in_each_batch_size():
    constrained = [s for s in warmup_steps(DEFAULTS) if s.constrained]
    assert {len(s.counts) for s in constrained if set(s.counts) == {1}} == {1, 3, 16, 256}
    assert all(s.sampling.logprobs == 0 for s in constrained if set(s.counts) == {1})  # eager, as above
    # Greedy rows take the masked argmax, sampled rows the mask kernel and then the race: both are warmed.
    assert {s.sampling.temperature for s in constrained if set(s.counts) == {1}} == {0.0, 1.0}
    assert any(max(s.counts) > 1 for s in constrained)  # a mixed step: the split prefill path


def test_warm_up_runs_constrained_rows_as_split_steps_then_resets_the_counters(model_dir):
    engine = create_engine("native", str(model_dir), {"dtype": "float32", "max_num_seqs": 4, "warmup": False})
    runner = engine.runner
    steps = [s for s in warmup_steps(WarmupLimits(4, 64, engine.max_model_len, 20)) if s.constrained]
    assert all((slot.host_bitmask == 0).all() for slot in runner.slots)
    warm_up(runner, steps, engine.options.block_size)
    # Each slot's first bitmask row was filled (allow every token) by a masked sampler's step.
    assert all((slot.host_bitmask[0] == -1).all() for slot in runner.slots)
    assert runner.masked_steps == 0 and runner.steps == 0


def _layer_calls(model) -> list[int]:
    calls = [0] * len(model.layers)
    for index, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    return calls


@pytest.mark.parametrize(
    ("arch", "overrides", "kernel_layers"),
    [
        ("llama", dict(num_hidden_layers=5), [0, 1]),  # the first (no residual yet) and one like the rest
        ("gemma3", dict(num_hidden_layers=6, sliding_window_pattern=3, layer_types=None), [0, 1, 2]),
        ("qwen3_moe", dict(num_hidden_layers=5, mlp_only_layers=[3]), [0, 1, 3]),
    ],
)
def test_warm_up_runs_one_layer_of_each_kind_and_every_step_after_it_runs_all(tmp_path, arch, overrides, kernel_layers):
    model_dir = make_tiny_model(tmp_path / arch, arch=arch, **overrides)
    engine = create_engine("native", str(model_dir), {"dtype": "float32", "max_num_seqs": 4, "warmup": False})
    model = engine.runner.model
    calls = _layer_calls(model)
    warm_up(engine.runner, warmup_steps(WarmupLimits(4, 64, engine.max_model_len, 20)), engine.options.block_size)
    assert [i for i, n in enumerate(calls) if n] == kernel_layers
    assert len({calls[i] for i in kernel_layers}) == 1  # each of them ran every warm-up step
    calls[:] = [0] * len(calls)
    list(engine.generate([Request(0, (5, 6, 7), SamplingParams(max_new_tokens=2))]))
    assert min(calls) > 0 and len(set(calls)) == 1
